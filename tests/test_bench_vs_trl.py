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

import pytest

REPO = Path(__file__).resolve().parent.parent


def load_benchmark():
    spec = importlib.util.spec_from_file_location("vs_trl", REPO / "benchmarks/vs_trl.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
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


def test_async_row_cpu_time_adds_the_engines_processes():
    bench = load_benchmark()
    # engine CPU read after each iteration's wait (warm-up, 3 measured) and once after the last
    snapshots = [5.0, 5.5, 6.25, 6.75, 7.5]
    assert bench.per_iteration_engine_cpu(snapshots, 3) == [0.75, 0.5, 0.75]
    with pytest.raises(ValueError, match="4 engine CPU snapshots"):
        bench.per_iteration_engine_cpu(snapshots[:-1], 3)  # the final wait's snapshot is missing

    # the engine's CPU is a phase of its own, and the trainer's refit another: not "other"
    spans = {"generate": 0.2, "sync": 0.1, "score": 0.4, "train": 1.0, "engine": 1.2}
    table = bench.phase_table(spans, iteration_s=3.0, iterations=1)
    assert table["sync"] == 0.1 and table["engine"] == 1.2
    assert math.isclose(table["other"], 3.0 - 0.2 - 0.1 - 0.4 - 1.0 - 1.2)
    assert bench.phase_table({"generate": 1.0}, 1.0, 1)["engine"] == 0.0  # the one-core rows have none


def test_async_row_summary_and_wall_ratio():
    bench = load_benchmark()

    def run(row, cpu, wall, **extra):
        return {"batch": 8, "row": row, "response_tokens": 32, "vocab": 87, "threads": 1, "versions": {},
                "timers": [], "cpu_s_per_iteration": cpu, "wall_s_per_iteration": wall,
                "phases": {path: 0.0 for path, _ in bench.PHASES}, "peak_rss_mib": 900.0,
                "rss_after_import_torch_mib": 600.0, "rss_increment_mib": 300.0, **extra}

    overlap = lambda wait: {"trainer_wait_seconds": wait, "engine_generate_seconds": 0.3,  # noqa: E731
                            "refit_seconds": 0.05, "trainer_idle_fraction": 0.1, "engine_busy_fraction": 0.5,
                            "staleness": 1.0}
    runs = [run("trl-nogc", 1.0, 1.0), run("trl-nogc", 1.2, 1.2),
            *(run("ours-async", 1.5, 0.5, cores=2, trainer_cpu_s=[0.5, 0.7], engine_cpu_s=[e, e],
                  overlap=overlap(w)) for e, w in ((0.8, 0.01), (1.0, 0.03), (0.9, 0.02)))]
    rows = bench.summarise(runs)
    trl, ours = (next(r for r in rows if r["row"] == name) for name in ("trl-nogc", "ours-async"))
    assert trl["cores"] == 1 and "overlap" not in trl and ours["cores"] == 2
    assert math.isclose(ours["trainer_cpu_s_per_iteration"], 0.6)
    assert math.isclose(ours["engine_cpu_s_per_iteration"], 0.9)
    assert math.isclose(ours["overlap"]["trainer_wait_seconds"], 0.02)
    ratio = bench.throughput_ratios(rows)["8"]["ours-async"]["vs_trl_best"]
    assert math.isclose(ratio["median"], 1.1 / 1.5)       # CPU: two cores' time costs more...
    assert math.isclose(ratio["wall_median"], 1.1 / 0.5)  # ...wall time is what the overlap buys


def test_async_row_runs_under_the_vllm_python_and_needs_two_cpus(tmp_path):
    bench = load_benchmark()
    assert bench.python_for("ours-async", "venv", "trl", "vllm") == "vllm"
    assert [bench.python_for(r, "venv", "trl", "vllm") for r in ("ours", "ours-reuse", "trl", "trl-nogc")] == [
        "venv", "venv", "trl", "trl"]
    missing = tmp_path / "no-vllm-python"
    assert "not found" in bench.async_row_unavailable(str(missing), {0, 1})
    missing.touch()
    assert "only CPUs [3]" in bench.async_row_unavailable(str(missing), {3})
    assert bench.async_row_unavailable(str(missing), {0, 1}) is None
