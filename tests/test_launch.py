"""The nemo-run launcher runs the recipe's pipeline.stages as dependent jobs of our stage
command. The dry run needs the optional `nemo` extra (skipped without it; not installed in
CI); choosing the stages does not."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rlhf import launch

REPO = Path(__file__).resolve().parent.parent


def test_default_stages_are_the_recipes_pipeline_stages(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert launch.recipe_stages("pipelines/llama3_70b.yaml", []) == ["sft", "rm", "rl"]
    assert launch.recipe_stages("pipelines/llama3_70b.yaml", ["pipeline.stages=[sft,rm]"]) == ["sft", "rm"]
    recipe = tmp_path / "rl_only.yaml"
    recipe.write_text(f"base: {REPO}/pipelines/tiny_cpu_grpo.yaml\npipeline: {{stages: [rl]}}\n"
                      "rl: {sft_from: /ckpt/sft, rm_from: /ckpt/rm}\n")
    assert launch.recipe_stages(str(recipe), []) == ["rl"]
    # the stages are validated before anything is submitted (or nemo-run is needed)
    assert launch.main(["--config", "pipelines/tiny_cpu.yaml", "--dryrun", "pipeline.stages=[rl]"]) == 2
    assert "config error: pipeline.stages=['rl']: rl starts from a sft checkpoint" in capsys.readouterr().err


def test_slurm_dryrun_submits_the_recipes_stages_in_order(tmp_path):
    pytest.importorskip("nemo_run")
    env = {**os.environ, "NEMORUN_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}

    def dryrun(*overrides):
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_rlhf.launch", "--config", "pipelines/llama3_70b.yaml", "--executor",
             "slurm", "--nodes", "8", "--tasks-per-node", "8", "--gpus-per-node", "8", "--partition", "batch",
             "--account", "acct", "--job-dir", str(tmp_path / "jobs"), "--dryrun", *overrides],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    out = dryrun("rl.steps=7")
    positions = [out.index(f"-m megatron_rlhf {stage} --config") for stage in ("sft", "rm", "rl")]
    assert positions == sorted(positions)
    assert "#SBATCH --nodes=8" in out and "#SBATCH --ntasks-per-node=8" in out and "rl.steps=7" in out
    out = dryrun("pipeline.stages=[sft,rm]")
    assert "-m megatron_rlhf rm --config" in out and "-m megatron_rlhf rl --config" not in out
