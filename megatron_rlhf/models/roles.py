"""The four PPO-RLHF roles as megatron-core models on this rank's TP x PP shard.

Every forward and backward goes through megatron-core's pipeline schedule
(`get_forward_backward_func`) over microbatches, so PP > 1 is the same code path as PP = 1.
Per-token outputs are computed on the last pipeline stage and broadcast to all stages, so
every rank returns the same full-batch tensors.

A batch is a dict of tensors with batch dimension first: `tokens` [B, S] (long) and,
optionally, `attention_mask` [B, 1, S, S] (bool, True = masked; default causal) plus whatever
the role's outputs or the caller's loss function read.

Losses are true means over the whole global batch (megatron-core's per-token loss path): a
loss function returns the *sum* of its loss over a microbatch and how many units (tokens,
sequences, pairs) that sum covers; megatron sums both over microbatches and data-parallel
ranks and divides the gradient by the global count. So micro batch size, DP, TP and PP do
not change the objective.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import Callable

import torch
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_rlhf.config import LoRAConfig, ModelConfig, OptimizerConfig
from megatron_rlhf.logging.memory import SavedActivations
from megatron_rlhf.models.gpt import build_model
from megatron_rlhf.models.lora import adapters_disabled, apply_lora
from megatron_rlhf.models.microbatches import (
    Batch, context_share, last_tokens, next_token_targets, pack_microbatches, packed_options, pad_for_sequence_parallel,
    per_row, real_positions, split_microbatches, to_width, trim_padding, unpack_rows, whole_sequence,
)
from megatron_rlhf.models.optimizer import build_optimizer, build_scheduler, wrap_ddp
from megatron_rlhf.models.role_experts import ExpertRouting
from megatron_rlhf.models.routing import RoutingReplay
from megatron_rlhf.models.vocab_parallel import (
    chunked_logprobs_and_entropy, mask_padded_vocab, vocab_parallel_logprobs_and_entropy,
)
from megatron_rlhf.parallel import context as context_parallel
from megatron_rlhf.parallel import device
from megatron_rlhf.parallel.collectives import dp_max, dp_sum
from megatron_rlhf.resilience.faults import FAULTS
from megatron_rlhf.resilience.nonfinite import NonFiniteGuard

# loss_fn(outputs, microbatch) -> (loss summed over the microbatch's units, number of units as
# an integer tensor, {statistic: its sum over the same units}); see the module docstring. Stats
# that hold "tokens" (the microbatch's token count) are token sums instead: the RL diagnostics
# stay token means whatever unit the loss averages over (algorithms/stats.py: token_sums). The
# units depend on the microbatch alone (its masks), never on the outputs: the MoE routers'
# load-balancing scale counts them before the forward (microbatches.loss_units).
LossFn = Callable[[dict[str, torch.Tensor], Batch], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


def broadcast_from_last_stage(tensors: dict[str, torch.Tensor], like: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Every pipeline stage gets the last stage's tensors (float32, shapes from `like`)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return tensors
    out = {}
    for key, shape in like.items():
        t = tensors[key].float().contiguous() if key in tensors else torch.empty(shape, device=device())
        torch.distributed.broadcast(
            t, src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        out[key] = t
    return out


def summed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, element count) of x: a LossFn's loss and units for a mean over every element."""
    return x.sum(), torch.ones_like(x, dtype=torch.int32).sum()


def global_means(store: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Each statistic summed over microbatches and data-parallel ranks, divided by the summed
    units or tokens (`stat_means`): the global-batch means, on every rank. One host read per step."""
    keys = [sorted(store[0])] if store else [None]  # only the last pipeline stage computed losses
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.broadcast_object_list(keys, src=last, group=pp_group)
    keys = keys[0]
    if store:
        totals = torch.stack([torch.stack([d[k] for d in store]).to(torch.float64).sum() for k in keys])
    else:
        totals = torch.empty(len(keys), dtype=torch.float64, device=device())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.broadcast(totals, src=last, group=pp_group)
    return stat_means(dict(zip(keys, dp_sum(totals).tolist())))


def stat_means(totals: dict[str, float]) -> dict[str, float]:
    """The global-batch means from each statistic's sum over every microbatch (see LossFn): the
    loss over its units, the other statistics over "tokens" when the loss function counted them,
    else over the units too."""
    units = max(totals["units"], 1)
    per_statistic = max(totals.get("tokens", units), 1)
    return {k: v / (units if k == "loss" else per_statistic) for k, v in totals.items() if k not in ("units", "tokens")}


def set_training(model: torch.nn.Module, training: bool) -> None:
    """`model.train(training)` unless every module is already in that mode. PPO alternates
    scoring (eval) and several train steps; `train()` calls every module's `train` (~150 us at
    2 layers), reading the flags is ~4x cheaper. Every module is read, not just the root: the
    rollout engine and megatron's inference wrappers switch modes themselves, and a module
    added later (LoRA adapters) starts in training mode whatever its parent's."""
    if any(m.training != training for m in model.modules()):
        model.train(training)


class Role(ExpertRouting):
    """One megatron GPTModel chunk of the model section `model_config`, trainable (DDP +
    DistributedOptimizer + LR schedule) or frozen.

    A trainable role needs its `optimizer` section and `max_consecutive_nonfinite`
    (resilience: how many non-finite steps in a row are skipped before the run stops);
    `total_steps` sets the LR decay length. `lora` (rank > 0) trains adapters on the frozen
    weights, initialised from `seed` (the run's seed)."""

    value_head = False
    # An MoE model whose routers record and replay the rollout's choices (the actor: models/routing.py)
    records_routes = False
    # The role whose module this one runs (a LoRA reference: the actor without adapters); its
    # weights are that role's, placed and counted with it.
    shares_weights_of: str | None = None
    # Packed sequences (rl.packing; set by the trainer that builds the role): each microbatch's
    # rows (by `lengths`) run back to back as one THD row (megatron's PackedSeqParams), no padding
    # between them; outputs come back per row as without packing (models/microbatches.py: pack_rows).
    packing = False

    def __init__(self, model_config: ModelConfig, trainable: bool, *, optimizer: OptimizerConfig | None = None,
                 total_steps: int = 1, lora: LoRAConfig | None = None, seed: int | None = None,
                 max_consecutive_nonfinite: int | None = None):
        # the architecture the role was built from: its vocabulary, its length, what its checkpoints record
        self.model_config = model_config
        self.trainable = trainable
        self.optimizer = self.scheduler = None
        # Bytes the largest microbatch kept for backward, measured on the first training call
        # (logging/memory.py: SavedActivations); None until then.
        self.activation_bytes: int | None = None
        self._meter = None
        # A trained role's losses are global-batch means (megatron's per-token loss path): DDP then sums
        # gradients over data-parallel ranks and finalize_model_grads divides by the global unit count.
        module = build_model(model_config, value_head=self.value_head, per_token_loss=trainable,
                             routes=self.records_routes and model_config.num_experts is not None)
        # the routers' record/replay, this role's own (None: dense, or a role that routes freely)
        self.routes = RoutingReplay.attach(module)
        self._compare_routes = False
        self.lora = lora if lora is not None and lora.rank > 0 else None
        # With LoRA: the weights trained besides the adapters (a value head), by name prefix
        self.trained_prefixes = ("output_layer.",) if self.lora is not None and self.value_head else ()
        # With LoRA: the checkpoint the frozen base weights were loaded from (saved with the
        # adapters), and the one a resumed checkpoint recorded
        self.lora_base: str | None = None
        self.resumed_lora_base: str | None = None
        if self.lora is not None:  # before DDP and the optimizer: they see only the trainable parameters
            assert trainable, "LoRA adapters belong to a trained role"
            assert seed is not None, "LoRA adapters are initialised from the run's seed"
            # a value model's output layer is its value head, trained in full
            self.lora_targets = [t for t in self.lora.targets if not (self.value_head and t == "output")]
            apply_lora(module, self.lora.rank, self.lora.alpha, self.lora.dropout, self.lora_targets,
                       seed=seed + (1 if self.value_head else 0), keep_trainable=self.trained_prefixes)
        if trainable:
            assert optimizer is not None and max_consecutive_nonfinite is not None, \
                "a trainable role needs its optimizer section and max_consecutive_nonfinite"
            if module.config.num_moe_experts:
                # Expert weights reduce over megatron's expert data-parallel group and get their own
                # optimizer. megatron marks them so only at EP > 1 (or ETP != TP); marked at every
                # layout, the optimizer has the same two parts at any EP and its checkpoints reshard.
                for name, param in module.named_parameters():
                    if ".experts." in name:
                        param.allreduce = False
            self.model = wrap_ddp(module, optimizer)
            self.optimizer = build_optimizer(self.model, optimizer, model_config.params_dtype)
            self.scheduler = build_scheduler(self.optimizer, optimizer, total_steps)
            config = module.config
            config.finalize_model_grads_func = finalize_model_grads
            config.grad_scale_func = self.optimizer.scale_loss
            config.no_sync_func = self.model.no_sync
            if config.num_moe_experts and (config.moe_aux_loss_coeff or config.moe_z_loss_coeff):
                # set per step (_forward_backward); shape [1] as megatron's own (it copies into the first one)
                self._router_loss_scale = torch.ones(1, device=device())
                config.moe_grad_scale_func = lambda: self._router_loss_scale
            self.guard = NonFiniteGuard(type(self).__name__, max_consecutive_nonfinite)
        else:
            module.requires_grad_(False)
            module.eval()
            self.model = module

    @property
    def grad_buffers(self) -> list:
        """DDP's parameter-and-gradient buffers of a trainable role (dense and expert-parallel)."""
        return self.model.buffers + self.model.expert_parallel_buffers

    @property
    def module(self) -> torch.nn.Module:
        """The bare GPTModel (unwrapped from DDP): what checkpoints save and load."""
        return getattr(self.model, "module", self.model)

    # --- non-tensor state saved with the role's checkpoint (rank 0's copy is kept)
    def extra_state(self) -> dict:
        if self.lora is None:
            return {}
        # what export needs to rebuild the full model: the base checkpoint and the adapters' shape
        return {"lora_base": self.lora_base, "lora": {"rank": self.lora.rank, "alpha": self.lora.alpha,
                                                       "targets": self.lora_targets}}

    def load_extra_state(self, state: dict) -> None:
        pass

    # --- role-specific: outputs computed from the decoder's final hidden states
    def outputs(self, *, hidden_states, output_layer, output_weight, context: Batch, **_) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def output_shapes(self, batch_size: int, seq_len: int) -> dict[str, torch.Size]:
        raise NotImplementedError

    # --- megatron schedule plumbing
    def _forward_step(self, loss_fn: LossFn | None, width: int, data_iterator, model):
        mb = next(data_iterator)
        tokens = mb["tokens"]
        position_ids = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)
        padding = self._padding_mask(mb, tokens.size(1))
        options = {"padding_mask": padding} if padding is not None else {}
        if "packed_tokens" in mb:  # the rows as one THD row: positions restart per row
            tokens, position_ids, options = mb["packed_tokens"], mb["packed_positions"], packed_options(mb)
        if context_parallel.SHARE_KEY in mb:  # this CP rank's share of the row(s)
            tokens, position_ids = mb["cp_tokens"], mb["cp_positions"]
        routed = self._route(mb)
        meter = SavedActivations(self.module.parameters()) if self._meter is not None else nullcontext()
        with meter:
            out = model(tokens, position_ids, mb.get("attention_mask"), **options,
                        output_processor=self.outputs, output_processor_context=mb)
        if routed and self._compare_routes:
            self.routes.compare(mb["routes"], self._lengths(mb), self._sequence_shard())
        if self._meter is not None:
            self._meter.append(meter.bytes)
        if loss_fn is None:
            return out, lambda o: (torch.zeros((), device=tokens.device),
                                   {k: to_width(v.detach(), width) for k, v in o.items()})

        def loss_func(o):
            loss, units, stats = loss_fn(o, mb)
            loss = FAULTS.corrupt_loss(loss)
            # int32: megatron adds it in place to its own int32 counter (a float raises there).
            units = units.to(torch.int32)
            stats = {k: v.detach().clone() for k, v in {"loss": loss, **stats}.items()}  # clone: kept past backward
            # every CP rank computed the whole-sequence loss: megatron counts its units once
            return loss, context_parallel.units_share(units, self._cp_rank), {**stats, "units": units}

        return out, loss_func

    def _run(self, batch: Batch, micro_batch_size: int, loss_fn: LossFn | None,
             force_all_reduce: bool = False, token_budget: int = 0) -> list[dict]:
        batch = {k: v.to(device()) for k, v in batch.items()}
        microbatches = split_microbatches(batch, micro_batch_size, token_budget, packed=self.packing)
        if self._has_experts and parallel_state.get_expert_model_parallel_world_size() > 1:
            # megatron's expert all-to-all pairs the microbatches of the ranks of an expert group,
            # which hold different data: all run as many as the rank that needs the most
            count = dp_max(torch.tensor([len(microbatches)], device=device()))
            if int(count) > len(microbatches):
                microbatches = split_microbatches(batch, micro_batch_size, token_budget, int(count), self.packing)
        if "lengths" in batch and "attention_mask" not in batch:
            microbatches = trim_padding(microbatches)  # no compute on the padding past each one's longest row
        tp = parallel_state.get_tensor_model_parallel_world_size()
        cp, self._cp_rank = context_parallel.size(), parallel_state.get_context_parallel_rank()
        # sequence parallelism splits each row (or the packed row) evenly over the TP ranks, context
        # parallelism each sequence into 2 x CP chunks
        multiple = context_parallel.column_multiple(cp, tp, self.module.config.sequence_parallel)
        if self.packing:
            if "lengths" not in batch or "attention_mask" in batch or self._has_experts:
                raise ValueError(f"{type(self).__name__}: packed sequences need a batch with `lengths`, no explicit "
                                 "attention_mask, and a dense model (MoE routing is not packed yet)")
            microbatches = pack_microbatches(microbatches, multiple, sequence_multiple=2 * cp if cp > 1 else 1)
        elif multiple > 1:
            microbatches = pad_for_sequence_parallel(microbatches, multiple)
        if cp > 1:
            microbatches = [context_share(mb, cp, self._cp_rank) for mb in microbatches]
        self._microbatches = len(microbatches)
        try:
            return get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, loss_fn, batch["tokens"].size(1)),
                data_iterator=iter(microbatches),
                model=self.model,
                num_microbatches=len(microbatches),
                seq_length=batch["tokens"].size(1),
                micro_batch_size=micro_batch_size,
                forward_only=loss_fn is None,
                force_all_reduce=force_all_reduce,
            )
        finally:
            if self.routes is not None:  # backward (and any recomputation in it) has run: free routing again
                self.routes.release()

    def forward(self, batch: Batch, micro_batch_size: int, token_budget: int = 0,
                compare_routes: bool = False) -> dict[str, torch.Tensor]:
        """Role outputs for the whole batch, on every rank. With a `token_budget` (and `lengths`)
        microbatches hold as many rows as fit in it instead of `micro_batch_size`. A batch with
        `routes` is routed through them (routing replay); with `compare_routes` the routers
        choose freely instead and how often they differ from `routes` is counted
        (self.routes.take_disagreement)."""
        set_training(self.model, False)
        self._compare_routes = compare_routes
        try:
            with torch.no_grad():
                store = self._run(batch, micro_batch_size, loss_fn=None, token_budget=token_budget)
        finally:
            self._compare_routes = False
        merged = {k: torch.cat([d[k] for d in store]) for k in store[0]} if store else {}
        return broadcast_from_last_stage(merged, self.output_shapes(*batch["tokens"].shape))

    def _forward_backward(self, batch: Batch, micro_batch_size: int, loss_fn: LossFn,
                          force_all_reduce: bool = False, token_budget: int = 0) -> list[dict]:
        assert self.trainable, f"{type(self).__name__} is frozen"
        self._begin_expert_step(batch, loss_fn)
        set_training(self.model, True)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._meter = [] if self.activation_bytes is None else None  # once: the hooks cost a call per tensor
        try:
            return self._run(batch, micro_batch_size, loss_fn, force_all_reduce, token_budget)
        finally:
            if self._meter:
                self.activation_bytes = max(self._meter)
            self._meter = None

    def gradients(self, batch: Batch, micro_batch_size: int, loss_fn: LossFn, token_budget: int = 0) -> dict[str, float]:
        """Forward and backward only (checks and tests): afterwards each parameter's
        `main_grad` holds the gradient of the global-batch loss, complete on every
        data-parallel rank (all-reduced even under the DistributedOptimizer). Returns the
        global means of the loss and its statistics."""
        return global_means(self._forward_backward(batch, micro_batch_size, loss_fn, True, token_budget))

    def train_step(self, batch: Batch, micro_batch_size: int, loss_fn: LossFn, token_budget: int = 0) -> dict[str, float]:
        """One optimizer step on `batch` (this rank's share of the global batch): gradient
        accumulation over its microbatches of the global-batch mean loss (see LossFn).

        Returns the global means of the loss and its statistics on every rank, the gradient
        norm and the learning rate. A step with a non-finite loss or gradient on any rank is
        skipped (`skipped`: True): no optimizer or LR-schedule update.
        """
        store = self._forward_backward(batch, micro_batch_size, loss_fn, token_budget=token_budget)
        FAULTS.at("train")  # between backward and the optimizer step: the middle of a step
        grads = [b.grad_data for b in self.grad_buffers]
        skipped = self.guard.should_skip([d["loss"] for d in store], grads)
        update_ok, grad_norm = False, float("nan")
        if not skipped:
            update_ok, grad_norm, _ = self.optimizer.step()
        if update_ok:
            self.scheduler.step(increment=1)
        return {**global_means(store), **self._router_losses(), **self._replay_overrides(),
                "grad_norm": float(grad_norm or 0.0),
                "update_ok": bool(update_ok), "skipped": skipped, "lr": self.optimizer.param_groups[0]["lr"]}


def lora_summary(roles: dict) -> dict:
    """For a stage's summary: which roles train adapters (rank, alpha, targets) on which base."""
    return {name: {**role.extra_state()["lora"], "base": role.lora_base}
            for name, role in roles.items() if getattr(role, "lora", None) is not None}


def lora_base_warnings(roles: dict) -> list[str]:
    """Resumed LoRA roles whose base this run loaded from elsewhere than where their adapters
    trained: a moved checkpoint, or other weights under the adapters (a changed setting)."""
    return [f"warning: {name}: the resumed LoRA adapters were trained on the base {role.resumed_lora_base}, this run "
            f"loaded it from {role.lora_base}; unless that checkpoint was moved there, restore the setting that named "
            "it (sft.init_from, dpo.init_from, rl.sft_from, rl.rm_from / rl.critic_from)"
            for name, role in roles.items()
            if getattr(role, "resumed_lora_base", None) and role.lora_base and role.resumed_lora_base != role.lora_base]


class Actor(Role):
    """The policy: per-token log-probs of given tokens and per-token entropy. An MoE actor's
    routers record and replay routes (models/routing.py).

    `logprobs[:, t]` is log p(tokens[:, t+1] | tokens[:, :t+1]) under logits / temperature;
    the last column has no next token and is 0, and so are the columns from `lengths - 1` on
    when the batch has `lengths`. Same for `entropy`.
    """

    records_routes = True

    def __init__(self, model_config: ModelConfig, trainable: bool = True, temperature: float = 1.0, **training):
        super().__init__(model_config, trainable, **training)
        self.temperature = temperature

    def outputs(self, *, hidden_states, output_layer, output_weight, context, **_):
        targets, valid = next_token_targets(context)  # [s, b]; a packed row's targets stay in their sequence
        if self.model_config.logits_chunk_tokens:  # a chunk's logits at a time (models/vocab_parallel.py)
            logprobs, entropy = chunked_logprobs_and_entropy(
                hidden_states, targets, output_layer, output_weight, temperature=self.temperature,
                vocab_size=self.model_config.token_vocab_size, chunk_tokens=self.model_config.logits_chunk_tokens)
        else:
            logits, _ = output_layer(hidden_states, weight=output_weight)  # [s, b, V/TP]
            logits = mask_padded_vocab(logits.float() / self.temperature, self.model_config.token_vocab_size)
            logprobs, entropy = vocab_parallel_logprobs_and_entropy(logits, targets)
        logprobs, entropy = logprobs * valid, entropy * valid
        return per_row(context, {"logprobs": logprobs, "entropy": entropy})

    def output_shapes(self, batch_size, seq_len):
        return {"logprobs": torch.Size([batch_size, seq_len]), "entropy": torch.Size([batch_size, seq_len])}


class Reference(Actor):
    """Frozen copy of the SFT policy: the per-token KL anchor. Its routers choose for
    themselves: the anchor is the SFT model as it routes, not the actor's routes through it."""

    records_routes = False

    def __init__(self, model_config: ModelConfig, temperature: float = 1.0):
        super().__init__(model_config, trainable=False, temperature=temperature)


class AdapterFreeReference(Actor):
    """The reference of a LoRA actor: the actor's own module with its adapters switched off,
    i.e. the frozen base. No second copy of the weights."""

    shares_weights_of = "actor"

    def __init__(self, actor: Actor):  # no Role.__init__: nothing to build
        self.model_config, self.trainable, self.temperature = actor.model_config, False, actor.temperature
        self.optimizer = self.scheduler = self.lora = self._meter = self.activation_bytes = None
        self.trained_prefixes, self.model = (), actor.module
        self.routes, self._compare_routes = None, False  # the actor's routers, left to route freely

    def forward(self, batch, micro_batch_size, token_budget=0):
        with adapters_disabled(self.model):
            return super().forward(batch, micro_batch_size, token_budget)


class Critic(Role):
    """Per-token values V(prefix up to and including token t); 0 from `lengths` on when the
    batch has `lengths`."""

    value_head = True

    def __init__(self, model_config: ModelConfig, trainable: bool = True, **training):
        super().__init__(model_config, trainable, **training)

    def outputs(self, *, hidden_states, output_layer, context, **_):
        values = whole_sequence(output_layer(hidden_states), context, 1)  # [b, s]
        if "packed_tokens" in context:  # one packed row: back to the rows, 0 past each
            return {"values": unpack_rows(values, context)}
        if "lengths" in context:  # 0 past the sequence, whatever the batch's width
            values = values * real_positions(context["lengths"], values.size(1))
        return {"values": values}

    def output_shapes(self, batch_size, seq_len):
        return {"values": torch.Size([batch_size, seq_len])}


class RewardModel(Role):
    """One scalar per sequence, read at its last non-pad token (`context["lengths"]` - 1),
    then normalised with the (mean, std) stored in its checkpoint (identity until set)."""

    value_head = True

    def __init__(self, model_config: ModelConfig, trainable: bool = False, **training):
        super().__init__(model_config, trainable, **training)
        self.reward_mean, self.reward_std = 0.0, 1.0

    def extra_state(self) -> dict:
        return {**super().extra_state(), "reward_mean": self.reward_mean, "reward_std": self.reward_std}

    def load_extra_state(self, state: dict) -> None:
        self.reward_mean, self.reward_std = state.get("reward_mean", 0.0), state.get("reward_std", 1.0)

    def outputs(self, *, hidden_states, output_layer, context, **_):
        values = whole_sequence(output_layer(hidden_states), context, 1)  # [b, s]
        if "packed_tokens" in context:
            raw = last_tokens(values, context)
        else:
            last = (context["lengths"] - 1).clamp(min=0).unsqueeze(1)
            raw = values.gather(1, last).squeeze(1)
        return {"rewards": (raw - self.reward_mean) / self.reward_std}

    def output_shapes(self, batch_size, seq_len):
        return {"rewards": torch.Size([batch_size])}
