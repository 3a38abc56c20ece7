"""Damaged files in a run directory (issue 53, items 6 and 11): each stops the command that reads it
with one line naming the file and the fix (exit 2), never a traceback and never a silently wrong
result. The report's summary.json and metrics.jsonl, the sampling.json export-hf checks (it
exports none of it), a checkpoint's trainer state on resume, and the config.yaml a stage writes
at its start. In-process and on directories built here: no stage is launched (~2 s in all)."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import REPO
from megatron_rlhf.__main__ import main
from megatron_rlhf.checkpoint.validate import CheckpointError
from megatron_rlhf.config import ConfigError, load_config, write_resolved_config


def run_main(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def assert_one_line(text: str, *parts: str) -> None:
    """One line of error (no traceback) that names every one of `parts`."""
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text
    assert all(part in lines[0] for part in parts), (parts, lines[0])


# ----------------------------------------------------------------------------- report
def stage_with_rows(run, stage="sft", lines=('{"step": 1, "loss": 2.0}', '{"step": 2, "loss": 1.5}')):
    (run / stage).mkdir(parents=True, exist_ok=True)
    (run / stage / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return run / stage


@pytest.mark.parametrize("damage", ["not json", "a list", "not utf-8", "a directory"])
def test_report_names_a_damaged_summary_and_the_fix(tmp_path, capsys, damage):
    run = tmp_path / "run"
    summary = stage_with_rows(run) / "summary.json"
    if damage == "a directory":
        summary.mkdir()
    else:
        summary.write_bytes({"not json": b'{"steps": 2, "wall', "a list": b"[1, 2]",
                             "not utf-8": b'{"steps": "\xff\xfe"}'}[damage])
    code, text = run_main(capsys, "report", "--run", run)
    assert code == 2
    assert_one_line(text, "config error:", str(summary), "delete it")
    assert not (run / "report.md").exists()
    # the pipeline reads it with the same reader: the same refusal, before any stage starts
    from megatron_rlhf.trainers.stage_inputs import _read_summary

    with pytest.raises(ConfigError, match="delete it"):
        _read_summary(summary.parent)


@pytest.mark.parametrize("line", ["[1, 2]", '"text"', "7", '{"loss": 1.0}', '{"step": "3", "loss": 1.0}'])
def test_report_names_a_metrics_line_that_is_not_a_row(tmp_path, capsys, line):
    run = tmp_path / "run"
    stage = stage_with_rows(run, lines=('{"step": 1, "loss": 2.0}', line, '{"step": 3, "loss": 1.0}'))
    code, text = run_main(capsys, "report", "--run", run)
    assert code == 2
    assert_one_line(text, "config error:", f"{stage / 'metrics.jsonl'}:2:", "delete that line")


def test_a_torn_metrics_line_is_skipped_and_a_resume_drops_every_damaged_line(tmp_path, capsys):
    from megatron_rlhf.logging.metrics import MetricsLogger

    run = tmp_path / "run"
    stage = stage_with_rows(run, lines=('{"step": 1, "loss": 2.0}', '{"step": 2, "loss": 1.5}', '{"step": 3, "lo'))
    assert run_main(capsys, "report", "--run", run) == (0, f"{run / 'report.md'}\n")
    # a resumed stage rewrites its metrics.jsonl up to its checkpoint's step: rows only
    rows = ['{"step": 1, "loss": 2.0}', "[1, 2]", '"text"', '{"loss": 1.0}', '{"step": 2, "loss": 1.5}',
            '{"step": 3, "loss": 1.0}']
    (stage / "metrics.jsonl").write_text("".join(r + "\n" for r in rows))
    MetricsLogger(stage, "sft", 10, resume_step=2, tensorboard=False).close()
    assert (stage / "metrics.jsonl").read_text().splitlines() == [rows[0], rows[4]]


# ----------------------------------------------------------------------------- export-hf
def fake_checkpoint(stage, step: int, state) -> Path:
    """A committed iter_* directory as CheckpointManager lays it out (one rank): an actor role
    directory (its .metadata never read here), the trainer state `state` and commit.json."""
    iter_dir = stage / f"iter_{step:07d}"
    (iter_dir / "actor").mkdir(parents=True)
    (iter_dir / "actor" / ".metadata").write_bytes(b"m" * 10)
    (iter_dir / "trainer_state").mkdir()
    torch.save(state, iter_dir / "trainer_state" / "rank_00000.pt")
    files = {p.relative_to(iter_dir).as_posix(): p.stat().st_size for p in iter_dir.rglob("*") if p.is_file()}
    (iter_dir / "commit.json").write_text(json.dumps({"step": step, "roles": ["actor"], "world_size": 1,
                                                      "layout": {"tp": 1, "pp": 1, "dp": 1}, "files": files}))
    (stage / "latest").write_text(iter_dir.name + "\n")
    return iter_dir


# What record_run writes, then damage: the file itself (issue 53 item 11) or its values (item 6).
RECORDED = {"do_sample": True, "temperature": 0.7, "top_p": 1.0, "top_k": 0, "max_new_tokens": 12}
BAD_SAMPLING = {
    "hot temperature": (json.dumps({**RECORDED, "temperature": "hot"}), 'temperature="hot": must be a number > 0'),
    "remote code": (json.dumps({**RECORDED, "trust_remote_code": True}), "'trust_remote_code' is not a sampling setting"),
    "negative max_new_tokens": (json.dumps({**RECORDED, "max_new_tokens": -5}),
                                "max_new_tokens=-5: must be an integer >= 1"),
    "float top_k": (json.dumps({**RECORDED, "top_k": 2.5}), "top_k=2.5: must be an integer >= 0"),
    "string do_sample": (json.dumps({**RECORDED, "do_sample": "yes"}), 'do_sample="yes": must be true or false'),
    "not json": ('{"temperature": 0.7, "top', "unreadable"),
    "not an object": ("[0.7, 12]", "not the JSON object of sampling settings"),
    "a directory": (None, "unreadable"),
}


@pytest.mark.parametrize("case", BAD_SAMPLING)
def test_export_refuses_a_damaged_or_unsafe_sampling_json(tmp_path, capsys, case):
    text, why = BAD_SAMPLING[case]
    run = tmp_path / "run"
    model = dataclasses.asdict(load_config(None, ["model.vocab_size=64"]).model)
    fake_checkpoint(run / "sft", 4, {"step": 4, "model_config": model})
    sampling = run / "sampling.json"
    sampling.mkdir() if text is None else sampling.write_text(text)
    # what export_hf checks before any weight is read, read as it reads it
    from megatron_rlhf.convert import ConvertError
    from megatron_rlhf.convert.hf_io import _recorded_with_checkpoint

    with pytest.raises(ConvertError, match=re.escape(why)):
        _recorded_with_checkpoint(run / "sft" / "iter_0000004")
    out = tmp_path / "exported"
    code, printed = run_main(capsys, "export-hf", "--ckpt", run / "sft", "--role", "actor", "--out", out)
    assert code == 2
    assert_one_line(printed, "conversion error:", str(sampling), why, "delete")
    assert not out.exists() and not list(tmp_path.glob("exported*"))


def test_the_recorded_sampling_settings_are_read_back_as_written(tmp_path):
    from megatron_rlhf.convert.hf_config import read_recorded_sampling

    path = tmp_path / "sampling.json"
    path.write_text(json.dumps(RECORDED, indent=1) + "\n")  # as record_run writes them
    assert read_recorded_sampling(path) == RECORDED
    path.write_text(json.dumps({"temperature": 2, "max_new_tokens": 1}))  # an int temperature; any subset
    assert read_recorded_sampling(path) == {"temperature": 2, "max_new_tokens": 1}


# ----------------------------------------------------------------------------- trainer state on resume
@pytest.fixture
def one_process_group():
    """A gloo group of this process alone (loading is collective), destroyed after the test."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("state, why", [
    ({"consumed_samples": 32}, "has no step"),
    ({"step": "4"}, "step='4', in iter_0000004 (saved at step 4)"),
    ({"step": 4.0}, "step=4.0"),
    ({"step": True}, "step=True"),
    ({"step": 3}, "step=3, in iter_0000004"),
    ([4, 32], "holds a list"),
])
def test_a_trainer_state_without_its_integer_step_is_refused_on_resume(tmp_path, one_process_group, state, why):
    from megatron_rlhf.checkpoint.manager import CheckpointManager

    stage = tmp_path / "sft"
    iter_dir = fake_checkpoint(stage, 4, {**state, "rng": {}} if isinstance(state, dict) else state)
    with pytest.raises(CheckpointError) as refused:
        CheckpointManager(stage).load({})
    message = str(refused.value)
    assert message.startswith(f"{iter_dir / 'trainer_state' / 'rank_00000.pt'}: ") and why in message, message
    assert f"move {iter_dir} out of {stage}" in message and "\n" not in message
    # what a good one passes
    from megatron_rlhf.checkpoint.manager import check_trainer_state

    good = {"step": 4, "consumed_samples": 32}
    assert check_trainer_state(good, iter_dir / "trainer_state" / "rank_00000.pt") is good


# ----------------------------------------------------------------------------- <stage>/config.yaml
@pytest.mark.parametrize("name", ["config.yaml", "config.yaml.prev"])
def test_a_directory_in_place_of_the_stage_config_is_named_and_nothing_is_left(tmp_path, name):
    cfg = load_config(None, [])
    stage = tmp_path / "sft"
    write_resolved_config(cfg, stage)
    (stage / "config.yaml").write_text((stage / "config.yaml").read_text().replace("seed: 1234", "seed: 1"))
    if name == "config.yaml":
        (stage / "config.yaml").unlink()
    (stage / name).mkdir()
    with pytest.raises(ConfigError, match=f"{stage / name}: a directory where the stage writes its resolved config.*"
                                          "move it away or delete it"):
        write_resolved_config(cfg, stage)
    assert sorted(p.name for p in stage.iterdir()) == sorted({"config.yaml", name})  # no config.yaml.tmp<pid>
    (stage / name).rmdir()
    assert write_resolved_config(cfg, stage).is_file()


@pytest.mark.slow
def test_an_exported_policy_carries_only_the_checked_sampling_settings(sft_rm_root, tmp_path, capsys):
    """End to end on a trained SFT checkpoint (conftest.sft_rm_root, copied): a recorded
    trust_remote_code stops export-hf before anything is written; the settings the run recorded
    stay the run's (its rollouts): generation_config.json has the token ids, none of them."""
    import shutil

    source, run = sft_rm_root / "main", tmp_path / "run"
    newest = (source / "sft" / "latest").read_text().strip()
    shutil.copytree(source / "sft" / newest, run / "sft" / newest)
    (run / "sft" / "latest").write_text(newest + "\n")
    shutil.copytree(source / "tokenizer", run / "tokenizer")
    recorded = json.loads((source / "sampling.json").read_text())
    (run / "sampling.json").write_text(json.dumps({**recorded, "trust_remote_code": True}))
    export = ["export-hf", "--ckpt", run / "sft", "--role", "actor", "--out", tmp_path / "hf"]
    code, text = run_main(capsys, *export)
    assert code == 2 and not (tmp_path / "hf").exists()
    assert_one_line(text, f"conversion error: {run / 'sampling.json'}: 'trust_remote_code' is not a sampling setting")
    (run / "sampling.json").write_text(json.dumps(recorded))
    # A process of its own: an export that runs starts a process group with the CPU adaptations
    # (parallel/cpu.py patches torch.cuda for the process), which must not reach this pytest
    # worker's later tests (the device-discipline tests fake CUDA tensors).
    proc = subprocess.run([sys.executable, "-m", "megatron_rlhf", *map(str, export)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert not set(recorded) & set(generation) and "trust_remote_code" not in generation
    assert generation.keys() <= {"bos_token_id", "eos_token_id", "pad_token_id"} and "eos_token_id" in generation
