"""benchmarks/gpu_ppo.py: its --dry-run (CPU, tiny model) runs every PPO phase with the
offload on and off and writes finite numbers; --size 1b without CUDA stops with exit code 2;
on a GPU the tiny size runs in bf16 (skipped on CPU)."""

import json
import math
import subprocess
import sys

import pytest
import torch

from distributed import REPO

SCRIPT = REPO / "benchmarks" / "gpu_ppo.py"


def check_result(result: dict) -> None:
    assert set(result["offload"]) == {"on", "off"}
    assert result["offload"]["on"]["offload"] is True and result["offload"]["off"]["offload"] is False
    for setting, run in result["offload"].items():
        assert set(run["phases"]) == {"generate", "score", "train"}, setting
        for phase, numbers in run["phases"].items():
            assert numbers["seconds"] > 0 and numbers["tokens_per_s"] > 0, (setting, phase, numbers)
            assert numbers["peak_memory_mib"] > 0, (setting, phase, numbers)
        assert run["iteration_seconds"] > 0
        # every response runs to the full length (no EOS)
        assert run["response_tokens_per_iteration"] == result["batch"] * result["response_length"]
        mfu = result["mfu"][setting]
        assert math.isfinite(mfu) and mfu > 0, mfu
        assert mfu == run["mfu"]
        assert result["decode_tokens_per_s"][setting] == run["phases"]["generate"]["tokens_per_s"]
        assert result["score_tokens_per_s"][setting] == run["phases"]["score"]["tokens_per_s"]
    assert sorted(result["params"]) == ["actor", "critic", "reference", "reward"]
    assert "gb_per_s" in result["refit"] or result["refit"]["not_run"]


def test_dry_run(tmp_path):
    out = tmp_path / "gpu_ppo.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dry run" in proc.stdout
    for phase in ("generate", "score", "train", "iteration", "MFU"):
        assert phase in proc.stdout, proc.stdout
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and result["device"] == "cpu" and result["dtype"] == "float32"
    assert result["iterations"] == 2 and result["model"]["num_layers"] == 2 and result["model"]["hidden_size"] == 64
    check_result(result)
    assert "rollout.engine=megatron" in result["refit"]["not_run"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_1b_needs_cuda(tmp_path):
    out = tmp_path / "gpu_ppo.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--size", "1b", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "CUDA" in proc.stderr
    assert not out.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tiny_on_gpu(tmp_path):
    out = tmp_path / "gpu_ppo.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dtype"] == "bfloat16" and result["device"] != "cpu"
    check_result(result)
