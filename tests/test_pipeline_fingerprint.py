"""`pipeline` reuses a finished stage only on the inputs its summary.json recorded
(trainers/stage_inputs.py), judged on small stage directories written here: a summary and a
committed checkpoint record, no training."""

import json

import pytest

from megatron_rlhf.checkpoint.validate import CheckpointError
from megatron_rlhf.config import ConfigError, load_config, validate
from megatron_rlhf.trainers.stage_inputs import plan, replaced_name, stage_inputs
from megatron_rlhf.trainers.stage_data import stage_dir

STEPS = 12


def config(root, *overrides):
    return validate(load_config("pipelines/tiny_cpu.yaml", [
        f"checkpoint.root={root}", "checkpoint.run_name=run", f"sft.steps={STEPS}", f"rm.steps={STEPS}",
        "pipeline.stages=[sft,rm]", *overrides]))


def finish(cfg, stage, inputs=None):
    """<run>/<stage> as a finished stage leaves it: a committed checkpoint and summary.json
    with the inputs the stage runner records (those of `cfg` unless given)."""
    out = stage_dir(cfg, stage)
    ckpt = out / f"iter_{STEPS:07d}"
    ckpt.mkdir(parents=True)
    (ckpt / "commit.json").write_text(json.dumps({"step": STEPS, "roles": [], "files": {}}))
    (out / "latest").write_text(ckpt.name + "\n")
    recorded = stage_inputs(cfg, stage) if inputs is None else inputs
    summary = {"stage": stage, "steps": STEPS, **({"inputs": recorded} if recorded != "none" else {})}
    (out / "summary.json").write_text(json.dumps(summary))


def sft_data(tmp_path, text):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "the film was", "response": text}) + "\n")
    return f"data.sft_train={path}"


def actions(plans):
    return {stage: p.action for stage, p in plans.items()}


def test_a_finished_stage_is_skipped_on_the_same_inputs_and_continued_on_more_steps(tmp_path):
    data = sft_data(tmp_path, "good")
    cfg = config(tmp_path, data)
    finish(cfg, "sft")
    finish(cfg, "rm")
    assert actions(plan(cfg)) == {"sft": "skip", "rm": "skip"}
    # what the stage does not depend on may differ: cadences, layout, the data file's path
    moved = tmp_path / "moved.jsonl"
    moved.write_text((tmp_path / "sft.jsonl").read_text())
    same = config(tmp_path, f"data.sft_train={moved}", "sft.log_interval=1", "sft.save_interval=1",
                  "sft.micro_batch_size=4", "parallel.tensor_parallel=2")
    assert actions(plan(same)) == {"sft": "skip", "rm": "skip"}
    longer = plan(config(tmp_path, data, f"rm.steps={STEPS + 6}"))
    assert actions(longer) == {"sft": "skip", "rm": "continue"}
    assert f"continuing to rm.steps={STEPS + 6}" in longer["rm"].note


def test_changed_data_stops_before_training_naming_the_split_and_the_fixes(tmp_path):
    cfg = config(tmp_path, sft_data(tmp_path, "good"))
    finish(cfg, "sft")
    finish(cfg, "rm")
    changed = config(tmp_path, sft_data(tmp_path, "bad"))  # same path, other contents
    with pytest.raises(ConfigError) as err:
        plan(changed)
    message = str(err.value)
    assert f"{stage_dir(cfg, 'sft')}: data.sft_eval: other contents (sha256:" in message, message
    assert "data.sft_train: other contents (sha256:" in message
    assert "rm" in message and "starts from sft, which changed" in message
    assert "checkpoint.run_name=run_2" in message and "pipeline.rerun=[sft,rm]" in message


@pytest.mark.parametrize("override, named", [
    ("sft.optimizer.lr=1e-3", "sft.optimizer.lr: was 0.003, now 0.001"),
    ("data.task=arithmetic", "tokenizer: was builtin (sentiment) sha256:"),
    ("seed=7", "seed: was 1234, now 7"),
    (f"sft.steps={STEPS - 1}", f"sft.steps: finished with {STEPS} steps, now {STEPS - 1}"),
])
def test_changed_settings_tokenizer_or_fewer_steps_are_refused(tmp_path, override, named):
    finish(config(tmp_path), "sft")
    with pytest.raises(ConfigError, match="pipeline.rerun=\\[sft") as err:
        plan(config(tmp_path, override, "pipeline.stages=[sft]"))
    assert named in str(err.value)


def test_a_stage_whose_start_checkpoint_was_retrained_is_refused(tmp_path):
    cfg = config(tmp_path)
    finish(cfg, "sft")
    finish(cfg, "rm")
    # sft trained again alone with another learning rate: its commit record can be byte-identical
    retrained = config(tmp_path, "sft.optimizer.lr=1e-3")
    (stage_dir(cfg, "sft") / "summary.json").write_text(json.dumps(
        {"steps": STEPS, "inputs": stage_inputs(retrained, "sft")}))
    with pytest.raises(ConfigError) as err:
        plan(retrained)
    assert f"{stage_dir(cfg, 'rm')}: start: was iter_{STEPS:07d}" in str(err.value)
    assert "its stage's inputs sha256:" in str(err.value) and "pipeline.rerun=[rm]" in str(err.value)


def test_rerun_replaces_the_changed_stage_and_is_not_repeated_once_it_has_trained(tmp_path):
    cfg = config(tmp_path)
    finish(cfg, "sft")
    finish(cfg, "rm")
    changed = config(tmp_path, "sft.optimizer.lr=1e-3", "pipeline.rerun=[sft]")  # an input of sft alone
    with pytest.raises(ConfigError, match=r"run/rm: starts from sft, which is trained again.*rerun=\[sft,rm\]"):
        plan(changed)  # rm started from the old sft
    changed = config(tmp_path, "sft.optimizer.lr=1e-3", "pipeline.rerun=[sft,rm]")
    plans = plan(changed)
    assert actions(plans) == {"sft": "rerun", "rm": "rerun"}
    assert plans["sft"].replaces == [stage_dir(cfg, "sft")] and plans["rm"].replaces == [stage_dir(cfg, "rm")]
    aside = replaced_name(stage_dir(cfg, "sft"), now=0)
    assert aside.parent == stage_dir(cfg, "sft").parent and aside.name.startswith("sft.replaced-")
    aside.mkdir()
    assert replaced_name(stage_dir(cfg, "sft"), now=0) != aside  # never onto an earlier one
    # once retrained (a requeue repeats the same command), the stages are reused, not replaced again
    for stage in ("sft", "rm"):
        (stage_dir(cfg, stage) / "summary.json").unlink()
    (stage_dir(cfg, "sft") / "summary.json").write_text(json.dumps(
        {"steps": STEPS, "inputs": stage_inputs(changed, "sft")}))
    (stage_dir(cfg, "rm") / "summary.json").write_text(json.dumps(
        {"steps": STEPS, "inputs": stage_inputs(changed, "rm")}))
    assert actions(plan(changed)) == {"sft": "skip", "rm": "skip"}


def test_a_finished_stage_with_a_damaged_checkpoint_is_not_skipped(tmp_path):
    cfg = config(tmp_path, "pipeline.stages=[sft]")
    finish(cfg, "sft")
    commit = stage_dir(cfg, "sft") / f"iter_{STEPS:07d}" / "commit.json"
    commit.write_text(json.dumps({"step": STEPS, "roles": [], "files": {"trainer_state/rank_00000.pt": 10}}))
    with pytest.raises(CheckpointError, match="trainer_state/rank_00000.pt: missing.*delete .*sft/summary.json"):
        plan(cfg)


def test_a_dense_stage_finished_before_the_expert_fields_existed_is_reused(tmp_path):
    cfg = config(tmp_path, sft_data(tmp_path, "good"))
    inputs = stage_inputs(cfg, "sft")
    assert not [k for k in inputs if "moe" in k or "experts" in k]  # as recorded before model.num_experts existed
    finish(cfg, "sft", inputs)
    finish(cfg, "rm")
    # and they do not change what a dense model trains
    assert actions(plan(config(tmp_path, sft_data(tmp_path, "good"), "model.moe_aux_loss_coef=0.5",
                               "model.moe_router_topk=4"))) == {"sft": "skip", "rm": "skip"}


def test_a_summary_without_inputs_is_reused_with_a_note(tmp_path):
    cfg = config(tmp_path, "pipeline.stages=[sft]")
    finish(cfg, "sft", inputs="none")  # written before summaries recorded their inputs
    plans = plan(cfg)
    assert plans["sft"].action == "skip" and "records no inputs" in plans["sft"].note
    assert plan(config(tmp_path, "pipeline.stages=[sft]", "pipeline.rerun=[sft]"))["sft"].action == "rerun"


def test_rerun_names_stages_of_the_pipeline(tmp_path):
    with pytest.raises(ConfigError, match=r"pipeline.rerun=\['ppo'\]: \['ppo'\] not in pipeline.stages.*stage is rl"):
        config(tmp_path, "pipeline.rerun=[ppo]")


def test_a_single_turn_rl_stage_fingerprint_leaves_the_environment_settings_out():
    """An RL stage finished before the multi-turn settings existed is still reused: single-turn
    (rl.environment.type none) they change nothing it trains and are not inputs; multi-turn they are."""
    single = stage_inputs(validate(load_config("pipelines/tiny_cpu.yaml", [])), "rl")
    assert single and not [k for k in single if "environment" in k or k in ("rl.max_turns", "rl.max_total_tokens",
                                                                             "rl.max_failed_episodes")]
    multi = stage_inputs(validate(load_config("pipelines/tiny_cpu_agent.yaml", [])), "rl")
    assert multi["rl.environment.type"] == "class" and multi["rl.max_turns"] == 3
