"""Generation in place with the Megatron actor's own weights: no copy, no second engine.

KV-cached incremental decoding through megatron-core's static inference context (its
attention layers keep the key/value cache). Ragged prompts are handled the way megatron's
static engine does: decoding starts at the shortest prompt, and a row whose prompt is longer
is fed its own prompt tokens until the prompt ends. No sequence ever contains padding, so no
attention mask is needed and RoPE positions are the true ones; the output is right-padded,
which is the layout the trainer uses.

Works at any TP x PP: hidden states travel between pipeline stages with megatron's inference
p2p helpers, the last stage's next-token logits (one position, gathered over TP) are
broadcast to every rank, and every rank samples with the same seeded generator.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.inference.communication_utils import (
    broadcast_from_last_pipeline_stage, recv_from_prev_pipeline_rank_, send_to_next_pipeline_rank,
)
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from megatron_rlhf.parallel import device
from megatron_rlhf.rollout.base import Rollout, RolloutEngine, SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then nucleus filtering of [B, V] logits (filtered entries -> -inf)."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the token crossing top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class MegatronRolloutEngine(RolloutEngine):
    def __init__(self, actor, eos_id: int, pad_id: int):
        self.actor, self.eos_id, self.pad_id = actor, eos_id, pad_id

    def _next_token_logits(self, chunk: torch.Tensor, start: int, context) -> torch.Tensor:
        """Full-vocabulary fp32 logits [B, V] for the position after `chunk`, on every rank."""
        model = self.actor.module
        batch, length = chunk.shape
        position_ids = torch.arange(start, start + length, device=chunk.device).expand(batch, -1)
        if not parallel_state.is_pipeline_first_stage(ignore_virtual=True):
            hidden = torch.empty(length, batch, model.config.hidden_size,
                                 dtype=model.config.params_dtype, device=chunk.device)
            recv_from_prev_pipeline_rank_(hidden)
            model.set_input_tensor(hidden)
        out = model(chunk, position_ids, None, inference_context=context)
        context.sequence_len_offset += length
        vocab = self.actor.cfg.model.padded_vocab_size
        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            send_to_next_pipeline_rank(out.contiguous())
            logits = None
        else:
            logits = gather_from_tensor_model_parallel_region(out[:, -1, :].float()).contiguous()
        logits = broadcast_from_last_pipeline_stage([batch, vocab], torch.float32, logits)
        logits[:, self.actor.cfg.model.vocab_size :] = float("-inf")  # padding rows are not tokens
        return logits

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seed: int) -> Rollout:
        self.actor.model.eval()
        batch = len(prompts)
        prompt_lengths = torch.tensor([len(p) for p in prompts])
        total = int(prompt_lengths.max()) + sampling.max_new_tokens
        if total > self.actor.cfg.model.max_seq_length:
            raise ValueError(f"longest prompt + max_new_tokens = {total} exceeds model.max_seq_length="
                             f"{self.actor.cfg.model.max_seq_length}")
        tokens = torch.full((batch, total), self.pad_id, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = torch.tensor(prompt)
        tokens = tokens.to(device())
        logprobs = torch.zeros(batch, total)
        lengths = prompt_lengths.clone()
        done = torch.zeros(batch, dtype=torch.bool)
        finished = torch.zeros(batch, dtype=torch.bool)
        generator = torch.Generator().manual_seed(seed)
        context = StaticInferenceContext(batch, total)

        prev, pos = 0, int(prompt_lengths.min())
        while pos < total and not bool(done.all()):
            logits = self._next_token_logits(tokens[:, prev:pos], prev, context).cpu() / sampling.temperature
            if sampling.greedy:
                sampled = logits.argmax(-1)
            else:
                probs = filter_logits(logits, sampling.top_k, sampling.top_p).softmax(-1)
                sampled = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            in_prompt = pos < prompt_lengths
            generating = ~in_prompt & ~done
            token = torch.where(in_prompt, tokens[:, pos].cpu(), sampled)
            token = torch.where(done, torch.full_like(token, self.pad_id), token)
            tokens[:, pos] = token.to(tokens.device)
            chosen_logprob = logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
            logprobs[:, pos - 1] = torch.where(generating, chosen_logprob, 0.0)
            lengths = torch.where(generating, torch.full_like(lengths, pos + 1), lengths)
            is_eos = generating & (token == self.eos_id)
            finished |= is_eos
            done |= is_eos | (generating & (pos + 1 - prompt_lengths >= sampling.max_new_tokens))
            prev, pos = pos, pos + 1

        width = int(lengths.max())
        return Rollout(tokens[:, :width].cpu(), prompt_lengths, lengths, logprobs[:, :width], finished)
