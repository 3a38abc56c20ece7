"""The run report: PNG plots of each stage's main curves and a markdown summary with sample
generations before and after RL (any algorithm). Reads only what the stages wrote (metrics.jsonl,
summary.json), so it can be rebuilt for any finished or partial run.

For each RL stage it also shows what a user needs to judge the run: the proxy reward (the
combined reward of rl.rewards being optimised) against the independent signals (gold score,
holdout RM score) with the reward-hacking alarms shaded, the KL-vs-reward trade-off, the alarms
and the final win rates against the SFT policy; and, for the run, the time each RL stage spent
in each phase.
Figures are drawn on matplotlib's Agg canvas directly (no pyplot, no global backend switch).
"""

from __future__ import annotations

import json
from pathlib import Path

CURVES = {
    "sft": ["loss", "eval_loss"],
    "rm": ["loss", "eval_accuracy"],
    "dpo": ["loss", "eval_loss", ("reward_accuracy", "eval_reward_accuracy"), ("chosen_reward", "rejected_reward"),
            "eval_margin", "eval_gold_score"],
    # every RL algorithm (<run>/ppo, <run>/grpo, ...); a curve a run did not log is left out;
    # a tuple shares one panel
    "rl": ["reward", "gold_score", "holdout_rm_score", "kl_mean", "response_length", "entropy", "value_loss",
           "clip_fraction", "sampling_shortfall", "sampling_rounds", "eval_gold_score", "eval_holdout_rm_score",
           ("eval_win_rate_reward", "eval_win_rate_gold", "eval_win_rate_holdout_rm")],
}
PROXY, INDEPENDENT = "reward", ("gold_score", "holdout_rm_score")
# The combined reward's names before it was called `reward` (they said rm even without a reward
# model): runs written by earlier versions are read under the current names.
LEGACY_NAMES = {"rm_score": "reward", "eval_rm_score": "eval_reward", "eval_win_rate_rm": "eval_win_rate_reward",
                "rm_score_eval_before": "reward_eval_before", "rm_score_eval_after": "reward_eval_after",
                "win_rate_rm_final": "win_rate_reward_final"}
# sync: only with a separate rollout engine; wait: with rl.max_staleness >= 1, the trainer waiting
# for the batch the engine generates ahead
PHASES = ("wait", "sync", "generate", "score", "train", "eval")
# the engine's own generation time with rl.max_staleness >= 1: beside the trainer's phases, not one of them
OVERLAPPED = "engine (overlapped)"
ALARM = "reward-hacking alarm"


def _kind(stage: str) -> str:
    """sft, dpo, rm (rm, rm_holdout) or rl (a directory per RL algorithm), with or without the
    _lora suffix of a stage that trains adapters (sft_lora, dpo_lora, ppo_lora)."""
    name = stage.removesuffix("_lora")
    if name in ("sft", "dpo"):
        return name
    return "rm" if name == "rm" or name.startswith("rm_") else "rl"


def _current_names(record: dict) -> dict:
    return {LEGACY_NAMES.get(k, k): v for k, v in record.items()}


def _read_metrics(stage_dir: Path) -> list[dict]:
    path = stage_dir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(_current_names(json.loads(line)))
        except json.JSONDecodeError:
            pass  # a line torn by a killed process
    return sorted(rows, key=lambda r: r["step"])


def _points(rows: list[dict], name: str) -> tuple[list, list]:
    """(steps, values) of `name`, leaving out steps without it or where it was null (not finite)."""
    points = [(r["step"], r[name]) for r in rows if r.get(name) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def alarm_spans(rows: list[dict]) -> list[tuple[int, int]]:
    """[(first step, last step)] of each run of consecutive logged iterations with
    reward_hacking == 1 (rows without the key, like an RL stage's step 0, are skipped)."""
    spans, on_before = [], False
    for r in (r for r in rows if "reward_hacking" in r):
        on = r["reward_hacking"] == 1
        if on and on_before:
            spans[-1] = (spans[-1][0], r["step"])  # the alarm stays on: extend its span
        elif on:
            spans.append((r["step"], r["step"]))
        on_before = on
    return spans


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, out: Path) -> Path | None:
    if fig is None:
        return None
    fig.savefig(out, dpi=100)
    return out


def curves_figure(rows: list[dict], names: list, title: str):
    """One panel per curve in `names` that the rows have (None if none)."""
    panels = [p for p in ((n,) if isinstance(n, str) else n for n in names) if any(_points(rows, n)[0] for n in p)]
    if not panels:
        return None
    cols = min(len(panels), 4)
    fig = _figure(3.2 * cols, 2.6 * -(-len(panels) // cols))
    axes = fig.subplots(-(-len(panels) // cols), cols, squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels):
        for name in panel:
            steps, values = _points(rows, name)
            ax.plot(steps, values, marker="." if len(steps) < 20 else None, label=name)
        if len(panel) > 1:
            ax.legend(fontsize=7)
        ax.set_title(" / ".join(panel), fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(title)
    return fig


def plot_stage(stage_dir: Path, names: list, out: Path) -> Path | None:
    return _save(curves_figure(_read_metrics(stage_dir), names, stage_dir.name), out)


def gold_vs_proxy_figure(rows: list[dict], title: str):
    """The proxy reward and each independent signal against step on one axes (gold score on a
    twin axis: its scale is not a reward model's), eval points as markers, alarms shaded."""
    signals = [n for n in (PROXY, *INDEPENDENT) if _points(rows, n)[0] or _points(rows, f"eval_{n}")[0]]
    if not signals:
        return None
    fig = _figure(8, 3.6)
    ax = fig.subplots()
    axes = {n: ax.twinx() if n == "gold_score" and len(signals) > 1 else ax for n in signals}
    for color, name in zip(("C0", "C1", "C2"), signals):
        role = "proxy" if name == PROXY else "independent"
        axes[name].plot(*_points(rows, name), color=color, linestyle="-" if role == "proxy" else "--",
                        label=f"{name} ({role})")
        if _points(rows, f"eval_{name}")[0]:
            axes[name].plot(*_points(rows, f"eval_{name}"), color=color, linestyle="none", marker="o",
                            label=f"eval_{name}")
        axes[name].set_ylabel("gold score" if name == "gold_score" else "reward")  # the proxy need not be an RM
    for i, (start, end) in enumerate(alarm_spans(rows)):
        ax.axvspan(start - 0.5, end + 0.5, color="red", alpha=0.15, label=ALARM if i == 0 else "_nolegend_")
    ax.set_xlabel("step")
    handles = [h for a in dict.fromkeys(axes.values()) for h in a.get_legend_handles_labels()[0]]
    fig.legend(handles=handles, loc="outside right upper", fontsize=8)
    ax.set_title(f"{title}: proxy reward vs independent signals")
    return fig


def kl_vs_reward_figure(rows: list[dict], title: str):
    """Reward against KL to the reference, one panel per reward signal (gold first), points
    coloured by step."""
    signals = [n for n in ("gold_score", PROXY, "holdout_rm_score")
               if any(r.get(n) is not None and r.get("kl_mean") is not None for r in rows)]
    if not signals:
        return None
    from matplotlib.colors import Normalize

    fig = _figure(3.4 * len(signals) + 1, 3.2)
    axes = fig.subplots(1, len(signals), squeeze=False)[0]
    steps = _points(rows, "kl_mean")[0]
    norm = Normalize(min(steps), max(steps))  # one colour scale for every panel
    for ax, name in zip(axes, signals):
        points = [(r["kl_mean"], r[name], r["step"]) for r in rows
                  if r.get(name) is not None and r.get("kl_mean") is not None]
        kl, reward, step = zip(*points)
        dots = ax.scatter(kl, reward, c=step, cmap="viridis", norm=norm, s=14, label=name)
        ax.set(xlabel="KL to reference (nats/sequence)", ylabel=name, title=name)
    fig.colorbar(dots, ax=list(axes), label="step")
    fig.suptitle(f"{title}: KL vs reward")
    return fig


def phase_time_figure(seconds: dict[str, dict], engine: dict[str, float] | None = None):
    """A stacked bar per RL stage: its seconds in each phase; beside it, hatched, the seconds an
    asynchronous stage's engine generated while the trainer ran those phases (`engine`)."""
    engine = engine or {}
    fig = _figure(4.5 + 1.2 * len(seconds), 3.4)  # room for the legend beside the bars, not over them
    ax = fig.subplots()
    xs, bottom = list(range(len(seconds))), [0.0] * len(seconds)
    for phase in phases_run(seconds):
        values = [s.get(phase) or 0.0 for s in seconds.values()]
        ax.bar(xs, values, width=0.5, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    if engine:
        ax.bar([x + 0.4 for x in xs], [engine.get(stage, 0.0) for stage in seconds], width=0.25, hatch="//",
               fill=False, label="vLLM engine generating (overlapped)")
    ax.set_xticks(xs, list(seconds))
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("time per phase")
    return fig


def phases_run(seconds: dict[str, dict]) -> list[str]:
    """PHASES that at least one of the stages ran."""
    return [p for p in PHASES if any(p in phases for phases in seconds.values())]


def phase_time_table(seconds: dict[str, dict], engine: dict[str, float] | None = None) -> list[str]:
    """One row per stage: each phase's seconds and share of the stage; with an asynchronous stage
    (`engine`), a last column of the engine's generation seconds, overlapped, not in the total."""
    columns, engine = phases_run(seconds), engine or {}
    extra = [OVERLAPPED] if engine else []
    lines = ["| stage | " + " | ".join(columns + ["total"] + extra) + " |", "|---" * (len(columns) + 2 + len(extra)) + "|"]
    for stage, phases in seconds.items():
        values = [phases.get(p) or 0.0 for p in columns]  # a phase the stage never ran: 0
        total = sum(values)
        cells = [f"{v:.4g} ({v / max(total, 1e-9):.0%})" for v in values]
        overlapped = [f"{engine[stage]:.4g}" if stage in engine else "-"] if engine else []
        lines.append(f"| {stage} | " + " | ".join(cells + [f"{total:.4g}"] + overlapped) + " |")
    return lines


def _num(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def reward_hacking_lines(summary: dict, rows: list[dict]) -> list[str]:
    alarms = summary.get("reward_hacking_alarms")
    if not alarms:
        checked = any("reward_hacking" in r for r in rows)  # logged once the alarm's window is full
        return ["**Reward hacking:** no alarm" + ("" if checked else " (never checked: rl.reward_hacking_window "
                                                  "is 0 or longer than the run, or no independent signal)")]
    return ["**Reward hacking:** the proxy rose while an independent signal did not (slopes per iteration):", ""] + [
        f"- step {a['step']}: {a.get('proxy', PROXY)} slope {_num(a.get('proxy_slope'), '+.4g')}, "
        f"{a.get('independent', 'independent')} slope {_num(a.get('independent_slope'), '+.4g')}" for a in alarms]


def win_rate_line(summary: dict) -> str:
    reward, gold, holdout = (_num(summary.get(f"win_rate_{s}_final"), ".1%") for s in ("reward", "gold", "holdout_rm"))
    return (f"**Final win rate vs the SFT policy** (held-out prompts): by the reward {reward}, by the gold score {gold}"
            + (f", by the holdout RM {holdout}" if summary.get("win_rate_holdout_rm_final") is not None else ""))


def stage_section(run_dir: Path, stage: str) -> list[str]:
    stage_dir, lines = run_dir / stage, [f"## {stage}", ""]
    rows, summary_path = _read_metrics(stage_dir), stage_dir / "summary.json"
    summary = _current_names(json.loads(summary_path.read_text())) if summary_path.exists() else None
    if summary is None:
        lines += ["not finished", ""]
    plots = [_save(curves_figure(rows, CURVES[_kind(stage)], stage), run_dir / f"report_{stage}.png")]
    if _kind(stage) == "rl":
        plots += [_save(gold_vs_proxy_figure(rows, stage), run_dir / f"report_{stage}_gold_vs_proxy.png"),
                  _save(kl_vs_reward_figure(rows, stage), run_dir / f"report_{stage}_kl_vs_reward.png")]
    lines += [line for p in plots if p is not None for line in (f"![{p.stem}]({p.name})", "")]
    if summary is None:
        return lines
    if _kind(stage) == "rl":
        lines += [*reward_hacking_lines(summary, rows), "", win_rate_line(summary), ""]
    lines += ["| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |"
              for k, v in summary.items() if not isinstance(v, (dict, list))]
    for key in ("samples_before", "samples_after"):
        if summary.get(key):
            lines += ["", f"**{key.replace('_', ' ')} {stage.upper()}** (prompt || response):", ""]
            lines += [f"- {s}" for s in summary[key]]
    return lines + [""]


def phase_time_section(run_dir: Path, rl_stages: list[str]) -> list[str]:
    """Time per phase of each finished RL stage (from its summary's phase_seconds)."""
    summaries = [(s, run_dir / s / "summary.json") for s in rl_stages]
    summaries = [(s, json.loads(path.read_text())) for s, path in summaries if path.exists()]
    seconds = {s: summary["phase_seconds"] for s, summary in summaries if summary.get("phase_seconds")}
    if not seconds:
        return []
    engine = {s: summary["engine_generate_seconds"] for s, summary in summaries
              if s in seconds and summary.get("max_staleness") and summary.get("engine_generate_seconds") is not None}
    out = _save(phase_time_figure(seconds, engine), run_dir / "report_phase_time.png")
    note = ([f"{OVERLAPPED}: seconds the vLLM engine generated the next batches while the trainer ran the phases "
             "(rl.max_staleness >= 1); not part of the total", ""] if engine else [])
    return ["## Time per phase (seconds, share of the stage)", "", f"![phase time]({out.name})", "",
            *phase_time_table(seconds, engine), "", *note]


def write_report(run_dir: str | Path, stages: list[str] | None = None) -> Path:
    """<run>/report.md for the stage directories `stages` (default: sft, rm, rm_holdout and
    every RL algorithm's directory that exists). The phase-time comparison covers every RL
    algorithm's directory in the run, so algorithms run one after another can be compared."""
    from megatron_rlhf.config import RL_ALGORITHMS

    run_dir = Path(run_dir)
    if stages is None:
        stages = ["sft", "rm", *(s for s in ("rm_holdout", "dpo", *RL_ALGORITHMS) if (run_dir / s).is_dir())]
    rl_stages = [s for s in stages if _kind(s) == "rl"]
    rl_stages += [a for a in RL_ALGORITHMS if a not in rl_stages and (run_dir / a).is_dir()]
    lines = [f"# Run report: {run_dir.name}", ""]
    for stage in stages:
        lines += stage_section(run_dir, stage)
    lines += phase_time_section(run_dir, rl_stages)
    out = run_dir / "report.md"
    out.write_text("\n".join(lines) + "\n")
    return out
