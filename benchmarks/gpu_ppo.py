"""PPO on one GPU at ~1B parameters: train-phase MFU, decode and score tokens/s, refit GB/s and
per-phase peak device memory with the colocation scheduler's offload on and off.

    python benchmarks/gpu_ppo.py [--size 1b|tiny] [--iterations 3] [--batch 64] [--response-length 512]
                                 [--engine megatron|vllm] [--out benchmarks/results/gpu_ppo.json]
    python benchmarks/gpu_ppo.py --dry-run      # CPU, tiny model, fp32, 2 iterations (~30 s on 2 cores)

Runs the RL stage's own phase functions (trainers/rl.py: build_roles, generate -> score ->
add_advantages + train_on_rollout) under its ColocationScheduler, like benchmarks/rl_step.py,
with all four PPO roles (actor, reference, reward model, critic) randomly initialised, so no
checkpoint is needed. The rollout engine gets eos_id=-1: every response runs to the full
--response-length. Sizes:
- 1b: a Llama-3.2-1B-like decoder, 16 layers, hidden 2048, 16 heads of 128, 8 KV groups,
  SwiGLU FFN 8192, untied embeddings, a synthetic 32000-token vocabulary, random prompt ids
  (lengths 32..128), bf16, Transformer Engine's layer spec (models/gpt.py picks it when TE
  imports); ~1.14B parameters in the actor. Needs CUDA (exit 2 otherwise).
- tiny: 2 layers, hidden 64, 4 heads, 2 KV groups, FFN 256, the built-in task's vocabulary,
  prompts of 3..6 random ids; bf16 on a GPU, fp32 on CPU. --dry-run is tiny on CPU.
One warm-up iteration, then --iterations measured ones (means reported). Each offload setting
runs in its own child process, so each peak memory is its own: torch.cuda.max_memory_allocated
per phase on GPU (the scheduler resets it as each phase starts, after its moves), the process's
peak RSS so far on CPU (it cannot be reset; on CPU the scheduler moves nothing, so both settings
measure the same thing there). Offload on: the stage's table (phases_for): idle frozen roles go
to host memory, trained roles' optimizer states and gradient buffers leave the device outside
train. Offload off: the same scheduler with a table that keeps every role fully resident in
every phase (ColocationScheduler's `phases` argument), so nothing moves. Phase seconds exclude
the moves (the scheduler starts a phase's clock after them); "iteration" is the wall time of a
whole iteration, moves included.

Train-phase MFU = model FLOPs of the train phase / train seconds / 989e12 (H200 bf16 dense peak),
with, per iteration,

    FLOPs = sum over trained roles r in {actor, critic} of
            epochs * (6 * N_r * T  +  12 * n_layers * n_heads * head_dim * sum_i S_i^2)

where T = sum_i S_i is the rollout's tokens (prompt + response of each sequence i, no padding),
N_r the role's parameters except its input embedding table (a lookup, no matmul; the actor's
vocabulary projection and the critic's value head count), 6 = forward (2) + backward (4) per
parameter and token, and the second term the attention score and value matmuls QK^T and AV
(4 * S^2 * n_heads * head_dim per layer forward, x3 with backward; no causal halving, as PaLM's
MFU counts them). Recomputation, the loss and the optimizer are not counted (model FLOPs, not
hardware FLOPs). On CPU the MFU is computed the same way, against the same H200 peak:
meaningless, but it exercises the arithmetic.
Decode tokens/s = response tokens / generate-phase seconds; score tokens/s = sequence tokens
(prompt + response) / score-phase seconds (one forward each of actor, reference, reward model,
critic). Refit GB/s (--engine vllm, when vllm imports): the actor's weights as HF tensors into
the vLLM engine, bytes / seconds of VLLMRolloutEngine.update_weights, the "sync" phase; else the
table says why it did not run. With vLLM the decode numbers are the engine's, and the engine's
own memory (another process, sleeping between generations: rollout.sleep_level) is not in the
trainer's peak. Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEAK_FLOPS = 989e12  # H200 SXM, bf16 dense (no sparsity)
SIZES = {
    "1b": dict(num_layers=16, hidden_size=2048, num_attention_heads=16, num_query_groups=8, ffn_hidden_size=8192,
               vocab_size=32000),
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256),
}
PROMPT_LENGTHS = {"1b": (32, 128), "tiny": (3, 6)}  # inclusive
DEFAULTS = {  # batch = prompts = sequences per iteration (n = 1); micro batch for every forward/backward
    "1b": dict(batch=64, response_length=512, iterations=3, micro_batch=8),
    "tiny": dict(batch=16, response_length=32, iterations=2, micro_batch=4),
}
PHASES = ("generate", "score", "train")


def train_flops(cfg, params: dict[str, int], lengths, trained=("actor", "critic")) -> float:
    """The docstring's formula for one iteration. params: role -> N_r; lengths: [B] sequence lengths."""
    m, epochs = cfg.model, cfg.rl.epochs
    tokens = float(lengths.double().sum())
    squares = float((lengths.double() ** 2).sum())
    attention = 12 * m.num_layers * m.num_attention_heads * m.kv_channels * squares
    return sum(epochs * (6 * params[r] * tokens + attention) for r in trained if r in params)


def matmul_params(role) -> int:
    """The role's parameters except the input embedding table (here: this process holds the whole model)."""
    return sum(p.numel() for name, p in role.module.named_parameters() if "embedding.word_embeddings" not in name)


def resident_table(roles: dict, phases: dict) -> dict:
    """Offload off: every phase keeps every role as built (trained: params+optimizer; frozen: params)."""
    return {phase: {name: "params+optimizer" if role.trainable else "params" for name, role in roles.items()}
            for phase in phases}


def child(args, offload: bool) -> dict:
    if str(REPO) not in sys.path:  # megatron_rlhf from this tree, also where it is not installed (PY=python3)
        sys.path.insert(0, str(REPO))
    import torch

    from megatron_rlhf import parallel  # first: it adapts megatron-core before its import
    from megatron_rlhf.trainers.runner import start_distributed
    from megatron_rlhf.colocation import ColocationScheduler, phases_for
    from megatron_rlhf.config import ConfigError, load_config
    from megatron_rlhf.data.encode import EncodedPrompt
    from megatron_rlhf.data.jsonl import PromptExample
    from megatron_rlhf.models.gpt import transformer_engine_available
    from megatron_rlhf.rewards import RewardSources
    from megatron_rlhf.rollout import MegatronRolloutEngine, SamplingParams
    from megatron_rlhf.trainers import rl as stage
    from megatron_rlhf.trainers.stage_data import resolve_vocab_size, tokenizer_for

    cuda = torch.cuda.is_available()
    if args.dry_run:
        torch.set_num_threads(1)  # the two children share the cores
    lo, hi = PROMPT_LENGTHS[args.size]
    batch, new = args.batch, args.response_length
    overrides = [f"model.{k}={v}" for k, v in SIZES[args.size].items()] + [
        f"model.params_dtype={'bfloat16' if cuda else 'float32'}",
        f"model.max_seq_length={max(hi + new, 64)}",  # at least the recipe's sft/rm/dpo seq_length
        f"rl.rollout_batch_size={batch}", f"rl.mini_batch_size={max(batch // 2, 1)}",
        f"rl.micro_batch_size={min(args.micro_batch, max(batch // 2, 1))}", f"rl.epochs={args.epochs}",
        f"sampling.max_new_tokens={new}", "rl.steps=100", "rl.algorithm=ppo", f"rollout.engine={args.engine}"]
    cfg = load_config(REPO / "pipelines/tiny_cpu.yaml", overrides)
    tokenizer = tokenizer_for(cfg)
    if cfg.model.vocab_size is None:
        cfg, _ = resolve_vocab_size(cfg, tokenizer)  # tiny: the built-in task's vocabulary, as a stage would
    # 1b: 32000 synthetic ids, all sampleable (no tokenizer_vocab_size): the reward is the reward
    # model's alone, so nothing is ever decoded
    refit_note = None
    if args.engine == "vllm":
        from megatron_rlhf.rollout.vllm_engine import check_engine_can_run

        try:
            check_engine_can_run(cfg.model, cfg.logging.verbose)
        except ConfigError as err:
            refit_note = str(err)
            cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine="megatron"))
    else:
        refit_note = "rollout.engine=megatron (in place: no weight copy); --engine vllm measures it"
    start_distributed(cfg)
    roles = stage.build_roles(cfg)
    assert sorted(roles) == ["actor", "critic", "reference", "reward"], sorted(roles)
    trained = {k: roles[k] for k in ("actor", "critic")}
    table = phases_for(roles, engine=cfg.rollout.engine)
    sched = ColocationScheduler(roles, table if offload else resident_table(roles, table))
    g = torch.Generator().manual_seed(0)
    vocab = cfg.model.token_vocab_size
    prompts = [EncodedPrompt(torch.randint(3, vocab, (int(k),), generator=g).tolist(), PromptExample("-"))
               for k in torch.randint(lo, hi + 1, (batch,), generator=g)]
    sampling = SamplingParams(max_new_tokens=new)
    rewards = RewardSources(cfg.rl.rewards, roles["reward"], micro_batch_size=cfg.rl.micro_batch_size,
                            micro_batch_tokens=cfg.rl.micro_batch_tokens)
    score_fn = partial(stage.sequence_rewards, rewards, tokenizer=tokenizer, rl=cfg.rl)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with tempfile.TemporaryDirectory() as workdir:
        if cfg.rollout.engine == "vllm":
            from megatron_rlhf.rollout.vllm_engine import VLLMRolloutEngine

            # vLLM takes only ids >= 0 as stop tokens: the last id, which a random model draws
            # ~1/vocab of the time (the tokens actually generated are what is counted)
            engine = VLLMRolloutEngine(cfg.rollout, cfg.model, roles["actor"], eos_id=vocab - 1, pad_id=0,
                                       workdir=Path(workdir), seed=cfg.seed, verbose=cfg.logging.verbose)
        else:
            engine = MegatronRolloutEngine(cfg.model, roles["actor"], eos_id=-1, pad_id=0)  # no EOS: full-length responses
        with engine:
            walls, flops, refits, response_tokens = [], [], [], []
            for it in range(args.iterations + 1):
                if it == 1:
                    sched.stats.clear()  # drop the warm-up iteration
                start = time.perf_counter()
                if engine.needs_refit:
                    with sched.phase("sync"):
                        engine.update_weights()
                    refits.append(engine.last_refit)
                with sched.phase("generate") as phase:
                    generation = stage.generate(engine, score_fn, lambda: prompts, cfg.rl, sampling, seed=it)
                    rollout = generation.rollout
                    phase.tokens = int(rollout.response_lengths().sum())
                    sync()
                with sched.phase("score") as phase:
                    batch_ = stage.score(rollout, generation.rewards or score_fn(rollout, generation.rows), roles, cfg.rl)
                    phase.tokens = int(rollout.lengths.sum())
                    sync()
                with sched.phase("train") as phase:
                    stage.add_advantages(batch_, cfg.rl, 0.05, cfg.sampling.max_new_tokens)
                    stage.train_on_rollout(trained, batch_, cfg.rl, 0.05, seed=it)
                    phase.tokens = int(rollout.lengths.sum()) * cfg.rl.epochs
                    sync()
                if it >= 1:  # wall time: the moves at each phase's entry included
                    walls.append(time.perf_counter() - start)
                    params = {k: matmul_params(r) for k, r in trained.items()}
                    flops.append(train_flops(cfg, params, rollout.lengths))
                    response_tokens.append(int(rollout.response_lengths().sum()))
    phases = {p: {"seconds": v["seconds"] / v["calls"], "tokens_per_s": v["tokens_per_s"],
                  "peak_memory_mib": v["peak_memory_bytes"] / 2**20} for p, v in sched.summary().items()}
    train_s = phases["train"]["seconds"]
    mean_flops = sum(flops) / len(flops)
    refit = None
    if refits:
        measured = refits[1:] or refits
        seconds = sum(r["refit_seconds"] for r in measured)
        refit = {"gb_per_s": sum(r["refit_bytes"] for r in measured) / seconds / 1e9,
                 "bytes": measured[0]["refit_bytes"], "seconds": seconds / len(measured)}
    out = {
        "offload": offload, "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": cfg.model.params_dtype, "engine": cfg.rollout.engine,
        "layer_spec": "transformer_engine" if transformer_engine_available() else "local",
        "params": {k: sum(p.numel() for p in r.module.parameters()) for k, r in roles.items()},
        "matmul_params": {k: matmul_params(r) for k, r in trained.items()},
        "padded_vocab_size": cfg.model.padded_vocab_size, "sequences": len(rollout),
        "response_tokens_per_iteration": sum(response_tokens) / len(response_tokens),
        "sequence_tokens_per_iteration": float(rollout.lengths.sum()), "epochs": cfg.rl.epochs,
        "phases": phases, "iteration_seconds": sum(walls) / len(walls),
        "train_flops_per_iteration": mean_flops, "train_tflops_per_s": mean_flops / train_s / 1e12,
        "mfu": mean_flops / train_s / PEAK_FLOPS,
        "refit": refit if refit is not None else {"not_run": refit_note},
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    parallel.destroy()
    return out


def table(result: dict) -> str:
    on, off = result["offload"]["on"], result["offload"]["off"]
    lines = [f"{'phase':>9} {'s (on)':>8} {'s (off)':>8} {'tokens/s (on)':>13} {'tokens/s (off)':>14} "
             f"{'peak MiB (on)':>13} {'peak MiB (off)':>14}"]
    for p in on["phases"]:
        a, b = on["phases"][p], off["phases"].get(p, {})
        tok = lambda r: f"{r['tokens_per_s']:.1f}" if r.get("tokens_per_s") else "-"  # noqa: E731
        lines.append(f"{p:>9} {a['seconds']:>8.3f} {b.get('seconds', float('nan')):>8.3f} {tok(a):>13} {tok(b):>14} "
                     f"{a['peak_memory_mib']:>13.0f} {b.get('peak_memory_mib', float('nan')):>14.0f}")
    lines.append(f"{'iteration':>9} {on['iteration_seconds']:>8.3f} {off['iteration_seconds']:>8.3f}"
                 "   (wall, offload moves included)")
    lines.append(f"train MFU vs H200 bf16 peak {PEAK_FLOPS / 1e12:.0f} TFLOP/s: on {on['mfu']:.3e} "
                 f"({on['train_tflops_per_s']:.3f} TFLOP/s), off {off['mfu']:.3e} ({off['train_tflops_per_s']:.3f} TFLOP/s)")
    lines.append(f"decode tokens/s: on {on['phases']['generate']['tokens_per_s']:.1f}, off "
                 f"{off['phases']['generate']['tokens_per_s']:.1f}; score tokens/s: on "
                 f"{on['phases']['score']['tokens_per_s']:.1f}, off {off['phases']['score']['tokens_per_s']:.1f}")
    refit = on["refit"]
    lines.append(f"refit: {refit['gb_per_s']:.2f} GB/s ({refit['bytes'] / 1e9:.2f} GB in {refit['seconds']:.2f} s)"
                 if "gb_per_s" in refit else f"refit: not run ({refit['not_run']})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, fp32, 2 iterations")
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="default: 1b (tiny with --dry-run)")
    ap.add_argument("--iterations", type=int, default=None, help="measured iterations after one warm-up")
    ap.add_argument("--batch", type=int, default=None, help="prompts = sequences per iteration")
    ap.add_argument("--response-length", type=int, default=None, help="new tokens per response (no EOS)")
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--engine", choices=("megatron", "vllm"), default="megatron")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/gpu_ppo.json")
    ap.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)  # one offload setting
    args = ap.parse_args()
    if args.dry_run and args.size == "1b":
        ap.error("--dry-run runs the tiny size on CPU")
    args.size = args.size or ("tiny" if args.dry_run else "1b")
    for key, value in DEFAULTS[args.size].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.child:
        print(json.dumps(child(args, offload=args.child == "on")))
        return
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU even on a GPU machine
    else:
        with warnings.catch_warnings():  # torch's import may warn (pynvml): the refusal below is one line
            warnings.simplefilter("ignore")
            import torch

        if args.size == "1b" and not torch.cuda.is_available():
            print("gpu_ppo: --size 1b needs CUDA (torch.cuda.is_available() is False); use --dry-run or --size tiny "
                  "on CPU", file=sys.stderr)
            sys.exit(2)
    passed = ["--size", args.size, "--iterations", str(args.iterations), "--batch", str(args.batch),
              "--response-length", str(args.response_length), "--micro-batch", str(args.micro_batch),
              "--epochs", str(args.epochs), "--engine", args.engine, *(["--dry-run"] if args.dry_run else [])]
    runs = {}
    spawn = lambda setting: subprocess.Popen([sys.executable, __file__, *passed, "--child", setting], env=env,  # noqa: E731
                                             stdout=subprocess.PIPE, text=True)
    # A dry run starts both children at once (their CPU numbers measure nothing; the imports
    # dominate); on a GPU one after the other, so neither disturbs the other's times.
    procs = {s: spawn(s) for s in ("on", "off")} if args.dry_run else {}
    for setting in ("on", "off"):
        proc = procs.get(setting) or spawn(setting)
        stdout, _ = proc.communicate()
        if proc.returncode != 0:
            sys.exit(f"gpu_ppo: the offload={setting} run failed (exit {proc.returncode}; its stderr is above)")
        runs[setting] = json.loads(stdout.strip().splitlines()[-1])
    on = runs["on"]
    result = {
        "benchmark": "PPO phases (actor, reference, reward, critic; random weights), one process, TP1 PP1",
        "dry_run": args.dry_run, "size": args.size, "device": on["device"], "dtype": on["dtype"],
        "layer_spec": on["layer_spec"], "engine": on["engine"], "model": SIZES[args.size],
        "padded_vocab_size": on["padded_vocab_size"], "params": on["params"], "prompt_lengths": PROMPT_LENGTHS[args.size],
        "batch": args.batch, "response_length": args.response_length, "micro_batch": args.micro_batch,
        "epochs": args.epochs, "iterations": args.iterations, "peak_flops": PEAK_FLOPS,
        "flops_formula": "sum_{r in actor, critic} epochs * (6 * N_r * T + 12 * n_layers * n_heads * head_dim * "
                         "sum_i S_i^2); N_r: parameters except the input embedding; T = sum_i S_i",
        "mfu": {k: r["mfu"] for k, r in runs.items()},
        "decode_tokens_per_s": {k: r["phases"]["generate"]["tokens_per_s"] for k, r in runs.items()},
        "score_tokens_per_s": {k: r["phases"]["score"]["tokens_per_s"] for k, r in runs.items()},
        "refit": on["refit"], "offload": runs,
    }
    head = f"{'dry run: ' if args.dry_run else ''}PPO {args.size} on {on['device']}, {on['dtype']}, " \
           f"{on['layer_spec']} layer spec, engine {on['engine']}, actor {on['params']['actor'] / 1e6:.2f}M params, " \
           f"{args.batch} x {args.response_length} new tokens, {args.epochs} epochs, {args.iterations} iterations"
    print(head)
    if args.dry_run:
        print("dry run: CPU, tiny model, fp32; MFU against the H200 peak is computed but meaningless here")
    print(table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
