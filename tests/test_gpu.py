"""GPU path (NCCL, TE spec when installed, bf16): the GPU tests run on a machine with CUDA and
are skipped on CPU. The `test_gpu_check_*_cpu` tests are not: they exercise the report and
pre-flight code of benchmarks/gpu_check.py (make gpu-check) on synthetic inputs, in CI."""

import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch

from distributed import REPO, torchrun

needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def gpu_test(fn):
    for mark in reversed(needs_gpu):
        fn = mark(fn)
    return fn


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@gpu_test
def test_smoke_roles_bf16_on_one_gpu():
    proc = torchrun(1, "-m", "megatron_rlhf", "smoke", "--config", "pipelines/tiny_cpu.yaml",
                    "model.params_dtype=bfloat16")
    for role in ("Actor", "Reference", "Critic", "RewardModel"):
        assert role in proc.stdout
    assert "nan" not in proc.stdout.lower()


@gpu_test
@pytest.mark.slow
def test_gpu_check_pipeline_bf16_on_one_gpu(tmp_path):
    """make gpu-check's run (this interpreter as it is, no venv): SFT -> RM -> PPO in bf16 with
    offload, then sane numbers in the table's JSON."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--no-install",
                           "--python", sys.executable, "--out", str(tmp_path), "--timeout", "600"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "peak GPU memory" in (tmp_path / "gpu_check.txt").read_text()
    assert res["complete"] and res["environment"]["params_dtype"] == "bfloat16"
    for name, phase in res["ppo_phases"].items():
        assert phase["seconds"] is not None and phase["seconds"] > 0, name
        assert phase["peak_memory_bytes"] is not None and phase["peak_memory_bytes"] > 0, name
    for stage in ("sft", "rm", "ppo"):
        assert res["stages"][stage]["seconds"] > 0
    gold = res["gold_score"]
    assert all(math.isfinite(gold[k]) for k in ("before", "after")), gold
    assert gold["after"] > gold["before"] - 0.1, gold
    mismatch = res["logprob_mismatch"]
    assert mismatch["first"]["value"] is not None and mismatch["last"]["value"] is not None, mismatch
    assert 0 <= mismatch["first"]["value"] < 1 and 0 <= mismatch["last"]["value"] < 1, mismatch


# --- on every machine (CPU included): the report and pre-flight code of make gpu-check ---

def write_run(run, with_stage_memory=True):
    """A run directory in the format the stages write (summary.json, ppo/metrics.jsonl)."""
    for stage, wall, mem in (("sft", 11.5, 3 * 2**20), ("rm", 9.25, 5 * 2**20)):
        (run / stage).mkdir(parents=True)
        summary = {"stage": stage, "steps": 120, "wall_seconds": wall}
        if with_stage_memory:
            summary["peak_memory_bytes"] = mem
        (run / stage / "summary.json").write_text(json.dumps(summary))
    (run / "ppo").mkdir()
    phases = ("eval", "generate", "score", "train")
    (run / "ppo" / "summary.json").write_text(json.dumps({
        "stage": "ppo", "steps": 40, "gold_score_eval_before": 0.01, "gold_score_eval_after": 0.655,
        "rm_score_eval_before": 0.08, "rm_score_eval_after": 1.5, "kl_mean_final": 3.25,
        "phase_seconds": dict(zip(phases, (2.0, 10.0, 4.0, 20.0))),
        "phase_peak_memory_bytes": dict(zip(phases, (100 * 2**20, 200 * 2**20, 300 * 2**20, 400 * 2**20))),
        "wall_seconds": 40.5,
    }))
    rows = [{"step": 0, "eval_gold_score": 0.01}]
    rows += [{"step": s, "gold_score": 0.1 * s, "logprob_mismatch": 1e-3 * s} for s in range(1, 41)]
    rows.append({"step": 40, "logprob_mismatch": 0.0625, "eval_gold_score": 0.655})  # a resumed run re-logs
    (run / "ppo" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_gpu_check_report_table_and_json_cpu(tmp_path):
    gc = load_gpu_check()
    run = tmp_path / "runs" / "gpu_check"
    write_run(run)
    out = tmp_path / "out"
    assert gc.main(["--report-only", str(run), "--out", str(out)]) == 0
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["complete"] and res["missing"] == []
    assert res["stages"]["sft"] == {"seconds": 11.5, "peak_memory_bytes": 3 * 2**20}
    assert res["stages"]["rm"] == {"seconds": 9.25, "peak_memory_bytes": 5 * 2**20}
    assert res["stages"]["ppo"] == {"seconds": 40.5, "peak_memory_bytes": 400 * 2**20}
    assert list(res["ppo_phases"]) == ["generate", "score", "train", "eval"]
    assert res["ppo_phases"]["train"] == {"seconds": 20.0, "peak_memory_bytes": 400 * 2**20}
    assert res["gold_score"] == {"before": 0.01, "after": 0.655}
    assert res["logprob_mismatch"] == {"first": {"step": 1, "value": 1e-3}, "last": {"step": 40, "value": 0.0625}}
    table = (out / "gpu_check.txt").read_text()
    lines = {line.split("  ")[0].strip(): line for line in table.splitlines()}
    assert lines["SFT stage"].split()[-3:] == ["11.5", "3.0", "MiB"]
    assert lines["PPO generate"].split()[-3:] == ["10.0", "200.0", "MiB"]
    assert lines["PPO eval"].split()[-3:] == ["2.0", "100.0", "MiB"]
    assert "before 0.010   after 0.655   change +0.645" in table
    assert "first 1.000e-03 (step 1)   last 6.250e-02 (step 40)" in table


def test_gpu_check_report_missing_numbers_cpu(tmp_path):
    """No peak_memory_bytes in the SFT/RM summaries (older runs) -> n/a; a run stopped before
    PPO -> n/a rows, the missing files listed, exit code 1."""
    gc = load_gpu_check()
    run = tmp_path / "gpu_check"
    write_run(run, with_stage_memory=False)
    res = gc.collect(run)
    assert res["stages"]["sft"]["peak_memory_bytes"] is None
    assert "n/a" in next(line for line in gc.format_table(res).splitlines() if line.startswith("RM stage"))
    (run / "ppo" / "summary.json").unlink()
    (run / "ppo" / "metrics.jsonl").write_text('{"step": 1, "logprob_mismatch": NaN}\n')
    assert gc.main(["--report-only", str(run), "--out", str(tmp_path / "out")]) == 1
    res = json.loads((tmp_path / "out" / "gpu_check.json").read_text())  # strict JSON: NaN -> null
    assert not res["complete"] and res["missing"] == [str(run / "ppo" / "summary.json")]
    assert res["gold_score"] == {"before": None, "after": None}
    assert res["logprob_mismatch"]["first"] == {"step": 1, "value": None}


def test_gpu_check_preflight_messages_cpu():
    gc = load_gpu_check()

    def fails(probes, *words):
        with pytest.raises(gc.CheckError) as err:
            gc.diagnose(probes)
        msg = str(err.value)
        assert "\n" not in msg and all(w in msg for w in words), msg

    base = {"executable": "/usr/bin/python3", "version": [3, 12, 3]}
    fails([], "no python")
    fails([{**base, "torch_error": "ModuleNotFoundError: No module named 'torch'"}], "no torch", "/usr/bin/python3")
    fails([{**base, "torch": "2.11.0+cpu", "torch_cuda": None, "cuda_available": False}], "torch without CUDA")
    fails([{**base, "torch": "2.13.0", "torch_cuda": "13.0", "cuda_available": False}], "no CUDA device", "2.13.0")
    fails([{**base, "version": [3, 11, 7], "torch": "2.11.0", "torch_cuda": "13.0", "cuda_available": True}],
          "wrong python", "3.11.7", "3.12")
    good = {**base, "torch": "2.11.0", "torch_cuda": "13.0", "cuda_available": True}
    assert gc.diagnose([{**base, "torch_error": "x"}, good]) is good
    reqs = gc.requirements()
    assert "megatron-core==0.19.2" in reqs and not any(r.startswith("torch") for r in reqs)
