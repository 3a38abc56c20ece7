"""What every stage trainer shares: run directories, the data the config names, data-parallel
slicing, padded forward passes, resume, and the summary file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlhf.config import Config, ConfigError
from megatron_rlhf.data import jsonl
from megatron_rlhf.data.tasks import get_task
from megatron_rlhf.data.tasks.base import Task
from megatron_rlhf.data.tokenizers import Tokenizer, load_tokenizer
from megatron_rlhf.logging.metrics import nonfinite_to_null


def run_dir(cfg: Config) -> Path:
    return Path(cfg.checkpoint.root) / cfg.checkpoint.run_name


def stage_dir(cfg: Config, stage: str) -> Path:
    return run_dir(cfg) / stage


@dataclass
class StageData:
    tokenizer: Tokenizer
    task: Task | None
    splits: dict[str, list]  # split name -> records (only the splits that were asked for)


_READERS = {
    "sft_train": jsonl.read_sft, "sft_eval": jsonl.read_sft,
    "preference_train": jsonl.read_preferences, "preference_eval": jsonl.read_preferences,
    "prompts_train": jsonl.read_prompts, "prompts_eval": jsonl.read_prompts,
}
_TASK_SPLIT = {"prompts_train": "ppo_prompts", "prompts_eval": "eval_prompts"}


def load_stage_data(cfg: Config, needed: tuple[str, ...]) -> StageData:
    """The splits a stage needs: from the JSONL path in `data.<split>` when set, else generated
    by the built-in task from `seed` (and written to <run>/data/ for the user to inspect)."""
    d = cfg.data
    task = get_task(d.task) if d.task else None
    generated = None
    if task is not None and any(getattr(d, name) is None for name in needed):
        generated = task.splits(cfg.seed, d.task_sizes)
        if dist.get_rank() == 0:
            generated.write(run_dir(cfg) / "data")
    splits = {}
    for name in needed:
        path = getattr(d, name)
        if path is not None:
            splits[name] = _READERS[name](path)
        elif generated is not None:
            splits[name] = getattr(generated, _TASK_SPLIT.get(name, name))
        else:
            raise ConfigError(f"data.{name}: no file given and data.task is null; set one of them")
    tokenizer = load_tokenizer(d.tokenizer, task.words() if task else None)
    if tokenizer.vocab_size != cfg.model.vocab_size:
        # Ids the tokenizer lacks would still get probability mass when sampling.
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size}: the tokenizer (data.tokenizer={d.tokenizer}) has "
            f"{tokenizer.vocab_size} tokens; set model.vocab_size={tokenizer.vocab_size}"
        )
    return StageData(tokenizer, task, splits)


def data_parallel() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def dp_slice(items: list, rank: int, size: int) -> list:
    """This data-parallel rank's contiguous share of a global batch."""
    per_rank = len(items) // size
    return items[rank * per_rank : (rank + 1) * per_rank]


def padded_forward(role, batch: dict[str, torch.Tensor], micro_batch_size: int) -> dict[str, torch.Tensor]:
    """role.forward on a batch whose size need not be a multiple of the microbatch size."""
    rows = batch["tokens"].size(0)
    extra = -rows % micro_batch_size
    if extra:
        batch = {k: torch.cat([v, v[-1:].expand(extra, *v.shape[1:])]) for k, v in batch.items()}
    return {k: v[:rows] for k, v in role.forward(batch, micro_batch_size).items()}


def resume_source(cfg: Config, ckpt) -> Path | str | None:
    """Where to resume from: checkpoint.load, else the stage's own complete checkpoint, else
    nothing (a fresh start); see CheckpointManager.has_checkpoint for damaged ones."""
    if cfg.checkpoint.load:
        return cfg.checkpoint.load
    if cfg.checkpoint.resume and ckpt.has_checkpoint():
        return ckpt.stage_dir
    return None


def resume(cfg: Config, ckpt, roles: dict, sampler) -> tuple[int, str | None, dict]:
    """Load the stage's checkpoint to resume from, if any: (step, lines for the log, the
    trainer state; step 0, None and {} on a fresh start). Restores the sampler and the
    non-finite guards of the trained roles."""
    source = resume_source(cfg, ckpt)
    if source is None:
        return 0, None, {}
    state = ckpt.load(roles, source)
    sampler.load_state_dict(state["sampler"])
    for name, guard in state.get("guards", {}).items():
        roles[name].guard.load_state_dict(guard)
    notes = [*state.get("checkpoint_warnings", []), f"resumed from {state['checkpoint']} at step {state['step']}"]
    return state["step"], "\n".join(notes), state


def trainer_state(step: int, consumed_samples: int, sampler, roles: dict, **extra) -> dict:
    """What every stage saves besides the roles: the step, the samples consumed, the data
    order and position, the skipped-step counters, and stage-specific `extra` (RNG states
    are added by the checkpoint manager)."""
    return {"step": step, "consumed_samples": consumed_samples, "sampler": sampler.state_dict(),
            "guards": {name: role.guard.state_dict() for name, role in roles.items()}, **extra}


def skipped_steps(roles: dict) -> dict[str, int]:
    """Optimizer steps skipped so far for a NaN/Inf loss or gradient, per trained role."""
    return {f"{name}_skipped_steps" if len(roles) > 1 else "skipped_steps": role.guard.skipped
            for name, role in roles.items()}


def write_summary(directory: Path, summary: dict[str, Any]) -> None:
    """summary.json (rank 0); NaN/Inf (e.g. gold scores without a gold scorer) are written as
    null, so that jq and strict JSON parsers can read it."""
    if dist.get_rank() == 0:
        tmp = directory / "summary.json.tmp"
        tmp.write_text(json.dumps(nonfinite_to_null(summary), indent=2, allow_nan=False) + "\n")
        tmp.replace(directory / "summary.json")


def checkpoint_if_due(ckpt, log, preemption, step: int, total: int, save_interval: int,
                      roles: dict, state: dict) -> None:
    """Save on the interval, at the last step, or when any rank was signalled; after a
    signalled save, wait for it to be committed and exit for requeue
    (resilience/preemption.py). Commits finished async saves on the way."""
    from megatron_rlhf.resilience.preemption import Preempted

    preempted = preemption.should_stop()
    # An interval save waits for a good step: a run that keeps producing NaN must stop with
    # its last checkpoint from before the trouble, not one taken in the middle of it.
    in_nonfinite_streak = any(role.guard.consecutive for role in roles.values())
    interval_due = bool(save_interval) and step % save_interval == 0 and not in_nonfinite_streak
    if interval_due or step == total or preempted:
        ckpt.save(step, roles, state)
    ckpt.poll()
    if preempted and step < total:
        ckpt.wait()
        log.info(f"signalled: checkpoint at step {step} saved, exiting for requeue")
        raise Preempted(step)
