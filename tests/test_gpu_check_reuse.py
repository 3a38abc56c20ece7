"""benchmarks/gpu_check.py's report of the old log-probs' mismatch with rl.reuse_rollout_logprobs
off and on (make gpu-check prints it for the bf16 runs), from the metrics the RL stage writes:
old_logprob_mismatch on every iteration, logprob_mismatch on those that recomputed the old log-probs."""

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_metrics(path: Path, rows: list[dict]) -> None:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_gpu_check_reports_the_old_logprob_mismatch_with_reuse_off_and_on_cpu(tmp_path):
    gc = load_gpu_check()
    run = tmp_path / "gpu_check"
    # PPO, reuse off: every step recomputed. old_logprob_mismatch 1e-3 * step, logprob_mismatch
    # 2e-3 * step over steps 1..5: medians 3e-3 (off) and 6e-3 (the engine's: "on", estimated).
    write_metrics(run / "ppo", [{"step": 0, "eval_gold_score": 0.1}] + [
        {"step": s, "old_logprob_mismatch": 1e-3 * s, "logprob_mismatch": 2e-3 * s} for s in range(1, 6)])
    # GRPO, reuse on, recomputed at steps 1 and 4 (they log logprob_mismatch): off = the upper
    # median of [1e-4, 3e-4] = 3e-4; on = the upper median of steps 2, 3, 5, 6
    # [4e-3, 6e-3, 1e-2, 1.2e-2] = 1e-2; a resumed run re-logged step 6: its last line counts.
    rows = [{"step": s, "old_logprob_mismatch": (1e-4 if s == 1 else 3e-4) if s in (1, 4) else 2e-3 * s,
             **({"logprob_mismatch": 5e-3} if s in (1, 4) else {})} for s in range(1, 7)]
    write_metrics(run / "grpo", [*rows[:-1], {"step": 6, "old_logprob_mismatch": 0.5}, rows[-1]])
    res = gc.collect(run)
    assert res["ppo"]["old_logprob_mismatch"] == {"recomputed": 3e-3, "reused": None, "engine": 6e-3}
    assert res["grpo"]["old_logprob_mismatch"] == {"recomputed": 3e-4, "reused": 1e-2, "engine": 5e-3}
    assert res["ppo_lora"]["old_logprob_mismatch"] == {"recomputed": None, "reused": None, "engine": None}
    line = ("old log-probs vs the first train step's forward, median |Δ| per token, rl.reuse_rollout_logprobs "
            "off / on: PPO 3.00e-03 / 6.00e-03*, GRPO 3.00e-04 / 1.00e-02; * no step reused them: the engine's "
            "logprob_mismatch, what they would be off by")
    assert gc.reuse_lines(res) == [line]
    assert line in gc.format_table(res).splitlines()
    res["environment"] = {"params_dtype": "bfloat16"}
    assert gc.reuse_lines(res)[0].startswith("old log-probs vs the first train step's forward (bfloat16), ")
    for name in gc.RL_RUNS:  # no run with a number: no line
        res[name]["old_logprob_mismatch"] = {"recomputed": None, "reused": None, "engine": None}
    assert gc.reuse_lines(res) == []
