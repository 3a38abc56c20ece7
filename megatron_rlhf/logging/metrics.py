"""One writer per run (global rank 0; every logged value is already identical on all ranks):
TensorBoard scalars `<stage>/<name>`, one JSON line per logged step with every metric, and a
compact console line with the few a user watches (CONSOLE; logging.verbose: all of them).

Each metrics.jsonl row also has `time`: when it was written (Unix seconds, wall clock; the
one field a resumed run's rows differ in besides the metrics that measure time). The W&B and
MLflow runs of logging.wandb / logging.mlflow (trackers.py) get every row too.

On resume from step k, lines and events after k are dropped first (they are about to be
recomputed), so a resumed run's logs equal an uninterrupted run's. NaN/Inf values are written
to metrics.jsonl as null (JSON has no NaN; jq and most parsers refuse it), to TensorBoard and
the console as they are.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_rlhf.logging.trackers import Trackers


def nonfinite_to_null(value: Any) -> Any:
    """`value` with every NaN/Inf float, in nested dicts, lists and tuples too, replaced by
    None: json.dumps would write NaN/Infinity, which is not JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: nonfinite_to_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [nonfinite_to_null(v) for v in value]
    return value


# The numbers on the console line (those a step measured), by stage kind, with short labels.
CONSOLE = {
    "sft": {"loss": "loss", "eval_loss": "eval loss", "grad_norm": "grad norm"},
    "rm": {"loss": "loss", "accuracy": "acc", "eval_accuracy": "eval acc", "eval_margin_raw": "eval margin(raw)"},
    "dpo": {"loss": "loss", "reward_accuracy": "acc", "margin": "margin", "eval_reward_accuracy": "eval acc",
            "eval_margin": "eval margin", "eval_gold_score": "eval gold", "eval_win_rate_gold": "win(gold)"},
    "rl": {"reward": "reward", "gold_score": "gold", "holdout_rm_score": "holdout rm", "kl_mean": "kl",
           "response_length": "len", "eval_reward": "eval reward", "eval_gold_score": "eval gold",
           "eval_win_rate_gold": "win(gold)", "eval_win_rate_reward": "win(reward)",
           "reward_hacking": "REWARD-HACKING ALARM"},  # shown only while on
}


def console_kind(stage: str) -> str:
    """sft | rm (also rm_holdout) | dpo | rl (every algorithm's directory), from the stage's
    directory name, with or without the _lora suffix of a stage that trains adapters."""
    name = stage.removesuffix("_lora")
    return "rm" if name == "rm" or name.startswith("rm_") else name if name in CONSOLE else "rl"


class MetricsLogger:
    def __init__(self, out_dir: str | Path, stage: str, total_steps: int, resume_step: int = 0,
                 tensorboard: bool = True, verbose: bool = False, trackers: Trackers | None = None):
        self.stage, self.total_steps, self.verbose = stage, total_steps, verbose
        self.trackers = trackers or Trackers()
        self._last = (time.perf_counter(), resume_step)  # (time, step) of the last console line
        self.active = not dist.is_initialized() or dist.get_rank() == 0
        self.jsonl = Path(out_dir) / "metrics.jsonl"
        self.writer = None
        self._start, self._first_step = time.perf_counter(), resume_step
        if not self.active:
            return
        self.jsonl.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(out_dir) / "tensorboard"), purge_step=resume_step + 1)

    def _truncate_after(self, step: int) -> None:
        if not self.jsonl.exists():
            return
        kept = []
        for line in self.jsonl.read_text().splitlines():
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                continue  # a line torn by a killed process
            # a line that is not a row (an object with an integer step) is damage: dropped too
            if isinstance(row, dict) and type(row.get("step")) is int and row["step"] <= step:
                kept.append(line)
        self.jsonl.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.active:
            return
        clean = {k: float(v) for k, v in metrics.items()}
        row = {"step": step, "time": time.time(), **clean}
        with self.jsonl.open("a") as f:
            f.write(json.dumps(nonfinite_to_null(row), allow_nan=False) + "\n")
        if self.writer is not None:
            for key, value in clean.items():
                self.writer.add_scalar(f"{self.stage}/{key}", value, step)
            self.writer.flush()
        self.trackers.log(step, clean)
        print(self.console_line(step, clean), flush=True)

    def console_line(self, step: int, metrics: dict[str, float]) -> str:
        """`[ppo] 12/40  reward 0.41  gold 0.35  kl 0.81  len 9.2  | 1.7 s/step  eta 48s`"""
        now = time.perf_counter()
        labels = {k: k for k in metrics} if self.verbose else CONSOLE[console_kind(self.stage)]
        shown = "  ".join(f"{label} {metrics[k]:.4g}" for k, label in labels.items()
                          if k in metrics and (k != "reward_hacking" or metrics[k] or self.verbose))
        pace = ""
        if step > self._last[1]:
            per_step = (now - self._last[0]) / (step - self._last[1])
            done = step - self._first_step
            eta = (now - self._start) / done * (self.total_steps - step)
            pace = f"  | {per_step:.2f} s/step  eta {eta:.0f}s"
        self._last = (now, step)
        return f"[{self.stage}] {step}/{self.total_steps}  {shown}{pace}"

    def info(self, message: str) -> None:
        if self.active:
            print(f"[{self.stage}] {message}", flush=True)

    def close(self, summary: dict | None = None) -> None:
        """`summary`: the stage's summary.json, for the trackers' run summary."""
        if self.writer is not None:
            self.writer.close()
        self.trackers.finish(summary or {})
