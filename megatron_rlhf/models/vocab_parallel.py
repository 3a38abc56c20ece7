"""Per-token log-probs and entropy from vocab-parallel logits, without gathering them.

Each TP rank holds logits for a slice of the vocabulary ([s, b, V/TP]). Both come from one
softmax in one autograd function that keeps a single logits-sized tensor for backward (the
shifted logits) and recomputes the softmax there: separate log-softmax and entropy graphs keep
three or four, and at a 49k vocabulary the logits are the largest activation there is. The
incoming gradients are replicated on every TP rank (the loss downstream is), so backward needs
no communication: each rank differentiates its own slice.

`chunked_logprobs_and_entropy` goes further: it takes the hidden states and the output layer,
and computes the logits a chunk of tokens at a time, in forward and again in backward, so no
more than one chunk's logits ever exist and nothing logits-sized is kept for backward (only
the hidden states, already alive, and three numbers per token). Long sequences then cost
[chunk x V/TP] for the log-probs instead of [s x b x V/TP].
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel

_PADDED_LOGIT = -1e9  # finite, so exp() gives exactly 0 and 0 * logit stays 0


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Padding rows of the embedding are not tokens: give them zero probability."""
    shard = logits.size(-1)
    start = parallel_state.get_tensor_model_parallel_rank() * shard
    if start + shard <= vocab_size:
        return logits
    ids = torch.arange(start, start + shard, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, _PADDED_LOGIT)


def _tp_all_reduce(t: torch.Tensor, op=torch.distributed.ReduceOp.SUM) -> torch.Tensor:
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(t, op=op, group=parallel_state.get_tensor_model_parallel_group())
    return t


def _owned_targets(targets: torch.Tensor, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of each target in this rank's vocabulary slice [.., 1], whether the slice holds it)."""
    local = targets - parallel_state.get_tensor_model_parallel_rank() * shard
    owned = (local >= 0) & (local < shard)
    return local.clamp(0, shard - 1).unsqueeze(-1), owned


def _softmax_stats(logits: torch.Tensor, targets: torch.Tensor):
    """(max, log Z of the shifted logits, log p(target), entropy), each [...] (one per token)."""
    local, owned = _owned_targets(targets, logits.size(-1))
    top = _tp_all_reduce(logits.max(dim=-1, keepdim=True).values, torch.distributed.ReduceOp.MAX)
    shifted = logits - top
    log_z = _tp_all_reduce(shifted.exp().sum(dim=-1)).log()
    target = _tp_all_reduce(shifted.gather(-1, local).squeeze(-1) * owned)
    probs = (shifted - log_z.unsqueeze(-1)).exp_()
    entropy = log_z - _tp_all_reduce(probs.mul_(shifted).sum(dim=-1))  # H = log Z - sum_v p_v z_v
    return top.squeeze(-1), log_z, target - log_z, entropy


def _grad_logits(shifted: torch.Tensor, log_z, entropy, targets, grad_logprobs, grad_entropy) -> torch.Tensor:
    """d(loss)/d(logits) of this rank's slice from the shifted logits."""
    local, owned = _owned_targets(targets, shifted.size(-1))
    log_p = shifted - log_z.unsqueeze(-1)
    p = log_p.exp()
    # d log p_t / dz = onehot_t - p;  dH / dz = -p (log p + H)
    grad = log_p.add_(entropy.unsqueeze(-1)).mul_(p).mul_(-grad_entropy.unsqueeze(-1))
    grad.sub_(p.mul_(grad_logprobs.unsqueeze(-1)))
    grad.scatter_add_(-1, local, (grad_logprobs * owned).unsqueeze(-1))
    return grad


class _LogprobsAndEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets):
        top, log_z, logprobs, entropy = _softmax_stats(logits, targets)
        ctx.save_for_backward(logits - top.unsqueeze(-1), log_z, entropy, targets)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        shifted, log_z, entropy, targets = ctx.saved_tensors
        return _grad_logits(shifted, log_z, entropy, targets, grad_logprobs, grad_entropy), None


def vocab_parallel_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) over the full vocabulary; logits [s, b, V/TP] (float), targets
    [s, b] (global ids) -> two [s, b]."""
    return _LogprobsAndEntropy.apply(logits, targets)


class _OutputChunks:
    """The output layer's logits over chunks of the hidden states' sequence.

    Under sequence parallelism each rank holds [s/TP, b, h] and the output layer all-gathers its
    input (and reduce-scatters the input's gradient, and sums a LoRA adapter's replicated
    gradient over TP): each chunk is then a slice of every rank's part, gathered by the layer
    itself, so the layer runs exactly as it does unchunked. The chunk's tokens are those slices
    of the TP parts in rank order; `rows` picks them from a full-sequence tensor, `join` puts
    per-chunk results back in sequence order."""

    def __init__(self, output_layer, output_weight, temperature: float, vocab_size: int,
                 chunk_tokens: int, local_length: int, batch: int):
        self.output_layer, self.output_weight = output_layer, output_weight
        self.temperature, self.vocab_size = temperature, vocab_size
        sequence_parallel = getattr(output_layer, "sequence_parallel", False)
        self.parts = parallel_state.get_tensor_model_parallel_world_size() if sequence_parallel else 1
        step = max(1, chunk_tokens // (batch * self.parts))  # local sequence rows per chunk
        self.bounds = [(a, min(a + step, local_length)) for a in range(0, local_length, step)]

    def draws_random(self) -> bool:
        """Whether the output layer's forward draws random numbers (a LoRA adapter's dropout in training)."""
        return bool(self.output_layer.training and getattr(self.output_layer, "lora_dropout_p", 0))

    def logits(self, hidden_chunk: torch.Tensor) -> torch.Tensor:
        """[chunk tokens, b, V/TP] float, temperature-scaled, padded ids masked: what Actor scores."""
        logits, _ = self.output_layer(hidden_chunk, weight=self.output_weight)
        return mask_padded_vocab(logits.float() / self.temperature, self.vocab_size)

    def rows(self, full: torch.Tensor, start: int, end: int) -> torch.Tensor:
        if self.parts == 1:
            return full[start:end]
        return full.unflatten(0, (self.parts, -1))[:, start:end].flatten(0, 1)

    def join(self, chunks: list[torch.Tensor]) -> torch.Tensor:
        if self.parts == 1:
            return torch.cat(chunks)
        return torch.cat([c.unflatten(0, (self.parts, -1)) for c in chunks], dim=1).flatten(0, 1)


def _rng_states():
    """Every generator a LoRA dropout on the output layer may draw from (see _ChunkedLogprobsAndEntropy)."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda, tensor_parallel.get_cuda_rng_tracker().get_states()


def _set_rng_states(states) -> None:
    cpu, cuda, tracker = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    tensor_parallel.get_cuda_rng_tracker().set_states(tracker)


class _ChunkedLogprobsAndEntropy(torch.autograd.Function):
    """Forward: per chunk, logits -> (max, log Z, log p(target), entropy); only those and the
    hidden states are saved. Backward: per chunk, the logits again (under autograd, from a
    detached slice of the hidden states), their gradient from the saved statistics, and
    `torch.autograd.backward` through the output layer: its weights' gradients accumulate as in
    any backward (megatron DDP's hooks add each chunk's into main_grad), the hidden slice's
    gradient is returned. `params` (the output layer's trained tensors) are inputs only so that
    autograd calls this backward when they alone need gradients (a LoRA head on a frozen body).
    Dropout in the output layer (a LoRA adapter's) redraws the forward's masks: the random
    generators are rewound to the forward's start and the chunks rerun in the same order."""

    @staticmethod
    def forward(ctx, hidden, targets, chunks: _OutputChunks, *params):
        ctx.chunks, ctx.rng = chunks, _rng_states() if chunks.draws_random() else None
        stats = [_softmax_stats(chunks.logits(hidden[a:b]), chunks.rows(targets, a, b)) for a, b in chunks.bounds]
        top, log_z, logprobs, entropy = (torch.cat([s[i].flatten() for s in stats]) for i in range(4))
        ctx.save_for_backward(hidden, targets, top, log_z, entropy)
        ctx.num_params = len(params)
        return chunks.join([s[2] for s in stats]), chunks.join([s[3] for s in stats])

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, targets, top, log_z, entropy = ctx.saved_tensors
        chunks = ctx.chunks
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        resume = _rng_states() if ctx.rng is not None else None
        if ctx.rng is not None:
            _set_rng_states(ctx.rng)
        done = 0
        with torch.enable_grad():
            for a, b in chunks.bounds:
                piece = hidden[a:b].detach().requires_grad_(grad_hidden is not None)
                logits = chunks.logits(piece)
                n = logits[..., 0].numel()
                shape, stats = logits.shape[:-1], slice(done, done + n)
                done += n
                shifted = logits.detach() - top[stats].view(shape).unsqueeze(-1)
                grad = _grad_logits(shifted, log_z[stats].view(shape), entropy[stats].view(shape),
                                    chunks.rows(targets, a, b), chunks.rows(grad_logprobs, a, b),
                                    chunks.rows(grad_entropy, a, b))
                if logits.requires_grad:
                    torch.autograd.backward(logits, grad)
                if grad_hidden is not None:
                    grad_hidden[a:b] = piece.grad
        if resume is not None:
            _set_rng_states(resume)
        return grad_hidden, None, None, *([None] * ctx.num_params)


def chunked_logprobs_and_entropy(hidden_states: torch.Tensor, targets: torch.Tensor, output_layer, output_weight,
                                 *, temperature: float, vocab_size: int, chunk_tokens: int):
    """What `vocab_parallel_logprobs_and_entropy(mask_padded_vocab(output_layer(hidden_states,
    weight=output_weight)[0].float() / temperature, vocab_size), targets)` returns, with the
    logits of at most `chunk_tokens` tokens at a time (see _ChunkedLogprobsAndEntropy).
    hidden_states [s, b, h] ([s/TP, b, h] under sequence parallelism), targets [s, b]."""
    chunks = _OutputChunks(output_layer, output_weight, temperature, vocab_size, chunk_tokens,
                           hidden_states.size(0), hidden_states.size(1))
    params = {id(p): p for p in (*output_layer.parameters(), output_weight) if p is not None and p.requires_grad}
    return _ChunkedLogprobsAndEntropy.apply(hidden_states, targets, chunks, *params.values())
