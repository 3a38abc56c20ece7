"""Asynchronous RL (rl.max_staleness = N >= 1): the vLLM engine generates ahead of the trainer
on a fixed schedule (docs/async_rl.md).

Versions: version v is the actor after v optimizer updates' iterations (step s trains with the
actor at version s - 1 and makes version s). Batch k, the one step k trains, is generated
entirely by version max(0, k - 1 - N). Step s therefore:
  wait     for the batch in flight (k = s - 1 + N, submitted at step s - 1), so the engine is idle;
  sync     refit the engine with version s - 1 (only between batches: nothing is running in it);
  advance  generate in the foreground the batches up to s + N - 1 that do not exist yet (the
           first step; all of them at version 0), submit batch s + N (version s - 1) to run while
           this step scores and trains, and take batch s from the buffer;
  score, train as ever.
The schedule depends on the step only, never on timing, so two runs, or a resumed one, see the
same samples: each batch's prompts (the sampler's next rl.rollout_batch_size), per-row seeds
(seed_of(k)) and weights (version) are fixed by k. With one engine, generation overlaps the
trainer's score + train of one batch; N = 2 buffers more (more stale) without more overlap.

Resume: a checkpoint (end of step s) holds the buffer, batches s + 1 .. s + N, completed (the one
in flight is waited for first) with their versions, prompts, log-probs and tokens, and the
sampler's position after drawing them. The resumed run takes them as the uninterrupted run
would have. A batch lost in flight (a crash between checkpoints) is regenerated whole by the
resumed run, from the checkpoint's weights, seeds and prompts: vLLM is not batch-invariant, so
never request by request.

The audit (<stage>/rollout_audit.jsonl, rank 0): a `drawn` line per batch (its version and global
prompt indices) and a `trained` line per step; lines after the checkpoint a run resumes from are
dropped at resume, so over a run with any number of restarts every batch is drawn once and
trained once.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from megatron_rlhf.config import ConfigError, RLConfig
from megatron_rlhf.parallel import device
from megatron_rlhf.rollout import Rollout, SamplingParams
from megatron_rlhf.trainers.rl_records import Generation


@dataclass
class BufferedBatch:
    """One batch of the schedule on this rank: `index` (the step that trains it), the policy
    `version` that generated it, the prompts (global sampler indices; this rank's share), and the
    rollout once generated (`submitted`: the engine's handle while in flight)."""
    index: int
    version: int
    drawn: list[int]
    mine: list[int]
    rollout: Rollout | None = None
    submitted: Any = None
    engine_seconds: float = 0.0

    def state(self) -> dict:
        return {"index": self.index, "version": self.version, "drawn": self.drawn, "mine": self.mine,
                "engine_seconds": self.engine_seconds,
                "rollout": {k: t.to("cpu") if t is not None else None for k, t in vars(self.rollout).items()}}

    @classmethod
    def of(cls, state: dict) -> BufferedBatch:
        rollout = Rollout(**{k: t.to(device()) if t is not None else None for k, t in state["rollout"].items()})
        return cls(state["index"], state["version"], state["drawn"], state["mine"], rollout,
                   engine_seconds=state["engine_seconds"])


class RolloutAudit:
    """<stage>/rollout_audit.jsonl (rank 0): which prompts each batch drew and when it was trained."""

    def __init__(self, path: Path, resumed_step: int, max_staleness: int):
        self.path = path
        self.writes = dist.get_rank() == 0
        if self.writes and path.exists():  # what a lost run did after its checkpoint happens again
            keep = [line for line in path.read_text().splitlines()
                    if line.strip() and self._kept(json.loads(line), resumed_step, max_staleness)]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(f"{line}\n" for line in keep))
            tmp.replace(path)

    @staticmethod
    def _kept(record: dict, step: int, n: int) -> bool:
        return record["batch"] <= step + n if record["event"] == "drawn" else record["step"] <= step

    def record(self, **fields) -> None:
        if self.writes:
            with self.path.open("a") as f:
                f.write(json.dumps(fields) + "\n")
                f.flush()
                os.fsync(f.fileno())


@dataclass
class AsyncRollouts:
    """The engine's look-ahead (module docstring). `draw()`: (the sampler's next batch of global
    prompt indices, this rank's share); `seed_of(k)`: batch k's sampling seed."""
    engine: Any
    prompts: list
    draw: Callable[[], tuple[list[int], list[int]]]
    rl: RLConfig
    sampling: SamplingParams
    seed_of: Callable[[int], int]
    audit: RolloutAudit
    buffer: deque = field(default_factory=deque)
    in_flight: BufferedBatch | None = None
    engine_seconds_total: float = 0.0
    _step: dict = field(default_factory=dict)  # this step's waits and engine seconds
    _step_start: float = field(default_factory=time.perf_counter)

    # ------------------------------------------------------------------ the schedule
    def wait_in_flight(self) -> None:
        """Collect the batch in flight, if any, into the buffer (the engine is idle after)."""
        if self.in_flight is None:
            return
        batch, start = self.in_flight, time.perf_counter()
        self.in_flight = None
        batch.rollout = self.engine.collect(batch.submitted)
        batch.engine_seconds, batch.submitted = batch.submitted.seconds, None
        self._add("trainer_wait_seconds", time.perf_counter() - start)
        self._add("engine_generate_seconds", batch.engine_seconds)
        self.engine_seconds_total += batch.engine_seconds
        self.buffer.append(batch)

    def advance(self, step: int, version: int) -> tuple[Generation, BufferedBatch]:
        """Step `step`'s batch; the engine holds `version` (= step - 1) and nothing is in flight."""
        n = self.rl.max_staleness
        next_index = self.buffer[-1].index + 1 if self.buffer else step
        while next_index < min(step + n, self.rl.steps + 1):  # the first step: generate what is missing now
            self.in_flight = self._submit(next_index, version)
            self.wait_in_flight()
            next_index += 1
        if next_index <= self.rl.steps:
            self.in_flight = self._submit(next_index, version)
        batch = self.buffer.popleft()
        if batch.index != step:
            raise RuntimeError(f"the rollout buffer holds batch {batch.index} where step {step} expected its own")
        self.audit.record(event="trained", step=step, batch=batch.index, version=batch.version, prompts=batch.drawn)
        rows = [self.prompts[i] for i in batch.mine for _ in range(self.rl.n_samples_per_prompt)]
        return Generation(batch.rollout, rows), batch

    def _submit(self, index: int, version: int) -> BufferedBatch:
        drawn, mine = self.draw()
        self.audit.record(event="drawn", batch=index, version=version, prompts=drawn)
        prompts = [self.prompts[i].ids for i in mine for _ in range(self.rl.n_samples_per_prompt)]
        return BufferedBatch(index, version, drawn, mine,
                             submitted=self.engine.submit(prompts, self.sampling, self.seed_of(index)))

    # ------------------------------------------------------------------ metrics
    def _add(self, key: str, seconds: float) -> None:
        self._step[key] = self._step.get(key, 0.0) + seconds

    def metrics(self, step: int, batch: BufferedBatch) -> dict[str, float]:
        """This step's: the batch's version and lag (a histogram of one bin: a batch has one
        version), the buffer's depth, the trainer's wait and the engine's generation time and
        their fractions of the step's wall time (since the last call)."""
        now = time.perf_counter()
        wall = max(now - self._step_start, 1e-9)
        wait, busy = self._step.get("trainer_wait_seconds", 0.0), self._step.get("engine_generate_seconds", 0.0)
        lag = step - 1 - batch.version
        out = {"policy_version": float(batch.version), "staleness": float(lag),
               f"staleness_lag_{lag}_samples": float(len(batch.mine) * self.rl.n_samples_per_prompt),
               "rollout_buffer_depth": float(len(self.buffer) + (self.in_flight is not None)),
               "trainer_wait_seconds": wait, "engine_generate_seconds": busy,
               "trainer_idle_fraction": min(wait / wall, 1.0), "engine_busy_fraction": min(busy / wall, 1.0)}
        self._step, self._step_start = {}, now
        return out

    # ------------------------------------------------------------------ checkpoints
    def saved_state(self) -> dict:
        """The buffer for a checkpoint: the batch in flight is drained first (its generation is
        completed, so nothing is lost or regenerated differently on resume)."""
        self.wait_in_flight()
        return self.snapshot()()

    def snapshot(self) -> Callable[[], dict]:
        """The buffer as it is now (nothing in flight), as a function that makes its checkpoint
        state only when called: a step's rewind (StageRunner.rewind_on) needs it only on an error,
        and making it copies every buffered rollout to the host."""
        batches, engine_seconds = list(self.buffer), self.engine_seconds_total  # completed batches do not change
        rank, size = dist.get_rank(), dist.get_world_size()
        return lambda: {"rollout_buffer": {"max_staleness": self.rl.max_staleness, "world_size": size, "rank": rank,
                                           "engine_seconds_total": engine_seconds,
                                           "batches": [b.state() for b in batches]}}

    def restore(self, state: dict) -> None:
        """From a resumed checkpoint's trainer state; refuses one written with another
        rl.max_staleness or world size (the buffered batches are per rank and per schedule)."""
        saved = state.get("rollout_buffer")
        if saved is None:
            raise ConfigError(f"rl.max_staleness={self.rl.max_staleness}: the checkpoint to resume was written with "
                              "rl.max_staleness=0 (no rollout buffer); resume it with rl.max_staleness=0")
        if saved["max_staleness"] != self.rl.max_staleness:
            raise ConfigError(f"rl.max_staleness={self.rl.max_staleness}: the checkpoint to resume holds the buffer "
                              f"of rl.max_staleness={saved['max_staleness']}; resume with that value")
        if saved["world_size"] != dist.get_world_size() or saved["rank"] != dist.get_rank():
            raise ConfigError(f"the checkpoint's rollout buffer was written by rank {saved['rank']} of "
                              f"{saved['world_size']} processes; resume an async run (rl.max_staleness="
                              f"{self.rl.max_staleness}) on the same number of processes")
        self.engine_seconds_total = saved["engine_seconds_total"]
        self.buffer = deque(BufferedBatch.of(b) for b in saved["batches"])

    def summary(self) -> dict[str, float]:
        return {"max_staleness": self.rl.max_staleness, "engine_generate_seconds": self.engine_seconds_total}
