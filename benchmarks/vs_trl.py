"""PPO throughput side by side: our RL stage against TRL's PPOTrainer, on one CPU thread.

    make bench-trl                      # builds .venv-trl (TRL 1.12 on .venv's torch), then runs this
    python benchmarks/vs_trl.py [--batch-sizes 8,16] [--iterations 5] [--repeats 5] [--rows ours,trl,...]
                                [--out benchmarks/results/vs_trl.json]
    python benchmarks/vs_trl.py --quick # B=4, 2 iterations, 8 new tokens, 1 repeat; our side only if .venv-trl is absent

The workload is TRL's PPO example configuration (issue 18): a 2-layer Llama (hidden 128, 4 heads,
no GQA, FFN 512), the vocabulary of our built-in task's tokenizer (the same V on both sides, no
padding rows), fp32; policy, reference, value and reward models all of that shape and randomly
initialised; a rollout batch of B prompts of random ids (length 3..6, the same prompts on both
sides) is one minibatch; exactly 32 new tokens per response (no EOS, so no early stop); 4 PPO
epochs; torch.set_num_threads(1) and OMP/MKL at 1 thread. Rows:

  * "trl": TRL 1.12 trl.experimental.ppo.PPOTrainer.train() as shipped, in .venv-trl
  * "trl-nogc" (TRL-best): the same with gc.collect monkeypatched to a no-op in that child.
    PPOTrainer.train() calls gc.collect() twice per iteration (after the rollout and after the
    update); a full collection walks every tracked Python object of the process (torch +
    transformers + datasets + pandas: over 400k before any model exists), which on a model this
    small costs about as much as the PPO math. The automatic generational collector still runs.
  * "ours": megatron_rlhf (TP1 PP1), our RL stage's own phase functions, as benchmarks/rl_step.py
    runs them (generate -> score -> advantages -> train)
  * "ours-reuse": the same with rl.reuse_rollout_logprobs (pi_old from the rollout's log-probs, as
    TRL takes it from its generation's logits: one policy forward less in score)

Measurement. Every repeat of every row is its own child process (fresh interpreter, its own RSS
and allocator state); the children run interleaved, one round of all rows after another (ours,
trl, trl-nogc, ours-reuse, ours, trl, ...), --repeats rounds per B, so slow spells of a shared
machine fall on every row alike. A child runs 1 warm-up iteration and --iterations measured ones.
The primary figure is the process CPU time per iteration (time.process_time: every thread of
the child, gloo's and any OpenMP pool's included) -- on a loaded machine wall time grows with the
load while CPU time mostly does not; wall time is printed beside it. Per row: min and median over
the repeats (a child's value is its measured iterations' mean), and the spread median/min - 1.

Ratios (printed and in the JSON): throughput ours / theirs = samples/s ours / samples/s theirs
= their CPU s per iteration / our CPU s per iteration at the same B (> 1: ours is faster), from
the medians (and from the minima beside), against TRL-best (trl-nogc) and TRL as shipped (trl).

Phase table (CPU time per iteration, median over repeats), measured inside each child by
wrapping functions from the outside (nothing in the package or in TRL is edited), with nested
spans: a span's time includes the spans opened inside it.
  * generate: ours `stage.generate` (the Megatron engine); TRL its module-level batch_generation.
  * score: from the end of generation to the first training forward, both sides: the scoring
    forwards (reference, value, reward; ours also the policy unless -reuse), rewards, KL, advantages.
  * train: the PPO epochs up to the iteration's end. Inside it, forward+backward: ours
    Role._forward_backward (zero-grad, megatron's schedule, DDP's grad finalise), with megatron's
    schedules.forward_step (model forward + loss) and backward_step and the model config's
    finalize_model_grads_func as sub-spans; TRL from the update's forward() call (model forward)
    to the end of accelerator.backward(), i.e. with its loss math. optimizer: ours
    role.optimizer.step(), TRL optimizer.step() + zero_grad(). NaN guard: ours role.guard.should_skip
    (TRL has none). LR schedule: scheduler.step() / lr_scheduler.step(). "rest" rows are what the
    parent span spent outside its listed children (batching, statistics, logging).
  * other: the iteration outside those (TRL: the post-update gc.collect() and the dataloader).
  * gc.collect: time in explicit gc.collect() calls, wherever they were (already in the rows above).
The generation row's CPU ms per token step (generate / new tokens) is printed in the main table;
below the ratios, per B, ours - TRL-best of each leaf phase (medians, largest first): the measured
costs that hold the ratio where it is.

Also per row: peak RSS (ru_maxrss) and the RSS above a bare `import torch` in the same
interpreter (VmRSS right after that import), and the model-FLOPs floor: the matmul FLOPs of one
iteration (generation, the scoring forwards of policy, reference, value and reward, forward +
backward of policy and value for 4 epochs) divided by the best measured single-thread fp32
torch.mm rate on the model's shapes, and each row's fraction of it (floor seconds / median CPU
seconds; 1.0 would be matmul-bound). The floor is one workload's for all rows; TRL takes the old
log-probs from generation's logits instead of a policy forward, which is ~3% of the floor's FLOPs.
Prints the tables, writes JSON (every child's result under "runs", the summaries under "rows").
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

# No torch (or anything heavy) at module level: a child's RSS baseline is "right after a bare
# `import torch`", and TRL children run this file under .venv-trl's interpreter.

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "pipelines/tiny_cpu.yaml"
ROWS = {  # in the order each round runs them (ours first: it reports V, which the TRL rows reuse)
    "ours": "megatron_rlhf (TP1 PP1)",
    "trl": "TRL 1.12 PPOTrainer as shipped",
    "trl-nogc": "TRL-best: its per-step gc.collect() disabled",
    "ours-reuse": "megatron_rlhf, rollout log-probs reused",
}
OURS, TRL_ROWS = ("ours", "ours-reuse"), ("trl", "trl-nogc")
# The model of issue 18 (TRL's PPO example configuration), on both sides.
LAYERS, HIDDEN, HEADS, FFN, EPOCHS = 2, 128, 4, 512, 4
PAD, EOS, UNK = 0, 1, 2  # the TRL side's tokenizer; prompt ids start above them on both sides
RESULT = "RESULT "       # a child's last stdout line: RESULT <json> (TRL may print its own lines)
# Phase table rows: (span path, label). "rest" rows and "other" are derived (see phase_table).
PHASES = [
    ("iteration", "iteration"),
    ("generate", "generate"),
    ("score", "score"),
    ("train", "train"),
    ("train/fwd_bwd", "  forward+backward"),
    ("train/fwd_bwd/forward", "    model forward (+ loss: ours)"),
    ("train/fwd_bwd/backward", "    backward"),
    ("train/fwd_bwd/finalize_grads", "    DDP grad finalise"),
    ("train/fwd_bwd/rest", "    rest (ours: schedule, zero-grad; TRL: loss)"),
    ("train/optimizer", "  optimizer step"),
    ("train/guard", "  NaN guard"),
    ("train/lr_schedule", "  LR schedule"),
    ("train/rest", "  rest (batching, statistics, logging)"),
    ("other", "other (TRL: post-update gc.collect, data)"),
    ("gc.collect", "gc.collect() calls, within the above"),
]


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


class SpanClock:
    """Process CPU seconds per named span, nested by path ("train/fwd_bwd/backward": a span
    opened while "train/fwd_bwd" is open). time.process_time covers every thread of the process."""

    def __init__(self):
        self.open: list[tuple[str, float]] = []  # (path, CPU clock at begin)
        self.seconds: dict[str, float] = defaultdict(float)

    def top(self) -> str | None:
        return self.open[-1][0].rsplit("/", 1)[-1] if self.open else None

    def begin(self, name: str) -> None:
        path = f"{self.open[-1][0]}/{name}" if self.open else name
        self.open.append((path, time.process_time()))

    def end(self, name: str) -> None:
        if self.top() != name:
            raise RuntimeError(f"span {name!r} ended while {self.top()!r} is the innermost open one")
        path, start = self.open.pop()
        self.seconds[path] += time.process_time() - start

    @contextmanager
    def span(self, name: str):
        self.begin(name)
        try:
            yield
        finally:
            self.end(name)

    def wrap(self, owner, attr: str, name: str) -> None:
        """Time every call of owner.attr (a module function or an instance's method) as `name`."""
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.span(name):
                return fn(*args, **kwargs)

        setattr(owner, attr, timed)

    def clear(self) -> None:
        """Forget the closed spans (the warm-up's); open ones keep their start."""
        self.seconds.clear()


def phase_table(seconds: dict[str, float], iteration_s: float, iterations: int) -> dict[str, float]:
    """CPU seconds per iteration of each PHASES row from a child's span totals."""
    per = {path: s / iterations for path, s in seconds.items()}
    get = lambda path: per.get(path, 0.0)  # noqa: E731  (a span that never ran: 0)
    table = {"iteration": iteration_s / iterations,
             **{p: get(p) for p in ("generate", "score", "train", "train/fwd_bwd", "train/fwd_bwd/forward",
                                    "train/fwd_bwd/backward", "train/fwd_bwd/finalize_grads", "train/optimizer",
                                    "train/guard", "train/lr_schedule")}}
    table["train/fwd_bwd/rest"] = table["train/fwd_bwd"] - sum(
        table[f"train/fwd_bwd/{p}"] for p in ("forward", "backward", "finalize_grads"))
    table["train/rest"] = table["train"] - sum(
        table[f"train/{p}"] for p in ("fwd_bwd", "optimizer", "guard", "lr_schedule"))
    table["other"] = table["iteration"] - table["generate"] - table["score"] - table["train"]
    table["gc.collect"] = sum(s for path, s in per.items() if path.rsplit("/", 1)[-1] == "gc.collect")
    return table


# ----------------------------------------------------------------------------- our side
def install_our_timers(clock: SpanClock, trained: dict) -> list[str]:
    """Spans around our trainer's steps, wrapped from the outside (public or role-level methods,
    so a different optimizer or guard class keeps working); returns what was wrapped."""
    from megatron.core.pipeline_parallel import schedules

    wrapped = []

    def wrap(owner, attr, name, label):
        if owner is not None and callable(getattr(owner, attr, None)):
            clock.wrap(owner, attr, name)
            wrapped.append(label)

    # megatron's per-microbatch steps (a module global the schedules look up at call time)
    wrap(schedules, "forward_step", "forward", "schedules.forward_step")
    wrap(schedules, "backward_step", "backward", "schedules.backward_step")
    for name, role in trained.items():
        wrap(role, "_forward_backward", "fwd_bwd", f"{name}._forward_backward")
        wrap(role.module.config, "finalize_model_grads_func", "finalize_grads", f"{name}.finalize_model_grads_func")
        wrap(role.optimizer, "step", "optimizer", f"{name}.optimizer.step")
        wrap(getattr(role, "guard", None), "should_skip", "guard", f"{name}.guard.should_skip")
        wrap(getattr(role, "scheduler", None), "step", "lr_schedule", f"{name}.scheduler.step")
    return wrapped


def run_ours(batch: int, iterations: int, new_tokens: int, seed: int, reuse_logprobs: bool = False) -> dict:
    """Our RL stage's phase functions, as benchmarks/rl_step.py's run() calls them."""
    base = import_torch_single_thread()
    import torch

    import megatron_rlhf  # noqa: F401  (before megatron.core: it adapts megatron-core to CPU)
    from megatron_rlhf import parallel
    from megatron_rlhf.trainers.runner import start_distributed
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
        f"rl.epochs={EPOCHS}", f"sampling.max_new_tokens={new_tokens}", "rl.steps=100"])
    tokenizer = tokenizer_for(cfg)
    cfg, _ = resolve_vocab_size(cfg, tokenizer)  # the built-in task's, as a stage would
    start_distributed(cfg)
    roles = stage.build_roles(cfg)
    trained = {k: roles[k] for k in ("actor", "critic") if k in roles}
    sched = ColocationScheduler(roles, phases_for(roles))
    engine = MegatronRolloutEngine(cfg.model, roles["actor"], eos_id=-1, pad_id=0)  # no EOS: full-length responses
    sampling = SamplingParams(max_new_tokens=new_tokens)
    prompts = [EncodedPrompt(ids, PromptExample("-")) for ids in make_prompts(batch, cfg.model.vocab_size, seed)]
    rewards = RewardSources(cfg.rl.rewards, roles.get("reward"), micro_batch_size=cfg.rl.micro_batch_size,
                            micro_batch_tokens=cfg.rl.micro_batch_tokens)
    score_fn = partial(stage.sequence_rewards, rewards, tokenizer=tokenizer, rl=cfg.rl)
    clock = SpanClock()
    timers = install_our_timers(clock, trained)
    import gc
    clock.wrap(gc, "collect", "gc.collect")  # as on the TRL side (ours calls none itself)
    torch.set_num_threads(1)  # again, in case an import or initialize changed it
    per_iteration = []  # (wall, CPU) seconds of each measured iteration
    for it in range(iterations + 1):
        if it == 1:  # iteration 0 is the warm-up
            clock.clear()
        wall, cpu = time.perf_counter(), time.process_time()
        with clock.span("generate"), sched.phase("generate"):
            generation = stage.generate(engine, score_fn, lambda: prompts, cfg.rl, sampling, seed=it)
            rollout = generation.rollout
        if int(rollout.response_lengths().min()) != new_tokens:
            raise RuntimeError(f"a response stopped early: {rollout.response_lengths().tolist()}")
        with sched.phase("score"), clock.span("score"):
            ppo_batch = stage.score(rollout, generation.rewards or score_fn(rollout, generation.rows), roles, cfg.rl,
                                    recompute_old=not reuse_logprobs)
        with sched.phase("train"):
            with clock.span("score"):  # advantages: TRL computes them before its first training forward
                stage.add_advantages(ppo_batch, cfg.rl, 0.05, cfg.sampling.max_new_tokens)
            with clock.span("train"):
                stage.train_on_rollout(trained, ppo_batch, cfg.rl, 0.05, seed=it)
        if it:
            per_iteration.append((time.perf_counter() - wall, time.process_time() - cpu))
    threads = torch.get_num_threads()
    parallel.destroy()
    return {"roles": sorted(roles), "vocab": cfg.model.vocab_size, "padded_vocab": cfg.model.padded_vocab_size,
            "per_iteration": per_iteration, "spans": dict(clock.seconds), "timers": timers,
            "threads": threads, "rss_after_import_torch_mib": base, "peak_rss_mib": peak_rss_mib(),
            "versions": {"torch": torch.__version__}}


# ----------------------------------------------------------------------------- TRL side
def run_trl(batch: int, iterations: int, new_tokens: int, vocab: int, seed: int, gc_off: bool) -> dict:
    """TRL 1.12's PPOTrainer.train() on locally built models (no hub), timed from the outside."""
    base = import_torch_single_thread()
    import gc
    if gc_off:
        # ppo_trainer.py does `import gc` and calls gc.collect() per step: replacing the module
        # attribute turns those calls (and any other explicit one in this process) into no-ops.
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

    # Phases from the outside: train() calls the module-level batch_generation and forward (looked
    # up at call time), so wrapping them marks generate -> score -> train; on_step_end closes the
    # iteration (after the update, the metrics and lr_scheduler.step; before the second gc.collect).
    clock = SpanClock()
    clock.wrap(gc, "collect", "gc.collect")
    batch_generation, forward = ppo_module.batch_generation, ppo_module.forward

    def timed_batch_generation(model, queries, *args, **kwargs):
        clock.end("other")
        with clock.span("generate"):
            out = batch_generation(model, queries, *args, **kwargs)
        clock.begin("score")
        if out[0].shape[1] - queries.shape[1] != new_tokens:
            raise RuntimeError(f"responses of {out[0].shape[1] - queries.shape[1]} tokens, not {new_tokens}")
        return out

    def timed_forward(model, *args, **kwargs):
        if not torch.is_grad_enabled():  # the scoring forwards (reference policy)
            with clock.span("forward"):
                return forward(model, *args, **kwargs)
        if clock.top() == "score":  # the update's first forward: training starts
            clock.end("score")
            clock.begin("train")
        clock.begin("fwd_bwd")  # closed after accelerator.backward
        with clock.span("forward"):
            return forward(model, *args, **kwargs)

    ppo_module.batch_generation, ppo_module.forward = timed_batch_generation, timed_forward

    per_iteration: list[tuple[float, float]] = []
    last_step_end: list[tuple[float, float]] = []
    spans: dict[str, float] = {}

    class StepClock(TrainerCallback):  # on_step_end runs once per PPO iteration, after the update
        def on_step_end(self, args, state, control, **kwargs):
            clock.end("train")
            now = (time.perf_counter(), time.process_time())
            if last_step_end:
                per_iteration.append((now[0] - last_step_end[0][0], now[1] - last_step_end[0][1]))
            else:  # the warm-up ends here
                clock.clear()
            last_step_end[:] = [now]
            spans.update(clock.seconds)  # as of this iteration's end: later spans (the last
            clock.begin("other")         # post-update gc.collect) fall outside the measured ones

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
    backward = trainer.accelerator.backward

    def timed_backward(loss, **kwargs):
        with clock.span("backward"):
            backward(loss, **kwargs)
        clock.end("fwd_bwd")

    trainer.accelerator.backward = timed_backward
    clock.wrap(trainer.optimizer, "step", "optimizer")
    clock.wrap(trainer.optimizer, "zero_grad", "optimizer")
    clock.wrap(trainer.lr_scheduler, "step", "lr_schedule")
    torch.set_num_threads(1)  # again, in case accelerate changed it
    clock.begin("other")
    trainer.train()
    out_dir.cleanup()
    if len(per_iteration) != iterations:
        raise RuntimeError(f"{len(per_iteration) + 1} PPO iterations ran, expected {iterations + 1}")
    return {"vocab": vocab, "per_iteration": per_iteration, "spans": spans,
            "timers": ["batch_generation", "forward", "accelerator.backward", "optimizer.step", "optimizer.zero_grad",
                       "lr_scheduler.step", "gc.collect"],
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
    if args.child in OURS:
        r = run_ours(args.batch, args.iterations, args.new_tokens, args.seed, args.child == "ours-reuse")
    else:
        r = run_trl(args.batch, args.iterations, args.new_tokens, args.vocab, args.seed, args.child == "trl-nogc")
    print(RESULT + json.dumps(r), flush=True)


def measure(python: str, row: str, batch: int, iterations: int, new_tokens: int, vocab: int | None) -> dict:
    """One child process: one repeat of one row."""
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
    wall, cpu = (sum(t[i] for t in r["per_iteration"]) for i in (0, 1))
    r.update(row=row, batch=batch, iterations=iterations, response_tokens=new_tokens, python=python,
             wall_s_per_iteration=wall / iterations, cpu_s_per_iteration=cpu / iterations,
             phases=phase_table(r["spans"], cpu, iterations),
             rss_increment_mib=r["peak_rss_mib"] - r["rss_after_import_torch_mib"])
    return r


def min_median(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "values": values}


def summarise(runs: list[dict]) -> list[dict]:
    """One row per (B, row): min and median over its repeats."""
    groups: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for r in runs:
        groups[r["batch"], r["row"]].append(r)
    rows = []
    for (batch, row), rs in groups.items():
        cpu = min_median([r["cpu_s_per_iteration"] for r in rs])
        wall = min_median([r["wall_s_per_iteration"] for r in rs])
        phases = {p: statistics.median(r["phases"][p] for r in rs) for p, _ in PHASES}
        rows.append({
            "batch": batch, "row": row, "label": ROWS[row], "repeats": len(rs), "response_tokens": rs[0]["response_tokens"],
            "vocab": rs[0]["vocab"], "threads": rs[0]["threads"], "versions": rs[0]["versions"], "timers": rs[0]["timers"],
            "cpu_s_per_iteration": cpu, "wall_s_per_iteration": wall,
            "cpu_spread": cpu["median"] / cpu["min"] - 1, "wall_spread": wall["median"] / wall["min"] - 1,
            "samples_per_s_cpu": batch / cpu["median"], "samples_per_s_wall": batch / wall["median"],
            "phases_cpu_s_per_iteration": phases,
            "generate_cpu_ms_per_token": phases["generate"] / rs[0]["response_tokens"] * 1e3,
            "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rs),
            "rss_after_import_torch_mib": statistics.median(r["rss_after_import_torch_mib"] for r in rs),
            "rss_increment_mib": statistics.median(r["rss_increment_mib"] for r in rs)})
    return rows


def throughput_ratios(rows: list[dict]) -> dict:
    """ours / theirs throughput = their CPU s per iteration / ours, per B, from medians and minima."""
    by = {(r["batch"], r["row"]): r["cpu_s_per_iteration"] for r in rows}
    out: dict[str, dict] = {}
    for (batch, ours), mine in by.items():
        if ours not in OURS:
            continue
        for theirs, name in (("trl-nogc", "vs_trl_best"), ("trl", "vs_trl_shipped")):
            if (batch, theirs) in by:
                other = by[batch, theirs]
                out.setdefault(str(batch), {}).setdefault(ours, {})[name] = {
                    stat: other[stat] / mine[stat] for stat in ("median", "min")}
    return out


# The leaf rows of PHASES: they add up to the iteration, so their differences explain a gap.
LEAVES = ["generate", "score", "train/fwd_bwd/forward", "train/fwd_bwd/backward", "train/fwd_bwd/finalize_grads",
          "train/fwd_bwd/rest", "train/optimizer", "train/guard", "train/lr_schedule", "train/rest", "other"]


def gaps_to_trl_best(rows: list[dict]) -> dict:
    """Per B: ours - TRL-best CPU s per iteration of each leaf phase (medians), largest first:
    the measured costs that keep the ratio where it is."""
    by = {(r["batch"], r["row"]): r["phases_cpu_s_per_iteration"] for r in rows}
    return {str(batch): dict(sorted(((p, ours[p] - by[batch, "trl-nogc"][p]) for p in LEAVES),
                                    key=lambda kv: -kv[1]))
            for (batch, row), ours in by.items() if row == "ours" and (batch, "trl-nogc") in by}


def interleaved(rows: list[str], batch_sizes: list[int], repeats: int, run) -> list[dict]:
    """run(row, batch, vocab) for every repeat, rounds of all rows (ABAB...) within each B;
    the first "ours" child of a B reports the vocabulary the TRL rows then use."""
    runs = []
    for batch in batch_sizes:
        vocab = None
        for repeat in range(repeats):
            for row in rows:
                r = run(row, batch, vocab)
                vocab = vocab or r["vocab"]
                r.update(repeat=repeat, order=len(runs))
                runs.append(r)
                print(f"  B={batch:<3} repeat {repeat + 1}/{repeats} {row:<10} CPU {r['cpu_s_per_iteration']:.3f} s/iter, "
                      f"wall {r['wall_s_per_iteration']:.3f}", flush=True)
    return runs


def print_tables(rows: list[dict], ratios: dict, floors: dict, new_tokens: int, iterations: int, repeats: int) -> None:
    print(f"\nPPO, 2-layer Llama h{HIDDEN} ffn{FFN}, V={rows[-1]['vocab']}, {new_tokens} new tokens, {EPOCHS} epochs, "
          f"fp32, 1 thread; {repeats} interleaved repeats per row (one child process each), {iterations} measured "
          "iterations after 1 warm-up in each; CPU = process CPU time (all threads)")
    print(f"{'B':>3} {'row':<44} {'CPU s/iter min':>14} {'median':>7} {'spread':>6} {'samples/s':>9} "
          f"{'wall s/iter min':>15} {'median':>7} {'samples/s':>9} {'gen ms/tok':>10} {'peak RSS':>8} "
          f"{'RSS-torch':>9} {'floor/CPU':>9}")
    for r in rows:
        c, w = r["cpu_s_per_iteration"], r["wall_s_per_iteration"]
        print(f"{r['batch']:>3} {r['label']:<44} {c['min']:>14.3f} {c['median']:>7.3f} {r['cpu_spread']:>6.1%} "
              f"{r['samples_per_s_cpu']:>9.2f} {w['min']:>15.3f} {w['median']:>7.3f} {r['samples_per_s_wall']:>9.2f} "
              f"{r['generate_cpu_ms_per_token']:>10.2f} {r['peak_rss_mib']:>8.0f} {r['rss_increment_mib']:>9.0f} "
              f"{r['fraction_of_floor']:>9.3f}")
    if ratios:
        print("\nthroughput ours / theirs = their CPU s per iteration / ours (> 1: ours faster), median (min):")
        for batch, per in ratios.items():
            for ours, vs in per.items():
                print(f"  B={batch:<3} {ours:<10} " + "   ".join(
                    f"{name}: {v['median']:.2f}x ({v['min']:.2f}x)" for name, v in vs.items()))
    for batch, gap in gaps_to_trl_best(rows).items():
        print(f"  B={batch:<3} ours - TRL-best, CPU ms per iteration: " + ", ".join(
            f"{path.removeprefix('train/')} {s * 1e3:+.0f}" for path, s in gap.items()))
    for batch in sorted({r["batch"] for r in rows}):
        at = [r for r in rows if r["batch"] == batch]
        print(f"\nB={batch}: phases, CPU ms per iteration (median over repeats)")
        print(f"{'':<46}" + "".join(f"{r['row']:>12}" for r in at))
        for path, label in PHASES:
            print(f"{label:<46}" + "".join(f"{r['phases_cpu_s_per_iteration'][path] * 1e3:>12.1f}" for r in at))
    print("\nmodel-FLOPs floor per iteration (matmul FLOPs / best single-thread fp32 torch.mm rate):")
    for batch, f in floors.items():
        fl = f["flops_per_iteration"]
        print(f"  B={batch:<3} {fl['total'] / 1e9:.3f} GFLOP (generate {fl['generate'] / 1e9:.3f}, score "
              f"{fl['score'] / 1e9:.3f}, train {fl['train'] / 1e9:.3f}) at "
              f"{max(f['matmul_flops_per_s'].values()) / 1e9:.1f} GFLOP/s -> {f['floor_s_per_iteration'] * 1e3:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="8,16", help="comma-separated rollout batch sizes B")
    ap.add_argument("--iterations", type=int, default=5, help="measured PPO iterations per child (after 1 warm-up)")
    ap.add_argument("--repeats", type=int, default=5, help="children per row and B, run interleaved with the other rows")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated rows among {', '.join(ROWS)}")
    ap.add_argument("--quick", action="store_true",
                    help="B=4, 2 iterations, 8 new tokens, 1 repeat, no ours-reuse; our side only when --trl-python is absent")
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

    rows = [r for r in args.rows.split(",") if r]
    if unknown := set(rows) - set(ROWS):
        raise SystemExit(f"--rows: unknown {sorted(unknown)}; choose among {', '.join(ROWS)}")
    if "ours" not in rows:
        raise SystemExit("--rows must include ours (it reports the vocabulary both sides use)")
    if args.quick:
        batch_sizes, iterations, new_tokens, repeats = [4], 2, 8, 1
        rows = [r for r in rows if r != "ours-reuse"]
    else:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        iterations, new_tokens, repeats = args.iterations, 32, args.repeats
    with_trl = Path(args.trl_python).exists()
    if not with_trl:
        if not args.quick:
            raise SystemExit(f"{args.trl_python} not found: run `make bench-trl-setup` (or --quick for our side only)")
        print(f"{args.trl_python} not found (make bench-trl-setup): --quick measures our side only")
        rows = [r for r in rows if r not in TRL_ROWS]
    rows = [r for r in ROWS if r in rows]  # the round's order: ours first

    def run(row, batch, vocab):
        python = sys.executable if row in OURS else args.trl_python
        return measure(python, row, batch, iterations, new_tokens, None if row in OURS else vocab)

    runs = interleaved(rows, batch_sizes, repeats, run)
    summary, floors = summarise(runs), {}
    for batch in batch_sizes:
        vocab = next(r["vocab"] for r in summary if r["batch"] == batch)
        lengths = [len(p) for p in make_prompts(batch, vocab)]
        flops = iteration_flops(lengths, new_tokens, vocab)
        rates = matmul_flops_per_s(batch * round(sum(lengths) / batch + new_tokens))
        floor_s = flops["total"] / max(rates.values())
        floors[batch] = {"flops_per_iteration": flops, "matmul_flops_per_s": rates, "floor_s_per_iteration": floor_s,
                         "prompt_lengths": lengths, "vocab": vocab}
        for r in summary:
            if r["batch"] == batch:
                r["floor_s_per_iteration"] = floor_s
                r["fraction_of_floor"] = floor_s / r["cpu_s_per_iteration"]["median"]
    ratios = throughput_ratios(summary)
    print_tables(summary, ratios, floors, new_tokens, iterations, repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "PPO vs TRL 1.12, 2-layer Llama, fp32, CPU, 1 thread per process",
        "config": {"layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "ffn": FFN, "epochs": EPOCHS,
                   "response_tokens": new_tokens, "iterations": iterations, "repeats": repeats, "rows": rows,
                   "batch_sizes": batch_sizes, "quick": args.quick, "trl": with_trl},
        "primary": "process CPU seconds per iteration (time.process_time of the child: all its threads)",
        "ratio_definition": "samples/s ours / samples/s theirs = their CPU s per iteration / our CPU s per iteration",
        "ratios": ratios, "gaps_to_trl_best_s_per_iteration": gaps_to_trl_best(summary), "floors": {str(b): f for b, f in floors.items()}, "rows": summary, "runs": runs}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
