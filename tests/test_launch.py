"""The nemo-run launcher builds the three stages as dependent jobs running our stage command.
Needs the optional `nemo` extra (skipped without it; not installed in CI)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

nemo_run = pytest.importorskip("nemo_run")


def test_slurm_dryrun_submits_the_three_stages_in_order(tmp_path):
    env = {**os.environ, "NEMORUN_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rlhf.launch", "--config", "pipelines/llama3_70b.yaml", "--executor",
         "slurm", "--nodes", "8", "--tasks-per-node", "8", "--gpus-per-node", "8", "--partition", "batch",
         "--account", "acct", "--job-dir", str(tmp_path / "jobs"), "--dryrun", "ppo.steps=7"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    positions = [out.index(f"-m megatron_rlhf {stage} --config") for stage in ("sft", "rm", "ppo")]
    assert positions == sorted(positions)
    assert "#SBATCH --nodes=8" in out and "#SBATCH --ntasks-per-node=8" in out and "ppo.steps=7" in out
