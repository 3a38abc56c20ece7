"""Failure injection for tests and fire drills: a chosen rank dies, hangs, is signalled or
sees a NaN loss at a chosen step and point, as a real failure would (no mocks: SIGKILL is
SIGKILL). Configured by one environment variable so that launchers pass it through:

    MEGATRON_RLHF_FAULT="kill@train:5:1"     rank 1 SIGKILLs itself in step 5, between
                                             backward and the optimizer step
    MEGATRON_RLHF_FAULT="kill@save:4:1"      rank 1 dies while checkpoint 4 is being written
    MEGATRON_RLHF_FAULT="hang@train:5:1"     rank 1 stops responding in step 5
    MEGATRON_RLHF_FAULT="sigusr1@train:5:0"  rank 0 gets SIGUSR1 in step 5 (as from Slurm)
    MEGATRON_RLHF_FAULT="sigterm@eval:4"     every rank gets SIGTERM as step 4's eval starts (a
                                             preemption in interruptible work: resilience/preemption.py)
    MEGATRON_RLHF_FAULT="nan@train:5"        the loss of step 5 is NaN on every rank
    MEGATRON_RLHF_FAULT="nan@train:5+"       ... and of every later step
    MEGATRON_RLHF_FAULT="kill_engine@generate:3"  the rollout engine's processes (vLLM) are
                                             SIGKILLed as step 3 starts generating
    MEGATRON_RLHF_FAULT="kill_engine@refit:4"   ... as step 4 refits the engine's weights
    MEGATRON_RLHF_FAULT="hang_engine@refit:2"   the engine's processes stop (SIGSTOP) as step 2
                                             refits: a hung engine (rollout.engine_timeout_seconds)
    MEGATRON_RLHF_FAULT="kill@serve:4"       a serve-reward process dies as it starts scoring
                                             its 4th batch (a reward service lost mid-run)

Several faults are comma-separated; without a rank every rank is hit. Faults fire only in a
job's first attempt (TORCHELASTIC_RESTART_COUNT and SLURM_RESTART_COUNT unset or 0), so the
in-job restart or requeue that follows runs clean. Steps are the trainer's 1-based steps.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

ENV = "MEGATRON_RLHF_FAULT"
KINDS = ("kill", "hang", "sigusr1", "sigterm", "nan", "kill_engine", "hang_engine")
ENGINE_KINDS = ("kill_engine", "hang_engine")  # fired by the rollout engine on its own processes
POINTS = ("train", "save", "generate", "refit", "serve", "eval")


@dataclass
class Fault:
    kind: str
    point: str
    step: int
    onwards: bool = False  # "5+": this step and every later one
    rank: int | None = None

    def due(self, point: str, step: int, rank: int) -> bool:
        hit = step >= self.step if self.onwards else step == self.step
        return point == self.point and hit and self.rank in (None, rank)


def parse(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            kind, where = item.split("@")
            point, step, *rank = where.split(":")
            onwards = step.endswith("+")
            fault = Fault(kind, point, int(step.rstrip("+")), onwards, int(rank[0]) if rank else None)
        except ValueError:
            raise ValueError(f"{ENV}={spec!r}: cannot parse {item!r}; expected kind@point:step[+][:rank], "
                             f"e.g. kill@train:5:1") from None
        if kind not in KINDS or point not in POINTS:
            raise ValueError(f"{ENV}={spec!r}: {item!r}: kind must be one of {KINDS}, point one of {POINTS}")
        faults.append(fault)
    return faults


def _first_attempt() -> bool:
    return all(os.environ.get(v, "0") in ("", "0") for v in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


class FaultInjector:
    def __init__(self, faults: list[Fault]):
        self.faults = faults
        self.step = 0

    @classmethod
    def from_env(cls) -> "FaultInjector":
        return cls(parse(os.environ.get(ENV, "")) if _first_attempt() else [])

    def _rank(self) -> int:
        return int(os.environ.get("RANK", "0"))

    def begin_step(self, step: int) -> None:
        """The trainer is now executing `step` (1-based)."""
        self.step = step

    def at(self, point: str, step: int | None = None) -> None:
        """Fire the process-level faults (kill, hang, signal) due here."""
        step = self.step if step is None else step
        for fault in self.faults:
            if fault.kind == "nan" or fault.kind in ENGINE_KINDS or not fault.due(point, step, self._rank()):
                continue
            print(f"[fault injection] rank {self._rank()}: {fault.kind} at {point} of step {step}", flush=True)
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "hang":
                while True:
                    time.sleep(3600)
            elif fault.kind in ("sigusr1", "sigterm"):
                self.faults.remove(fault)  # once
                os.kill(os.getpid(), signal.SIGUSR1 if fault.kind == "sigusr1" else signal.SIGTERM)
                return

    def engine_fault_due(self, point: str) -> str | None:
        """The engine fault (kill_engine, hang_engine) due at `point` (generate, refit) of the
        current step on this rank, fired once; None if none."""
        for fault in self.faults:
            if fault.kind in ENGINE_KINDS and fault.due(point, self.step, self._rank()):
                if not fault.onwards:
                    self.faults.remove(fault)
                return fault.kind
        return None

    def corrupt_loss(self, loss):
        """`loss` made NaN where a nan fault is due at the train point of the current step."""
        if any(f.kind == "nan" and f.due("train", self.step, self._rank()) for f in self.faults):
            return loss * float("nan")
        return loss


# One per process: trainers set the step, roles and the checkpoint manager call the hooks.
FAULTS = FaultInjector.from_env()
