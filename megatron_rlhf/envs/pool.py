"""A turn's environment calls (resets, steps, closes: the user's code) run at the same time in a
bounded set of daemon threads, and are waited for in the calling (main) thread.

    outcomes = run_calls([lambda: env.step(text, ids), ...], workers=32, timeout_s=30.0)
    outcomes[i].value | .error | .timed_out      # in the calls' order, whatever order they finished in

Each call gets `timeout_s` from its own start (None: the call bounds itself, as the HTTP client
does); at most `workers` run at once, taken in order. A call past its time is abandoned: Python
cannot kill a thread, so it keeps its thread until it returns, but another thread takes its
place, so hung calls never shrink the pool (a turn of n calls that all hang ends after
ceil(n / workers) * timeout_s). Whatever a call raises, BaseExceptions included (SystemExit from an
argparse-based tool, KeyboardInterrupt), is its outcome: user code never ends the stage from here.

The caller waits on a condition with a timeout, so a signal handler that raises in the main thread
(resilience/preemption.py: StageInterrupted on SIGTERM) ends the wait at once; the calls not yet
started never start, and those running are abandoned (daemon threads: they do not hold the
process). `stop_on`: an exception type that ends the wait as soon as a call raises it (raised
again in the caller: a service that is down stops the stage without waiting for the others).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# The longest single wait of the caller on the condition: a backstop only (a signal ends a wait at
# once on POSIX); the caller wakes when a call finishes or a running call's time is up.
_POLL_S = 1.0


@dataclass
class Outcome:
    """What one call did: returned `value`, raised `error`, or gave no answer in time."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False


def run_calls(calls: Sequence[Callable[[], Any]], workers: int, timeout_s: float | None,
              stop_on: type[BaseException] | tuple = ()) -> list[Outcome]:
    """Every `calls[i]()`, at most `workers` at a time, each within `timeout_s` of its start;
    their outcomes in order (see the module docstring)."""
    if workers < 1:
        raise ValueError(f"workers={workers}: need >= 1")
    run = _Run(list(calls), stop_on)
    for _ in range(min(workers, len(run.calls))):
        run.spawn()
    try:
        run.wait(timeout_s)
    finally:
        run.stop()  # an interrupted wait: nothing more starts
    return run.outcomes


class _Run:
    def __init__(self, calls: list[Callable[[], Any]], stop_on):
        self.calls, self.stop_on = calls, stop_on
        self.outcomes: list[Outcome | None] = [None] * len(calls)
        self.started: list[float | None] = [None] * len(calls)
        self.next, self.resolved, self.stopped, self.failure = 0, 0, False, None
        self.changed = threading.Condition()

    def spawn(self) -> None:
        threading.Thread(target=self.work, name="environment-call", daemon=True).start()

    def take(self) -> int | None:
        with self.changed:
            if self.stopped or self.next >= len(self.calls):
                return None
            index, self.next = self.next, self.next + 1
            self.started[index] = time.monotonic()
            return index

    def work(self) -> None:
        while (index := self.take()) is not None:
            try:
                outcome = Outcome(value=self.calls[index]())
            except BaseException as err:  # noqa: BLE001  (the user's code: its outcome, read by the caller)
                outcome = Outcome(error=err)
            with self.changed:
                if self.outcomes[index] is not None:  # timed out meanwhile: this thread left the pool
                    return
                self.outcomes[index], self.resolved = outcome, self.resolved + 1
                if self.stop_on and isinstance(outcome.error, self.stop_on) and self.failure is None:
                    self.failure = outcome.error
                self.changed.notify_all()

    def wait(self, timeout_s: float | None) -> None:
        while True:
            with self.changed:
                if self.failure is not None:
                    raise self.failure
                if self.resolved == len(self.calls):
                    return
                self.changed.wait(self._until_next_deadline(timeout_s))
                replaced = min(self._time_out(timeout_s), len(self.calls) - self.next)
            for _ in range(replaced):  # a hung call's thread is lost to the pool: another takes its place
                self.spawn()

    def _until_next_deadline(self, timeout_s: float | None) -> float:
        if timeout_s is None:
            return _POLL_S
        now = time.monotonic()
        running = [start for start, outcome in zip(self.started, self.outcomes) if start is not None and outcome is None]
        return min([_POLL_S, *(max(start + timeout_s - now, 0.0) for start in running)])

    def _time_out(self, timeout_s: float | None) -> int:
        """Mark the running calls past their time (holding the lock); how many there were."""
        if timeout_s is None:
            return 0
        now, count = time.monotonic(), 0
        for index, (start, outcome) in enumerate(zip(self.started, self.outcomes)):
            if start is not None and outcome is None and now - start >= timeout_s:
                self.outcomes[index], self.resolved, count = Outcome(timed_out=True), self.resolved + 1, count + 1
        return count

    def stop(self) -> None:
        with self.changed:
            self.stopped = True
