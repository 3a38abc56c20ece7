"""Generation in place with the Megatron actor's own weights: no copy, no second engine.

KV-cached incremental decoding through megatron-core's static inference context (its
attention layers keep the key/value cache). Ragged prompts are handled the way megatron's
static engine does: decoding starts at the shortest prompt, and a row whose prompt is longer
is fed its own prompt tokens until the prompt ends. No sequence ever contains padding, so no
attention mask is needed and RoPE positions are the true ones; the output is right-padded,
which is the layout the trainer uses.

Everything stays on the actor's device. Per decoded token, at any TP x PP:
- hidden states [B, L, H] go stage to stage with megatron's inference p2p helpers;
- the last stage gathers its next-token logits over TP ([B, V] fp32 on each of its TP ranks)
  and samples there (`sample_next`, a seeded device generator);
- only the chosen ids [B] (int64) cross ranks: from TP rank 0 of the last stage to its TP
  group (so TP ranks agree even with nondeterministic kernels), then from the last stage to
  the other stages. The log-probs stay on the last stage until generation ends, when the
  [B, S] block crosses the same two groups once;
- a mixture-of-experts actor's routers record their choices in every forward (models/routing.py)
  and each step's are copied into the rollout's routes [B, S, layers, k] on the device: each
  stage keeps its own layers' (what it replays in training), nothing crosses ranks;
- with experts across ranks (EP > 1) the ranks of a data-parallel group hold different rows but
  megatron's expert all-to-all pairs their forwards: each rank feeds its own span (its own
  uncached chunk, its own decoding steps) and they agree only on the number of forwards, a rank
  whose rows are done (or that has none) running idle one-token forwards meanwhile.

Multi-turn episodes (rollout/episodes.py) keep one KV cache from a turn to the next (`TurnCache`,
sized for the episodes' whole trajectories): a turn feeds only what its rows have not cached
(the last turn's final token and the observation after it) as one chunk after the cached keys,
then decodes. Core attention sees a chunk of queries after cached keys, which must be causal
aligned to the bottom right: megatron's static inference passes `no_mask` for every call after
the first, right for one-token steps only; the CPU spec's SDPA attention and the GPU spec's
Transformer Engine attention (models/attention.py: te_chunked_inference_attention, chosen in
models/gpt.py) apply the layer's own causal mask, bottom-right aligned, instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state as ps
from megatron.core.inference.communication_utils import (
    broadcast_from_last_pipeline_stage, recv_from_prev_pipeline_rank_, send_to_next_pipeline_rank,
)
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from megatron_rlhf.config import ConfigError, ModelConfig
from megatron_rlhf.models.gpt import sequence_parallel_disabled
from megatron_rlhf.models.microbatches import padding_positions
from megatron_rlhf.parallel import cpu, device
from megatron_rlhf.parallel.collectives import dp_max
from megatron_rlhf.rollout.base import Rollout, RolloutEngine, SamplingParams, sample_next


@dataclass(frozen=True)
class StageLayout:
    """This rank's place in the model-parallel grid, read from megatron's parallel_state once
    per generate() call (each query is a few Python calls; the loop needs them every token)."""

    first: bool  # first pipeline stage: embeds the tokens
    last: bool   # last pipeline stage: holds the logits and samples
    tp: int
    pp: int

    @classmethod
    def current(cls) -> StageLayout:
        return cls(ps.is_pipeline_first_stage(ignore_virtual=True), ps.is_pipeline_last_stage(ignore_virtual=True),
                   ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())


def from_last_stage_tp0(x: torch.Tensor | None, shape: list[int], dtype: torch.dtype,
                        layout: StageLayout) -> torch.Tensor:
    """`x` as TP rank 0 of the last pipeline stage holds it, on every model-parallel rank
    (`x` is only read on the last stage)."""
    if layout.last and layout.tp > 1:
        torch.distributed.broadcast(x, ps.get_tensor_model_parallel_src_rank(),
                                    group=ps.get_tensor_model_parallel_group())
    if layout.pp > 1:
        x = broadcast_from_last_pipeline_stage(shape, dtype, x)
    return x


@dataclass
class Decoding:
    """Per-row state of one generate() call, on one device: tokens [B, S] (prompts, then the
    response, pad elsewhere), prompt_lengths / lengths [B], logprobs [B, S] (sequence layout,
    as in Rollout), finished [B] (ended with EOS), done [B] (no more tokens: EOS or budget)."""

    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    lengths: torch.Tensor
    logprobs: torch.Tensor
    finished: torch.Tensor
    done: torch.Tensor

    @classmethod
    def start(cls, prompts: list[list[int]], total: int, pad_id: int, dev: torch.device) -> Decoding:
        tokens = torch.full((len(prompts), total), pad_id, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = torch.tensor(prompt)
        prompt_lengths = torch.tensor([len(p) for p in prompts], device=dev)
        flags = torch.zeros(len(prompts), dtype=torch.bool, device=dev)
        return cls(tokens.to(dev), prompt_lengths, prompt_lengths.clone(),
                   torch.zeros(len(prompts), total, device=dev), flags, flags.clone())

    def record(self, pos: int, sampled: torch.Tensor, logprob: torch.Tensor | None, eos_id: int | torch.Tensor,
               pad_id: int, max_new_tokens: int) -> None:
        """Write position `pos`: rows still in their prompt keep the prompt token, done rows get
        pad, the others take `sampled` ([B]) and, when given, its log-prob ([B]) at pos - 1.
        EOS is only looked for in rows still generating, so a pad equal to EOS, written into
        rows already done, never marks them finished or extends their length. `eos_id`: the id,
        or a tensor of ids that each end a row (EOS and SamplingParams.stop_token_ids)."""
        # Called once per token, where each tensor op costs a dispatch: the writes go in place
        # into views of the state (no temporaries, no index_put).
        generating = (self.prompt_lengths <= pos) & ~self.done
        column = self.tokens[:, pos]
        column.masked_fill_(self.done, pad_id)
        torch.where(generating, sampled, column, out=column)
        if logprob is not None:  # the column is still start()'s zeros: each position is written once
            previous = self.logprobs[:, pos - 1]
            torch.where(generating, logprob, previous, out=previous)
        self.lengths.masked_fill_(generating, pos + 1)
        is_eos = generating & (torch.isin(column, eos_id) if isinstance(eos_id, torch.Tensor) else column == eos_id)
        self.finished |= is_eos
        self.done |= is_eos | (generating & (self.prompt_lengths <= pos + 1 - max_new_tokens))  # budget used


class TurnCache:
    """The KV cache of a batch of episodes, carried from one turn's generate to the next.

    One static inference context, sized for `capacity` tokens (rl.max_total_tokens: prompt and
    every turn); its batch rows hold the episodes `rows` (keys the caller chooses). `cached[key]`
    is how many leading positions of that episode's sequence have their keys and values in the
    cache: everything fed so far but the last sampled token (which was never fed; rows that
    ended early were fed padding after it, overwritten when the row is fed again). A turn whose
    rows are a subset of the cached ones (episodes that ended are dropped) selects theirs first;
    a key not in the cache starts from nothing (cached 0)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.context: StaticInferenceContext | None = None
        self.rows: list = []
        self.cached: dict = {}
        self.reused_tokens = 0   # positions taken from the cache instead of being fed again
        self.fed_tokens = 0      # positions fed to the model (prompt chunks and decoding steps)

    def take(self, keys: list, lengths: list[int]) -> tuple[StaticInferenceContext, int]:
        """The context for a generate over `keys` (sequences of `lengths`), its batch rows
        selected in that order, and the first position to feed (every row's cache holds at
        least that many, and less than its length)."""
        cached = [min(self.cached.get(k, 0), n - 1) for k, n in zip(keys, lengths)]
        start = min(cached)
        if self.context is None or any(k not in self.cached for k in keys):
            start = 0  # a new row: fed from its first token (the others' rows are rewritten the same)
            self.context = StaticInferenceContext(len(keys), self.capacity)
        elif keys != self.rows:
            index = torch.tensor([self.rows.index(k) for k in keys], device=device())
            memory = self.context.key_value_memory_dict
            for layer, (k, v) in memory.items():  # [positions, batch, ...]: this turn's rows only
                memory[layer] = (k.index_select(1, index), v.index_select(1, index))
            self.context.max_batch_size = len(keys)
        self.rows = list(keys)
        return self.context, start

    def keep(self, lengths: list[int]) -> None:
        """After the generate: each row's sequence of `lengths` is cached but its last token."""
        self.cached = {k: n - 1 for k, n in zip(self.rows, lengths)}


def _last_position_logits(*, hidden_states, output_layer, output_weight, **_) -> torch.Tensor:
    """[B, V/TP] logits of the chunk's last position only: a prefill of a long prompt would
    otherwise project every position ([B, L, V/TP]) to keep one (megatron slices the same way
    under its own inference mode, which this engine does not run)."""
    logits, _ = output_layer(hidden_states[-1:], weight=output_weight)
    return logits[0]


class MegatronRolloutEngine(RolloutEngine):
    """Samples with `actor`, a model of section `model` (its vocabulary and length)."""

    # generate([]) takes part in the collective steps of the others without a stand-in row
    # (rollout/episodes.py: a rank whose episodes have all ended)
    generates_without_rows = True

    def __init__(self, model: ModelConfig, actor, eos_id: int, pad_id: int):
        if ps.model_parallel_is_initialized() and ps.get_context_parallel_world_size() > 1:
            raise ConfigError(f"parallel.context_parallel={ps.get_context_parallel_world_size()} with "
                              "rollout.engine=megatron: the in-place engine decodes on the training layout, and "
                              "megatron's inference has no context parallelism; set rollout.engine=vllm (its own "
                              "layout, rollout.tensor_parallel) for context-parallel training")
        self.model, self.actor, self.eos_id, self.pad_id = model, actor, eos_id, pad_id
        self._idle_context = self._idle_token = None
        self.forward_steps = 0  # every forward generate ran (idle ones included), since the engine was made

    def _next_token_logits(self, chunk: torch.Tensor, positions: torch.Tensor, context,
                           layout: StageLayout) -> torch.Tensor | None:
        """Last stage: full-vocabulary fp32 logits [B, V] for the position after `chunk`
        (`positions`: its RoPE positions, [B, L]; gathered over TP, padded vocabulary rows
        -inf). Other stages: None."""
        model = self.actor.module
        batch, length = chunk.shape
        if not layout.first:
            hidden = torch.empty(length, batch, model.config.hidden_size,
                                 dtype=model.config.params_dtype, device=chunk.device)
            recv_from_prev_pipeline_rank_(hidden)
            model.set_input_tensor(hidden)
        out = model(chunk, positions, None, inference_context=context, output_processor=_last_position_logits)
        context.sequence_len_offset += length
        if not layout.last:
            send_to_next_pipeline_rank(out.contiguous())
            return None
        logits = out.float()
        if layout.tp > 1:
            logits = gather_from_tensor_model_parallel_region(logits)
        tokens = self.model.token_vocab_size
        if logits.size(-1) > tokens:
            logits[:, tokens:] = float("-inf")  # padding, ids past the tokenizer
        return logits

    def _experts_across_ranks(self) -> bool:
        return bool(self.actor.module.config.num_moe_experts) and ps.get_expert_model_parallel_world_size() > 1

    @staticmethod
    def _next_step(decoding: bool | torch.Tensor, across_ranks: bool) -> tuple[bool, bool]:
        """(this rank feeds its rows in the next forward, some rank of the data-parallel group
        does): `decoding` is this rank's "a row is still generating" flag (a device bool, or False
        for a rank without rows). With experts across ranks every rank runs a forward while any
        does (megatron's all-to-all pairs them); each feeds its own rows, or idles. The one host
        read per token."""
        if not across_ranks:
            mine = bool(decoding)
            return mine, mine
        flag = torch.as_tensor(decoding, device=device()).to(torch.int32).reshape(1)
        mine, anyone = torch.cat([flag, dp_max(flag)]).tolist()
        return bool(mine), bool(anyone)

    def _idle_step(self, layout: StageLayout) -> None:
        """A forward with one pad token of a throwaway one-row context: this rank's part of the
        expert all-to-all of a step in which it has no rows to feed (its rows are done, or it has
        none), whatever the others feed. Nothing it computes is kept."""
        if self._idle_context is None:
            self._idle_context = StaticInferenceContext(1, 1)
            self._idle_token = torch.full((1, 1), self.pad_id, dtype=torch.long, device=device())
        self._idle_context.sequence_len_offset = 0
        self._next_token_logits(self._idle_token, torch.zeros_like(self._idle_token), self._idle_context, layout)

    def turn_cache(self, capacity: int) -> TurnCache:
        """A KV cache for the turns of a batch of episodes of up to `capacity` tokens each."""
        if capacity > self.model.max_seq_length:
            raise ValueError(f"a turn cache of {capacity} tokens exceeds model.max_seq_length={self.model.max_seq_length}")
        return TurnCache(capacity)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seed: int,
                 cache: TurnCache | None = None, keys: list | None = None) -> Rollout:
        """Rollout tensors on the actor's device. Collective over the model-parallel group (and,
        with experts across ranks, over the data-parallel group: a rank with no `prompts` then
        still takes part in the others' forwards). With `cache` (a turn of multi-turn episodes):
        `prompts` continue the sequences that `cache` holds for `keys` (one key per prompt), fed
        from where the cache ends."""
        self.actor.model.eval()
        layout = StageLayout.current()
        across_ranks = self._experts_across_ranks()
        if not prompts:
            return self._no_rows(layout, across_ranks)
        batch, shortest = len(prompts), min(len(p) for p in prompts)
        total = max(len(p) for p in prompts) + sampling.max_new_tokens
        limit = cache.capacity if cache is not None else self.model.max_seq_length
        if total > limit:
            field = "rl.max_total_tokens" if cache is not None else "model.max_seq_length"
            raise ValueError(f"longest prompt + max_new_tokens = {total} exceeds {field}={limit}")
        # Each rank feeds its own span: its uncached chunk [start, shortest) in one forward, then
        # one token a step. With experts across ranks the ranks of a data-parallel group run
        # as many forwards as the one that needs most (megatron's all-to-all pairs them step by
        # step, whatever each feeds), a rank done early idling (_idle_step).
        context, start = cache.take(keys, [len(p) for p in prompts]) if cache is not None else (None, 0)
        if context is None:
            context = StaticInferenceContext(batch, total)
        context.sequence_len_offset = start
        if cache is not None:
            cache.reused_tokens += start * batch
        state = Decoding.start(prompts, total, self.pad_id, device())
        generator = torch.Generator(device=device()).manual_seed(seed)
        positions = torch.arange(total, device=state.tokens.device).expand(batch, -1)
        routers = self.actor.routes  # an MoE actor's: the rollout's routes are recorded for replay
        routes = routers.new_routes(batch, total, device()) if routers is not None else None
        if routers is not None:
            routers.record()
        try:
            fed = self._decode(state, context, positions, start, shortest, total, generator, sampling, layout,
                               across_ranks, routers, routes)
        finally:
            if routers is not None:
                routers.release()
        if cache is not None:
            cache.keep(state.lengths.tolist())
            cache.fed_tokens += fed * batch

        width = int(state.lengths.max())
        logprobs = state.logprobs[:, :width].contiguous() if layout.last else None
        logprobs = from_last_stage_tp0(logprobs, [batch, width], torch.float32, layout)
        if routes is not None:  # what rows were fed after their end (pad) was never theirs
            routes = routes[:, :width].contiguous()
            routes.masked_fill_(padding_positions(state.lengths, width)[:, :, None, None], routers.unrouted)
        return Rollout(state.tokens[:, :width], state.prompt_lengths, state.lengths, logprobs, state.finished, routes)

    def _no_rows(self, layout: StageLayout, across_ranks: bool) -> Rollout:
        """generate() of no prompts (a rank whose episodes have all ended): with experts across
        ranks, idle forwards for as long as another rank of the data-parallel group decodes; an
        empty rollout."""
        if across_ranks:
            with cpu.hot_path(), sequence_parallel_disabled(self.actor.module):
                while self._next_step(False, across_ranks)[1]:
                    self._idle_step(layout)
                    self.forward_steps += 1
        empty = torch.zeros(0, 0, dtype=torch.long, device=device())
        lengths = torch.zeros(0, dtype=torch.long, device=device())
        return Rollout(empty, lengths, lengths.clone(), empty.float(), lengths.bool())

    def _decode(self, state: Decoding, context, positions, start: int, shortest: int, total: int, generator,
                sampling, layout: StageLayout, across_ranks: bool, routers, routes) -> int:
        """Feeds positions [start, shortest) in one chunk, then one token a step (with experts
        across ranks: idle steps once this rank's rows are done, while another rank's are not);
        returns how many positions were fed."""
        batch, prev, pos = state.tokens.size(0), start, shortest
        stops = (torch.tensor([self.eos_id, *sampling.stop_token_ids], device=state.tokens.device)
                 if sampling.stop_token_ids else self.eos_id)
        # The whole loop runs outside the CPU device-rewriting mode (a no-op on GPU): besides the
        # model (which ran there already) it only does tensor math on the state's own device and
        # megatron's inference p2p / TP helpers, which name the device only through
        # torch.cuda.current_device() (patched on CPU). The mode costs ~2 us per op: ~30 ops a token.
        with cpu.hot_path(), sequence_parallel_disabled(self.actor.module):
            # the flag read is the one host sync per token, kept so a batch that has finished stops
            # at once: at PP > 1 megatron's p2p helpers synchronise every step anyway, and at PP = 1
            # decoding is launch-bound, so the sync costs about a kernel launch, far less than the
            # extra forward steps that checking only every k tokens could run.
            while True:
                mine, anyone = self._next_step(~state.done.all() if pos < total else False, across_ranks)
                if not anyone:
                    break
                self.forward_steps += 1
                if not mine:
                    self._idle_step(layout)
                    continue
                logits = self._next_token_logits(state.tokens[:, prev:pos], positions[:, prev:pos], context, layout)
                if routes is not None:
                    routers.write_step(routes, prev, pos)
                ids, logprob = sample_next(logits, generator, sampling) if layout.last else (None, None)
                ids = from_last_stage_tp0(ids, [batch], torch.long, layout)
                state.record(pos, ids, logprob, stops, self.pad_id, sampling.max_new_tokens)
                prev, pos = pos, pos + 1
        return prev - start
