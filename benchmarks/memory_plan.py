"""A recipe's memory per GPU on paper: model state, activations, the log-prob part and the KV cache.

    python benchmarks/memory_plan.py --config pipelines/X.yaml [--set key=value ...] [--json out.json]
        [--gpu-gb 80] [--seq-length N] [--micro-tokens N] [--implementation te|local] [--no-flash]

No torch: the config is loaded and validated as print-config does (megatron_rlhf.config), and
every number is arithmetic on its model, parallel, rl, sampling and rollout sections.

What it counts, per GPU (the busiest pipeline stage: its layers plus one vocabulary matrix):
  weights         params_dtype bytes x params per GPU, per role
  gradients       4 B x params (megatron's grad buffers reduce in fp32), trained roles
  optimizer       DistributedOptimizer: fp32 main copy (none when the weights are fp32) + Adam
                  m, v = 12 (or 8) B x params / (DP x CP), trained roles
  activations     what a microbatch keeps for backward: per layer (elements per token below)
                  x tokens / TP (sequence parallelism) / CP x bytes; 1F1B keeps up to PP
                  microbatches in flight on the first stage. Full recompute keeps each recomputed
                  group's input (h per token) and adds one group's working set during backward.
  log-prob part   chunked (model.logits_chunk_tokens): one chunk x vocab/TP fp32 at a time;
                  unchunked: the whole tokens x vocab/TP fp32 logits kept for backward
  KV cache        2 x layers x kv_heads/TP x head_dim x 2 B per token (vLLM: all layers,
                  rollout.tensor_parallel; the in-place engine: the stage's layers, TP)

Elements kept per token and layer (no recompute), by implementation:
  te (GPU: Transformer Engine, flash attention, fused SwiGLU): two norms' input and output 4h,
     the QKV output (a + 2kv)d (V is a view of it), rotated q and k (a + kv)d, the attention
     output a d, the q norm's input a d (Qwen3; k's is a view of the QKV output), SwiGLU's input
     2f and fc2's input f; no dropout.
     This is Korthikanti et al. 2022's count (34 s b h bytes in 16-bit at GPT-3's shape: 16 h
     elements + two 1-byte dropout masks) with SwiGLU's 3f in place of GeLU's 8h, RoPE's rotated
     q and k added and no dropout masks (RL roles run without dropout). Qwen3-8B: 17.8 h
     elements = 35.5 s b h bytes per layer. --no-flash adds their 5 a s / h term.
  local (CPU: megatron's local spec, torch RMSNorm, SDPA): each norm keeps its input, output and
     rstd (2h + 1) and each linear its input h; attention as te plus the softmax's log-sum-exp a,
     RoPE's cos/sin (4d per position) and the q/k norms' outputs and rstd; SwiGLU 5f (fc1 output
     2f, silu output, gate copy, fc2 input). tests/test_memory_plan.py measures this one against
     autograd's saved tensors (TP1, and TP2 with sequence parallelism).
  selective recompute: the core attention's own saves (te: log-sum-exp; --no-flash: the s^2 term).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron_rlhf.config import ConfigError, load_config, validate  # noqa: E402

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
IMPLEMENTATIONS = ("te", "local")
GB = 1e9


def layer_params(m) -> int:
    """One dense decoder layer's parameters (attention, SwiGLU MLP, norms)."""
    h, d, a, kv, f = m.hidden_size, m.kv_channels, m.num_attention_heads, m.kv_heads, m.ffn_hidden_size
    qkv = h * (a + 2 * kv) * d + ((a + 2 * kv) * d if m.qkv_bias else 0)
    return qkv + a * d * h + 3 * h * f + 2 * h + (2 * d if m.qk_layernorm else 0)


def model_params(m) -> int:
    vocab = m.padded_vocab_size * m.hidden_size
    return m.num_layers * layer_params(m) + vocab * (1 if m.share_embeddings_and_output_weights else 2) + m.hidden_size


def params_per_gpu(m, tp: int, pp: int) -> float:
    """The busiest stage: its layers and one vocabulary matrix (PP 1: both, unless tied)."""
    vocab = m.padded_vocab_size * m.hidden_size
    ends = vocab * (2 if pp == 1 and not m.share_embeddings_and_output_weights else 1)
    return (m.num_layers // pp * layer_params(m) + ends) / tp


def layer_elements_per_token(m, implementation: str, tp: int, recompute: str | None) -> float:
    """Elements one layer keeps for backward per token (before the TP / CP split of the tokens;
    the head dimensions here are already per TP rank where TP splits heads)."""
    h, d, f = m.hidden_size, m.kv_channels, m.ffn_hidden_size
    a, kv = m.num_attention_heads / tp, m.kv_heads / tp
    f_rank = f / tp
    # heads and the MLP split over TP, norms' tensors over the sequence (sequence parallelism)
    if implementation == "te":
        norms = 4 * h / tp
        # q/k norms: q's input is a copy (k's a view of the QKV output); TE's norms keep their input
        qk_norm = a * d if m.qk_layernorm else 0
        attention = (a + 2 * kv) * d + (a + kv) * d + a * d + qk_norm
        core_own = 2 * a  # flash attention's fp32 log-sum-exp, as 16-bit elements
        mlp = 3 * f_rank
    else:
        norms = 2 * (2 * h + 1) / tp + 2 * h / tp
        # q/k norms: q's input copy and output, k's output (its input is a view of the QKV output), rstd
        qk_norm = (2 * a + kv) * d + a + kv if m.qk_layernorm else 0
        attention = (a + 2 * kv) * d + (a + kv) * d + a * d + qk_norm
        core_own = a
        mlp = 5 * f_rank
    kept = norms + attention + mlp + core_own
    return kept - core_own if recompute == "selective" else kept


@dataclass
class Plan:
    recipe: str
    layout: str
    gpus: int
    data_parallel: int
    implementation: str
    recompute: str
    tokens_per_microbatch: int
    sequence_length: int
    microbatches_in_flight: int
    params_total: float
    params_per_gpu: float
    weights_gb: float             # one role's weights
    gradients_gb: float           # one trained role's fp32 gradient buffers
    optimizer_gb: float           # one trained role's optimizer shard
    trained_role_gb: float        # weights + gradients + optimizer
    trained_roles: list
    frozen_roles: list
    activations_per_layer_gb: float   # one layer, one microbatch, kept for backward (no recompute)
    activations_kept_gb: float        # one microbatch, all the stage's layers, with the recompute setting
    activations_in_flight_gb: float   # x microbatches in flight (1F1B)
    recompute_working_gb: float       # full recompute: one group's activations while its backward runs
    logprob_gb: float                 # chunk x vocab/TP fp32, or the whole logits kept
    activations_saved_bytes: float    # what autograd keeps per microbatch (the test measures it)
    kv_bytes_per_token: float
    kv_cache_gb: float
    kv_tokens_fit: float
    engine: str
    engine_gpu_gb: float
    generate_gb: float
    train_gb: float
    peak_gb: float
    gpu_gb: float
    fits: bool


def plan(cfg, world_size: int, *, gpu_gb: float = 80.0, seq_length: int | None = None, micro_tokens: int | None = None,
         implementation: str = "te", flash: bool = True, rows: int | None = None, recipe: str = "") -> Plan:
    """The memory plan of `cfg`'s RL stage at `world_size` GPUs (see the module docstring)."""
    m, p, rl = cfg.model, cfg.parallel, cfg.rl
    if m.num_experts is not None:
        raise ConfigError("benchmarks/memory_plan.py: dense models only (model.num_experts is set); the MoE recipes "
                          "carry their expert arithmetic in their headers (pipelines/qwen3_30b_a3b_grpo.yaml)")
    if implementation not in IMPLEMENTATIONS:
        raise ConfigError(f"--implementation={implementation}: choose one of {IMPLEMENTATIONS}")
    tp, pp, cp = p.tensor_parallel, p.pipeline_parallel, p.context_parallel
    dp = p.check(m, world_size)
    seq = seq_length or m.max_seq_length
    if micro_tokens:
        tokens = micro_tokens
    elif rl.packing and rl.micro_batch_tokens:
        tokens = rl.micro_batch_tokens  # packed: the budget counts real tokens
    else:
        tokens = (rows or rl.micro_batch_size) * seq
    act_bytes = BYTES[m.params_dtype]
    sp = p.sequence_parallel_on
    # tokens per rank: sequence parallelism splits the norms' tokens, CP every tensor's
    h_split = tp if sp else 1
    per_rank_tokens = tokens / cp
    packed = rl.packing and rows is None
    positions = (tokens if packed else seq) / cp  # RoPE's cos / sin: per position, shared by the rows

    def layer_bytes(recompute):
        elements = layer_elements_per_token(m, implementation, tp, recompute)
        if not sp:  # without SP the norms and residual-side tensors are whole on every TP rank
            norm_share = (4 if implementation == "te" else 6) * m.hidden_size / tp
            elements += norm_share * (tp - 1)
        b = elements * per_rank_tokens * act_bytes
        if implementation == "local":  # RoPE cos / sin per position: 4 x head_dim, fp32 or the compute dtype
            b += 4 * m.kv_channels * positions * act_bytes
        if not flash and recompute != "selective":  # Korthikanti's 5 a s / h x s b h bytes (16-bit, dropout):
            b += 5 * (m.num_attention_heads / tp) * seq * per_rank_tokens  # each query's scores over all s keys
        return b

    layers = m.num_layers // pp
    full_layer = layer_bytes(None)
    granularity = m.recompute_granularity
    working = 0.0
    layer_input = m.hidden_size / h_split * per_rank_tokens * act_bytes
    if granularity == "full":
        n = m.recompute_num_layers
        if m.recompute_method == "uniform":  # every group of n layers keeps only its input
            kept = math.ceil(layers / n) * layer_input
            working = min(n, layers) * full_layer
        else:  # block: the first n layers of the stage recomputed, the rest keep everything
            recomputed = min(n, layers)
            kept = recomputed * layer_input + (layers - recomputed) * full_layer
            working = full_layer if recomputed else 0.0
        kept += positions * m.kv_channels * 4  # the rotary embedding, a checkpoint input every group shares
        recompute = f"full {m.recompute_method} {n}"
    else:
        kept = layers * layer_bytes(granularity)
        recompute = granularity or "none"
    # the output side (last stage): final norm and the head's input per token, log-probs, targets
    hidden_out = m.hidden_size / h_split * per_rank_tokens * act_bytes  # the head keeps its input un-gathered (SP)
    vocab_rank = m.padded_vocab_size / tp
    chunk = m.logits_chunk_tokens or 0
    if implementation == "local":
        out_saved = (2 * m.hidden_size + 1) / h_split * per_rank_tokens * act_bytes + hidden_out \
            + per_rank_tokens * (8 + 8 + 4 * 4)  # embedding ids, targets, 4 fp32 per-token values
    else:
        out_saved = 2 * m.hidden_size / h_split * per_rank_tokens * act_bytes + hidden_out + per_rank_tokens * 24
    whole_logits = per_rank_tokens * vocab_rank * 4
    logprob = min(chunk, per_rank_tokens) * vocab_rank * 4 if chunk else whole_logits
    saved = kept + out_saved + (0 if chunk else whole_logits)
    in_flight = min(pp, max(1, math.ceil(rl.mini_batch_size / dp / (rl.micro_batch_size or 1)))) if pp > 1 else 1

    params = params_per_gpu(m, tp, pp)
    weights = params * BYTES[m.params_dtype]
    grads = params * 4
    main_copy = 0 if m.params_dtype == "float32" else 4
    shards = dp * cp if cfg.optimizer.use_distributed_optimizer else 1
    optimizer = params * (main_copy + 8) / shards
    trained_role = weights + grads + optimizer
    trained = ["actor"] + (["critic"] if rl.has_critic else [])
    frozen = ["reference"] + (["reward"] if rl.has_reward_model else [])

    engine = cfg.rollout.engine
    if engine == "vllm":
        etp = cfg.rollout.tensor_parallel
        kv_token = 2 * m.num_layers * max(m.kv_heads / etp, 1) * m.kv_channels * 2
        engine_gpu = cfg.rollout.gpu_memory_utilization * gpu_gb * GB
        engine_weights = model_params(m) * 2 / etp
        kv_cache = max(engine_gpu - engine_weights, 0)
        generate = len(trained) * weights + engine_gpu
    else:
        kv_token = 2 * layers * (m.kv_heads / tp) * m.kv_channels * act_bytes
        sequences = rl.samples_per_iteration / dp
        kv_cache = kv_token * sequences * seq
        engine_gpu = 0.0
        generate = len(trained) * weights + kv_cache
    train = len(trained) * trained_role + (kept + out_saved) * in_flight + working + logprob
    peak = max(train, generate, (len(trained) + len(frozen)) * weights)
    return Plan(
        recipe=recipe, layout=f"TP{tp} CP{cp} PP{pp} DP{dp}", gpus=world_size, data_parallel=dp,
        implementation=implementation, recompute=recompute, tokens_per_microbatch=tokens, sequence_length=seq,
        microbatches_in_flight=in_flight, params_total=model_params(m), params_per_gpu=params,
        weights_gb=weights / GB, gradients_gb=grads / GB, optimizer_gb=optimizer / GB, trained_role_gb=trained_role / GB,
        trained_roles=trained, frozen_roles=frozen, activations_per_layer_gb=full_layer / GB,
        activations_kept_gb=(kept + out_saved) / GB, activations_in_flight_gb=(kept + out_saved) * in_flight / GB,
        recompute_working_gb=working / GB, logprob_gb=logprob / GB, activations_saved_bytes=saved,
        kv_bytes_per_token=kv_token, kv_cache_gb=kv_cache / GB, kv_tokens_fit=kv_cache / kv_token, engine=engine,
        engine_gpu_gb=engine_gpu / GB, generate_gb=generate / GB, train_gb=train / GB, peak_gb=peak / GB,
        gpu_gb=gpu_gb, fits=peak <= gpu_gb * GB)


def table(pl: Plan) -> str:
    trained = " + ".join(pl.trained_roles)
    rows = [
        ("layout", f"{pl.layout} = {pl.gpus} GPUs; {pl.implementation}; recompute {pl.recompute}"),
        ("params", f"{pl.params_total / 1e9:.2f} B total, {pl.params_per_gpu / 1e9:.2f} B per GPU (busiest stage)"),
        ("weights", f"{pl.weights_gb:.1f} GB per role"),
        ("gradients (fp32)", f"{pl.gradients_gb:.1f} GB per trained role"),
        ("optimizer (DP x CP shard)", f"{pl.optimizer_gb:.1f} GB per trained role"),
        ("trained role", f"{pl.trained_role_gb:.1f} GB ({trained})"),
        ("microbatch", f"{pl.tokens_per_microbatch} tokens (sequences up to {pl.sequence_length})"),
        ("activations, one layer", f"{pl.activations_per_layer_gb:.2f} GB (no recompute)"),
        ("activations kept", f"{pl.activations_kept_gb:.1f} GB per microbatch x {pl.microbatches_in_flight} in flight"
                             f" = {pl.activations_in_flight_gb:.1f} GB"),
        ("recompute working set", f"{pl.recompute_working_gb:.1f} GB"),
        ("log-prob part", f"{pl.logprob_gb:.2f} GB"),
        ("KV cache", f"{pl.kv_bytes_per_token / 1e3:.1f} KB per token; {pl.kv_cache_gb:.1f} GB "
                     f"= {pl.kv_tokens_fit / 1e3:.0f} K tokens ({pl.engine})"),
        ("generate phase", f"{pl.generate_gb:.1f} GB"),
        ("train phase", f"{pl.train_gb:.1f} GB"),
        ("peak", f"{pl.peak_gb:.1f} GB of {pl.gpu_gb:.0f} GB: {'fits' if pl.fits else 'DOES NOT FIT'}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, type=Path)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--gpus", type=int, help="world size (default: TP x PP x CP x 2, i.e. DP 2)")
    ap.add_argument("--gpu-gb", type=float, default=80.0)
    ap.add_argument("--seq-length", type=int, help="default model.max_seq_length")
    ap.add_argument("--micro-tokens", type=int, help="tokens per microbatch (default: rl.micro_batch_tokens when "
                                                     "packing, else rl.micro_batch_size x sequence length)")
    ap.add_argument("--implementation", choices=IMPLEMENTATIONS, default="te")
    ap.add_argument("--no-flash", action="store_true", help="attention without flash (adds the 5 a s / h term)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        p = cfg.parallel
        world = args.gpus or p.tensor_parallel * p.pipeline_parallel * p.context_parallel * 2
        validate(cfg, world_size=world)
        pl = plan(cfg, world, gpu_gb=args.gpu_gb, seq_length=args.seq_length, micro_tokens=args.micro_tokens,
                  implementation=args.implementation, flash=not args.no_flash, recipe=str(args.config))
    except ConfigError as e:
        print(f"memory_plan.py: {e}", file=sys.stderr)
        return 2
    print(table(pl))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"benchmark": "memory plan per GPU (arithmetic, no measurement)",
                                         "overrides": args.set, **asdict(pl)}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
