"""benchmarks/vs_trl.py --quick runs our side end to end and writes a sane row.

The TRL side needs .venv-trl (make bench-trl-setup) and ~1 min more, so the test points
--trl-python at a path that does not exist: the script then measures our side only, whether
or not .venv-trl has been built on this machine.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_vs_trl_quick_measures_our_side(tmp_path):
    out = tmp_path / "vs_trl.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/vs_trl.py"), "--quick", "--out", str(out),
         "--trl-python", str(tmp_path / "no-trl-python")],
        capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "our side only" in proc.stdout
    result = json.loads(out.read_text())
    assert not result["config"]["trl"]
    (ours,) = [r for r in result["rows"] if r["row"] == "ours"]
    assert [r["row"] for r in result["rows"]] == ["ours"]
    assert math.isfinite(ours["samples_per_s"]) and ours["samples_per_s"] > 0
    assert ours["threads"] == 1 and ours["response_tokens"] == 8
    assert ours["peak_rss_mib"] > 0 and ours["peak_rss_mib"] >= ours["rss_after_import_torch_mib"] > 0
    floor = result["floors"][str(ours["batch"])]
    assert floor["flops_per_iteration"]["total"] > 0 and floor["floor_s_per_iteration"] > 0
    assert 0 < ours["fraction_of_floor"] < 1  # nothing beats the matmul-bound floor
