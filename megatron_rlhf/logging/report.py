"""The run report: PNG plots of each stage's main curves and a markdown summary with sample
generations before and after RL (any algorithm). Reads only what the stages wrote (metrics.jsonl,
summary.json), so it can be rebuilt for any finished or partial run."""

from __future__ import annotations

import json
from pathlib import Path

CURVES = {
    "sft": ["loss", "eval_loss"],
    "rm": ["loss", "eval_accuracy"],
    # every RL algorithm (<run>/ppo, <run>/grpo, ...); a curve a run did not log is left out
    "rl": ["rm_score", "gold_score", "kl_mean", "response_length", "entropy", "value_loss", "clip_fraction",
           "sampling_shortfall", "sampling_rounds", "eval_gold_score"],
}


def _read_metrics(stage_dir: Path) -> list[dict]:
    path = stage_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def plot_stage(stage_dir: Path, names: list[str], out: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    rows = _read_metrics(stage_dir)
    names = [n for n in names if any(n in r for r in rows)]
    if not names:
        return None
    cols = min(len(names), 4)
    rows_n = -(-len(names) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.2 * cols, 2.6 * rows_n), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names):
        points = [(r["step"], r[name]) for r in rows if r.get(name) is not None]  # null: not finite
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 20 else None)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(stage_dir.name)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def write_report(run_dir: str | Path, stages: list[str] | None = None) -> Path:
    """<run>/report.md for the stage directories `stages` (default: sft, rm and every RL
    algorithm's directory that exists)."""
    run_dir = Path(run_dir)
    if stages is None:
        from megatron_rlhf.config import RL_ALGORITHMS

        stages = ["sft", "rm", *(a for a in RL_ALGORITHMS if (run_dir / a).is_dir())]
    lines = [f"# Run report: {run_dir.name}", ""]
    for stage in stages:
        names, stage_dir = CURVES.get(stage, CURVES["rl"]), run_dir / stage
        summary_path = stage_dir / "summary.json"
        if not summary_path.exists():
            lines += [f"## {stage}", "", "not finished", ""]
            continue
        summary = json.loads(summary_path.read_text())
        lines += [f"## {stage}", ""]
        plot = plot_stage(stage_dir, names, run_dir / f"report_{stage}.png")
        if plot is not None:
            lines += [f"![{stage}]({plot.name})", ""]
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |"
                  for k, v in summary.items() if not isinstance(v, (dict, list))]
        for key in ("samples_before", "samples_after"):
            if summary.get(key):
                lines += ["", f"**{key.replace('_', ' ')} {stage.upper()}** (prompt || response):", ""]
                lines += [f"- {s}" for s in summary[key]]
        lines.append("")
    out = run_dir / "report.md"
    out.write_text("\n".join(lines) + "\n")
    return out
