"""CheckpointManager is crash-safe and self-validating: commit records, validation, fallback to
the newest complete checkpoint, retention, the bytes megatron's own save writes (without its
up-front copies), async saves equal to sync ones while training goes on, no checkpoint from NaN
weights, a rank SIGKILLed in the middle of a save, and a resume at another layout. The fast
tests check validation and the choice of checkpoint on directories built here; the slow ones
run real 2-process jobs (tests/workers/checkpoint_safety.py)."""

import dataclasses
import json
import os
import pickle
import shutil

import pytest
import torch

from distributed import TINY_MODEL, read_global_tensors, torchrun
from megatron_rlhf.checkpoint.validate import (
    CheckpointError, DamagedNewestCheckpoint, checkpoint_dirs, find_checkpoint, validate,
)

WORKER = "tests/workers/checkpoint_safety.py"
# lr large enough that one step moves the weights far beyond float noise
OVERRIDES = [*TINY_MODEL, "seed=7", "optimizer.lr=0.01"]
TP2, PP2 = ["parallel.tensor_parallel=2"], ["parallel.pipeline_parallel=2"]
KILL_6 = {"MEGATRON_RLHF_FAULT": "kill@save:6:1"}


# --------------------------------------------------------------------- fast: validation
def fake_checkpoint(stage, step, files=None, commit=True):
    """An iter_* dir shaped like the manager's: role dir, trainer state, commit.json."""
    path = stage / f"iter_{step:07d}"
    files = files or {"actor/__0_0.distcp": b"x" * 100, "actor/.metadata": b"m" * 10,
                      "trainer_state/rank_00000.pt": b"r" * 20, "trainer_state/rank_00001.pt": b"r" * 20}
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    if commit:
        record = {"step": step, "roles": ["actor"], "world_size": 2, "layout": {"tp": 2, "pp": 1, "dp": 1},
                  "files": {rel: len(data) for rel, data in files.items()}}
        (path / "commit.json").write_text(json.dumps(record))
    return path


def test_validate_reports_each_kind_of_damage(tmp_path):
    good = fake_checkpoint(tmp_path, 1)
    assert validate(good) == []
    truncated = fake_checkpoint(tmp_path, 2)
    (truncated / "actor" / "__0_0.distcp").write_bytes(b"x" * 40)
    assert validate(truncated) == ["actor/__0_0.distcp: 40 bytes, 100 when committed"]
    missing = fake_checkpoint(tmp_path, 3)
    (missing / "trainer_state" / "rank_00001.pt").unlink()
    assert validate(missing) == ["trainer_state/rank_00001.pt: missing"]
    no_role = fake_checkpoint(tmp_path, 4)
    shutil.rmtree(no_role / "actor")
    assert validate(no_role)[0] == "actor/: missing" and "actor/__0_0.distcp: missing" in validate(no_role)
    uncommitted = fake_checkpoint(tmp_path, 5, commit=False)
    assert validate(uncommitted) == ["commit.json: missing (the save was never committed)"]
    garbled = fake_checkpoint(tmp_path, 6)
    (garbled / "commit.json").write_text('{"step": 6, "fil')
    assert validate(garbled)[0].startswith("commit.json: unreadable")
    assert validate(tmp_path / "iter_0000099") == ["directory missing"]


def test_find_checkpoint_falls_back_past_damage_and_reports_it(tmp_path):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4)
    newest = fake_checkpoint(tmp_path, 6)
    (newest / "trainer_state" / "rank_00001.pt").unlink()
    fake_checkpoint(tmp_path, 8, commit=False).rename(tmp_path / "iter_0000008.tmp")
    (tmp_path / "latest").write_text("iter_0000006\n")
    path, warnings = find_checkpoint(tmp_path)
    assert path == tmp_path / "iter_0000004"
    assert warnings == ["iter_0000008.tmp: an unfinished save (interrupted while writing); ignored",
                        "checkpoint iter_0000006 is damaged (trainer_state/rank_00001.pt: missing); "
                        "falling back to iter_0000004"]
    # `latest` naming a missing directory, or no `latest`: the newest complete one
    (tmp_path / "latest").write_text("iter_0000010\n")
    path, warnings = find_checkpoint(tmp_path)
    assert path.name == "iter_0000004" and "'latest' names 'iter_0000010', which does not exist" in warnings
    (tmp_path / "latest").unlink()
    assert find_checkpoint(tmp_path)[0].name == "iter_0000004"
    # a complete checkpoint newer than the one `latest` names is not used
    (tmp_path / "latest").write_text("iter_0000002\n")
    path, warnings = find_checkpoint(tmp_path)
    assert path.name == "iter_0000002"
    assert "iter_0000004 is newer than the checkpoint 'latest' names (iter_0000002); ignored" in warnings


def test_find_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        find_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_checkpoint(tmp_path / "nowhere")
    first = fake_checkpoint(tmp_path, 2)
    (first / "actor" / ".metadata").unlink()
    second = fake_checkpoint(tmp_path, 4, commit=False)
    (tmp_path / "latest").write_text("iter_0000004\n")
    # explicit iter dir: validated, never silently replaced
    with pytest.raises(CheckpointError, match=r"iter_0000002 is damaged \(actor/.metadata: missing\)"):
        find_checkpoint(first)
    assert find_checkpoint(fake_checkpoint(tmp_path / "other", 1)) == (tmp_path / "other" / "iter_0000001", [])
    # a stage with checkpoints, none complete: what is wrong with each
    with pytest.raises(CheckpointError) as e:
        find_checkpoint(tmp_path)
    assert f"no complete checkpoint in {tmp_path}" in str(e.value)
    assert "iter_0000004 is damaged (commit.json: missing (the save was never committed))" in str(e.value)
    assert "iter_0000002 is damaged (actor/.metadata: missing)" in str(e.value)
    assert isinstance(e.value, FileNotFoundError)  # callers treating "nothing to load" alike keep working
    second.rename(tmp_path / "iter_0000004.tmp")
    shutil.rmtree(first)
    with pytest.raises(CheckpointError, match="iter_0000004.tmp: an unfinished save"):
        find_checkpoint(tmp_path)


def test_a_damaged_newest_checkpoint_is_refused_unless_an_older_one_is_named(tmp_path):
    """Starting another stage from (or exporting) a stage whose newest checkpoint is damaged
    must not silently use an older one; resuming does, loudly (the crash-safety fallback)."""
    from megatron_rlhf.checkpoint.manager import _resume_choice, resolve_checkpoint
    from megatron_rlhf.trainers.serve_reward import find_reward_checkpoint

    older = fake_checkpoint(tmp_path, 4)
    fake_checkpoint(tmp_path, 2)
    newest = fake_checkpoint(tmp_path, 6)
    (newest / "actor" / "__0_0.distcp").unlink()
    (tmp_path / "latest").write_text("iter_0000006\n")
    damage = "checkpoint iter_0000006 is damaged (actor/__0_0.distcp: missing)"
    with pytest.raises(DamagedNewestCheckpoint) as e:
        find_checkpoint(tmp_path, allow_fallback=False)
    assert str(e.value) == (f"the newest checkpoint of {tmp_path} is not usable: {damage}. An older checkpoint is "
                            "not used in its place unless asked for: to use the newest complete one, iter_0000004, "
                            f"name it explicitly: {tmp_path}@iter_4 (or {older})")
    assert str(pickle.loads(pickle.dumps(e.value))) == str(e.value)  # it crosses ranks pickled
    with pytest.raises(DamagedNewestCheckpoint) as e:
        resolve_checkpoint(tmp_path, "rm.init_from")
    assert str(e.value).startswith("rm.init_from: the newest checkpoint") and damage in str(e.value)
    assert str(e.value).endswith(f"iter_0000004, set rm.init_from={tmp_path}@iter_4")
    with pytest.raises(DamagedNewestCheckpoint):  # nor served as a reward model
        find_reward_checkpoint(str(tmp_path))
    # picked explicitly: the older one, or the damaged one refused as before
    for explicit in (f"{tmp_path}@iter_4", f"{tmp_path}@iter_0000004", older):
        assert find_checkpoint(explicit, allow_fallback=False) == (older, [])
    assert resolve_checkpoint(f"{tmp_path}@iter_4", "rm.init_from") == older
    with pytest.raises(CheckpointError, match="iter_0000006 is damaged"):
        find_checkpoint(f"{tmp_path}@iter_6")
    with pytest.raises(FileNotFoundError, match=f"iter_0000005 .*{tmp_path} has iter_2, iter_4, iter_6$"):
        find_checkpoint(f"{tmp_path}@iter_5")
    # resuming falls back, with a line that says so (it goes to the log and the summary)
    path, warnings = _resume_choice(tmp_path)
    assert path == older and warnings[-1] == (f"RESUMING FROM AN OLDER CHECKPOINT, iter_0000004: {damage}; "
                                              "the training after step 4 is done again")
    # `latest` naming a checkpoint that is gone: the newest is missing, the same refusal
    shutil.rmtree(newest)
    with pytest.raises(DamagedNewestCheckpoint, match="'latest' names 'iter_0000006', which does not exist"):
        find_checkpoint(tmp_path, allow_fallback=False)
    (tmp_path / "latest").write_text("iter_0000004\n")
    assert find_checkpoint(tmp_path, allow_fallback=False) == (older, [])


def test_symlinks_in_a_stage_directory_are_damage_never_followed(tmp_path):
    stage, outside = tmp_path / "stage", tmp_path / "outside"
    older = fake_checkpoint(stage, 2)
    # iter level: a complete checkpoint outside, linked in as the newest
    os.symlink(fake_checkpoint(outside, 4), stage / "iter_0000004")
    (stage / "latest").write_text("iter_0000004\n")
    link = f"iter_0000004 is a symlink to {outside / 'iter_0000004'}"
    path, warnings = find_checkpoint(stage)
    assert path == older and any(w.startswith(f"checkpoint iter_0000004 is damaged ({link}") for w in warnings)
    for where, allow_fallback in ((stage, False), (stage / "iter_0000004", True)):
        with pytest.raises(CheckpointError) as e:
            find_checkpoint(where, allow_fallback)
        assert link in str(e.value)
    # role and file level: the sizes match what commit.json records, only the links give it away
    role = fake_checkpoint(stage, 6)
    shutil.rmtree(role / "actor")
    os.symlink(outside / "iter_0000004" / "actor", role / "actor")
    assert validate(role)[0] == f"actor: a symlink to {outside / 'iter_0000004' / 'actor'}"
    file = fake_checkpoint(stage, 8)
    (file / "trainer_state" / "rank_00000.pt").unlink()
    os.symlink(outside / "iter_0000004" / "trainer_state" / "rank_00000.pt", file / "trainer_state" / "rank_00000.pt")
    assert validate(file)[0].startswith("trainer_state/rank_00000.pt: a symlink to ")
    # a recorded path leaving the checkpoint
    escaping = fake_checkpoint(stage, 10, files={"actor/.metadata": b"m", "../elsewhere.bin": b"x"})
    assert "../elsewhere.bin: recorded outside the checkpoint directory" in validate(escaping)
    # tmp level and `latest`: listed (save and retention remove them as links), never read
    os.symlink(outside, stage / "iter_0000012.tmp")
    assert checkpoint_dirs(stage)[1] == {12: stage / "iter_0000012.tmp"}
    (stage / "latest").unlink()
    os.symlink(outside / "iter_0000004" / "commit.json", stage / "latest")
    assert f"'latest' is a symlink to {outside}/iter_0000004/commit.json, never followed" in find_checkpoint(stage)[1]


def test_a_stage_whose_checkpoints_are_all_damaged_stops_instead_of_starting_over(tmp_path):
    from megatron_rlhf.checkpoint.manager import CheckpointManager
    from megatron_rlhf.config import load_config
    from megatron_rlhf.trainers.runner import resume_source

    cfg = load_config(None, [])
    manager = CheckpointManager(tmp_path)
    assert resume_source(cfg, manager) is None  # empty: a fresh start
    fake_checkpoint(tmp_path, 2, commit=False).rename(tmp_path / "iter_0000002.tmp")
    assert resume_source(cfg, manager) is None  # only an unfinished first save: still fresh
    damaged = fake_checkpoint(tmp_path, 4)
    (damaged / "actor" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="iter_0000004 is damaged.*checkpoint.resume=false to start over"):
        resume_source(cfg, manager)
    assert damaged.is_dir()
    assert resume_source(dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=False)), manager) is None


# ------------------------------------------------------------------ slow: real jobs
def launch(nproc, *args, env=None):
    """torchrun the worker; returns the finished process whatever its exit status."""
    return torchrun(nproc, WORKER, *args, env=env, check=False, timeout=300)


def explain(proc) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"


def state_of(stage):
    return {"dirs": sorted(p.name for p in stage.iterdir() if p.name.startswith("iter_")),
            "latest": (stage / "latest").read_text().strip()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_safety")
    # 1. TP2: sync/async saves, NaN refusal; then rank 1 is killed saving step 6 of kill_sync
    train = launch(2, f"--root={root}", "--mode=train", *OVERRIDES, *TP2, env=KILL_6)
    assert train.returncode != 0 and "[fault injection] rank 1: kill at save of step 6" in train.stdout, explain(train)
    # 2. TP2: async saves of steps 4 and 6 into kill_async; rank 1 is killed committing 6
    kill = launch(2, f"--root={root}", "--mode=kill", *OVERRIDES, *TP2, env=KILL_6)
    assert kill.returncode != 0 and "[fault injection] rank 1: kill at save of step 6" in kill.stdout, explain(kill)
    killed = {stage: state_of(root / stage) for stage in ("kill_sync", "kill_async")}
    # 3. damaged copies of the sync stage, then PP2: load them, resume the killed stages
    shutil.copytree(root / "sync", root / "damaged")
    distcp = root / "damaged" / "iter_0000004" / "actor" / "__1_0.distcp"
    size = distcp.stat().st_size
    os.truncate(distcp, size // 2)
    shutil.copytree(root / "sync", root / "bad_latest")
    (root / "bad_latest" / "latest").write_text("iter_0000009\n")
    shutil.copytree(root / "sync", root / "all_damaged")
    (root / "all_damaged" / "iter_0000004" / "trainer_state" / "rank_00001.pt").unlink()
    (root / "all_damaged" / "iter_0000003" / "commit.json").unlink()
    relayout = launch(2, f"--root={root}", "--mode=relayout", *OVERRIDES, *PP2)
    assert relayout.returncode == 0, explain(relayout)
    return {"root": root, "killed": killed, "truncated": (size, size // 2),
            "train": torch.load(root / "results_train.pt", weights_only=False),
            "relayout": torch.load(root / "results_relayout.pt", weights_only=False)}


def files_on_disk(path):
    return {p.relative_to(path).as_posix(): p.stat().st_size for p in path.rglob("*")
            if p.is_file() and p.name != "commit.json" and not p.name.endswith(".full.pt")}


def assert_same_tensors(want_dir, got_dir):
    want, got = read_global_tensors(want_dir), read_global_tensors(got_dir)
    assert want.keys() == got.keys()
    assert any("optimizer" in k for k in want) and any("embedding" in k for k in want), sorted(want)
    for key in want:
        assert torch.equal(want[key], got[key]), key


@pytest.mark.slow
def test_sync_save_commits_a_complete_record_and_keeps_the_last_two(runs):
    stage = runs["root"] / "sync"
    assert state_of(stage) == {"dirs": ["iter_0000003", "iter_0000004"], "latest": "iter_0000004"}
    for step in (3, 4):
        path = stage / f"iter_{step:07d}"
        record = json.loads((path / "commit.json").read_text())
        assert record["step"] == step and record["roles"] == ["actor"] and record["world_size"] == 2
        assert record["layout"] == {"tp": 2, "pp": 1, "dp": 1}
        assert record["files"] == files_on_disk(path)
        assert {"actor/.metadata", "actor/metadata.json", "trainer_state/rank_00000.pt",
                "trainer_state/rank_00001.pt"} <= record["files"].keys()
        assert validate(path) == []
        # plain values only, RNG states included: it loads with weights_only=True
        assert torch.load(path / "trainer_state" / "rank_00001.pt", weights_only=True)["step"] == step


@pytest.mark.slow
def test_saves_write_the_bytes_megatrons_own_save_writes(runs):
    # ours copies one tensor at a time (streaming_writer.py) and, at DP1, none of the optimizer
    # state (live_param_state_at_dp1); megatron's copies them all up front
    ours, megatrons = runs["root"] / "sync" / "iter_0000004" / "actor", runs["root"] / "megatron_own"
    names = sorted(p.name for p in megatrons.iterdir())
    assert names == sorted(p.name for p in ours.iterdir())
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "metadata.json"} <= set(names), names
    for name in names:
        if name == ".metadata":  # also records where and under which random id it was saved
            assert without_storage_meta(ours / name) == without_storage_meta(megatrons / name)
        else:
            assert (ours / name).read_bytes() == (megatrons / name).read_bytes(), name


def without_storage_meta(path):
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # noqa: S301  (written by this test's own run)
    metadata.storage_meta = None
    return metadata


@pytest.mark.slow
def test_async_save_equals_sync_save_while_training_goes_on(runs):
    res, root = runs["train"], runs["root"]
    # step 4 trained (in place) while checkpoint 3 was still uncommitted
    assert res["committed_before_wait"] == [False, False]
    assert res["moved_while_pending"] > 1e-3
    assert res["polls_to_commit"] >= 1  # step 4 was committed by poll(), not by wait()
    assert state_of(root / "async") == {"dirs": ["iter_0000003", "iter_0000004"], "latest": "iter_0000004"}
    for step in (3, 4):
        name = f"iter_{step:07d}"
        assert validate(root / "async" / name) == []
        assert_same_tensors(root / "sync" / name / "actor", root / "async" / name / "actor")
    # plain optimizer: tensors megatron does not copy while planning (see the worker)
    assert validate(root / "plain_async" / "iter_0000001") == []
    assert_same_tensors(root / "plain_sync" / "iter_0000001" / "actor", root / "plain_async" / "iter_0000001" / "actor")


@pytest.mark.slow
def test_nonfinite_weights_are_never_saved(runs):
    for name in ("nan_sync", "nan_async"):
        errors = runs["train"][name]
        assert len(errors) == 2 and all(e and e.startswith("NonFiniteError: refusing to save") for e in errors), errors
        assert not (runs["root"] / name).exists()  # no iter dir, no .tmp, not even the stage dir


@pytest.mark.slow
def test_an_error_on_one_rank_is_raised_on_every_rank(runs):
    """parallel.collectives.errors_agreed: the failed rank raises its own error (or its wrapped
    form), the others the error saying it happened elsewhere; without one every rank goes on."""
    own, elsewhere = "ValueError: rank 1's own error", "RuntimeError: failed on another rank"
    assert runs["train"]["agreed"] == [(elsewhere, None), (own, None)]
    assert runs["train"]["agreed_as"] == [(elsewhere, None), ("LookupError: wrapped: rank 1's own error", None)]
    assert runs["train"]["agreed_none"] == [(None, "went on"), (None, "went on")]


@pytest.mark.slow
def test_load_falls_back_from_a_damaged_newest_checkpoint(runs):
    res, (size, cut) = runs["relayout"], runs["truncated"]
    assert res["damaged"]["checkpoint"].endswith("damaged/iter_0000003")
    damage = f"checkpoint iter_0000004 is damaged (actor/__1_0.distcp: {cut} bytes, {size} when committed)"
    assert f"{damage}; falling back to iter_0000003" in res["damaged"]["warnings"]
    assert (f"RESUMING FROM AN OLDER CHECKPOINT, iter_0000003: {damage}; the training after step 3 is done again"
            in res["damaged"]["warnings"])
    assert res["bad_latest"]["checkpoint"].endswith("bad_latest/iter_0000004")
    assert "'latest' names 'iter_0000009', which does not exist" in res["bad_latest"]["warnings"]


@pytest.mark.slow
def test_load_of_damaged_checkpoints_is_a_clear_error_on_every_rank(runs):
    res, (size, cut) = runs["relayout"], runs["truncated"]
    for error in res["explicit_damaged"]:
        assert error.startswith("CheckpointError: checkpoint ") and "damaged/iter_0000004 is damaged" in error
        assert f"actor/__1_0.distcp: {cut} bytes, {size} when committed" in error
    for error in res["all_damaged"]:
        assert error.startswith("CheckpointError: no complete checkpoint in")
        assert "iter_0000004 is damaged (trainer_state/rank_00001.pt: missing)" in error
        assert "iter_0000003 is damaged (commit.json: missing" in error


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["kill_sync", "kill_async"])
def test_rank_killed_while_saving_falls_back_then_saves_again(runs, stage):
    root = runs["root"]
    # the killed job left the previous checkpoint committed and the new one unfinished
    assert runs["killed"][stage] == {"dirs": ["iter_0000004", "iter_0000006.tmp"], "latest": "iter_0000004"}
    resumed = runs["relayout"][stage]
    assert resumed["step"] == 4 and resumed["checkpoint"].endswith(f"{stage}/iter_0000004")
    assert "iter_0000006.tmp: an unfinished save (interrupted while writing); ignored" in resumed["warnings"]
    # the loaded actor (weights and optimizer state), saved again, is checkpoint 4 exactly
    assert_same_tensors(root / stage / "iter_0000004" / "actor", root / f"{stage}_loaded" / "actor")
    # the same step saved again: committed, the debris of the crashed save gone
    assert state_of(root / stage) == {"dirs": ["iter_0000004", "iter_0000006"], "latest": "iter_0000006"}
    assert validate(root / stage / "iter_0000006") == []


@pytest.mark.slow
def test_same_layout_load_restores_the_rng_streams(runs):
    loaded = runs["train"]["same_layout"]
    assert loaded["checkpoint"].endswith("sync/iter_0000004") and loaded["warnings"] == []
    assert loaded["rng_restored"] == [True, True]


@pytest.mark.slow
def test_saved_at_tp2_resumes_at_pp2(runs):
    loaded, saved = runs["relayout"]["sync"], runs["train"]["outputs"]
    assert loaded["step"] == 4 and loaded["checkpoint"].endswith("sync/iter_0000004")
    assert "RNG states not restored: saved at TP2 PP1 DP1, running at TP1 PP2 DP1" in loaded["warnings"]
    assert saved.keys() == loaded["outputs"].keys() == {"logprobs", "entropy"}
    for key in saved:
        torch.testing.assert_close(loaded["outputs"][key], saved[key], atol=1e-5, rtol=0, msg=key)


@pytest.mark.slow
def test_checkpoints_record_their_model_config_and_refuse_another_architecture(runs):
    """Every stage checkpoint records its model config (export-hf reads it); loading it into a
    role of another architecture stops with each differing field named, before megatron's
    shape errors."""
    from types import SimpleNamespace

    from megatron_rlhf.checkpoint.dist import check_architecture
    from megatron_rlhf.config import load_config

    path = runs["root"] / "sync" / "iter_0000004"
    recorded = torch.load(path / "trainer_state" / "rank_00001.pt", weights_only=True)["model_config"]
    model = load_config(None, TINY_MODEL).model
    assert recorded == dataclasses.asdict(model)
    check_architecture(SimpleNamespace(model_config=model), path / "actor")
    other = load_config(None, [*TINY_MODEL, "model.num_layers=2", "model.rope_scaling.type=linear",
                               "model.rope_scaling.factor=2.0", "model.max_seq_length=32"]).model
    with pytest.raises(CheckpointError) as err:
        check_architecture(SimpleNamespace(model_config=other), path / "actor")
    message = str(err.value)
    assert "model.num_layers: checkpoint 4, this run 2" in message and "model.rope_scaling" in message
    assert "max_seq_length" not in message  # the run's choice, not the architecture
