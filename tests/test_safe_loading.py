"""Files are safe to read. Opening a checkpoint never runs code from it
(megatron_rlhf/checkpoint/safe_load.py): trainer states, DCP `.metadata` files and the pickled
objects in .distcp files that hold anything but plain values are refused with a
CheckpointError naming the file; RNG states survive the restricted load exactly. The fast
tests work on files built here; one test loads a real tampered megatron checkpoint in a
single subprocess (tests/workers/checkpoint_safety.py), which also saves past symlinks planted
in a stage directory: nothing is written through them. And what runs write for other tools
(metrics.jsonl, summary.json) is strict JSON: NaN/Inf become null."""

import json
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from distributed import TINY_MODEL
from megatron_rlhf.checkpoint.safe_load import load_pt, read_dcp_metadata, restricted_dcp_unpickling
from megatron_rlhf.checkpoint.validate import CheckpointError, find_checkpoint
from megatron_rlhf.logging.metrics import MetricsLogger
from megatron_rlhf.trainers.runner import write_summary

REPO = Path(__file__).resolve().parent.parent
REFUSED = "holds objects other than tensors, numbers and strings"
WHY = "it was not loaded, because unpickling it could run arbitrary code"


class Payload:
    """Unpickling it creates the file `marker`: a stand-in for running any code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def recommit(iter_dir: Path) -> None:
    """commit.json recording the files' current sizes, as someone tampering with them would write it."""
    files = {p.relative_to(iter_dir).as_posix(): p.stat().st_size for p in iter_dir.rglob("*") if p.is_file()}
    files.pop("commit.json", None)
    record = {"step": 1, "roles": [], "world_size": 1, "layout": {"tp": 1, "pp": 1, "dp": 1}, "files": files}
    (iter_dir / "commit.json").write_text(json.dumps(record))


# ------------------------------------------------------------------------- trainer state
def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture
def rng_tracker():
    """megatron's RNG tracker as it was: set_rng_state replaces its states."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved = dict(vars(tracker))
    yield tracker
    vars(tracker).update(saved)


@pytest.fixture
def torch_allowlist_only(rng_tracker):
    """weights_only with torch's own allowlist: importing megatron-core adds numpy arrays and
    more to it, which would hide an ndarray left in a trainer state."""
    added = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    yield
    torch.serialization.add_safe_globals(added)


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path, torch_allowlist_only):
    from megatron_rlhf.checkpoint.manager import rng_state, set_rng_state

    seed_all(3)
    np.random.randn()  # numpy's state then holds a cached gaussian too
    torch.save({"rng": rng_state()}, tmp_path / "state.pt")
    expected = [random.random(), np.random.randn(), np.random.randint(0, 2**31, 4).tolist(), torch.rand(4)]
    seed_all(99)

    set_rng_state(torch.load(tmp_path / "state.pt", weights_only=True)["rng"])
    got = [random.random(), np.random.randn(), np.random.randint(0, 2**31, 4).tolist(), torch.rand(4)]
    assert got[:3] == expected[:3] and torch.equal(got[3], expected[3])


def test_trainer_state_from_before_plain_rng_states_still_loads(tmp_path, torch_allowlist_only):
    """Trainer states written before held numpy's legacy tuple (with an ndarray key)."""
    from megatron_rlhf.checkpoint.manager import rng_state, set_rng_state

    legacy = {**rng_state(), "numpy": np.random.get_state()}
    torch.save({"step": 3, "rng": legacy}, tmp_path / "old.pt")
    expected = np.random.rand(3)
    np.random.seed(99)
    set_rng_state(load_pt(tmp_path / "old.pt")["rng"])
    assert np.random.rand(3).tolist() == expected.tolist()


def test_trainer_state_with_a_payload_is_refused_and_never_runs(tmp_path):
    iter_dir = tmp_path / "iter_0000001"
    (iter_dir / "trainer_state").mkdir(parents=True)
    state_file = iter_dir / "trainer_state" / "rank_00000.pt"
    marker = tmp_path / "payload_ran"
    torch.save({"step": 1, "note": Payload(marker)}, state_file)
    recommit(iter_dir)
    assert find_checkpoint(tmp_path)[0] == iter_dir  # the sizes match: it passes validation

    with pytest.raises(CheckpointError) as info:
        load_pt(state_file)
    message = str(info.value)
    assert message.startswith(f"{state_file}: {REFUSED} (it refers to ") and WHY in message
    assert "weights_only=False" not in message  # torch's advice to disable the check is left out
    assert not marker.exists()
    torch.load(state_file, weights_only=False)  # what happened before: the payload runs
    assert marker.exists()


# ------------------------------------------------------------------ dist checkpoints (DCP)
def dcp_checkpoint(path: Path, obj) -> Path:
    """A one-process torch.distributed.checkpoint: a tensor and a pickled object "obj.lr" (as
    megatron stores its common state)."""
    dcp.save({"w": torch.arange(6.0), "obj": {"lr": obj}}, checkpoint_id=path, no_dist=True)
    return path


def load(path: Path) -> dict:
    target = {"w": torch.zeros(6), "obj": {"lr": None}}
    dcp.load(target, checkpoint_id=path, no_dist=True)
    return target


def test_dcp_checkpoint_of_plain_values_loads_restricted(tmp_path):
    path = dcp_checkpoint(tmp_path / "ckpt", ("adam", 0.1, [1, 2]))
    with restricted_dcp_unpickling(path):
        loaded = load(path)
    assert torch.equal(loaded["w"], torch.arange(6.0)) and loaded["obj"]["lr"] == ("adam", 0.1, [1, 2])
    assert read_dcp_metadata(path / ".metadata").state_dict_metadata.keys() == {"w", "obj.lr"}


def test_dcp_metadata_with_a_payload_is_refused_and_never_runs(tmp_path):
    path = dcp_checkpoint(tmp_path / "ckpt", 0.1)
    marker = tmp_path / "payload_ran"
    md = pickle.loads((path / ".metadata").read_bytes())
    md.planner_data = Payload(marker)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError) as info:
        with restricted_dcp_unpickling(path):
            load(path)
    assert str(info.value).startswith(f"{path / '.metadata'}: holds objects other than "
                                      "torch.distributed.checkpoint metadata (it refers to ")
    assert WHY in str(info.value) and not marker.exists()


def test_dcp_object_with_a_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "payload_ran"
    path = dcp_checkpoint(tmp_path / "ckpt", Payload(marker))
    with pytest.raises(CheckpointError) as info:  # torch wraps it in a CheckpointException; unwrapped
        with restricted_dcp_unpickling(path):
            load(path)
    assert str(info.value).startswith(f"{path / '__0_0.distcp'} (object obj.lr): {REFUSED}")
    assert not marker.exists()
    load(path)  # outside the context torch's own unpickling is back, and runs the payload
    assert marker.exists()


# ------------------------------------------------------------- a real megatron checkpoint
def run_python(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """A bare python process (rank 0 of 1: no torchrun needed) in the repo, tests/ importable."""
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_RLHF_FAULT"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests"), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, *args], cwd=REPO, env={**env, "PYTHONWARNINGS": "ignore"},
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def payloads(tmp_path_factory):
    """The one-process worker's run (tests/workers/checkpoint_safety.py --mode payloads): its
    root and results."""
    root = tmp_path_factory.mktemp("payloads")
    proc = run_python("tests/workers/checkpoint_safety.py", "--root", str(root), "--mode", "payloads",
                      *TINY_MODEL, "seed=7")
    assert proc.returncode == 0, proc.stderr[-6000:]
    return root, torch.load(root / "results_payloads.pt", weights_only=True)


def test_tampered_megatron_checkpoints_are_refused_and_never_run(payloads):
    tmp_path, res = payloads
    assert res["good"] == {"step": 1, "warnings": [], "rng_restored": True}
    files = {"trainer_state": f"{tmp_path}/trainer_state/iter_0000001/trainer_state/rank_00000.pt: {REFUSED}",
             "metadata": f"{tmp_path}/metadata/iter_0000001/actor/.metadata: holds objects other than "
                         "torch.distributed.checkpoint metadata",
             "common_state": f"{tmp_path}/common_state/iter_0000001/actor/__0_0.distcp (object common_state/"
                             f"shard_0_1): {REFUSED}"}
    for name, start in files.items():
        assert res[name]["error"].startswith(f"CheckpointError: {start}"), res[name]["error"]
        assert WHY in res[name]["error"] and not res[name]["payload_ran"], name


def test_saves_never_write_through_symlinks_planted_in_the_stage_directory(payloads):
    """Planted symlinks to <root>/outside: a save's tmp dir, the iter dir of the step saved next,
    latest.tmp and .tmp debris are removed as links, not followed; a tmp dir holding a symlinked
    role directory or file is not committed; the next save works."""
    root, res = payloads
    res = res["symlinks"]
    assert (res["save_1"], res["save_2"], res["save_3"]) == (None, None, None)
    for name, rel in (("role", "actor"), ("file", "trainer_state/rank_00000.pt")):
        assert res[f"commit_{name}"] == (
            f"CheckpointError: {root}/links/iter_0000003.tmp: not committed, it holds a symlink ({rel}: a symlink "
            f"to {root}/outside/actor_copy/{rel}); a checkpoint is never written or read through one")
        assert not res[f"committed_{name}"]
    assert res["stage"] == ["iter_0000003", "latest"] and res["latest"] == "iter_0000003"
    assert res["complete"] == ["iter_0000003"]
    assert res["outside"] == ["keep.txt"] and res["keep.txt"] == "not the checkpoint's"


# ------------------------------------------------------------------ strict JSON out
def strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_metrics_jsonl_and_summary_write_nan_and_inf_as_null(tmp_path, monkeypatch):
    log = MetricsLogger(tmp_path, "ppo", 2, tensorboard=False)
    log.log(1, {"loss": 0.5, "eval_gold_score": float("nan"), "kl": float("inf")})
    lines = [strict_json(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert isinstance(lines[0].pop("time"), float)  # the row's wall-clock time
    assert lines == [{"step": 1, "loss": 0.5, "eval_gold_score": None, "kl": None}]

    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)  # write_summary writes on rank 0
    write_summary(tmp_path, {"steps": 2, "gold_score_eval_after": float("nan"), "samples_after": ["a || b"],
                             "phase_seconds": {"eval": float("-inf"), "train": 1.5}, "curve": (1.0, float("nan"))})
    assert strict_json((tmp_path / "summary.json").read_text()) == {
        "steps": 2, "gold_score_eval_after": None, "samples_after": ["a || b"],
        "phase_seconds": {"eval": None, "train": 1.5}, "curve": [1.0, None]}
