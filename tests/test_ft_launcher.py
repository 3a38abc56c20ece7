"""In-job restart under nvidia-resiliency-ext's ft_launcher, run as users run it:
`ft_launcher ... -m megatron_rlhf sft`. A rank SIGKILLed mid-step, and a rank that hangs
mid-step (found by the rank heartbeat timeout), make ft_launcher restart the workers in the
same job; they resume from the latest checkpoint and end bit-identical to a run that was
never interrupted."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import REPO
from megatron_rlhf.resilience.heartbeat import Heartbeat
from stages import FAULT_SFT as TINY
from stages import FAULT_SFT_STEPS as STEPS  # checkpoints at 2, 4, 6, 8; faults hit 5: resume at 4
from stages import RECIPE, assert_same_tensors, deterministic_metrics, metrics

FT_LAUNCHER = Path(sys.executable).with_name("ft_launcher")
# Start-up (imports, data, model, checkpoint load, first step) takes ~10 s on a loaded 2-core
# machine, a step ~0.2 s, a save ~1-2 s. Hang detection needs a short timeout between beats;
# the other runs get a generous one so that a slow moment never counts as a hang.
INITIAL_TIMEOUT, TIMEOUT, HANG_TIMEOUT = 120, 60, 15
RESTARTED = "will restart worker group"


def ft_launcher(root: Path, run: str, fault: str | None = None, hb_timeout: float = TIMEOUT) -> str:
    """The SFT stage on 2 ranks under ft_launcher (2 in-job restarts allowed); its output."""
    cmd = [str(FT_LAUNCHER), "--standalone", "--nproc-per-node=2", "--max-restarts=2",
           f"--ft-initial-rank-heartbeat-timeout={INITIAL_TIMEOUT}", f"--ft-rank-heartbeat-timeout={hb_timeout}",
           "--ft-workload-check-interval=1",  # how often rank monitors check the timeouts
           "--ft-enable-nic-monitor=false",  # no NICs/NVML here: avoids a traceback in the log
           # Healthy ranks stopped for a restart are blocked in a collective with the dead one
           # (SIGTERM only sets their preemption flag): SIGKILL them after 5 s, not 30.
           "--workers-stop-timeout=5", "--term-timeout=5",
           "-m", "megatron_rlhf", "sft", *RECIPE, *TINY, f"checkpoint.root={root}", f"checkpoint.run_name={run}"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("MEGATRON_RLHF_FAULT", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")}
    env.update(PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", **({"MEGATRON_RLHF_FAULT": fault} if fault else {}))
    # Output to a file, not a pipe: a process that outlives the job cannot block the test.
    log = root / f"{run}.log"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the launcher passes SIGTERM on to its workers, SIGKILL after --term-timeout
            rc = proc.wait(timeout=60)
    out = log.read_text()
    assert rc == 0, f"{' '.join(cmd)} exited {rc}\n{out[-15000:]}"
    return out


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft")
    out = ft_launcher(root, "clean")
    assert RESTARTED not in out, out[-5000:]
    return root


def test_heartbeat_is_inactive_outside_ft_launcher(monkeypatch):
    monkeypatch.delenv("FT_RANK_MONITOR_IPC_SOCKET", raising=False)
    heartbeat = Heartbeat.from_env()
    assert not heartbeat.active
    heartbeat.beat()
    heartbeat.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["kill", "hang"])
def test_failed_rank_is_restarted_in_job_and_resumes_bitwise(clean, kind):
    root = clean
    out = ft_launcher(root, kind, fault=f"{kind}@train:5:1", hb_timeout=HANG_TIMEOUT if kind == "hang" else TIMEOUT)
    tail = out[-8000:]
    assert f"[fault injection] rank 1: {kind} at train of step 5" in out, tail
    if kind == "kill":
        assert "failed (exitcode: -9) local_rank: 1" in out, tail
    else:  # the rank monitors found the silence, not the launcher's process watch
        assert "Did not get subsequent heartbeat" in out, tail
    assert RESTARTED in out, tail
    assert "resumed from" in out and "iter_0000004 at step 4" in out, tail

    last = f"iter_{STEPS:07d}"
    assert (root / kind / "sft" / "latest").read_text().strip() == last
    assert_same_tensors(root / "clean" / "sft" / last / "actor", root / kind / "sft" / last / "actor")
    # every step logged once (the restart dropped what it redid), with identical values; step 0: the eval before training
    assert [x["step"] for x in metrics(root, kind, "sft")] == list(range(0, STEPS + 1))
    assert deterministic_metrics(root, kind, "sft") == deterministic_metrics(root, "clean", "sft")
