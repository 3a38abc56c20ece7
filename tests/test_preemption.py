"""Signals against blocking work (resilience/preemption.py), in this process with real signals:
SIGTERM ends interruptible work (a wait on a hung thread) at once; outside it only sets the
flag the step boundary reads, and interruptible work entered afterwards does not start; SIGUSR1
only sets the flag; a second signal interrupts anything but a checkpoint write."""

import os
import signal
import threading
import time

import pytest

from megatron_rlhf.resilience.preemption import SIGNALS, PreemptionHandler, StageInterrupted


@pytest.fixture
def handler():
    saved = {sig: signal.getsignal(sig) for sig in SIGNALS}
    yield PreemptionHandler()
    for sig, previous in saved.items():
        signal.signal(sig, previous)


def signal_soon(sig: int, after_s: float = 0.2) -> None:
    threading.Timer(after_s, os.kill, (os.getpid(), sig)).start()


def hung_thread() -> threading.Thread:
    thread = threading.Thread(target=time.sleep, args=(30,), daemon=True)
    thread.start()
    return thread


def test_sigterm_ends_a_wait_on_a_hung_environment_step_at_once(handler):
    hung = hung_thread()
    signal_soon(signal.SIGTERM)
    start = time.monotonic()
    with pytest.raises(StageInterrupted, match="SIGTERM during an environment step") as raised:
        with handler.interruptible("an environment step"):
            hung.join(30)
    assert time.monotonic() - start < 5 and raised.value.code == 42


def test_sigterm_in_a_training_step_lets_it_finish_and_stops_the_next_wait(handler):
    handler.step = 7
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # the handler has run: no exception outside interruptible work
    assert handler.signalled and handler.interrupt
    with pytest.raises(StageInterrupted, match="SIGTERM during the eval"):
        with handler.interruptible("the eval"):
            pytest.fail("interruptible work entered after SIGTERM must not start")


def test_sigusr1_only_sets_the_flag_and_a_second_signal_interrupts_anything(handler):
    with handler.interruptible("an environment step"):  # minutes of lead time: the step may finish
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
    assert handler.signalled and not handler.interrupt
    with pytest.raises(StageInterrupted, match="SIGUSR1 during step 3"):
        handler.step = 3
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(1)


def test_a_checkpoint_write_is_never_cut_short(handler):
    with handler.interruptible("the generate phase"):
        with handler.protected():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            written = True
    assert written and handler.signalled and handler.interrupt
