"""torchrun worker for tests/test_moe_aux_loss.py: the gradient of megatron's load-balancing
loss in our trainers, at each layout of the launch (`--layout NAME=TPxPP[:key=value...]`), for
both load-balancing types (model.moe_load_balancing_type: aux_loss, seq_aux_loss).

The batch's rows are distinct sequences of unequal lengths (right padding), so megatron's
per-microbatch loss changes with the split into microbatches. The auxiliary gradient (the
actor's gradient with the coefficient on minus with it off, the policy loss held fixed) is
recorded per (type, loss, micro batch size): for micro batch 1, 2 and 4 (the microbatches are
then the same rows at every layout: a DP2 rank's share of 4 rows is one microbatch of 4 at DP1),
for the whole share, for token-mean and sequence-mean aggregation and for a short and a long
prompt (other response-token counts). At TP1 the whole batch as one microbatch is also computed
by megatron's own path (no per-token loss, loss scale 1), the definition the rest must equal.
At the TP2 layout (sequence parallel) the worker also records what megatron's own token count
(models/moe_fixes.py keeps it) returns, so the test notices when upstream fixes it.
Results go to --root (global rank 0).
"""

import dataclasses
from functools import partial

import torch

from megatron_rlhf.checkpoint.dist import load_role, save_role
from megatron_rlhf.config import RLConfig
from megatron_rlhf.models import moe_fixes
from megatron_rlhf.models.microbatches import padding_positions
from megatron_rlhf.models.roles import Actor
from megatron_rlhf.trainers.rl import actor_loss
from workers import run_layouts, training_of

ROWS, SEQ = 8, 16
LENGTHS = [16, 12, 15, 13, 16, 14, 12, 15]  # unequal: padding differs between rows and SP slices
COEF = 1.0  # large: the auxiliary gradient is a difference of two gradients that the policy loss dominates otherwise
TYPES = ("aux_loss", "seq_aux_loss")
LOSSES = {  # name -> (loss aggregation, prompt length)
    "token_mean": ("token_mean", 3),
    "seq_mean": ("seq_mean_token_mean", 3),
    "token_mean_long_prompt": ("token_mean", 9),
}
MICRO_BATCHES = (1, 2, 4)  # the same microbatches at every layout of 1 or 2 data-parallel ranks


def make_batch(prompt: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor(LENGTHS)
    positions = torch.arange(SEQ)
    tokens = torch.randint(2, 100, (ROWS, SEQ), generator=g).masked_fill(positions >= lengths[:, None], 0)
    mask = ((positions >= prompt - 1) & (positions < lengths[:, None] - 1)).float()
    return {"tokens": tokens, "lengths": lengths, "prompt_lengths": torch.full((ROWS,), prompt), "mask": mask,
            "advantages": torch.randn(ROWS, SEQ, generator=g) * mask,
            "old_logprobs": torch.full((ROWS, SEQ), -4.0) * mask, "ref_logprobs": torch.full((ROWS, SEQ), -4.0) * mask}


def dp_share(batch):
    from megatron.core import parallel_state as ps

    n, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    return {k: v[r * ROWS // n:(r + 1) * ROWS // n] for k, v in batch.items()}


def shared_gradients(actor) -> dict[str, torch.Tensor]:
    """main_grad of every parameter but the experts' (which the load-balancing loss does not
    reach). At TP > 1 the tensor-parallel ones are this rank's shards: the test compares only
    the parameters whose shape is the TP1 one (the replicated router weights and norms)."""
    return {n: p.main_grad.detach().clone() for n, p in actor.module.named_parameters() if ".experts." not in n}


def auxiliary_gradient(actor, batch, micro_batch_size: int, loss_fn) -> dict[str, torch.Tensor]:
    config = actor.module.config
    grads = {}
    for coef in (COEF, 0.0):
        config.moe_aux_loss_coeff = coef
        actor.gradients(batch, micro_batch_size, loss_fn)
        grads[coef] = shared_gradients(actor)
    config.moe_aux_loss_coeff = COEF
    return {n: grads[COEF][n] - grads[0.0][n] for n in grads[COEF]}


def megatron_reference(actor, batch) -> dict[str, torch.Tensor]:
    """COEF x the gradient of megatron's load-balancing loss over the whole batch as one
    microbatch, padding masked, by megatron's own path: no per-token loss, loss scale 1, a zero
    main loss."""
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    routers = [m for m in actor.module.modules() if hasattr(m, "calculate_per_token_loss")]
    actor.model.zero_grad_buffer()
    actor.model.train()
    for router in routers:
        router.calculate_per_token_loss = False
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    tokens = batch["tokens"]
    logits = actor.model(tokens, torch.arange(SEQ).expand_as(tokens), None,
                         padding_mask=padding_positions(batch["lengths"], SEQ))
    (logits.sum() * 0.0).backward()
    for router in routers:
        router.calculate_per_token_loss = True
    return shared_gradients(actor)


def megatron_token_count(tp_group) -> dict[str, float]:
    """What megatron's own get_tokens_per_expert_and_token_count (and the fix) return as the
    local count when the TP ranks hold 3 and 5 valid tokens (top-2 of 4 experts)."""
    rank = torch.distributed.get_rank(tp_group)
    own = 3 + 2 * rank
    routing_map = torch.zeros(own, 4, dtype=torch.bool)
    routing_map[:, :2] = True
    _, upstream_local, total = moe_fixes.megatron_original(routing_map.clone(), tp_group, topk=2, with_padding_mask=True)
    _, fixed_local, _ = moe_fixes.group_mean_token_count(routing_map.clone(), tp_group, topk=2, with_padding_mask=True)
    return {"own": float(own), "upstream_local": float(upstream_local), "total": float(total),
            "fixed_local": float(fixed_local)}


def check_layout(args, cfg, layout: str) -> None:
    from megatron.core import parallel_state as ps

    if layout == "init":
        save_role(Actor(cfg.model, **training_of(cfg)), args.root / "init", with_optimizer=False)
        return
    results = {"aux": {}, "megatron": {}}
    for balancing in TYPES:
        actor = Actor(dataclasses.replace(cfg.model, moe_load_balancing_type=balancing), **training_of(cfg))
        load_role(actor, args.root / "init", with_optimizer=False)
        for name, (aggregation, prompt) in LOSSES.items():
            batch = dp_share(make_batch(prompt))
            loss_fn = partial(actor_loss, rl=RLConfig(loss_aggregation=aggregation, kl_in_reward=False), kl_coef=0.1)
            for mbs in sorted({*MICRO_BATCHES, batch["tokens"].size(0)}):
                results["aux"][(balancing, name, mbs)] = auxiliary_gradient(actor, batch, mbs, loss_fn)
        if layout == "tp1pp1":
            results["megatron"][balancing] = megatron_reference(actor, make_batch(3))
    if ps.get_tensor_model_parallel_world_size() > 1:
        results["token_count"] = megatron_token_count(ps.get_tensor_model_parallel_group())
    if torch.distributed.get_rank() == 0:
        torch.save(results, args.root / f"aux_{layout}.pt")


if __name__ == "__main__":
    run_layouts(check_layout)
