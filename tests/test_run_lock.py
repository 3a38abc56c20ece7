"""One writer per stage directory (resilience/run_lock.py) and workers that end with their
launcher: a second run on a live stage directory is refused (exit 2) naming the holder, at the
launcher's pre-flight and in the stage itself; a dead holder's lock is free at once; a launcher
killed with its process group takes its worker with it (before: the worker, in a session of
its own, trained on to the end)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from distributed import REPO, still_running
from megatron_rlhf.resilience.run_lock import LOCK_FILE, lock_stage_directory, stage_directory_holder

SFT = ["--config", "pipelines/tiny_cpu.yaml", "data.task_sizes.sft_train=256", "data.task_sizes.sft_eval=32",
       "sft.eval_interval=100000", "sft.optimizer.warmup_steps=1"]
HOLD = ("import sys, time; from megatron_rlhf.resilience.run_lock import lock_stage_directory; "
        "assert lock_stage_directory(sys.argv[1]) is None; print('held', flush=True); time.sleep(120)")


def env() -> dict:
    return {**{k: v for k, v in os.environ.items() if k != "MEGATRON_RLHF_FAULT"}, "PYTHONWARNINGS": "ignore"}


@pytest.fixture
def held(tmp_path):
    """<tmp>/run/sft locked by another live process, as by a run's rank 0."""
    directory = tmp_path / "run" / "sft"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    yield directory, holder
    holder.kill()
    holder.wait()


def test_a_live_holder_is_named_and_a_dead_ones_lock_is_free(held):
    directory, holder = held
    who = stage_directory_holder(directory)
    assert who is not None and f"pid {holder.pid}" in who and "host " in who
    assert f"pid {holder.pid}" in lock_stage_directory(directory)  # refused, not taken
    holder.kill()  # SIGKILL: no clean-up, the kernel releases the lock
    holder.wait()
    assert lock_stage_directory(directory) is None  # taken by this process now ...
    assert json.loads((directory / LOCK_FILE).read_text())["pid"] == os.getpid()  # ... which says so
    assert lock_stage_directory(directory) is None  # and taking it again in the same process is a no-op


@pytest.mark.parametrize("launch", [["-m", "megatron_rlhf.torchrun", "--nproc-per-node=1"], ["-m", "megatron_rlhf"]],
                         ids=["launcher_preflight", "stage"])
def test_a_second_writer_is_refused_with_exit_2_naming_the_holder(held, launch):
    directory, holder = held
    root = directory.parent.parent
    proc = subprocess.run([sys.executable, *launch, "sft", *SFT, f"checkpoint.root={root}", "checkpoint.run_name=run"],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("config error: checkpoint.run_name=run: ") and f"pid {holder.pid}" in last, proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in directory.iterdir()) == [LOCK_FILE]  # nothing written


def training(metrics) -> bool:
    """Whether the stage logged a training step (the step-0 eval row is written in start-up)."""
    rows = metrics.read_text().splitlines() if metrics.is_file() else []
    return any(json.loads(row)["step"] > 0 for row in rows if row.strip())


@pytest.mark.slow
def test_a_killed_launcher_leaves_no_worker(tmp_path):
    """SIGKILL to the launcher's whole process group: the worker (own session) gets SIGTERM from
    the kernel as its parent dies, finishes its step, saves and exits for requeue."""
    directory = tmp_path / "run" / "sft"
    cmd = [sys.executable, "-m", "megatron_rlhf.torchrun", "--nproc-per-node=1", "sft", *SFT, "sft.steps=5000",
           "sft.save_interval=0", f"checkpoint.root={tmp_path}", "checkpoint.run_name=run"]
    with (tmp_path / "launch.log").open("w") as log:
        launcher = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not training(directory / "metrics.jsonl"):  # past start-up, where SIGTERM abandons instead
            assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "launch.log").read_text()
            time.sleep(0.2)
        worker = json.loads((directory / LOCK_FILE).read_text())["pid"]
        assert worker != launcher.pid
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
    assert still_running([worker], within=60) == [], (tmp_path / "launch.log").read_text()[-3000:]
    assert "signalled: checkpoint at step" in (tmp_path / "launch.log").read_text()
    assert (directory / "latest").is_file()
