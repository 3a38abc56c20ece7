"""SFT and RM stages on the built-in sentiment task, run as users run them
(`python -m megatron_rlhf sft|rm` under torchrun), checked through what they write."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from distributed import REPO, read_global_tensors
from stages import RECIPE, RM_STEPS, SFT_STEPS, SIZES, metrics, stage, summary

pytestmark = pytest.mark.slow

# SFT must bring the eval NLL of response tokens below this fraction of its start.
SFT_EVAL_LOSS_RATIO = 0.6
RM_MIN_ACCURACY = 0.9


@pytest.fixture(scope="module")
def root(sft_rm_root):
    # The main SFT run resumed from its mid-run checkpoint, in a fresh run directory.
    stage(1, "sft", sft_rm_root, "resumed", f"sft.steps={SFT_STEPS}", f"sft.save_interval={SFT_STEPS // 2}",
          f"sft.eval_interval={SFT_STEPS // 2}", f"checkpoint.load={sft_rm_root}/main/sft/iter_{SFT_STEPS // 2:07d}")
    return sft_rm_root


def test_sft_lowers_eval_loss(root):
    s = summary(root, "main", "sft")
    assert s["stage"] == "sft" and s["steps"] == SFT_STEPS
    assert s["eval_loss"] < SFT_EVAL_LOSS_RATIO * s["eval_loss_start"], s
    first = metrics(root, "main", "sft")[0]  # the eval before training, where the report's eval curve starts
    assert first["step"] == 0 and first["eval_loss"] == pytest.approx(s["eval_loss_start"])
    for key in ("final_train_loss", "wall_seconds", "checkpoint"):
        assert s[key] is not None


def test_rm_learns_the_preferences(root):
    s = summary(root, "main", "rm")
    assert s["eval_accuracy"] >= RM_MIN_ACCURACY, s
    assert s["eval_margin_normalized"] > 0
    # normalisation over SFT responses is stored with the checkpoint
    assert s["reward_std"] > 0 and s["reward_mean"] != 0.0


def test_pipeline_reuses_stages_on_the_inputs_their_summaries_recorded(sft_rm_root):
    """The inputs a stage records in summary.json are the ones `pipeline` computes for the same
    settings: the finished SFT and RM are skipped, more RM steps continue it, other data is refused."""
    from megatron_rlhf.config import ConfigError, load_config
    from megatron_rlhf.trainers.stage_inputs import plan

    def pipeline_plan(*overrides):
        return plan(load_config(RECIPE[1], [*SIZES, f"checkpoint.root={sft_rm_root}", "checkpoint.run_name=main",
                                            f"sft.steps={SFT_STEPS}", f"rm.steps={RM_STEPS}", *overrides]))

    assert summary(sft_rm_root, "main", "rm")["inputs"]["start"].startswith(f"iter_{SFT_STEPS:07d}, commit.json")
    # each stage wrote the config it ran (conftest.sft_rm_root's SFT command), a recipe that reads back equal
    assert load_config(sft_rm_root / "main" / "sft" / "config.yaml") == load_config(RECIPE[1], [
        *SIZES, f"checkpoint.root={sft_rm_root}", "checkpoint.run_name=main", f"sft.steps={SFT_STEPS}",
        f"sft.save_interval={SFT_STEPS // 2}", f"sft.eval_interval={SFT_STEPS // 2}"])
    assert {s: p.action for s, p in pipeline_plan("pipeline.stages=[sft,rm]").items()} == {"sft": "skip", "rm": "skip"}
    assert pipeline_plan(f"rm.steps={RM_STEPS + 10}")["rm"].action == "continue"
    with pytest.raises(ConfigError, match="sft: data.sft_train: was task sentiment"):
        pipeline_plan("data.task_sizes.sft_train=512")


def test_resumed_sft_equals_uninterrupted(root):
    last = f"iter_{SFT_STEPS:07d}"
    want = read_global_tensors(root / "main" / "sft" / last / "actor")
    got = read_global_tensors(root / "resumed" / "sft" / last / "actor")
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key
    assert summary(root, "resumed", "sft")["eval_loss"] == summary(root, "main", "sft")["eval_loss"]


def test_checkpoint_layout_and_retention(root):
    sft_dir = root / "main" / "sft"
    assert (sft_dir / "latest").read_text().strip() == f"iter_{SFT_STEPS:07d}"
    iters = sorted(p.name for p in sft_dir.glob("iter_*"))
    assert iters == [f"iter_{SFT_STEPS // 2:07d}", f"iter_{SFT_STEPS:07d}"]
    assert not list(sft_dir.glob("*.tmp"))
    assert (sft_dir / iters[-1] / "trainer_state" / "rank_00000.pt").is_file()


@pytest.mark.parametrize("name", ["sft", "rm"])
def test_tensorboard_matches_metrics_jsonl(root, name):
    lines = [json.loads(x) for x in (root / "main" / name / "metrics.jsonl").read_text().splitlines()]
    assert lines, "nothing logged"
    acc = EventAccumulator(str(root / "main" / name / "tensorboard"))
    acc.Reload()
    assert all(isinstance(line["time"], float) for line in lines)  # each row's wall-clock time
    keys = {k for line in lines for k in line if k not in ("step", "time")}  # time: the row's, not a metric
    assert {f"{name}/{k}" for k in keys} <= set(acc.Tags()["scalars"])
    for key in keys:
        logged = {x["step"]: x[key] for x in lines if key in x}
        events = {e.step: e.value for e in acc.Scalars(f"{name}/{key}")}
        assert events == pytest.approx(logged, rel=1e-6), key  # TensorBoard stores float32


def test_checkpoint_saved_at_tp2_loads_at_tp1_with_identical_outputs(root):
    """SFT at TP2 (2 processes); then SFT at TP1 resumed from it: the eval loss the TP1 run
    computes right after loading equals the TP2 run's final eval loss."""
    steps = ["sft.steps=6", "sft.optimizer.warmup_steps=2", "sft.save_interval=0", "sft.eval_interval=6",
             "data.task_sizes.sft_train=256"]
    stage(2, "sft", root, "tp2", "parallel.tensor_parallel=2", *steps)
    shutil.copytree(root / "tp2" / "sft", root / "tp1" / "sft")
    (root / "tp1" / "sft" / "summary.json").unlink()
    stage(1, "sft", root, "tp1", *steps[1:], "sft.steps=8")
    tp2, tp1 = summary(root, "tp2", "sft"), summary(root, "tp1", "sft")
    assert tp1["eval_loss_start"] == pytest.approx(tp2["eval_loss"], abs=1e-5)
    assert tp1["steps"] == 8


def test_sft_on_user_jsonl_with_a_local_hf_tokenizer(tmp_path):
    """The path users take: one JSONL file (its eval part held out) and a tokenizer directory,
    no built-in task, no model.vocab_size (the tokenizer's)."""
    from test_data import make_hf_dir

    tok = make_hf_dir(tmp_path / "tok", {"eos_token": "</s>", "pad_token": "<pad>"})
    rows = [{"prompt": "hello", "response": "world again", "source": "kept-and-ignored"}] * 16
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stage(1, "sft", tmp_path, "user", "data.task=null", f"data.tokenizer={tok}", "data.eval_fraction=0.25",
          f"data.sft_train={tmp_path / 'train.jsonl'}",
          "sft.steps=3", "sft.optimizer.warmup_steps=0", "sft.global_batch_size=8", "sft.micro_batch_size=4")
    s = summary(tmp_path, "user", "sft")
    assert s["steps"] == 3 and s["train_data"]["total"] == 12 and s["eval_data"]["total"] == 4
    assert s["eval_loss"] < s["eval_loss_start"]
    assert "4 of 16 records" in s["data_sources"]["sft_eval"]


def test_bad_user_data_stops_with_file_line_and_field(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "hello", "response": "world"}\n{"prompt": "hello"}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rlhf", "sft", *RECIPE, f"data.sft_train={tmp_path / 'train.jsonl'}",
         f"checkpoint.root={tmp_path}"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2
    assert f"data error: {tmp_path / 'train.jsonl'}:2: field 'response': missing" in proc.stderr
