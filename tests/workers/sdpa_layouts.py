"""torchrun worker for tests/test_sdpa_attention.py: the SDPA core attention
(megatron_rlhf/models/attention.py) against megatron-core's own local DotProductAttention and a
reference softmax(q k^T * scale + mask) v whose mask is written out element by element.

Layouts come as `--layout NAME=TPxPP` (workers.run_layouts). At TP1-PP1 (each rank alone):
  - core attention, SDPA vs megatron vs the reference, outputs and q/k/v gradients, per mask
    case; megatron's SelfAttention built with either core attention; dropout; refusals;
    the two layer specs;
  - a GPTModel built with either spec from the same weights: logits and every gradient;
  - KV-cached greedy decoding (the in-place engine) vs full recomputation vs the local spec,
    and a multi-token chunk after cached keys vs full recomputation.
At every other layout: the GPTModel check, through megatron's pipeline schedule.
Results go to --root/sdpa_<layout>.pt (global rank 0); differences are reduced (max) over ranks.
"""

import dataclasses
import functools

import torch

import megatron_rlhf  # noqa: F401  (first: it prepares megatron-core's import)
from megatron.core import parallel_state as ps  # noqa: E402,I001  (after megatron_rlhf)
from megatron.core import tensor_parallel
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer import utils as megatron_masks
from megatron.core.transformer.spec_utils import build_module
from megatron_rlhf.config import ModelConfig
from megatron_rlhf.models.attention import SDPADotProductAttention, visible_keys
from megatron_rlhf.models.gpt import build_model, local_layer_spec, sdpa_layer_spec, transformer_config
from megatron_rlhf.models.roles import Actor
from megatron_rlhf.parallel import cpu
from megatron_rlhf.rollout import MegatronRolloutEngine, SamplingParams
from workers import run_layouts

HEADS, HEAD_DIM, BATCH = 4, 8, 2
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15], [16, 17, 18, 19]]
NEW = 8
# mask cases: name -> (query groups, sq, skv, window, explicit-mask kind)
CASES = {
    "causal": (HEADS, 7, 7, None, None),
    "gqa": (2, 7, 7, None, None),
    "padding": (2, 7, 7, None, "padding"),
    "window": (2, 7, 7, (2, 0), None),
    "chunk_after_cache": (2, 3, 8, None, None),
    "window_chunk_after_cache": (2, 3, 8, (2, 0), None),
    "decode_step": (2, 1, 8, None, None),
}
ROW_LENGTHS = [5, 5]  # the padding case (7 positions): row 0 right-padded, row 1 left-padded


def hand_written_visible(sq: int, skv: int, window) -> torch.Tensor:
    """[sq, skv] True = attend, element by element: query i is position skv - sq + i."""
    left, right = window if window is not None else (skv, 0)
    rows = []
    for i in range(sq):
        position = skv - sq + i
        rows.append([position - left <= j <= position + right for j in range(skv)])
    return torch.tensor(rows)


def padding_mask(sq: int) -> torch.Tensor:
    """megatron's [b, 1, sq, sq] bool (True = masked): causal, row 0 with padding keys after
    ROW_LENGTHS[0], row 1 with its first sq - ROW_LENGTHS[1] positions padding (whose
    queries see no key)."""
    masked = torch.zeros(BATCH, 1, sq, sq, dtype=torch.bool)
    for i in range(sq):
        for j in range(sq):
            masked[:, 0, i, j] = j > i
        masked[0, 0, i, ROW_LENGTHS[0]:] = True
        masked[1, 0, i, : sq - ROW_LENGTHS[1]] = True
    return masked


def right_padding_mask(sq: int) -> torch.Tensor:
    """padding_mask's row 0 for every row: every query sees a key."""
    return padding_mask(sq)[:1].expand(BATCH, 1, sq, sq).clone()


def reference_attention(q, k, v, scale: float, visible: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v; q [sq, b, n, d], k/v [skv, b, g, d], visible
    broadcastable to [b, n, sq, skv] (True = attend). Rows with no visible key give 0."""
    k = k.repeat_interleave(q.size(2) // k.size(2), dim=2)
    v = v.repeat_interleave(q.size(2) // v.size(2), dim=2)
    scores = torch.einsum("qbnd,kbnd->bnqk", q, k) * scale
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("bnqk,kbnd->qbnd", probs, v).reshape(q.size(0), q.size(1), -1)


def attention_config(base, groups: int, window=None, dropout: float = 0.0):
    return dataclasses.replace(base, num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=groups, kv_channels=HEAD_DIM, ffn_hidden_size=4 * HEADS * HEAD_DIM,
                               window_size=window, attention_dropout=dropout, variable_seq_lengths=False)


def run_core(attend, q, k, v, upstream):
    """attend(q, k, v) and the gradients of q, k, v for the given output gradient."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    out.backward(upstream)
    return out.detach(), q.grad, k.grad, v.grad


def core_attention_cases(base) -> dict:
    """Per case: {'sdpa', 'megatron' (None where megatron's local softmax cannot: a causal
    chunk of several queries after cached keys), 'reference'}: (out, dq, dk, dv); and 'rows':
    the query rows that see a key."""
    results = {}
    for name, (groups, sq, skv, window, kind) in CASES.items():
        config = attention_config(base, groups, window)
        gen = torch.Generator().manual_seed(len(results))
        q = torch.randn(sq, BATCH, HEADS, HEAD_DIM, generator=gen)
        k, v = (torch.randn(skv, BATCH, groups, HEAD_DIM, generator=gen) for _ in range(2))
        mask = padding_mask(sq) if kind == "padding" else None
        visible = ~mask if mask is not None else hand_written_visible(sq, skv, window)
        rows = visible.expand(BATCH, 1, sq, skv).any(-1)[:, 0].t()  # [sq, b]: queries that see a key
        # Rows without a visible key are padding, read by nobody: no gradient flows back from them.
        upstream = torch.randn(sq, BATCH, HEADS * HEAD_DIM, generator=gen) * rows.unsqueeze(-1)
        sdpa = SDPADotProductAttention(config, 1, AttnMaskType.causal, "self")
        # the per-call mask type as megatron's Attention passes it: no_mask after cached keys
        call_type = AttnMaskType.no_mask if sq < skv else AttnMaskType.causal
        case = {"rows": rows, "megatron": None,
                "sdpa": run_core(lambda *qkv: sdpa(*qkv, mask, attn_mask_type=call_type), q, k, v, upstream),
                "reference": run_core(lambda *qkv: reference_attention(*qkv, HEAD_DIM ** -0.5, visible), q, k, v,
                                      upstream)}
        if window is not None or sq == skv or sq == 1:
            megatron = DotProductAttention(config, 1, AttnMaskType.causal, "self")
            case["megatron"] = run_core(lambda *qkv: megatron(*qkv, mask, attn_mask_type=call_type), q, k, v, upstream)
        if sq < skv:
            # the chunk is the last sq queries of a full self-attention over skv: megatron's
            # local attention on all skv queries (causal, square) gives those rows too
            full_q = torch.cat([torch.randn(skv - sq, BATCH, HEADS, HEAD_DIM, generator=gen), q])
            full_upstream = torch.cat([torch.zeros(skv - sq, *upstream.shape[1:]), upstream])
            megatron = DotProductAttention(config, 1, AttnMaskType.causal, "self")
            out, dq, dk, dv = run_core(lambda *qkv: megatron(*qkv, None), full_q, k, v, full_upstream)
            case["megatron_full_rows"] = (out[skv - sq:], dq[skv - sq:], dk, dv)
        results[name] = case
    return results


def self_attention_layers(base) -> dict:
    """megatron's SelfAttention from the local spec and the SDPA spec, same weights: (output,
    input gradient, parameter gradients) for a causal and a padding-masked batch."""
    config = attention_config(base, 2)
    results = {}
    for kind in ("causal", "padding"):
        outs = {}
        for spec_name, spec in (("local", local_layer_spec(ModelConfig())), ("sdpa", sdpa_layer_spec(ModelConfig()))):
            layer = build_module(spec.submodules.self_attention, config=config, layer_number=1)
            with torch.no_grad():  # weights far from init's 0.02: scores far from uniform attention
                weights = torch.Generator().manual_seed(2)
                for p in layer.parameters():
                    p.copy_(torch.randn(p.shape, generator=weights) * 0.3)
            want_core = SDPADotProductAttention if spec_name == "sdpa" else DotProductAttention
            assert type(layer.core_attention) is want_core
            gen = torch.Generator().manual_seed(1)
            hidden = torch.randn(7, BATCH, config.hidden_size, generator=gen).requires_grad_()
            out, _ = layer(hidden, right_padding_mask(7) if kind == "padding" else None)
            out.backward(torch.randn(out.shape, generator=gen))
            outs[spec_name] = (out.detach(), hidden.grad, {n: p.grad for n, p in layer.named_parameters()})
        results[kind] = outs
    return results


def dropout_checks(base) -> dict:
    config = attention_config(base, 2, dropout=0.5)
    module = SDPADotProductAttention(config, 1, AttnMaskType.causal, "self")
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(4, 1, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(4, 1, 2, HEAD_DIM, generator=gen) for _ in range(2))
    with torch.no_grad():
        module.eval()
        plain = module(q, k, v, None)
        module.train()
        tracker = tensor_parallel.get_cuda_rng_tracker()
        state = tracker.get_states()
        first = module(q, k, v, None)
        tracker.set_states(state)
        again = module(q, k, v, None)
        mean = torch.stack([module(q, k, v, None) for _ in range(2000)]).mean(0)
    return {"plain": plain, "first": first, "again": again, "mean": mean}


def refusals(base) -> dict:
    """What each unsupported input raises: the exception's type and message (None: no error)."""
    config = attention_config(base, 2)
    module = SDPADotProductAttention(config, 1, AttnMaskType.causal, "self")
    q = torch.randn(3, 1, HEADS, HEAD_DIM)
    k = v = torch.randn(3, 1, 2, HEAD_DIM)

    def attempt(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (the test reads which)
            return type(e).__name__, str(e)
        return None

    return {
        # THD runs (models/attention.py: _packed; tests/test_role_layouts.py); other packed formats do not
        "packed_seq_params": attempt(lambda: module(q, k, v, None,
                                                    packed_seq_params=PackedSeqParams(qkv_format="bshd"))),
        "attention_bias": attempt(lambda: module(q, k, v, None, attention_bias=torch.zeros(1, HEADS, 3, 3))),
        "softmax_type": attempt(lambda: SDPADotProductAttention(dataclasses.replace(config, softmax_type="off-by-one"),
                                                                1, AttnMaskType.causal, "self")),
        "padding_causal": attempt(lambda: SDPADotProductAttention(config, 1, AttnMaskType.padding_causal, "self")),
    }


def mask_builder_mismatches() -> list[tuple]:
    """(sq, skv, window) where the CPU adaptations' stand-ins (parallel/cpu.py, built on
    visible_keys) differ from megatron's own mask builders (transformer/utils.py; their literal
    device="cuda" runs on CPU under the adaptations' device mode)."""
    bad = [(sq, sq, None) for sq in (1, 2, 5)
           if not torch.equal(cpu._causal_mask(sq), megatron_masks.get_default_causal_mask(sq))]
    for sq, skv in ((1, 1), (4, 4), (3, 7), (1, 6)):
        for window in ((0, 0), (2, 0), (1, 1), (5, 2)):
            if not torch.equal(cpu._sliding_window_causal_mask(sq, skv, window),
                               megatron_masks.get_sliding_window_causal_mask(sq, skv, window)):
                bad.append((sq, skv, window))
    return bad


def visible_keys_mismatches() -> list[tuple]:
    """(sq, skv, window) where visible_keys differs from the element-by-element mask, negative
    (unbounded) window sides included."""
    bad = []
    for sq, skv in ((1, 1), (4, 4), (3, 7), (1, 6)):
        for window in (None, (0, 0), (2, 0), (1, 1), (-1, 0), (2, -1), (-1, -1)):
            want = hand_written_visible(sq, skv, None if window is None else
                                        tuple(skv if side < 0 else side for side in window))
            if not torch.equal(visible_keys(sq, skv, window), want):
                bad.append((sq, skv, window))
    return bad


def spec_differences(cfg) -> list[str]:
    """Fields (dotted paths) in which the SDPA spec differs from megatron's local spec."""
    def diff(a, b, path):
        if dataclasses.is_dataclass(a) and type(a) is type(b):
            return [d for f in dataclasses.fields(a) for d in diff(getattr(a, f.name), getattr(b, f.name),
                                                                   f"{path}.{f.name}")]
        if isinstance(a, functools.partial) and isinstance(b, functools.partial):  # equal only when identical
            return diff((a.func, a.args, a.keywords), (b.func, b.args, b.keywords), path)
        if isinstance(a, (tuple, list)) and type(a) is type(b) and len(a) == len(b):
            return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{i}]")]
        if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
            return [d for key in a for d in diff(a[key], b[key], f"{path}[{key!r}]")]
        return [] if a == b else [path]

    return diff(sdpa_layer_spec(cfg.model), local_layer_spec(cfg.model), "spec")


def same_weights_models(cfg):
    """(sdpa model, local model), the local one holding the SDPA one's weights."""
    sdpa = build_model(cfg.model)
    local = build_model(cfg.model, spec=local_layer_spec(cfg.model))
    local.load_state_dict(sdpa.state_dict())
    return sdpa, local


def batch_tokens(seq: int) -> torch.Tensor:
    return torch.randint(2, 100, (BATCH, seq), generator=torch.Generator().manual_seed(11))


def forward_backward(model, tokens: torch.Tensor, mask) -> tuple[torch.Tensor | None, dict]:
    """Logits [b, s, V/TP] (last stage; None elsewhere) and every parameter's gradient for
    the loss sum(logits * fixed weights), through megatron's pipeline schedule (2 microbatches)."""
    model.zero_grad()
    positions = torch.arange(tokens.size(1)).expand_as(tokens)
    probe = torch.randn(tokens.size(1), model.vocab_size, generator=torch.Generator().manual_seed(3))
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    shard = probe.chunk(tp, dim=-1)[tp_rank]
    microbatches = [(tokens[i : i + 1], positions[i : i + 1], None if mask is None else mask[i : i + 1])
                    for i in range(tokens.size(0))]
    logits = []

    def step(data_iterator, model):
        t, p, m = next(data_iterator)
        out = model(t, p, m)

        def loss(o):
            logits.append(o.detach())
            return (o.float() * shard).sum(), {}

        return out, loss

    get_forward_backward_func()(forward_step_func=step, data_iterator=iter(microbatches), model=[model],
                                num_microbatches=len(microbatches), seq_length=tokens.size(1), micro_batch_size=1,
                                forward_only=False)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return (torch.cat(logits) if logits else None), grads


def max_over_ranks(x: float) -> float:
    t = torch.tensor(x, dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t)


def model_parity(cfg) -> dict:
    """SDPA vs local spec GPTModel at this layout, causal and right-padded batches: max |diff|
    and max |value| of logits and of parameter gradients, over ranks."""
    sdpa, local = same_weights_models(cfg)
    tokens = batch_tokens(12)
    out = {}
    for kind, mask in (("causal", None), ("padding", right_padding_mask(12))):
        (got_logits, got_grads), (want_logits, want_grads) = (forward_backward(m, tokens, mask) for m in (sdpa, local))
        assert got_grads.keys() == want_grads.keys()
        logits_diff = 0.0 if want_logits is None else float((got_logits - want_logits).abs().max())
        logits_max = 0.0 if want_logits is None else float(want_logits.abs().max())
        out[kind] = {
            "logits_diff": max_over_ranks(logits_diff), "logits_max": max_over_ranks(logits_max),
            "grad_diff": max_over_ranks(max(float((got_grads[n] - g).abs().max()) for n, g in want_grads.items())),
            "grad_max": max_over_ranks(max(float(g.abs().max()) for g in want_grads.values())),
            "grad_count": len(want_grads),
        }
    return out


def greedy_by_recomputation(module, prompt: list[int], vocab: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            logits = module(torch.tensor([tokens]), torch.arange(len(tokens))[None], None)[0, -1, :vocab]
            tokens.append(int(logits.argmax()))
    return tokens


def decoding(cfg) -> dict:
    """Greedy tokens and log-probs: KV-cached (in-place engine) with the SDPA spec and with the
    local spec, and full recomputation with the SDPA spec; plus the logits of a 3-token chunk
    fed after 5 cached positions vs the full sequence's (the SDPA spec)."""
    actor = Actor(cfg.model, trainable=False)
    sdpa = actor.module
    local = build_model(cfg.model, spec=local_layer_spec(cfg.model))
    local.load_state_dict(sdpa.state_dict())
    local.eval()
    greedy = SamplingParams(max_new_tokens=NEW, greedy=True)
    engine = MegatronRolloutEngine(cfg.model, actor, eos_id=1, pad_id=0)
    res = {"sdpa_cached": vars(engine.generate(PROMPTS, greedy, seed=0)),
           "sdpa_recomputed": [greedy_by_recomputation(sdpa, p, cfg.model.vocab_size) for p in PROMPTS]}
    actor.model = local  # the same engine, decoding with megatron's local core attention
    res["local_cached"] = vars(engine.generate(PROMPTS, greedy, seed=0))
    actor.model = sdpa

    tokens = batch_tokens(8)
    positions = torch.arange(8).expand_as(tokens)
    with torch.no_grad():
        full = sdpa(tokens, positions, None)
        context = StaticInferenceContext(BATCH, 8)
        sdpa(tokens[:, :5], positions[:, :5], None, inference_context=context)
        context.sequence_len_offset += 5
        chunk = sdpa(tokens[:, 5:], positions[:, 5:], None, inference_context=context)
    # a static context computes only the last position's logits; with 4 layers they depend on how
    # every chunk position attended in the layers below
    res["chunk_logits"], res["full_logits"] = chunk[:, -1], full[:, -1]
    return res


def check_layout(args, cfg, layout: str) -> None:
    res = {"model": model_parity(cfg)}
    if layout == "tp1pp1":
        base = transformer_config(cfg.model)
        res.update(core=core_attention_cases(base), self_attention=self_attention_layers(base),
                   dropout=dropout_checks(base), refusals=refusals(base), spec_differences=spec_differences(cfg),
                   mask_builder_mismatches=mask_builder_mismatches(), visible_keys_mismatches=visible_keys_mismatches(),
                   decoding=decoding(cfg))
    if torch.distributed.get_rank() == 0:
        torch.save(res, args.root / f"sdpa_{layout}.pt")


if __name__ == "__main__":
    run_layouts(check_layout)
