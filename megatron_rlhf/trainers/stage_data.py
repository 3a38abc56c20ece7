"""Where a run writes (run and stage directories) and the data a stage reads: the splits the
config names, from JSONL files or the built-in task, and the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from megatron_rlhf.config import Config, ConfigError
from megatron_rlhf.data import jsonl
from megatron_rlhf.data.tasks import get_task
from megatron_rlhf.data.tasks.base import Task
from megatron_rlhf.data.tokenizers import Tokenizer, load_tokenizer


def run_dir(cfg: Config) -> Path:
    return Path(cfg.checkpoint.root) / cfg.checkpoint.run_name


def stage_dir(cfg: Config, stage: str) -> Path:
    """<run>/<stage>; the RL stage writes under its algorithm's name (<run>/ppo, <run>/grpo,
    ...), so algorithms tried on the same SFT and RM checkpoints do not overwrite each other."""
    return run_dir(cfg) / (cfg.rl.algorithm if stage == "rl" else stage)


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
