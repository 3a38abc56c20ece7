"""One writer per run (global rank 0; every logged value is already identical on all ranks):
TensorBoard scalars `<stage>/<name>`, one JSON line per logged step, a console progress line.

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


class MetricsLogger:
    def __init__(self, out_dir: str | Path, stage: str, total_steps: int, resume_step: int = 0,
                 tensorboard: bool = True):
        self.stage, self.total_steps = stage, total_steps
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
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError):
                pass  # a line torn by a killed process
        self.jsonl.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.active:
            return
        clean = {k: float(v) for k, v in metrics.items()}
        with self.jsonl.open("a") as f:
            f.write(json.dumps(nonfinite_to_null({"step": step, **clean}), allow_nan=False) + "\n")
        if self.writer is not None:
            for key, value in clean.items():
                self.writer.add_scalar(f"{self.stage}/{key}", value, step)
            self.writer.flush()
        done = step - self._first_step
        elapsed = time.perf_counter() - self._start
        eta = f"  eta {elapsed / done * (self.total_steps - step):.0f}s" if done > 0 else ""
        shown = "  ".join(f"{k} {v:.4g}" for k, v in clean.items())
        print(f"[{self.stage}] step {step}/{self.total_steps}  {shown}{eta}", flush=True)

    def info(self, message: str) -> None:
        if self.active:
            print(f"[{self.stage}] {message}", flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
