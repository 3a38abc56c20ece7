"""The run report: PNG plots of each stage's main curves and a markdown summary with sample
generations before and after RL (any algorithm). Reads only what the stages wrote (metrics.jsonl,
summary.json, checkpoints' commit.json), so it can be rebuilt for any finished or partial run
(write_report(run_dir); the CLI's `report` verb). It covers every stage directory in the run, in
pipeline order (STAGE_ORDER), whichever pipeline config wrote each; a stage without summary.json
is shown as stopped at its last logged step. Bytes are printed in KiB/MiB/GiB, and a value a
stage did not record is left out, not printed as None.

For each RL stage it also shows what a user needs to judge the run: the proxy reward (the
combined reward of rl.rewards being optimised) against the independent signals (gold score,
holdout RM score) with the reward-hacking alarms shaded, the KL-vs-reward trade-off, the alarms
and the final win rates against the SFT policy; and, for the run, the time each RL stage spent
in each phase.
Figures are drawn on matplotlib's Agg canvas directly (no pyplot, no global backend switch).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from megatron_rlhf.config.errors import ConfigError

CURVES = {
    "sft": ["loss", "eval_loss"],
    "rm": ["loss", "eval_accuracy"],
    "dpo": ["loss", "eval_loss", ("reward_accuracy", "eval_reward_accuracy"), ("chosen_reward", "rejected_reward"),
            "eval_margin", "eval_gold_score"],
    # every RL algorithm (<run>/ppo, <run>/grpo, ...); a curve a run did not log is left out;
    # a tuple shares one panel
    "rl": ["reward", "gold_score", "holdout_rm_score", "kl_mean", "response_length", "entropy", "value_loss",
           "clip_fraction", "sampling_shortfall", "sampling_rounds", "eval_reward", "eval_gold_score",
           "eval_holdout_rm_score",
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
# Run-level directories that are not stages (the run's data, its HF exports, its tokenizer).
NOT_STAGES = ("data", "export", "tokenizer")
# Report order: the pipeline's (sft -> rm -> dpo -> rl), each LoRA variant right after its full
# fine-tuning, the RL algorithms in config.RL_ALGORITHMS order (ppo, the default, first); then any
# other stage directory by name.
STAGE_ORDER = ("sft", "rm", "rm_holdout", "dpo")
MISSING = "—"  # a table cell a stage did not record


def _kind(stage: str) -> str:
    """sft, dpo, rm (rm, rm_holdout) or rl (a directory per RL algorithm), with or without the
    _lora suffix of a stage that trains adapters (sft_lora, dpo_lora, ppo_lora)."""
    name = stage.removesuffix("_lora")
    if name in ("sft", "dpo"):
        return name
    return "rm" if name == "rm" or name.startswith("rm_") else "rl"


def stage_order_key(stage: str) -> tuple:
    from megatron_rlhf.config import RL_ALGORITHMS

    base, order = stage.removesuffix("_lora"), (*STAGE_ORDER, *RL_ALGORITHMS)
    return (order.index(base) if base in order else len(order), base, stage.endswith("_lora"))


def stage_dirs(run_dir: Path) -> list[str]:
    """The names of the run's stage directories (those holding a summary.json or a metrics.jsonl;
    not data/, export/, nor a stage moved aside as <name>.replaced-<time>), in report order."""
    stages = [d.name for d in run_dir.iterdir() if d.is_dir() and d.name not in NOT_STAGES and "." not in d.name
              and ((d / "summary.json").exists() or (d / "metrics.jsonl").exists())] if run_dir.is_dir() else []
    return sorted(stages, key=stage_order_key)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; 996990976 -> '950.8 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def human_seconds(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    minutes, seconds = divmod(round(s), 60)
    return f"{minutes} min {seconds} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def format_value(key: str, value) -> str | None:
    """A summary value as report.md prints it: bytes (a key naming bytes) in KiB/MiB/GiB, byte
    rates per second likewise, floats to 4 significant digits, lists of scalars joined; None for
    what has no row (null, empty, or a nested record shown by its own section)."""
    if value is None or isinstance(value, dict) or value in ([], ""):
        return None
    if isinstance(value, list):
        return ", ".join(map(str, value)) if all(isinstance(v, (str, int, float)) for v in value) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "bytes_per_s" in key:
            return human_bytes(value) + "/s"
        if "bytes" in key.split("_"):
            return human_bytes(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _current_names(record: dict) -> dict:
    return {LEGACY_NAMES.get(k, k): v for k, v in record.items()}


def _unreadable(path: Path, error: Exception) -> str:
    why = error.strerror if isinstance(error, OSError) and error.strerror else str(error) or type(error).__name__
    return f"{path}: unreadable ({why})"


def read_summary(stage_dir: Path) -> dict | None:
    """<stage_dir>/summary.json, None when there is none: the one reader of it, for the report and
    the pipeline (trainers/stage_inputs.py). One that cannot be read or holds no JSON object is a
    ConfigError naming the file and the fix."""
    path = Path(stage_dir) / "summary.json"
    fix = ("delete it: the stage then counts as unfinished (the report shows how far it got; the pipeline "
           "resumes it from its checkpoints and writes summary.json again)")
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:  # ValueError: not JSON, not UTF-8
        raise ConfigError(f"{_unreadable(path, e)}; {fix}") from None
    if not isinstance(summary, dict):
        raise ConfigError(f"{path}: holds a JSON {type(summary).__name__}, not the object a stage writes; {fix}")
    return summary


def _read_metrics(stage_dir: Path) -> list[dict]:
    """<stage_dir>/metrics.jsonl's rows by step ([] when there is none). A line that is not JSON is
    skipped (torn by a killed process); one that is JSON but not a row (an object with an integer
    step) is a ConfigError naming the file, the line and the fix."""
    path = Path(stage_dir) / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise ConfigError(f"{_unreadable(path, e)}; delete it or move it away (the report then has no curves "
                          "for the stage)") from None
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            continue  # a line torn by a killed process
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            what = "no integer step" if isinstance(row, dict) else f"a JSON {type(row).__name__}"
            raise ConfigError(f"{path}:{number}: not a metrics row (a JSON object with an integer step): {what}; delete "
                              "that line (the stage wrote every other one, and a resumed stage drops it too)")
        rows.append(_current_names(row))
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
    """One panel per curve in `names` that the rows have (None if none); a panel of several
    curves (a tuple) shows those the rows have, with its legend below the axes, off the curves.
    Eval curves start at step 0 where the stage logged the eval before training."""
    panels = [p for p in ([n for n in ((n,) if isinstance(n, str) else n) if _points(rows, n)[0]] for n in names) if p]
    if not panels:
        return None
    cols = min(len(panels), 4)
    fig = _figure(3.2 * cols, 2.6 * -(-len(panels) // cols) + 0.4 * any(len(p) > 1 for p in panels))
    axes = fig.subplots(-(-len(panels) // cols), cols, squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels):
        for name in panel:
            steps, values = _points(rows, name)
            ax.plot(steps, values, marker="." if len(steps) < 20 else None, label=name)
        if len(panel) > 1:
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
        # wrapped to the panel's width, so that a long title is not cut off or run into its neighbour's
        ax.set_title(textwrap.fill(" / ".join(panel), 40), fontsize=9)
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
        overlapped = [f"{engine[stage]:.4g}" if stage in engine else MISSING] if engine else []
        lines.append(f"| {stage} | " + " | ".join(cells + [f"{total:.4g}"] + overlapped) + " |")
    return lines


def _num(value, fmt: str) -> str:
    return MISSING if value is None else format(value, fmt)


def reward_hacking_lines(summary: dict, rows: list[dict]) -> list[str]:
    alarms = summary.get("reward_hacking_alarms")
    if not alarms:
        checked = any("reward_hacking" in r for r in rows)  # logged once the alarm's window is full
        return ["**Reward hacking:** no alarm" + ("" if checked else " (never checked: rl.reward_hacking_window "
                                                  "is 0 or longer than the run, or no independent signal)")]
    return ["**Reward hacking:** the proxy rose while an independent signal did not (slopes per iteration):", ""] + [
        f"- step {a['step']}: {a.get('proxy', PROXY)} slope {_num(a.get('proxy_slope'), '+.4g')}, "
        f"{a.get('independent', 'independent')} slope {_num(a.get('independent_slope'), '+.4g')}" for a in alarms]


def win_rate_line(summary: dict) -> str | None:
    """The final win rates the stage measured (a signal the run did not have is left out)."""
    rates = [f"by the {label} {summary[f'win_rate_{key}_final']:.1%}" for key, label in
             (("reward", "reward"), ("gold", "gold score"), ("holdout_rm", "holdout RM"))
             if summary.get(f"win_rate_{key}_final") is not None]
    return f"**Final win rate vs the SFT policy** (held-out prompts): {', '.join(rates)}" if rates else None


def checkpoint_bytes(checkpoint: Path) -> int | None:
    """The size of a complete checkpoint as its commit.json lists its files (None: none there)."""
    try:
        return sum(json.loads((checkpoint / "commit.json").read_text())["files"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def latest_checkpoint(stage_dir: Path) -> Path | None:
    complete = [d for d in stage_dir.glob("iter_*") if (d / "commit.json").exists()]
    return max(complete, key=lambda d: d.name, default=None)


def progress_line(stage_dir: Path, rows: list[dict]) -> str:
    """What a stage without summary.json got to: its last logged step and its latest checkpoint."""
    if not stage_dir.is_dir():
        return f"**Not started:** no {stage_dir.name}/ directory in the run"
    where = f"at step {rows[-1]['step']}" if rows else "before its first logged step"
    line = f"**Not finished:** in progress or stopped {where} (no summary.json yet)"
    checkpoint = latest_checkpoint(stage_dir)
    if checkpoint is not None:
        size = checkpoint_bytes(checkpoint)
        line += (f"; a rerun resumes from its checkpoint at step {int(checkpoint.name.removeprefix('iter_'))}"
                 + (f" ({human_bytes(size)})" if size is not None else ""))
    return line


def summary_table(summary: dict, stage_dir: Path) -> list[str]:
    """| metric | value | of the summary's scalars and lists of scalars, sizes in KiB/MiB/GiB, a
    null or empty value left out, and the final checkpoint's size."""
    rows = [(k, format_value(k, v)) for k, v in summary.items() if k not in ("samples_before", "samples_after")]
    if summary.get("checkpoint"):
        rows.append(("checkpoint_bytes", (size := checkpoint_bytes(stage_dir / Path(summary["checkpoint"]).name))
                     and human_bytes(size)))
    return ["| metric | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows if v is not None)]


MEMORY_TOTALS = {"model_state_bytes": "model state", "activation_bytes": "activations",
                 "checkpoint_save_bytes": "checkpoint save", "account_bytes": "account", "baseline_bytes": "baseline",
                 "peak_above_baseline_bytes": "peak above baseline", "other_bytes": "other (not in the account)"}


def memory_lines(account: dict) -> list[str]:
    """The summary's memory_account (logging/memory.py) as a table per role and one line of totals."""
    columns = ("weights", "gradient_buffers", "optimizer_state", "activations")
    lines = ["**Memory account** (per role on one rank; the peak above the stage's starting memory against "
             "what the account explains):", "", "| role | " + " | ".join(c.replace("_", " ") for c in columns)
             + " | trainable parameters |", "|---" * (len(columns) + 2) + "|"]
    for role, sizes in account.get("roles", {}).items():
        cells = [human_bytes(sizes[c]) if sizes.get(c) is not None else MISSING for c in columns]
        trainable = sizes.get("trainable_parameters")
        lines.append(f"| {role} | " + " | ".join(cells) + f" | {MISSING if trainable is None else f'{trainable:,}'} |")
    totals = [f"{label} {human_bytes(account[key])}" for key, label in MEMORY_TOTALS.items()
              if account.get(key) is not None]
    if account.get("peak_over_account") is not None:
        totals.append(f"peak above baseline / account {account['peak_over_account']:.3g}x")
    return lines + (["", "; ".join(totals)] if totals else [])


def stage_section(run_dir: Path, stage: str) -> list[str]:
    stage_dir, lines = run_dir / stage, [f"## {stage}", ""]
    rows, summary = _read_metrics(stage_dir), read_summary(stage_dir)
    summary = None if summary is None else _current_names(summary)
    if summary is None:
        lines += [progress_line(stage_dir, rows), ""]
    plots = [_save(curves_figure(rows, CURVES[_kind(stage)], stage), run_dir / f"report_{stage}.png")]
    if _kind(stage) == "rl":
        plots += [_save(gold_vs_proxy_figure(rows, stage), run_dir / f"report_{stage}_gold_vs_proxy.png"),
                  _save(kl_vs_reward_figure(rows, stage), run_dir / f"report_{stage}_kl_vs_reward.png")]
    lines += [line for p in plots if p is not None for line in (f"![{p.stem}]({p.name})", "")]
    if summary is None:
        return lines
    if _kind(stage) == "rl":
        lines += [*reward_hacking_lines(summary, rows), ""]
        lines += [win, ""] if (win := win_rate_line(summary)) else []
    lines += summary_table(summary, stage_dir)
    if isinstance(summary.get("memory_account"), dict):
        lines += ["", *memory_lines(summary["memory_account"])]
    for key in ("samples_before", "samples_after"):
        if summary.get(key):
            lines += ["", f"**{key.replace('_', ' ')} {stage.upper()}** (prompt || response):", ""]
            lines += [f"- {s}" for s in summary[key]]
    return lines + [""]


def overview_lines(run_dir: Path, stages: list[str]) -> list[str]:
    """One row per stage: finished or not, steps, wall time, peak memory."""
    lines = ["| stage | status | steps | wall time | peak memory |", "|---|---|---|---|---|"]
    for stage in stages:
        summary = read_summary(run_dir / stage)
        if summary is not None:
            status = "finished"
        elif rows := _read_metrics(run_dir / stage):
            status = f"in progress or stopped at step {rows[-1]['step']}"
        else:
            status = "started, nothing logged yet" if (run_dir / stage).is_dir() else "not started"
        summary = summary or {}
        cells = [summary.get("steps"), summary.get("wall_seconds"), summary.get("peak_memory_bytes")]
        cells = [MISSING if v is None else f(v) for v, f in zip(cells, (str, human_seconds, human_bytes))]
        lines.append(f"| {stage} | {status} | " + " | ".join(cells) + " |")
    return lines + [""]


def phase_time_section(run_dir: Path, rl_stages: list[str]) -> list[str]:
    """Time per phase of each finished RL stage (from its summary's phase_seconds)."""
    summaries = [(s, read_summary(run_dir / s)) for s in rl_stages]
    summaries = [(s, summary) for s, summary in summaries if summary is not None]
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
    """<run>/report.md for the stage directories `stages` (default: every stage directory in the
    run, stage_dirs). The phase-time comparison covers every RL stage directory in the run, so
    algorithms run one after another can be compared."""
    run_dir = Path(run_dir)
    found = stage_dirs(run_dir)
    if stages is None and not found:
        raise FileNotFoundError(f"{run_dir} holds no stage directories (sft/, rm/, ppo/, ... with a summary.json "
                                "or metrics.jsonl): give a run directory, <checkpoint.root>/<run name>, "
                                "e.g. checkpoints/tiny_cpu")
    stages = found if stages is None else stages
    rl_stages = [s for s in stages if _kind(s) == "rl"]
    rl_stages += [s for s in found if _kind(s) == "rl" and s not in rl_stages]
    lines = [f"# Run report: {run_dir.name}", "", *overview_lines(run_dir, stages)]
    for stage in stages:
        lines += stage_section(run_dir, stage)
    lines += phase_time_section(run_dir, rl_stages)
    out = run_dir / "report.md"
    out.write_text("\n".join(lines) + "\n")
    return out
