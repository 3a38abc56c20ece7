"""The run report (megatron_rlhf/logging/report.py) built from metrics.jsonl and summary.json
files written into a run directory as the stages write them: per RL stage the gold-vs-proxy
and KL-vs-reward plots, the reward-hacking alarms and final win rates; the phase-time
comparison of the run's RL stages; partial stages (no summary, no gold) reported, not crashed on;
every stage directory of the run in pipeline order, sizes in KiB/MiB/GiB, no None, and figures
whose titles and legends stay clear of the figure's edge and of the curves and bars."""

import json
import re

import matplotlib.image
import pytest

from megatron_rlhf.logging.report import (ALARM, CURVES, LEGACY_NAMES, _points, _read_metrics, alarm_spans, curves_figure,
                                          format_value, gold_vs_proxy_figure, human_bytes, human_seconds, phase_time_figure,
                                          stage_dirs, write_report)

PHASE_SECONDS = {"ppo": {"generate": 120.0, "score": 30.0, "train": 45.5, "eval": 4.5},
                 "grpo": {"generate": 80.0, "score": 10.0, "train": 10.0, "eval": 0.0}}
ALARM_RECORD = {"step": 31, "proxy": "reward", "proxy_slope": 0.0412, "independent": "gold_score",
                "independent_slope": -0.0103}


def rl_rows(steps=40, gold=True, holdout=False, alarm=(), eval_every=5):
    """An RL stage's metrics.jsonl rows: step 0 has only eval_* keys; the proxy keeps rising,
    the gold (and holdout) score peaks at step 25 and then falls."""
    def scores(k, prefix=""):
        out = {f"{prefix}reward": 0.05 * k}
        if gold:
            out[f"{prefix}gold_score"] = 0.03 * min(k, 25) - 0.02 * max(k - 25, 0)
        if holdout:
            out[f"{prefix}holdout_rm_score"] = 0.04 * min(k, 25) - 0.03 * max(k - 25, 0)
        return out

    rows = [{"step": 0, **scores(0, "eval_")}]
    for k in range(1, steps + 1):
        row = {"step": k, **scores(k), "kl_mean": 0.15 * k, "response_length": 10.0 + k / 4,
               "generate_seconds": 3.0, "score_seconds": 0.75, "train_seconds": 1.1,
               "reward_hacking": 1.0 if k in alarm else 0.0}
        if k == 12:
            row["kl_mean"] = None  # non-finite: written as null
        if k % eval_every == 0:
            row |= scores(k, "eval_") | {"eval_seconds": 0.9, "eval_win_rate_reward": min(0.5 + k / 80, 1.0)}
            row |= {"eval_win_rate_gold": 0.5 + (k - 20) / 100} if gold else {}
        rows.append(row)
    return rows


def write_stage(run, stage, rows, summary=None):
    (run / stage).mkdir(parents=True)
    (run / stage / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (run / stage / "summary.json").write_text(json.dumps(summary, indent=2))


def rl_summary(algorithm, alarms=None, win_reward=0.625, win_gold=0.7):
    summary = {"stage": algorithm, "steps": 40, "algorithm": algorithm, "phase_seconds": PHASE_SECONDS[algorithm],
               "win_rate_reward_final": win_reward, "win_rate_gold_final": win_gold,
               "samples_before": ["a || b"], "samples_after": ["a || c"]}
    return summary if alarms is None else summary | {"reward_hacking_alarms": alarms}


def synthetic_run(run):
    """sft, rm, ppo (an alarm over steps 31-34) and grpo (no alarm) as a finished run writes them."""
    write_stage(run, "sft", [{"step": k, "loss": 3 / k, **({"eval_loss": 3.1 / k} if k % 5 == 0 else {})}
                             for k in range(1, 21)], {"stage": "sft", "steps": 20})
    write_stage(run, "rm", [{"step": k, "loss": 0.7 / k, "eval_accuracy": 0.5 + k / 40} for k in range(1, 11)],
                {"stage": "rm", "steps": 10})
    write_stage(run, "ppo", rl_rows(alarm=range(31, 35)), rl_summary("ppo", [ALARM_RECORD]) | SIZES)
    write_commit(run / "ppo" / "iter_0000040", {"actor/__0_0.distcp": 3 * 2**30, "trainer_state/rank_00000.pt": 2**20})
    write_stage(run, "grpo", rl_rows(), rl_summary("grpo", []))
    return run


# What a stage's summary.json holds in bytes (memory account: logging/memory.py), and values it leaves null.
SIZES = {"peak_memory_bytes": 996990976, "refit_bytes_per_s_final": 25981593.0, "win_rate_holdout_rm_final": None,
         "started_from": None, "checkpoint": "checkpoints/run/ppo/iter_0000040",
         "memory_account": {"roles": {"actor": {"weights": 1116416, "gradient_buffers": 1116672,
                                                "optimizer_state": 2232940, "activations": 4955280,
                                                "trainable_parameters": 279104}},
                            "model_state_bytes": 4466028, "activation_bytes": 4955280, "checkpoint_save_bytes": 61440,
                            "account_bytes": 9421308, "baseline_bytes": 778817536,
                            "peak_above_baseline_bytes": 218173440, "other_bytes": 208752132,
                            "peak_over_account": 23.16}}


def write_commit(checkpoint, files):
    """A complete checkpoint as CheckpointManager commits it: commit.json lists its files' sizes."""
    checkpoint.mkdir(parents=True)
    (checkpoint / "commit.json").write_text(json.dumps({"step": int(checkpoint.name[5:]), "files": files}))


def sections(report: str) -> dict[str, str]:
    return {part.split("\n", 1)[0]: part for part in report.split("\n## ")[1:]}


def assert_png(path, min_width=300, min_height=200):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width >= min_width and height >= min_height, (path, width, height)


def test_alarm_spans_are_runs_of_consecutive_alarm_iterations():
    assert alarm_spans(rl_rows(alarm=[3, 4, 5, 8, 40])) == [(3, 5), (8, 8), (40, 40)]
    assert alarm_spans(rl_rows()) == []
    assert alarm_spans([{"step": 0, "eval_reward": 0.1}]) == []  # step 0: eval keys only


def test_gold_vs_proxy_plot_has_every_signal_on_one_axes_and_shades_the_alarms():
    fig = gold_vs_proxy_figure(rl_rows(holdout=True, alarm=[3, 4, 5, 8]), "ppo")
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["reward (proxy)", "eval_reward", "holdout_rm_score (independent)",
                      "eval_holdout_rm_score", ALARM, "gold_score (independent)", "eval_gold_score"]
    ax, twin = fig.axes  # gold on a twin y-axis of the same plot
    assert ax.get_shared_x_axes().joined(ax, twin)
    assert [(p.get_x(), p.get_x() + p.get_width()) for p in ax.patches] == [(2.5, 5.5), (7.5, 8.5)]
    no_alarm = gold_vs_proxy_figure(rl_rows(), "ppo")
    assert ALARM not in [t.get_text() for t in no_alarm.legends[0].get_texts()] and not no_alarm.axes[0].patches


def test_the_win_rates_share_a_panel_of_the_curve_grid():
    fig = curves_figure(rl_rows(holdout=True), ["reward", ("eval_win_rate_reward", "eval_win_rate_gold")], "ppo")
    # the title wrapped to the panel's width
    win = [ax for ax in fig.axes if ax.get_title().replace("\n", " ") == "eval_win_rate_reward / eval_win_rate_gold"]
    assert len(win) == 1
    assert [line.get_label() for line in win[0].lines] == ["eval_win_rate_reward", "eval_win_rate_gold"]
    assert list(win[0].lines[0].get_xdata()) == list(range(5, 41, 5))


def test_eval_curves_start_at_the_eval_before_training():
    """An RL stage logs the eval of the starting policy as step 0 (eval keys only): the eval curves
    start there, the training curves at step 1."""
    rows = rl_rows()
    assert _points(rows, "eval_reward")[0][:2] == [0, 5] and _points(rows, "eval_gold_score")[0][0] == 0
    assert _points(rows, "reward")[0][0] == 1
    fig = curves_figure(rows, CURVES["rl"], "ppo")
    panels = {ax.get_title(): ax for ax in fig.axes}
    for name in ("eval_reward", "eval_gold_score"):
        assert panels[name].lines[0].get_xdata()[0] == 0, name


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """(run directory, report.md) of synthetic_run, written as the pipeline writes it (every stage directory)."""
    run = synthetic_run(tmp_path_factory.mktemp("finished") / "run")
    return run, write_report(run).read_text()


def test_report_of_a_finished_run_plots_judges_and_times_each_rl_stage(finished_run):
    run, report = finished_run
    for name in ("sft", "rm", "ppo", "grpo", "ppo_gold_vs_proxy", "ppo_kl_vs_reward", "grpo_gold_vs_proxy",
                 "grpo_kl_vs_reward", "phase_time"):
        assert_png(run / f"report_{name}.png")
        assert f"(report_{name}.png)" in report
    parts = sections(report)
    assert "- step 31: reward slope +0.0412, gold_score slope -0.0103" in parts["ppo"]
    assert "no alarm" not in parts["ppo"] and "**Reward hacking:** no alarm\n" in parts["grpo"]
    assert "by the reward 62.5%, by the gold score 70.0%\n" in parts["ppo"]  # no holdout RM
    assert "Reward hacking" not in parts["sft"] + parts["rm"] and "kl_vs_reward" not in parts["sft"]
    table = parts["Time per phase (seconds, share of the stage)"]
    assert "| stage | generate | score | train | eval | total |" in table
    assert "| ppo | 120 (60%) | 30 (15%) | 45.5 (23%) | 4.5 (2%) | 200 |" in table
    assert "| grpo | 80 (80%) | 10 (10%) | 10 (10%) | 0 (0%) | 100 |" in table


def test_the_report_covers_every_stage_directory_in_pipeline_order(finished_run, tmp_path):
    """Whichever pipeline config wrote them (here a PPO run, then a GRPO run on the same run
    directory): sft, rm, ppo and grpo in pipeline order, each stage's LoRA variant after it; the
    run's data/, export/, tokenizer/ and a stage moved aside (<name>.replaced-<time>) are not stages."""
    report = finished_run[1]
    assert list(sections(report)) == ["sft", "rm", "ppo", "grpo", "Time per phase (seconds, share of the stage)"]
    assert [line.split(" | ")[0] for line in report.split("\n") if "| finished |" in line] == [
        "| sft", "| rm", "| ppo", "| grpo"]
    run = tmp_path / "run"
    for stage in ("ppo", "grpo", "rm", "sft"):
        write_stage(run, stage, [{"step": 1, "loss": 1.0}], {"stage": stage})
    for other in ("data", "export", "tokenizer", "notes"):  # notes: neither summary.json nor metrics.jsonl
        (run / other).mkdir()
    (run / "export" / "summary.json").write_text("{}")
    write_stage(run, "ppo.replaced-20261204-120000", rl_rows(steps=2), {"stage": "ppo"})
    for stage in ("rloo", "dpo_lora", "sft_lora", "ppo_lora", "dpo", "rm_holdout", "my_stage"):
        write_stage(run, stage, [{"step": 1, "loss": 1.0}])
    assert stage_dirs(run) == ["sft", "sft_lora", "rm", "rm_holdout", "dpo", "dpo_lora", "ppo", "ppo_lora", "grpo",
                               "rloo", "my_stage"]


def test_sizes_are_human_readable_and_nothing_prints_none(finished_run):
    assert [human_bytes(n) for n in (0, 1023, 1536, 996990976, 3 * 2**30)] == [
        "0 B", "1023 B", "1.5 KiB", "950.8 MiB", "3.0 GiB"]
    assert [human_seconds(s) for s in (8.751, 125, 7300)] == ["8.8 s", "2 min 5 s", "2 h 1 min"]
    assert format_value("refit_bytes_per_s_final", 25981593.0) == "24.8 MiB/s"
    assert format_value("checkpoint_save_bytes", 61440) == "60.0 KiB" and format_value("steps", 120) == "120"
    assert [format_value("started_from", None), format_value("lora", {}), format_value("checkpoint_warnings", [])] == [
        None, None, None]
    report = finished_run[1]
    assert "None" not in report and not re.findall(r"\b\d{7,}\b", report)  # no raw byte counts
    ppo = sections(report)["ppo"]
    for line in ("| peak_memory_bytes | 950.8 MiB |", "| refit_bytes_per_s_final | 24.8 MiB/s |",
                 "| checkpoint_bytes | 3.0 GiB |",  # the final checkpoint's files, as its commit.json lists them
                 "| actor | 1.1 MiB | 1.1 MiB | 2.1 MiB | 4.7 MiB | 279,104 |", "baseline 742.7 MiB;",
                 "peak above baseline 208.1 MiB;", "other (not in the account) 199.1 MiB;"):
        assert line in ppo, line
    assert "win_rate_holdout_rm_final" not in ppo and "started_from" not in ppo and "holdout RM" not in ppo
    assert "| ppo | finished | 40 | — | 950.8 MiB |" in report


def assert_clear_layout(fig):
    """After drawing: every visible text inside the figure (no clipped title or label), no two
    axes titles overlapping, and every legend outside every axes' data area (off the curves and
    bars) and inside the figure."""
    from matplotlib.legend import Legend
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer, inside = fig.canvas.get_renderer(), fig.bbox.padded(1)  # 1 px: rounding
    shown = [ax for ax in fig.axes if ax.get_visible()]
    # titles, axis labels and the figure's own texts (suptitle); tick labels are left to the layout
    # engine (matplotlib keeps unused ones, off-canvas, among an axis's texts)
    texts = [t for ax in shown for t in (ax.title, ax.xaxis.label, ax.yaxis.label)]
    texts += [t for t in fig.get_children() if isinstance(t, Text)]
    for text in (t for t in texts if t.get_visible() and t.get_text().strip()):
        box = text.get_window_extent(renderer)
        assert inside.contains(box.x0, box.y0) and inside.contains(box.x1, box.y1), text.get_text()
    titles = [ax.title.get_window_extent(renderer) for ax in shown if ax.get_title()]
    assert not any(a.overlaps(b) for i, a in enumerate(titles) for b in titles[i + 1:]), "titles overlap"
    legends = [lg for lg in fig.findobj(Legend) if lg.get_visible()]
    for legend in legends:
        box = legend.get_window_extent(renderer)
        assert inside.contains(box.x0, box.y0) and inside.contains(box.x1, box.y1), "legend cut off"
        assert not any(box.overlaps(ax.bbox) for ax in shown), [t.get_text() for t in legend.get_texts()]
    return legends


def test_titles_are_not_clipped_and_legends_do_not_cover_the_data():
    rows = rl_rows(holdout=True, alarm=[3, 4])
    rows[20]["eval_win_rate_holdout_rm"] = 0.5  # a long three-name panel title, first in the grid's last row
    assert len(assert_clear_layout(curves_figure(rows, CURVES["rl"], "reinforce_pp_baseline"))) == 1
    assert len(assert_clear_layout(gold_vs_proxy_figure(rows, "reinforce_pp_baseline"))) == 1
    assert len(assert_clear_layout(phase_time_figure(PHASE_SECONDS, {"grpo": 60.0}))) == 1
    from megatron_rlhf.logging.report import kl_vs_reward_figure

    assert_clear_layout(kl_vs_reward_figure(rows, "reinforce_pp_baseline"))


def test_an_async_stage_shows_its_wait_and_the_engine_generating_beside_the_trainer(tmp_path):
    run = synthetic_run(tmp_path / "run")
    summary = rl_summary("grpo")
    summary.update(phase_seconds={"wait": 5.0, "sync": 5.0, "generate": 1.0, "score": 40.0, "train": 49.0},
                   max_staleness=1, engine_generate_seconds=60.0)
    (run / "grpo" / "summary.json").write_text(json.dumps(summary))
    table = sections(write_report(run).read_text())["Time per phase (seconds, share of the stage)"]
    assert "| stage | wait | sync | generate | score | train | eval | total | engine (overlapped) |" in table
    assert "| grpo | 5 (5%) | 5 (5%) | 1 (1%) | 40 (40%) | 49 (49%) | 0 (0%) | 100 | 60 |" in table
    assert "| ppo | 0 (0%) | 0 (0%) | 120 (60%) |" in table and table.split("| ppo |")[1].split("\n")[0].endswith("| — |")
    assert_png(run / "report_phase_time.png")
    fig = phase_time_figure({"grpo": summary["phase_seconds"]}, {"grpo": 60.0})
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels[-1] == "vLLM engine generating (overlapped)" and "wait" in labels


def test_the_phase_time_bars_compare_every_rl_stage_of_the_run(tmp_path):
    """The pipeline reports only the stages it ran (here grpo); the phase-time comparison
    still covers ppo, run before it in the same run directory."""
    run = synthetic_run(tmp_path / "run")
    report = write_report(run, ["sft", "rm", "grpo"]).read_text()
    assert "## ppo" not in report and "| ppo | 120 (60%)" in report and "| grpo | 80 (80%)" in report


def test_user_data_without_gold_plots_the_proxy_against_the_holdout_rm(tmp_path):
    run = tmp_path / "run"
    summary = rl_summary("ppo", [ALARM_RECORD | {"independent": "holdout_rm_score"}], win_gold=None)
    summary["win_rate_holdout_rm_final"] = 0.55
    write_stage(run, "ppo", rl_rows(gold=False, holdout=True, alarm=[31]), summary)
    report = write_report(run, ["ppo"]).read_text()
    for name in ("gold_vs_proxy", "kl_vs_reward"):
        assert_png(run / f"report_ppo_{name}.png")
        assert f"(report_ppo_{name}.png)" in report
    assert "- step 31: reward slope +0.0412, holdout_rm_score slope -0.0103" in report
    assert "by the reward 62.5%, by the holdout RM 55.0%\n" in report  # no gold score: left out
    fig = gold_vs_proxy_figure(rl_rows(gold=False, holdout=True), "ppo")
    assert len(fig.axes) == 1 and [t.get_text() for t in fig.legends[0].get_texts()] == [
        "reward (proxy)", "eval_reward", "holdout_rm_score (independent)", "eval_holdout_rm_score"]


def test_unfinished_and_partial_stages_are_reported_not_crashed_on(tmp_path):
    run = tmp_path / "run"
    write_stage(run, "ppo", rl_rows(steps=8), None)  # stopped at step 8: no summary
    (run / "ppo" / "metrics.jsonl").open("a").write('{"step": 9, "rm_sc')  # a line torn by the kill
    write_commit(run / "ppo" / "iter_0000005", {"actor/__0_0.distcp": 5 * 2**20})
    (run / "ppo" / "iter_0000008").mkdir()  # a save the kill interrupted: no commit.json
    write_stage(run, "grpo", [{"step": 0, "eval_reward": 0.1}], rl_summary("grpo"))  # no alarm record
    (run / "rloo").mkdir()  # started, nothing written yet
    report = write_report(run, ["sft", "ppo", "grpo", "rloo"]).read_text()
    parts = sections(report)
    assert parts["ppo"].split("\n")[2] == ("**Not finished:** in progress or stopped at step 8 (no summary.json yet); "
                                           "a rerun resumes from its checkpoint at step 5 (5.0 MiB)")
    assert parts["rloo"].split("\n")[2] == ("**Not finished:** in progress or stopped before its first logged step "
                                            "(no summary.json yet)")
    assert parts["sft"].split("\n")[2] == "**Not started:** no sft/ directory in the run"
    overview = report.split("\n## ")[0]
    for row in ("| sft | not started | — | — | — |", "| ppo | in progress or stopped at step 8 | — | — | — |",
                "| grpo | finished | 40 | — | — |", "| rloo | started, nothing logged yet | — | — | — |"):
        assert row in overview, row
    assert "(report_ppo_gold_vs_proxy.png)" in parts["ppo"]  # the partial curves are shown
    assert_png(run / "report_ppo_gold_vs_proxy.png")
    assert "Reward hacking" not in parts["ppo"]
    assert "**Reward hacking:** no alarm (never checked" in parts["grpo"] and "kl_vs_reward" not in parts["grpo"]
    table = parts["Time per phase (seconds, share of the stage)"]
    assert "| grpo | 80 (80%)" in table and "| ppo |" not in table and "| rloo |" not in table


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_a_stage_without_phase_seconds_is_left_out_of_the_time_split(tmp_path, algorithm):
    run = tmp_path / "run"
    write_stage(run, algorithm, rl_rows(steps=3), {"algorithm": algorithm})
    report = write_report(run, [algorithm]).read_text()
    assert "Time per phase" not in report and not (run / "report_phase_time.png").exists()
    assert "**Reward hacking:** no alarm\n" in report  # checked, never on; the summary predates the record
    write_stage(run, "rloo", [{"step": 1, "reward": 0.1}], {"algorithm": "rloo", "reward_hacking_alarms": []})
    assert "**Reward hacking:** no alarm (never checked" in write_report(run, ["rloo"]).read_text()


def test_lora_stage_directories_are_reported_as_their_stage(tmp_path):
    """The pipeline names LoRA stages by directory (sft_lora, dpo_lora, ppo_lora): SFT and DPO
    curves for the first two, and the RL judges only for the RL stage."""
    run = tmp_path / "run"
    write_stage(run, "sft_lora", [{"step": k, "loss": 3 / k} for k in range(1, 6)], {"stage": "sft_lora", "steps": 5})
    write_stage(run, "dpo_lora", [{"step": k, "loss": 0.7 / k, "reward_accuracy": 0.5 + k / 20} for k in range(1, 6)],
                {"stage": "dpo_lora", "steps": 5})
    write_stage(run, "ppo_lora", rl_rows(steps=10), rl_summary("ppo", []))
    parts = sections(write_report(run, ["sft_lora", "dpo_lora", "ppo_lora"]).read_text())
    for stage in ("sft_lora", "dpo_lora", "ppo_lora"):
        assert_png(run / f"report_{stage}.png")
        assert f"(report_{stage}.png)" in parts[stage]
    assert "Reward hacking" not in parts["sft_lora"] + parts["dpo_lora"] and "win rate" not in parts["dpo_lora"]
    assert "**Reward hacking:** no alarm\n" in parts["ppo_lora"]
    assert "(report_ppo_lora_gold_vs_proxy.png)" in parts["ppo_lora"]


def test_a_run_of_an_earlier_version_is_read_under_the_current_reward_names(tmp_path):
    """Runs written before the combined reward was called `reward` (rm_score, eval_win_rate_rm,
    win_rate_rm_final, ...) still get their proxy curve, win rates and summary numbers."""
    old_names = {new: old for old, new in LEGACY_NAMES.items()}
    run = tmp_path / "run"
    summary = {old_names.get(k, k): v for k, v in rl_summary("ppo", []).items()} | {"rm_score_eval_before": 0.125}
    write_stage(run, "ppo", [{old_names.get(k, k): v for k, v in r.items()} for r in rl_rows(steps=10)], summary)
    assert "win_rate_rm_final" in summary and "rm_score" in (run / "ppo" / "metrics.jsonl").read_text()
    report = write_report(run, ["ppo"]).read_text()
    assert "by the reward 62.5%, by the gold score 70.0%" in report and "| reward_eval_before | 0.125 |" in report
    assert_png(run / "report_ppo_gold_vs_proxy.png")
    rows = _read_metrics(run / "ppo")
    assert rows[10]["reward"] == 0.5 and rows[10]["eval_win_rate_reward"] == 0.625 and "rm_score" not in rows[10]
