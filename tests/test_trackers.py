"""W&B and MLflow (megatron_rlhf/logging/trackers.py), driven through MetricsLogger with a
made-up metrics stream, no server: MLflow on a sqlite:/// tracking store read back through
MlflowClient; W&B in offline mode, read back from the run's own .wandb file (wandb 0.31 writes
config and summary there, not to files/config.yaml and files/wandb-summary.json, until a sync).
A stage crashed after its checkpoint at step 2 and resumed from it continues the same runs."""

import dataclasses
import json
import math
import struct
import time
from pathlib import Path

import pytest

from megatron_rlhf.config import Config, ConfigError, validate
from megatron_rlhf.config.run import CheckpointConfig, LoggingConfig, MlflowConfig, WandbConfig
from megatron_rlhf.logging.metrics import MetricsLogger
from megatron_rlhf.logging.trackers import Trackers, previous_runs

mlflow = pytest.importorskip("mlflow")  # the test extra installs both
wandb = pytest.importorskip("wandb")


def config(tmp_path, **logging) -> Config:
    return dataclasses.replace(Config(), checkpoint=CheckpointConfig(root=str(tmp_path), run_name="r1"),
                               logging=LoggingConfig(tensorboard=False, **logging))


def rows(first: int, last: int) -> list[tuple[int, dict]]:
    """A stage's metrics stream: every step a loss, every other one an eval that may be NaN."""
    return [(s, {"loss": 1.0 / s, "grad_norm": 0.5 + s, **({"eval_loss": math.nan if s == 4 else 2.0 / s}
                                                            if s % 2 == 0 else {})}) for s in range(first, last + 1)]


def run_stage(cfg, stage_dir, first, last, resumed=None, crash=False) -> Trackers:
    """Log rows first..last as a StageRunner would; `crash`: stop without finishing (no summary)."""
    trackers = Trackers.start(cfg, stage_dir.name, stage_dir, resumed)
    log = MetricsLogger(stage_dir, stage_dir.name, last, resume_step=first - 1, tensorboard=False, trackers=trackers)
    for step, metrics in rows(first, last):
        log.log(step, metrics)
    if not crash:
        log.close({"stage": stage_dir.name, "steps": last, "wall_seconds": 1.5, "phase_seconds": {"train": 1.0}})
    return trackers


def checkpoint_state(stage_dir: Path, step: int, trackers: Trackers) -> dict:
    """The part of a resumed checkpoint's trainer state the trackers read (runner.py)."""
    return {"checkpoint": str(stage_dir / f"iter_{step:07d}"), "trackers": trackers.ids()}


def jsonl(stage_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory) -> str:
    """One tracking store for the module: creating its tables takes seconds."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


def test_mlflow_run_has_every_row_and_the_config_and_a_resume_continues_it(tmp_path, mlflow_uri):
    uri, started = mlflow_uri, time.time()
    cfg = config(tmp_path, mlflow=MlflowConfig(enabled=True, tracking_uri=uri, tags=["team=rl", "nightly"]))
    stage_dir = tmp_path / "r1" / "sft"
    first = run_stage(cfg, stage_dir, 1, 3, crash=True)  # killed at step 3, its last checkpoint at 2
    run_id = first.ids()["mlflow"]["run_id"]
    second = run_stage(cfg, stage_dir, 3, 6, resumed=checkpoint_state(stage_dir, 2, first))
    assert second.ids() == {} and Trackers.start(cfg, "sft", stage_dir).ids()["mlflow"]["run_id"] != run_id

    client = mlflow.tracking.MlflowClient(uri)
    written = jsonl(stage_dir)
    assert [r["step"] for r in written] == [1, 2, 3, 4, 5, 6]
    assert all(started <= r["time"] <= time.time() for r in written)  # each row's wall-clock time
    for key in ("loss", "grad_norm", "eval_loss"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        want = [(r["step"], math.nan if r[key] is None else r[key]) for r in written if key in r]
        assert [s for s, _ in history] == [s for s, _ in want], key  # each step once: 3 was not sent twice
        assert all(a == b or (math.isnan(a) and math.isnan(b)) for (_, a), (_, b) in zip(history, want)), key
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r1/sft"
    assert run.data.params["seed"] == "1234" and run.data.params["checkpoint.run_name"] == "r1"
    assert len(run.data.params) > 100  # the whole resolved config, flattened
    assert run.data.tags["team"] == "rl" and run.data.tags["nightly"] == "" and run.data.tags["stage"] == "sft"
    assert run.data.metrics["summary/wall_seconds"] == 1.5 and run.data.metrics["summary/phase_seconds.train"] == 1.0


def test_mlflow_failure_is_reported_once_and_the_stage_goes_on(tmp_path, mlflow_uri, capsys):
    uri = mlflow_uri
    cfg = config(tmp_path, mlflow=MlflowConfig(enabled=True, tracking_uri=uri))
    stage_dir = tmp_path / "r1" / "rm"
    trackers = Trackers.start(cfg, "rm", stage_dir)
    mlflow.tracking.MlflowClient(uri).delete_run(trackers.ids()["mlflow"]["run_id"])  # the server refuses from now
    log = MetricsLogger(stage_dir, "rm", 3, tensorboard=False, trackers=trackers)
    for step, metrics in rows(1, 3):
        log.log(step, metrics)
    log.close({"steps": 3})
    assert capsys.readouterr().out.count("WARNING: mlflow failed") == 1
    assert [r["step"] for r in jsonl(stage_dir)] == [1, 2, 3]


def wandb_records(stage_dir: Path) -> list:
    """The records of every offline W&B run under `stage_dir`, oldest first. A .wandb file is a
    LevelDB-style log after a 7-byte header: 32 KiB blocks of chunks, each `<crc u32, length u16,
    type u8>` then its bytes (type 1: a whole record, 2/3/4: first/middle/last part)."""
    from wandb.proto.wandb_internal_pb2 import Record

    records = []
    for path in sorted(stage_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, part = path.read_bytes(), 7, b""
        assert data[:4] == b":W&B", path
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind in (1, 4):
                records.append(Record.FromString(part))
                part = b""
            elif kind == 0:
                break
    return records


def key(item) -> str:
    """An item's name in a W&B record: `key`, or the parts of `nested_key` joined by dots."""
    return item.key or ".".join(item.nested_key)


def test_wandb_offline_run_has_every_row_the_config_and_the_summary_and_a_resume_passes_its_id(tmp_path):
    settings = WandbConfig(enabled=True, mode="offline", tags=["nightly"])
    cfg = config(tmp_path, wandb=settings)
    stage_dir = tmp_path / "r1" / "ppo"
    first = run_stage(cfg, stage_dir, 1, 3, crash=True)
    first.trackers[0].run.finish()  # what the crash's exit would do for W&B
    wandb.teardown()
    run_id = first.ids()["wandb"]["id"]
    second = Trackers.start(cfg, "ppo", stage_dir, checkpoint_state(stage_dir, 2, first))
    (tracker,) = second.trackers
    assert tracker.init_kwargs["id"] == run_id and tracker.init_kwargs["resume"] == "allow"
    assert tracker.run.id == run_id
    log = MetricsLogger(stage_dir, "ppo", 6, resume_step=2, tensorboard=False, trackers=second)
    for step, metrics in rows(3, 6):
        log.log(step, metrics)
    log.close({"stage": "ppo", "steps": 6, "wall_seconds": 1.5})

    records = wandb_records(stage_dir)
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert [r.run_id for r in runs] == [run_id, run_id]
    assert runs[0].display_name == "r1/ppo" and runs[0].run_group == "r1" and list(runs[0].tags) == ["nightly"]
    config_items = {key(i): json.loads(i.value_json) for i in runs[0].config.update}
    assert config_items["seed"] == 1234 and config_items["checkpoint"]["run_name"] == "r1"
    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {key(i): json.loads(i.value_json) for i in record.history.item}
            history.setdefault(items.pop("_step"), []).append(items)
    written = {r["step"]: r for r in jsonl(stage_dir)}
    assert sorted(history) == [1, 2, 3, 4, 5, 6]
    for step, logged in history.items():
        want = {k: v for k, v in written[step].items() if k not in ("step", "time")}
        got = logged[-1]
        assert {k: got[k] for k in want if want[k] is not None} == {k: v for k, v in want.items() if v is not None}
        assert all(got[k] == "NaN" or math.isnan(float(got[k])) for k in want if want[k] is None), (step, got)
    summary = {key(i): json.loads(i.value_json) for r in records if r.WhichOneof("record_type") == "summary"
               for i in r.summary.update}
    assert summary["wall_seconds"] == 1.5 and summary["steps"] == 6


def test_an_unreachable_mlflow_server_costs_seconds_at_start_not_minutes(tmp_path, capsys, monkeypatch):
    """A real client against a port nothing listens on: with MLflow's defaults its retries held the
    stage's start-up ~4 minutes; bounded, the stage starts without MLflow within seconds, saying so."""
    import os
    import socket
    import threading

    bounded = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "MLFLOW_HTTP_REQUEST_TIMEOUT")
    for name in bounded:  # MLflow's defaults: 7 retries, doubling backoff
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as free:  # a port on this machine that refuses connections
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    cfg = config(tmp_path, mlflow=MlflowConfig(enabled=True, tracking_uri=f"http://127.0.0.1:{port}"))
    started: list[Trackers] = []
    starting = threading.Thread(target=lambda: started.append(Trackers.start(cfg, "sft", tmp_path / "r1" / "sft")),
                                daemon=True)
    starting.start()
    starting.join(timeout=30)  # bounded: about 2-4 s (STARTUP_REQUESTS); unbounded: minutes
    assert not starting.is_alive(), "the stage's start-up still waits on the unreachable MLflow server"
    assert started[0].ids() == {}
    out = capsys.readouterr().out
    assert out.count("WARNING: mlflow could not start") == 1 and f"127.0.0.1:{port}" in out
    assert "training goes on without mlflow for this stage" in out
    assert not any(name in os.environ for name in bounded)  # set only while the run starts


def test_a_checkpoint_from_another_directory_starts_new_tracker_runs(tmp_path):
    ids = {"wandb": {"id": "abc"}}
    assert previous_runs({"checkpoint": str(tmp_path / "sft" / "iter_0000002"), "trackers": ids}, tmp_path / "sft") == ids
    assert previous_runs({"checkpoint": str(tmp_path / "other" / "iter_0000002"), "trackers": ids}, tmp_path / "sft") == {}
    assert previous_runs({}, tmp_path / "sft") == {}


def test_config_refuses_a_tracker_without_its_package_or_an_unknown_mode(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"logging.wandb.mode='cloud'.*online"):
        validate(config(tmp_path, wandb=WandbConfig(mode="cloud")))
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"logging.mlflow.enabled=true.*pip install -e '\.\[mlflow\]'"):
        validate(config(tmp_path, mlflow=MlflowConfig(enabled=True)))
    validate(config(tmp_path, mlflow=MlflowConfig(enabled=False)))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sqlalchemy" else real(name, *a))
    with pytest.raises(ConfigError, match=r"logging.mlflow.enabled=true but the sqlalchemy package"):
        validate(config(tmp_path, mlflow=MlflowConfig(enabled=True)))  # the default store: <run>/mlflow.db
    validate(config(tmp_path, mlflow=MlflowConfig(enabled=True, tracking_uri="http://mlflow.internal:5000")))
