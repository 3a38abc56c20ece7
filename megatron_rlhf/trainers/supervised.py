"""The supervised stages' (SFT, RM, DPO) start-up and step loop, written once on the
StageRunner lifecycle (runner.py). A stage keeps what is its own: its roles, how a batch is
collated, its loss and metrics, its eval and its summary fields.

    runner = StageRunner(cfg, "sft", ...)
    examples = encode_splits(encode_sft, train, eval, fit(data, st.seq_length, "sft.seq_length"))
    ...build the role...
    state = resume(runner, {"actor": actor}, len(examples.train), cfg.seed)
    log_lines(runner, runner.resumed, ...)
    metrics = run_steps(runner, SupervisedSteps(actor, collate, sft_loss, ...))
    runner.finish({...}, "done: ...")

Each step: this rank's share of the sampler's next global batch -> collate -> the role's
train_step -> the stage's train metrics, the skipped steps and tokens/s (tokens of every
data-parallel rank) -> the eval when due -> runner.end_step (log, checkpoint, heartbeat).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from megatron_rlhf import parallel
from megatron_rlhf.data.sampler import EpochSampler
from megatron_rlhf.models.batching import data_parallel, dp_slice
from megatron_rlhf.parallel.collectives import dp_sums
from megatron_rlhf.resilience.preemption import interruptible
from megatron_rlhf.trainers.runner import StageRunner, skipped_steps


# ----------------------------------------------------------------------------- start-up
@dataclass
class Encoded:
    """A stage's train and eval examples, fitted to its sequence length, and the encoders'
    reports (what was kept, truncated or dropped; for the log and summary.json)."""
    train: list
    eval: list
    train_report: Any
    eval_report: Any


def fit(data, seq_length: int, max_len_field: str) -> dict:
    """The encoders' arguments (data/encode.py): the run's tokenizer, the stage's sequence
    length (`max_len_field` names it in errors) and data.overflow."""
    return {"tokenizer": data.tokenizer, "max_len": seq_length, "overflow": data.config.data.overflow,
            "max_len_field": max_len_field}


def encode_splits(encode: Callable, train: list, eval_examples: list, fitted: dict) -> Encoded:
    """`encode` (encode_sft, encode_preferences) of the train, then the eval examples."""
    train_set, train_report = encode(train, **fitted)
    eval_set, eval_report = encode(eval_examples, **fitted)
    return Encoded(train_set, eval_set, train_report, eval_report)


def resume(runner: StageRunner, roles: dict, train_size: int, seed: int) -> dict:
    """The sampler over the train set (its order seeded with `seed`) and the runner's resume
    of the trained `roles` and the sampler; the trainer state ({} on a fresh start)."""
    return runner.resume(roles, EpochSampler(train_size, seed=seed))


def log_lines(runner: StageRunner, *lines: str | None) -> None:
    """The start-up notes, in order; None or empty: nothing to say."""
    for line in lines:
        if line:
            runner.log.info(line)


# ----------------------------------------------------------------------------- the step loop
@dataclass
class SupervisedSteps:
    """What a supervised stage's step is made of: the shared loop (run_steps) calls these."""
    role: Any                                   # the trained role (models/roles.py)
    collate: Callable[[list[int]], dict]        # this rank's train indices -> the batch (with "lengths")
    loss: Callable                              # LossFn (models/roles.py)
    micro_rows: int                             # rows per microbatch (a preference pair is 2 rows)
    global_batch_size: int                      # samples per step, all data-parallel ranks together
    eval_interval: int
    step_metrics: Callable[[dict], dict]        # train_step's result -> the stage's train metrics
    evaluate: Callable[[], dict]                # the eval metrics, added to the step's when due
    inputs: tuple[str, ...] | None = None       # the batch keys train_step gets (None: all of them)
    before_last_checkpoint: Callable[[], None] | None = None  # after the last step's eval, before its save
    trainer_state: Callable[[], dict] = dict    # the stage's own part of each checkpoint's trainer state


def run_steps(runner: StageRunner, steps: SupervisedSteps) -> dict:
    """The step loop over the runner's remaining steps (after runner.resume); the last step's
    metrics ({} when there was none left)."""
    dp_rank, dp_size = data_parallel()
    metrics = {}
    for step in runner.steps():
        t0 = time.perf_counter()
        indices = dp_slice(runner.sampler.next_indices(steps.global_batch_size), dp_rank, dp_size)
        batch = steps.collate(indices)
        inputs = batch if steps.inputs is None else {k: batch[k] for k in steps.inputs}
        result = steps.role.train_step(inputs, steps.micro_rows, steps.loss)
        tokens = dp_sums({"tokens": int(batch["lengths"].sum())}, parallel.device())["tokens"]
        metrics = {**steps.step_metrics(result), **skipped_steps(runner.trained),
                   "tokens_per_s": tokens / (time.perf_counter() - t0)}
        evaluated = runner.due(steps.eval_interval)
        if evaluated:
            with interruptible("the eval"):  # SIGTERM ends it at once (resilience/preemption.py)
                metrics.update(steps.evaluate())
        if step == runner.total and steps.before_last_checkpoint is not None:
            steps.before_last_checkpoint()
        runner.end_step(metrics, step * steps.global_batch_size, evaluated, **steps.trainer_state())
    return metrics
