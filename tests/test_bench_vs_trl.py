"""benchmarks/vs_trl.py --quick runs our side end to end and writes a sane row with its phase
table; the summary's ratios are throughput ours / theirs (their CPU time over ours).

The TRL side needs .venv-trl (make bench-trl-setup) and ~1 min more, so the test points
--trl-python at a path that does not exist: the script then measures our side only, whether
or not .venv-trl has been built on this machine.
"""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def load_benchmark():
    spec = importlib.util.spec_from_file_location("vs_trl", REPO / "benchmarks/vs_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vs_trl_quick_measures_our_side(tmp_path):
    out = tmp_path / "vs_trl.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/vs_trl.py"), "--quick", "--out", str(out),
         "--trl-python", str(tmp_path / "no-trl-python")],
        capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "our side only" in proc.stdout
    result = json.loads(out.read_text())
    assert not result["config"]["trl"] and result["ratios"] == {}
    assert [r["row"] for r in result["rows"]] == ["ours"] and [r["row"] for r in result["runs"]] == ["ours"]
    (ours,), (run,) = result["rows"], result["runs"]
    cpu = ours["cpu_s_per_iteration"]
    assert cpu["values"] == [run["cpu_s_per_iteration"]] and cpu["min"] == cpu["median"] > 0
    assert math.isclose(ours["samples_per_s_cpu"], ours["batch"] / cpu["median"])
    assert len(run["per_iteration"]) == run["iterations"] == 2
    assert ours["threads"] == 1 and ours["response_tokens"] == 8
    assert ours["peak_rss_mib"] > 0 and ours["peak_rss_mib"] >= ours["rss_after_import_torch_mib"] > 0
    floor = result["floors"][str(ours["batch"])]
    assert floor["flops_per_iteration"]["total"] > 0 and floor["floor_s_per_iteration"] > 0
    assert 0 < ours["fraction_of_floor"] < 1  # nothing beats the matmul-bound floor

    # the core timers were installed and ran (the grad finalise and the guard are timed where the
    # trainer has them); the phases add up to the iteration's CPU time
    timers = set(ours["timers"])
    assert {"schedules.forward_step", "schedules.backward_step", "actor._forward_backward", "critic.optimizer.step",
            "actor.scheduler.step"} <= timers
    phases = ours["phases_cpu_s_per_iteration"]
    for path in ("generate", "score", "train", "train/fwd_bwd", "train/fwd_bwd/forward", "train/fwd_bwd/backward",
                 "train/optimizer"):
        assert phases[path] > 0, path
    assert (phases["train/fwd_bwd/finalize_grads"] > 0) == ("actor.finalize_model_grads_func" in timers)
    assert (phases["train/guard"] > 0) == ("actor.guard.should_skip" in timers)
    assert math.isclose(phases["iteration"], cpu["median"])
    assert phases["generate"] + phases["score"] + phases["train"] <= phases["iteration"]
    assert phases["other"] < 0.05 * phases["iteration"]  # ours has nothing outside its three phases
    inside_train = sum(phases[f"train/{p}"] for p in ("fwd_bwd", "optimizer", "guard", "lr_schedule"))
    assert inside_train <= phases["train"] and phases["train/rest"] == phases["train"] - inside_train
    assert phases["train/fwd_bwd/forward"] + phases["train/fwd_bwd/backward"] <= phases["train/fwd_bwd"]


def test_ratios_are_their_cpu_time_over_ours():
    bench = load_benchmark()

    def run(row, repeat, cpu):
        return {"batch": 8, "row": row, "repeat": repeat, "response_tokens": 32, "vocab": 87, "threads": 1,
                "versions": {}, "timers": [], "cpu_s_per_iteration": cpu, "wall_s_per_iteration": 2 * cpu,
                "phases": {path: cpu / 4 for path, _ in bench.PHASES}, "peak_rss_mib": 900.0,
                "rss_after_import_torch_mib": 600.0, "rss_increment_mib": 300.0}

    times = {"ours": [1.0, 1.2, 0.9], "trl": [3.0, 2.5, 2.8], "trl-nogc": [0.8, 0.7, 1.0]}
    rows = bench.summarise([run(row, i, t) for i in range(3) for row, ts in times.items() for t in [ts[i]]])
    ours = next(r for r in rows if r["row"] == "ours")
    assert ours["cpu_s_per_iteration"]["min"] == 0.9 and ours["cpu_s_per_iteration"]["median"] == 1.0
    assert math.isclose(ours["cpu_spread"], 1.0 / 0.9 - 1)
    ratios = bench.throughput_ratios(rows)["8"]["ours"]
    assert math.isclose(ratios["vs_trl_shipped"]["median"], 2.8 / 1.0)  # TRL slower: ours > 1x
    assert math.isclose(ratios["vs_trl_best"]["median"], 0.8 / 1.0)
    assert math.isclose(ratios["vs_trl_best"]["min"], 0.7 / 0.9)
    gaps = bench.gaps_to_trl_best(rows)["8"]  # every phase here is a quarter of the iteration
    assert set(gaps) == set(bench.LEAVES) and math.isclose(gaps["train/optimizer"], (1.0 - 0.8) / 4)
