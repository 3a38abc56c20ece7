"""benchmarks/long_context_check.py, the long-context part of `make gpu-check`, run on CPU: its
packed and CP2 comparisons (through the tests' reference CP attention), multi-turn continuation
from the turn cache, its verdict and the
lines gpu-check prints from its JSON."""

import json
import sys

import pytest

from distributed import REPO, torchrun

sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_check  # noqa: E402
import long_context_check  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("long_context") / "long_context.json"
    torchrun(2, "tests/workers/long_context_cp.py", "--cpu", "--out", str(out))
    return json.loads(out.read_text())


def test_the_check_compares_packed_and_context_parallel_runs_and_passes(report):
    assert report["ok"] and report["dtype"] == "float32"
    assert "skipped" in report["split"]  # no Transformer Engine here
    assert set(report["packed"]) == {"logits_chunk_tokens=256", "logits_chunk_tokens=0"}
    assert len(report["cp"]) == 4  # chunked or not x packed or not
    for d in [*report["packed"].values(), *report["cp"].values()]:
        assert d["logprobs"] < 1e-4 and d["grad_rel"] < 1e-4
    assert report["turns"]["logprobs"] < 1e-4 and report["turns"]["reused_tokens"] > 100


def test_a_difference_past_the_tolerance_fails_the_check(report):
    broken = json.loads(json.dumps(report))
    next(iter(broken["cp"].values()))["grad_rel"] = 0.3
    assert long_context_check.passed(report) and not long_context_check.passed(broken)
    assert not long_context_check.passed({**report, "turns": {"logprobs": 2.0, "reused_tokens": 300}})
    broken = {**report, "split": {"cases": 4, "all_equal": False, "differ": [{"cp": 2}]}}
    assert not long_context_check.passed(broken)


def test_gpu_check_prints_each_comparison_or_why_it_was_skipped(report):
    lines = "\n".join(gpu_check.long_context_lines({**report, "exit_code": 0, "seconds": 12.0}))
    assert "within" in lines and "NOT within" not in lines
    assert "cp logits_chunk_tokens=256, packed=True" in lines and "packed logits_chunk_tokens=0" in lines
    assert "thd_get_partitioned_indices vs ours: skipped" in lines
    assert "turns from the turn cache: max |engine - recomputed log-prob|" in lines
    assert "skipped: --no-long-context" in "\n".join(gpu_check.long_context_lines({"skipped": "--no-long-context"}))
