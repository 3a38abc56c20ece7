"""SIGUSR1 / SIGTERM -> stop for requeue (exit REQUEUE_EXIT_CODE) with the last complete checkpoint.

Slurm sends SIGUSR1 before the time limit (`--signal=B:USR1@T`, forwarded by slurm/stage.sh)
and SIGTERM on preemption, `scancel` and node shutdown, with a grace period (KillWait, often
30 s) before SIGKILL. What a signal does depends on where the stage is:

- In computation (a training step, a checkpoint write): the handler sets a flag. At the step
  boundary every rank agrees (all-reduce MAX) whether any rank was signalled, all ranks save
  that step together and exit 42 (Preempted). A step is seconds to minutes: it is finished.
- In interruptible work (`interruptible(...)`: start-up, generating and scoring episodes, which
  wait on environments, tools and reward services, and eval): SIGTERM ends it at once. The
  handler raises StageInterrupted in the main thread (a wait on a thread, a socket read and
  Python code all let it run within milliseconds); the step is abandoned, nothing is saved and
  the process exits 42: the last complete checkpoint stands and a rerun resumes from it
  exactly (a step is a pure function of that checkpoint). Such work can block for as long as
  an environment takes, so it must not outlast the grace period. SIGUSR1 (minutes of lead
  time) only sets the flag there too.
- A second signal, of either kind, interrupts whatever runs, except a checkpoint being
  written (`protected()`): the way to stop a stage that is stuck, without a half-written save.

A rank that was signalled and then fails in any other way (a peer that stopped mid-collective
closes its connections) also exits 42: the job is being stopped anyway, and the checkpoints
on disk are complete.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager, nullcontext

from megatron_rlhf.parallel import any_rank

REQUEUE_EXIT_CODE = 42
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StageInterrupted(BaseException):
    """Raised in the main thread by the signal handler when SIGTERM (or a second signal) arrives
    while the stage is blocked in interruptible work (an environment step, a tool call, a
    template render, an eval): the step is abandoned, the last complete checkpoint stands and the
    process exits REQUEUE_EXIT_CODE. A BaseException, like KeyboardInterrupt, so that code
    catching Exception (a template's errors, a failed episode) lets it through; code that turns
    user code's BaseExceptions into failures must re-raise it."""

    def __init__(self, signal_name: str, during: str):
        super().__init__(f"{signal_name} during {during}")
        self.signal_name, self.during = signal_name, during
        self.code = REQUEUE_EXIT_CODE


class PreemptionHandler:
    """The process's signal handler (one per process: `install()`); a pipeline's stages share it."""

    def __init__(self, signals=SIGNALS):
        self.signalled = False  # some signal came: checkpoint at the step's end, exit 42
        self.interrupt = False  # SIGTERM or a second signal came: interruptible work ends now
        self.last_signal = ""
        self.step = 0  # the trainer's step, for the message
        self._work: list[str] = []  # the interruptible work the main thread is in, innermost last
        self._protected = 0  # checkpoint writes in progress: never cut short
        for sig in signals:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        repeated = self.signalled
        self.signalled, self.last_signal = True, signal.Signals(signum).name
        self.interrupt = self.interrupt or repeated or signum == signal.SIGTERM
        if self.interrupt and not self._protected and (self._work or repeated):
            raise StageInterrupted(self.last_signal, self._work[-1] if self._work else self.where())

    def where(self) -> str:
        return f"step {self.step}" if self.step else "start-up"

    def should_stop(self) -> bool:
        """Collective: True on every rank if any rank was signalled."""
        return any_rank(self.signalled)

    @contextmanager
    def interruptible(self, what: str):
        """Work that SIGTERM ends at once (StageInterrupted); entered after a SIGTERM, it does not start."""
        if self.interrupt and not self._protected:
            raise StageInterrupted(self.last_signal, what)
        self._work.append(what)
        try:
            yield
        finally:
            self._work.pop()

    @contextmanager
    def protected(self):
        """A checkpoint write: a signal meanwhile only sets the flag."""
        self._protected += 1
        try:
            yield
        finally:
            self._protected -= 1


_HANDLER: PreemptionHandler | None = None


def install() -> PreemptionHandler:
    """The process's handler, installed on first use (first thing in a stage: a signal during
    start-up is not lost)."""
    global _HANDLER
    if _HANDLER is None:
        _HANDLER = PreemptionHandler()
    return _HANDLER


def interruptible(what: str):
    """`with interruptible("eval"):` work that SIGTERM ends at once, when a handler is installed."""
    return _HANDLER.interruptible(what) if _HANDLER is not None else nullcontext()


def protected():
    return _HANDLER.protected() if _HANDLER is not None else nullcontext()


def signalled() -> bool:
    """Whether this process received SIGUSR1/SIGTERM since its handler was installed."""
    return _HANDLER is not None and _HANDLER.signalled


class Preempted(SystemExit):
    """Raised after the checkpoint is written; exits the process with REQUEUE_EXIT_CODE."""

    def __init__(self, step: int):
        super().__init__(REQUEUE_EXIT_CODE)
        self.step = step
