"""SIGUSR1 / SIGTERM -> finish the current step, save, exit with REQUEUE_EXIT_CODE.

Slurm sends SIGUSR1 before the time limit (`--signal=B:USR1@T`, forwarded by
slurm/stage.sh) and SIGTERM on preemption. The handler only sets a flag; at each step
boundary every rank agrees (all-reduce MAX) whether any rank was signalled, so all ranks
save the same step together. slurm/stage.sh requeues the job on REQUEUE_EXIT_CODE.
"""

from __future__ import annotations

import signal

from megatron_rlhf.parallel import any_rank

REQUEUE_EXIT_CODE = 42


class PreemptionHandler:
    def __init__(self, signals=(signal.SIGUSR1, signal.SIGTERM)):
        self.signalled = False
        for sig in signals:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True

    def should_stop(self) -> bool:
        """Collective: True on every rank if any rank was signalled."""
        return any_rank(self.signalled)


class Preempted(SystemExit):
    """Raised after the checkpoint is written; exits the process with REQUEUE_EXIT_CODE."""

    def __init__(self, step: int):
        super().__init__(REQUEUE_EXIT_CODE)
        self.step = step


class StageInterrupted(BaseException):
    """Raised in the main thread by the signal handler when SIGTERM (or a second signal) arrives
    while the stage is blocked in interruptible work (an environment step, a tool call, a
    template render, an eval): the step is abandoned, the last complete checkpoint stands and the
    process exits REQUEUE_EXIT_CODE. A BaseException, like KeyboardInterrupt, so that code
    catching Exception (a template's errors, a failed episode) lets it through; code that turns
    user code's BaseExceptions into failures must re-raise it."""
