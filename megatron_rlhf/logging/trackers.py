"""W&B and MLflow beside metrics.jsonl: the same rows at the same steps, the resolved config as
the run's config (W&B) or params (MLflow), and the stage summary at the end (logging.wandb,
logging.mlflow; docs/logging.md).

Rank 0 only, like metrics.jsonl. Each stage is one tracker run, named <checkpoint.run_name>/<stage>
by default. Its id goes into every checkpoint's trainer state ("trackers") and into summary.json,
so a stage resumed from its own checkpoint continues the same run; one started from another
directory's checkpoint (checkpoint.load) starts a new run. Steps the run already has (logged
before a crash, then recomputed after the resume, with the same values) are not sent twice
(MLflow: a run tag records the last step sent; W&B: the resumed run's starting_step, which an
offline run cannot know).

A tracker that fails (network, server, login) must not stop training: its error is printed once,
that tracker is switched off for the rest of the stage, and metrics.jsonl still has every row.
MLflow's client already retries a request (MLFLOW_HTTP_REQUEST_MAX_RETRIES) before it raises,
so an error that reaches us means the server is gone, and trying again every step would only
stall training. Its defaults (7 retries with a doubling backoff, a 120 s timeout per attempt)
would hold a stage's start-up ~4 minutes on a tracking server that is down, so the requests that
start the run go out under STARTUP_REQUESTS (a few seconds when the connection is refused, about
35 s when nothing answers) unless the user set those variables; later requests keep MLflow's own.
A missing package is a config error instead (config/run.py, at validate time).
The clients are imported only when enabled: `import megatron_rlhf` imports neither.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from megatron_rlhf.config import Config
    from megatron_rlhf.config.run import MlflowConfig, WandbConfig

# The MLflow run tag that records the last step sent, so that a resumed stage skips the steps the
# run already has (one tag in the same request as the metrics; read once, at the resume).
LAST_STEP_TAG = "megatron_rlhf.last_step"
MLFLOW_PARAM_MAX_CHARS = 6000  # MLflow refuses longer param values
# MLflow's HTTP settings (mlflow/environment_variables.py, read at each request) while a stage's
# run starts: 2 retries, 1 s backoff (0 s then 2 s; + up to 1 s jitter), 10 s to connect and answer.
# A variable the user set wins.
STARTUP_REQUESTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


@contextmanager
def _startup_requests():
    """STARTUP_REQUESTS in the environment for the block, where the user has not set them."""
    added = [name for name in STARTUP_REQUESTS if name not in os.environ]
    os.environ.update({name: STARTUP_REQUESTS[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are leaves."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def default_run_name(cfg: Config, stage: str) -> str:
    return f"{cfg.checkpoint.run_name}/{stage}"


class WandbTracker:
    """One W&B run per stage, grouped by checkpoint.run_name."""

    name = "wandb"

    def __init__(self, settings: WandbConfig, cfg: Config, stage: str, stage_dir: Path, previous: dict | None):
        import wandb

        self._wandb = wandb
        # What we pass to wandb.init, kept: offline mode ignores `resume`, so a test of the resume reads it here.
        self.init_kwargs = {
            "project": settings.project, "entity": settings.entity, "group": cfg.checkpoint.run_name,
            "name": settings.run_name or default_run_name(cfg, stage), "tags": list(settings.tags),
            "dir": str(settings.dir or stage_dir), "config": cfg.to_dict(), "mode": settings.mode,
            # "allow", not "must": a run started offline (or one W&B deleted) is not on the server;
            # it is made there under the same id instead of stopping the stage
            **({"id": previous["id"], "resume": "allow"} if previous else {}),
        }
        self.init_kwargs = {k: v for k, v in self.init_kwargs.items() if v is not None}
        Path(self.init_kwargs["dir"]).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(**self.init_kwargs)
        self.first_step = self.run.starting_step  # 0 fresh; a resumed online run: the step after its last

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step >= self.first_step:
            self.run.log(metrics, step=step)

    def finish(self, summary: dict) -> None:
        self.run.summary.update(summary)
        self.run.finish()
        # Writes out what the run's service holds (in offline mode the .wandb file is empty until then).
        self._wandb.teardown()

    def ids(self) -> dict:
        return {"id": self.run.id, "project": self.run.project, "url": self.run.url}


class MlflowTracker:
    """One MLflow run per stage in logging.mlflow.experiment, through MlflowClient (no global
    active run, so stages in one process and other MLflow users do not interfere)."""

    name = "mlflow"

    def __init__(self, settings: MlflowConfig, cfg: Config, stage: str, stage_dir: Path, previous: dict | None):
        from mlflow.tracking import MlflowClient

        self.uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or \
            f"sqlite:///{Path(stage_dir).resolve().parent / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=self.uri)
        with _startup_requests():  # a server that is down: a warning within seconds, not minutes
            self._start(settings, cfg, stage, previous)

    def _start(self, settings: MlflowConfig, cfg: Config, stage: str, previous: dict | None) -> None:
        """The stage's run: the one `previous` names if the store has it, else a new one; the
        config's params it lacks."""
        from mlflow.entities import Param

        run = self._previous_run(previous["run_id"]) if previous else None
        if run is not None:
            self.last_step = int(run.data.tags.get(LAST_STEP_TAG, -1))
        else:
            experiment = self.client.get_experiment_by_name(settings.experiment)
            experiment_id = (experiment.experiment_id if experiment
                             else self.client.create_experiment(settings.experiment))
            tags = dict(tag.partition("=")[::2] for tag in settings.tags)
            run = self.client.create_run(experiment_id, run_name=settings.run_name or default_run_name(cfg, stage),
                                         tags={**tags, "stage": stage, "checkpoint.run_name": cfg.checkpoint.run_name})
            self.last_step = -1
        self.run_id, self.experiment_id = run.info.run_id, run.info.experiment_id
        # Params cannot change once logged: a resumed run adds only the keys it lacks.
        params = {k: str(v)[:MLFLOW_PARAM_MAX_CHARS] for k, v in flat(cfg.to_dict()).items()}
        new = [Param(k, v) for k, v in params.items() if k not in run.data.params]
        if new:
            self.client.log_batch(self.run_id, params=new)

    def _previous_run(self, run_id: str):
        """The run to continue; None when the store no longer has it (e.g. a new local mlflow.db)."""
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id)
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            print(f"mlflow: run {run_id} of the resumed checkpoint is not in {self.uri}; starting a new run",
                  flush=True)
            return None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric, RunTag

        if step <= self.last_step:
            return
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()],
                              tags=[RunTag(LAST_STEP_TAG, str(step))])
        self.last_step = step

    def finish(self, summary: dict) -> None:
        """The summary's numbers as metrics summary/<key> (MLflow has no summary of its own)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        numbers = {k: v for k, v in flat(summary).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        step = int(summary.get("steps", 0))
        self.client.log_batch(self.run_id, metrics=[Metric(f"summary/{k}", float(v), now, step)
                                                    for k, v in numbers.items()])
        self.client.set_terminated(self.run_id)

    def ids(self) -> dict:
        return {"run_id": self.run_id, "experiment_id": self.experiment_id, "tracking_uri": self.uri}


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


class Trackers:
    """The enabled trackers of one stage on rank 0 (none elsewhere)."""

    def __init__(self, trackers: list | None = None):
        self.trackers = list(trackers or [])

    @classmethod
    def start(cls, cfg: Config, stage: str, stage_dir: Path, resumed: dict | None = None) -> Trackers:
        """`resumed`: the trainer state a stage resumed from (None: a fresh start)."""
        if dist.is_initialized() and dist.get_rank() != 0:
            return cls()
        previous = previous_runs(resumed, stage_dir)
        started = []
        for name, tracker in TRACKERS.items():
            settings = getattr(cfg.logging, name)
            if settings.enabled:
                try:
                    started.append(tracker(settings, cfg, stage, Path(stage_dir), previous.get(name)))
                except Exception as e:  # noqa: BLE001  (a tracker must not stop training)
                    _warn(name, "could not start", e)
        return cls(started)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._each("log", step, metrics)

    def finish(self, summary: dict) -> None:
        self._each("finish", summary)
        self.trackers = []

    def ids(self) -> dict[str, dict]:
        """{tracker: its run's ids} for the trainer state and summary.json ({} with none)."""
        return {t.name: t.ids() for t in self.trackers}

    def _each(self, method: str, *args) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as e:  # noqa: BLE001  (a tracker must not stop training)
                _warn(tracker.name, f"failed in {method}", e)
                self.trackers.remove(tracker)


def previous_runs(resumed: dict | None, stage_dir: Path) -> dict[str, dict]:
    """The tracker runs to continue: those the resumed checkpoint recorded, when it is one of
    this stage's own (a checkpoint.load from elsewhere starts new runs)."""
    if not resumed or "trackers" not in resumed:
        return {}
    own = Path(resumed["checkpoint"]).resolve().parent == Path(stage_dir).resolve()
    return dict(resumed["trackers"]) if own else {}


def _warn(name: str, what: str, error: Exception) -> None:
    print(f"WARNING: {name} {what} ({type(error).__name__}: {error}); training goes on without {name} "
          "for this stage (metrics.jsonl has every row)", flush=True)
