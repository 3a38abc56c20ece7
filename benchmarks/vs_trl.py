"""PPO throughput side by side: our RL stage against TRL's PPOTrainer, on one CPU thread.

    make bench-trl                      # builds .venv-trl (TRL 1.12 on .venv's torch), then runs this
    python benchmarks/vs_trl.py [--batch-sizes 8,16] [--iterations 5] [--out benchmarks/results/vs_trl.json]
    python benchmarks/vs_trl.py --quick # B=4, 2 iterations, 8 new tokens; our side only if .venv-trl is absent

The workload is TRL's PPO example configuration (issue 18): a 2-layer Llama (hidden 128, 4 heads,
no GQA, FFN 512), the vocabulary of our built-in task's tokenizer (the same V on both sides, no
padding rows), fp32; policy, reference, value and reward models all of that shape and randomly
initialised; a rollout batch of B prompts of random ids (length 3..6, the same prompts on both
sides) is one minibatch; exactly 32 new tokens per response (no EOS, so no early stop); 4 PPO
epochs. Three rows per B, each measured in its own process with torch.set_num_threads(1):

  * "TRL 1.12 PPOTrainer as shipped": trl.experimental.ppo.PPOTrainer.train(), in .venv-trl
  * "TRL with its per-step gc.collect() disabled": the same, with gc.collect monkeypatched to a
    no-op in that child. PPOTrainer.train() calls gc.collect() twice per iteration (after the
    rollout and after the update); a full collection walks every tracked Python object of the
    process (torch + transformers + datasets + pandas: over 400k before any model exists), which
    on a model this small costs about as much as the PPO math. The automatic generational
    collector still runs.
  * "megatron_rlhf (TP1 PP1)": our RL stage's own phase functions, as benchmarks/rl_step.py
    runs them (generate -> score -> advantages -> train).

Per row: samples/s (B x iterations / wall time of the measured iterations, after 1 warm-up
iteration), seconds per iteration, the process's CPU seconds per iteration (with one thread
this is the wall time on an idle machine; on a busy one it stays put while wall time grows, so
compare the two before trusting a row), generation seconds per iteration (TRL: its batch_generation
call, timed by wrapping it; ours: the generate phase), peak RSS (ru_maxrss) and the RSS above a
bare `import torch` in the same interpreter (VmRSS right after that import). Also the model-FLOPs
floor: the matmul FLOPs of one iteration (generation, the scoring forwards of policy, reference,
value and reward, forward+backward of policy and value for 4 epochs) divided by the best measured
single-thread fp32 torch.mm rate on the model's shapes, and each row's fraction of it (floor
seconds / measured seconds; 1.0 would be matmul-bound). The floor is one workload's for all
rows; TRL takes the old log-probs from generation's logits instead of a policy forward, which
is ~3% of the floor's FLOPs.
Prints a table, writes JSON. On a shared machine the numbers are indicative.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# No torch (or anything heavy) at module level: a child's RSS baseline is "right after a bare
# `import torch`", and TRL children run this file under .venv-trl's interpreter.

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "pipelines/tiny_cpu.yaml"
ROWS = {
    "trl": "TRL 1.12 PPOTrainer as shipped",
    "trl-nogc": "TRL with its per-step gc.collect() disabled",
    "ours": "megatron_rlhf (TP1 PP1)",
    # TRL takes pi_old from its generation's logits; ours can too (rl.reuse_rollout_logprobs)
    "ours-reuse": "megatron_rlhf, rollout log-probs reused",
}
# The model of issue 18 (TRL's PPO example configuration), on both sides.
LAYERS, HIDDEN, HEADS, FFN, EPOCHS = 2, 128, 4, 512, 4
PAD, EOS, UNK = 0, 1, 2  # the TRL side's tokenizer; prompt ids start above them on both sides
RESULT = "RESULT "       # a child's last stdout line: RESULT <json> (TRL may print its own lines)


# ----------------------------------------------------------------------------- shared helpers
def vm_rss_mib() -> float:
    """Current resident set (ru_maxrss is a peak and cannot give the after-import baseline)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def make_prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """B prompts of random ids in [3, V), lengths 3..6: the same on both sides (same torch build)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 7, (batch,), generator=g)
    return [torch.randint(UNK + 1, vocab, (int(k),), generator=g).tolist() for k in lengths]


def import_torch_single_thread() -> float:
    """The child's first heavy import; returns VmRSS right after it (the baseline)."""
    import torch
    base = vm_rss_mib()
    torch.set_num_threads(1)
    return base


# ----------------------------------------------------------------------------- our side
def run_ours(batch: int, iterations: int, new_tokens: int, seed: int, reuse_logprobs: bool = False) -> dict:
    """Our RL stage's phase functions, exactly as benchmarks/rl_step.py's run() calls them."""
    base = import_torch_single_thread()
    import torch

    import megatron_rlhf  # noqa: F401  (before megatron.core: it adapts megatron-core to CPU)
    from megatron_rlhf import parallel
    from megatron_rlhf.colocation import ColocationScheduler, phases_for
    from megatron_rlhf.config import load_config
    from megatron_rlhf.data.encode import EncodedPrompt
    from megatron_rlhf.data.jsonl import PromptExample
    from megatron_rlhf.rewards import RewardSources
    from megatron_rlhf.rollout import MegatronRolloutEngine, SamplingParams
    from megatron_rlhf.trainers import rl as stage
    from megatron_rlhf.trainers.stage_data import resolve_vocab_size, tokenizer_for
    from functools import partial

    cfg = load_config(RECIPE, [
        f"model.num_layers={LAYERS}", f"model.hidden_size={HIDDEN}", f"model.num_attention_heads={HEADS}",
        f"model.num_query_groups={HEADS}", f"model.ffn_hidden_size={FFN}",
        # no padding rows: the embedding and logits have exactly the tokenizer's V, like the TRL side
        "model.make_vocab_size_divisible_by=1", "model.max_seq_length=64",
        f"rl.rollout_batch_size={batch}", f"rl.mini_batch_size={batch}", f"rl.micro_batch_size={batch}",
        f"rl.epochs={EPOCHS}", f"rl.max_new_tokens={new_tokens}", "rl.steps=100"])
    tokenizer = tokenizer_for(cfg)
    resolve_vocab_size(cfg, tokenizer)  # the built-in task's, as a stage would
    parallel.initialize(cfg)
    roles = stage.build_roles(cfg)
    trained = {k: roles[k] for k in ("actor", "critic") if k in roles}
    sched = ColocationScheduler(roles, phases_for(roles))
    engine = MegatronRolloutEngine(roles["actor"], eos_id=-1, pad_id=0)  # no EOS: full-length responses
    sampling = SamplingParams(max_new_tokens=new_tokens)
    prompts = [EncodedPrompt(ids, PromptExample("-")) for ids in make_prompts(batch, cfg.model.vocab_size, seed)]
    score_fn = partial(stage.sequence_rewards, RewardSources(cfg, roles.get("reward")), tokenizer=tokenizer, rl=cfg.rl)
    torch.set_num_threads(1)  # again, in case an import or initialize changed it
    for it in range(iterations + 1):
        if it == 1:  # iteration 0 is the warm-up
            sched.stats.clear()
            start, start_cpu = time.perf_counter(), time.process_time()
        with sched.phase("generate"):
            rollout, rows, scored, _ = stage.generate(engine, score_fn, lambda: prompts, cfg.rl, sampling, seed=it)
        if int(rollout.response_lengths().min()) != new_tokens:
            raise RuntimeError(f"a response stopped early: {rollout.response_lengths().tolist()}")
        with sched.phase("score"):
            ppo_batch, _ = stage.score(rollout, scored or score_fn(rollout, rows), roles, cfg.rl,
                                       recompute_old=not reuse_logprobs)
        with sched.phase("train"):
            stage.add_advantages(ppo_batch, cfg.rl, 0.05)
            stage.train_on_rollout(trained, ppo_batch, cfg.rl, 0.05, seed=it)
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    phases = {p: v["seconds"] / iterations for p, v in sched.summary().items()}
    threads = torch.get_num_threads()
    parallel.destroy()
    return {"roles": sorted(roles), "vocab": cfg.model.vocab_size, "padded_vocab": cfg.model.padded_vocab_size,
            "wall_s": wall, "cpu_s": cpu, "generation_s_per_iteration": phases["generate"], "phase_s_per_iteration": phases,
            "threads": threads, "rss_after_import_torch_mib": base, "peak_rss_mib": peak_rss_mib(),
            "versions": {"torch": torch.__version__}}


# ----------------------------------------------------------------------------- TRL side
def run_trl(batch: int, iterations: int, new_tokens: int, vocab: int, seed: int, gc_off: bool) -> dict:
    """TRL 1.12's PPOTrainer.train() on locally built models (no hub), timed from the outside."""
    base = import_torch_single_thread()
    if gc_off:
        # ppo_trainer.py does `import gc` and calls gc.collect() per step: replacing the module
        # attribute turns those calls (and any other explicit one in this process) into no-ops.
        import gc
        gc.collect = lambda generation=2: 0
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import (LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification,
                              PreTrainedTokenizerFast, TrainerCallback)
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_module

    # A word-level tokenizer over exactly V ids: PPOTrainer only needs pad/eos ids and padding.
    # Left padding, as TRL's PPO example uses: generation continues right after each prompt.
    words = {"<pad>": PAD, "<eos>": EOS, "<unk>": UNK, **{f"t{i}": i for i in range(UNK + 1, vocab)}}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="<unk>")),
                                        pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left")
    assert len(tokenizer) == vocab

    def llama(**extra):
        return LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=64,
                           pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None, **extra)

    torch.manual_seed(seed)
    policy, ref = LlamaForCausalLM(llama()), LlamaForCausalLM(llama())
    value, reward = (LlamaForSequenceClassification(llama(num_labels=1)) for _ in range(2))

    # Generation time: wrap the module-level batch_generation that train() calls each iteration.
    gen_seconds: list[float] = []
    batch_generation = ppo_module.batch_generation

    def timed_batch_generation(model, queries, *args, **kwargs):
        t = time.perf_counter()
        out = batch_generation(model, queries, *args, **kwargs)
        gen_seconds.append(time.perf_counter() - t)
        if out[0].shape[1] - queries.shape[1] != new_tokens:
            raise RuntimeError(f"responses of {out[0].shape[1] - queries.shape[1]} tokens, not {new_tokens}")
        return out

    ppo_module.batch_generation = timed_batch_generation

    step_ends: list[tuple[float, float]] = []  # (wall, process CPU) clocks

    class StepClock(TrainerCallback):  # on_step_end runs once per PPO iteration, after the update
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append((time.perf_counter(), time.process_time()))

    out_dir = tempfile.TemporaryDirectory(prefix="vs_trl_")  # nothing is saved; TRL may create the directory
    args = PPOConfig(
        output_dir=out_dir.name, report_to="none", eval_strategy="no", save_strategy="no",
        use_cpu=True, seed=seed,
        bf16=False,                     # TRL configs default to bf16 when fp16 is unset; we compare fp32
        gradient_checkpointing=False,   # default True, but PPOTrainer.train() never enables it anyway
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, num_mini_batches=1,
        local_rollout_forward_batch_size=batch, num_ppo_epochs=EPOCHS,
        total_episodes=batch * (iterations + 1),  # one warm-up + the measured iterations
        response_length=new_tokens, stop_token=None, stop_token_id=None, missing_eos_penalty=None,
        temperature=1.0,                # ours samples at 1.0 too (TRL's default is 0.7)
        num_sample_generations=0)       # no debug generations between iterations
    dataset = Dataset.from_dict({"input_ids": make_prompts(batch, vocab, seed)})
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=ref, reward_model=reward,
                         value_model=value, train_dataset=dataset, callbacks=[StepClock()])
    torch.set_num_threads(1)  # again, in case accelerate changed it
    trainer.train()
    out_dir.cleanup()
    if len(step_ends) != iterations + 1:
        raise RuntimeError(f"{len(step_ends)} PPO iterations ran, expected {iterations + 1}")
    return {"wall_s": step_ends[-1][0] - step_ends[0][0],  # from the end of the warm-up iteration
            "cpu_s": step_ends[-1][1] - step_ends[0][1],
            "generation_s_per_iteration": sum(gen_seconds[1:]) / iterations, "vocab": vocab,
            "threads": torch.get_num_threads(), "rss_after_import_torch_mib": base, "peak_rss_mib": peak_rss_mib(),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__}}


# ----------------------------------------------------------------------------- FLOP floor
def iteration_flops(prompt_lengths: list[int], new_tokens: int, vocab: int) -> dict[str, float]:
    """Matmul FLOPs of one PPO iteration (2 per multiply-add; norms, softmax, sampling ignored)."""
    layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN  # q,k,v,o (no GQA) + SwiGLU gate, up, down
    lm = LAYERS * layer + HIDDEN * vocab             # policy, reference: + the logits projection
    scalar = LAYERS * layer + HIDDEN                 # value, reward: + a 1-output head

    def forward(weights: int, s: int) -> float:
        # causal attention: position c scores and mixes c keys, 4*h*c per layer (QK^T and AV)
        return 2 * weights * s + 2 * LAYERS * HIDDEN * s * (s + 1)

    # generation: the prompt's forward, then one token at a time with a KV cache; the last
    # sampled token is never fed back, so p + R - 1 positions are computed per sequence
    generate = sum(forward(lm, p + new_tokens - 1) for p in prompt_lengths)
    lm_fwd = sum(forward(lm, p + new_tokens) for p in prompt_lengths)
    scalar_fwd = sum(forward(scalar, p + new_tokens) for p in prompt_lengths)
    score = 2 * lm_fwd + 2 * scalar_fwd                # policy + reference, value + reward
    train = EPOCHS * 3 * (lm_fwd + scalar_fwd)         # forward + backward (2x) of policy and value
    return {"generate": generate, "score": score, "train": train, "total": generate + score + train}


def matmul_flops_per_s(rows: int) -> dict[str, float]:
    """Single-thread fp32 torch.mm rate on the model's own shapes ([B*S,128]x[128,512] and back),
    best of several timings: the floor assumes every FLOP runs at the best rate measured."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rates = {}
    for m, k, n in ((rows, HIDDEN, FFN), (rows, FFN, HIDDEN)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        reps = 1
        while True:  # enough repetitions for ~50 ms per timing
            t = time.perf_counter()
            for _ in range(reps):
                torch.mm(a, b)
            if time.perf_counter() - t > 0.05:
                break
            reps *= 2
        best = min(_timed(torch.mm, a, b, reps) for _ in range(5))
        rates[f"[{m},{k}]x[{k},{n}]"] = 2 * m * k * n / best
    torch.set_num_threads(threads)
    return rates


def _timed(fn, a, b, reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn(a, b)
    return (time.perf_counter() - t) / reps


# ----------------------------------------------------------------------------- driver
def child(args) -> None:
    if args.child in ("ours", "ours-reuse"):
        r = run_ours(args.batch, args.iterations, args.new_tokens, args.seed, args.child == "ours-reuse")
    else:
        r = run_trl(args.batch, args.iterations, args.new_tokens, args.vocab, args.seed, args.child == "trl-nogc")
    print(RESULT + json.dumps(r), flush=True)


def measure(python: str, row: str, batch: int, iterations: int, new_tokens: int, vocab: int | None) -> dict:
    cmd = [python, __file__, "--child", row, "--batch", str(batch), "--iterations", str(iterations),
           "--new-tokens", str(new_tokens)] + (["--vocab", str(vocab)] if vocab else [])
    # One thread everywhere (also OpenMP/MKL pools that set_num_threads does not reach); offline.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
           "TRL_EXPERIMENTAL_SILENCE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"{row} (B={batch}) failed with exit code {proc.returncode}")
    r = json.loads(lines[-1][len(RESULT):])
    r.update(row=row, label=ROWS[row], batch=batch, iterations=iterations, response_tokens=new_tokens,
             python=python, seconds_per_iteration=r["wall_s"] / iterations,
             samples_per_s=batch * iterations / r["wall_s"], cpu_s_per_iteration=r["cpu_s"] / iterations,
             rss_increment_mib=r["peak_rss_mib"] - r["rss_after_import_torch_mib"])
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="8,16", help="comma-separated rollout batch sizes B")
    ap.add_argument("--iterations", type=int, default=5, help="measured PPO iterations (after 1 warm-up)")
    ap.add_argument("--quick", action="store_true",
                    help="B=4, 2 iterations, 8 new tokens; our side only when --trl-python is absent")
    ap.add_argument("--trl-python", default=str(REPO / ".venv-trl/bin/python"),
                    help="interpreter with TRL 1.12 (make bench-trl-setup)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/vs_trl.json")
    # child processes
    ap.add_argument("--child", choices=sorted(ROWS), help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--new-tokens", type=int, default=32, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    batch_sizes = [4] if args.quick else [int(b) for b in args.batch_sizes.split(",")]
    iterations, new_tokens = (2, 8) if args.quick else (args.iterations, 32)
    with_trl = Path(args.trl_python).exists()
    if not with_trl:
        if not args.quick:
            raise SystemExit(f"{args.trl_python} not found: run `make bench-trl-setup` (or --quick for our side only)")
        print(f"{args.trl_python} not found (make bench-trl-setup): --quick measures our side only")

    rows, floors = [], {}
    for batch in batch_sizes:
        # ours first: it reports V (the built-in task's tokenizer), which the TRL children reuse
        ours = measure(sys.executable, "ours", batch, iterations, new_tokens, None)
        vocab = ours["vocab"]
        measured = [measure(args.trl_python, row, batch, iterations, new_tokens, vocab)
                    for row in ("trl", "trl-nogc")] if with_trl else []
        measured.append(ours)
        if not args.quick:
            measured.append(measure(sys.executable, "ours-reuse", batch, iterations, new_tokens, None))
        lengths = [len(p) for p in make_prompts(batch, vocab)]
        flops = iteration_flops(lengths, new_tokens, vocab)
        rates = matmul_flops_per_s(batch * round(sum(lengths) / batch + new_tokens))
        rate = max(rates.values())
        floor_s = flops["total"] / rate
        floors[batch] = {"flops_per_iteration": flops, "matmul_flops_per_s": rates, "floor_s_per_iteration": floor_s,
                         "prompt_lengths": lengths, "vocab": vocab}
        for r in measured:
            r["floor_s_per_iteration"] = floor_s
            r["fraction_of_floor"] = floor_s / r["seconds_per_iteration"]
        rows += measured

    print(f"\nPPO, 2-layer Llama h{HIDDEN} ffn{FFN}, V={rows[-1]['vocab']}, {new_tokens} new tokens, {EPOCHS} epochs, "
          f"fp32, 1 thread, {iterations} measured iterations after 1 warm-up")
    print(f"{'B':>3} {'row':<45} {'samples/s':>9} {'s/iter':>7} {'CPU s/iter':>10} {'gen s/iter':>10} "
          f"{'peak RSS MiB':>12} {'RSS-torch MiB':>13} {'floor/meas':>10}")
    for r in rows:
        print(f"{r['batch']:>3} {r['label']:<45} {r['samples_per_s']:>9.2f} {r['seconds_per_iteration']:>7.3f} "
              f"{r['cpu_s_per_iteration']:>10.3f} {r['generation_s_per_iteration']:>10.3f} {r['peak_rss_mib']:>12.0f} "
              f"{r['rss_increment_mib']:>13.0f} {r['fraction_of_floor']:>10.3f}")
    print("\nmodel-FLOPs floor per iteration (matmul FLOPs / best single-thread fp32 torch.mm rate):")
    for batch, f in floors.items():
        fl = f["flops_per_iteration"]
        print(f"  B={batch:<3} {fl['total'] / 1e9:.3f} GFLOP (generate {fl['generate'] / 1e9:.3f}, score "
              f"{fl['score'] / 1e9:.3f}, train {fl['train'] / 1e9:.3f}) at "
              f"{max(f['matmul_flops_per_s'].values()) / 1e9:.1f} GFLOP/s -> {f['floor_s_per_iteration'] * 1e3:.1f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "PPO vs TRL 1.12, 2-layer Llama, fp32, CPU, 1 thread per process",
        "config": {"layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "ffn": FFN, "epochs": EPOCHS,
                   "response_tokens": new_tokens, "iterations": iterations, "batch_sizes": batch_sizes,
                   "quick": args.quick, "trl": with_trl},
        "floors": {str(b): f for b, f in floors.items()}, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
