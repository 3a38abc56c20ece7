"""The stage lifecycle, written once: start-up (signal handler, process groups, heartbeat),
resume, the step loop with its cadences (log, checkpoint, preemption), the summary and close.

A stage builds its roles and data, then:

    runner = StageRunner(cfg, "sft", total_steps=..., log_interval=..., save_interval=...)
    ...build roles, sampler...
    state = runner.resume(trained_roles, sampler)      # {} on a fresh start
    for step in runner.steps():
        metrics = ...one step...
        if runner.due(eval_interval): metrics.update(evaluate())
        runner.end_step(metrics, consumed_samples, evaluated=...)   # log, checkpoint, heartbeat
    runner.finish({...stage fields...}, "done: ...")

`periodic` is the one cadence rule (every `interval` steps and at the last step).
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch.distributed as dist

from megatron_rlhf import parallel
from megatron_rlhf.checkpoint.manager import CheckpointManager, rng_state, set_rng_state
from megatron_rlhf.checkpoint.validate import iter_name
from megatron_rlhf.colocation import current_memory_bytes, peak_memory_bytes, reset_peak_memory
from megatron_rlhf.config import Config, learning_rate_warnings, validate, write_resolved_config
from megatron_rlhf.logging.memory import memory_account
from megatron_rlhf.logging.metrics import MetricsLogger, nonfinite_to_null
from megatron_rlhf.logging.trackers import Trackers
from megatron_rlhf.resilience import preemption
from megatron_rlhf.resilience.faults import FAULTS
from megatron_rlhf.resilience.heartbeat import Heartbeat
from megatron_rlhf.resilience.preemption import Preempted
from megatron_rlhf.resilience.run_lock import hold_stage_directory
from megatron_rlhf.trainers.stage_data import architecture_from_start, stage_dir
from megatron_rlhf.trainers.stage_inputs import stage_inputs

STAGE_OF = {"rm_holdout": "rm"}  # runners that are part of a pipeline stage


def start_distributed(cfg: Config, stage: str | None = None) -> parallel.DistEnv:
    """Validate `cfg` for the world size this process was launched with, then start
    torch.distributed and megatron's parallel_state (parallel.initialize): a config error is
    raised before any process group is made. A `stage` that starts from a checkpoint is
    validated with the architecture that checkpoint recorded (stage_data.architecture_from_start:
    a DPO length past the recipe's model.max_seq_length is right when its SFT trained longer)."""
    world_size = parallel.read_dist_env().world_size
    if stage is not None:
        cfg = architecture_from_start(cfg, STAGE_OF.get(stage, stage), world_size)[0]
    validate(cfg, world_size=world_size)
    return parallel.initialize(cfg.parallel, cfg.seed)


def periodic(step: int, interval: int, total: int) -> bool:
    """Every `interval` steps (0: never) and at the last step."""
    return (interval > 0 and step % interval == 0) or step == total


class StageRunner:
    def __init__(self, cfg: Config, stage: str, total_steps: int, log_interval: int, save_interval: int):
        self.start_time = time.perf_counter()
        self.preemption = preemption.install()  # first: a signal during start-up is not lost
        # Start-up writes nothing a rerun needs (config.yaml is replaced whole): SIGTERM ends it at once.
        self._startup = self.preemption.interruptible(f"the {stage} stage's start-up")
        self._startup.__enter__()
        start_distributed(cfg, stage)
        reset_peak_memory()  # this stage's own peak, also after an earlier stage in the same process
        self.memory_at_start = current_memory_bytes()  # before any role is built
        self.heartbeat = Heartbeat.from_env()
        self.cfg, self.stage, self.total = cfg, stage, total_steps
        self.log_interval, self.save_interval = log_interval, save_interval
        self.out = stage_dir(cfg, stage)
        hold_stage_directory(self.out, cfg)  # one writer per stage directory, before anything is written
        if dist.get_rank() == 0:  # what this start of the stage was asked to do (a resume rewrites it)
            write_resolved_config(cfg, self.out)
        # At the start: what the stage trains on, for summary.json (pipeline reuses it only on the same).
        self.inputs = stage_inputs(cfg, STAGE_OF.get(stage, stage))
        self.step, self.resumed, self.trained, self.sampler = 0, None, {}, None
        self.checkpoint_warnings: list[str] = []  # of this run's resume, e.g. a damaged checkpoint skipped
        self.ckpt: CheckpointManager | None = None
        self.log: MetricsLogger | None = None

    # ------------------------------------------------------------------ start
    def resume(self, trained: dict, sampler) -> dict:
        """Load the stage's checkpoint to resume from, if any, into the trained roles and the
        sampler; open the metrics log at that step. Returns the trainer state ({} fresh)."""
        self.trained, self.sampler = trained, sampler
        self.ckpt = CheckpointManager(self.out, self.cfg.checkpoint.keep_last, self.cfg.checkpoint.async_save)
        self.step, self.resumed, state = resume(self.cfg, self.ckpt, trained, sampler)
        self.checkpoint_warnings = state.get("checkpoint_warnings", [])
        self.log = MetricsLogger(self.out, self.stage_name, self.total, resume_step=self.step,
                                 tensorboard=self.cfg.logging.tensorboard, verbose=self.cfg.logging.verbose,
                                 trackers=Trackers.start(self.cfg, self.stage_name, self.out, state))
        for warning in learning_rate_warnings(self.cfg, [STAGE_OF.get(self.stage, self.stage)]):
            self.log.info(f"warning: {warning}")
        return state

    @property
    def stage_name(self) -> str:
        return self.out.name

    def tracker_state(self) -> dict:
        """The W&B / MLflow run ids for the trainer state, so a resume continues those runs ({}: none)."""
        return {"trackers": ids} if (ids := self.log.trackers.ids()) else {}

    # ------------------------------------------------------------------ the loop
    def steps(self) -> Iterator[int]:
        if self._startup is not None:  # from here a SIGTERM lets the step finish and save (resilience/preemption.py)
            self._startup.__exit__(None, None, None)
            self._startup = None
        while self.step < self.total:
            self.step += 1
            self.preemption.step = self.step
            FAULTS.begin_step(self.step)
            yield self.step

    def due(self, interval: int) -> bool:
        return periodic(self.step, interval, self.total)

    def end_step(self, metrics: dict, consumed_samples: int, evaluated: bool = False,
                 before_save: Callable[[], dict] | None = None, **state) -> None:
        """Log (on the interval and after an eval), checkpoint when due or signalled (with the
        stage-specific trainer `state`, and `before_save()`'s, called only when a checkpoint is
        taken: e.g. draining the rollout engine's batch in flight), beat the heartbeat."""
        if self.due(self.log_interval) or evaluated:
            self.log.log(self.step, metrics)
        step, sampler, trained = self.step, self.sampler, self.trained

        def full_state() -> dict:
            extra = before_save() if before_save is not None else {}  # first: it may drain (e.g. the engine's batch)
            return trainer_state(step, consumed_samples, sampler, trained, **state, **extra, **self.tracker_state())

        checkpoint_if_due(self.ckpt, self.log, self.preemption, self.step, self.total, self.save_interval,
                          self.trained, full_state)
        self.heartbeat.beat()

    @contextmanager
    def rewind_on(self, errors: tuple[type[BaseException], ...], consumed_samples: int,
                  before_save: Callable[[], dict] | None = None, **state):
        """Wrap the part of a step that changes no weights (e.g. generate and score). If it
        raises one of `errors`, the previous step is checkpointed as it ended (the sampler's
        position and the RNG streams from before this part, the trainer `state` given, and
        `before_save()`'s, called only then: it must describe the state from before this part)
        unless it already was, then the error propagates: a rerun resumes as if nothing had happened."""
        position, rng = self.sampler.state_dict(), rng_state()
        try:
            yield
        except errors:
            previous = self.step - 1
            if previous > 0 and not (self.ckpt.stage_dir / iter_name(previous)).is_dir():
                self.sampler.load_state_dict(position)
                set_rng_state(rng)
                extra = before_save() if before_save is not None else {}
                with preemption.protected():
                    self.ckpt.save(previous, self.trained, trainer_state(
                        previous, consumed_samples, self.sampler, self.trained, **state, **extra, **self.tracker_state()))
                    self.ckpt.wait()
                self.log.info(f"checkpoint of step {previous} (the last complete one) saved before stopping")
            raise

    # ------------------------------------------------------------------ end
    def finish(self, fields: dict, message: str, roles: dict | None = None) -> dict:
        """Wait for the last checkpoint, write summary.json, close the logs; returns the summary.
        `roles`: every role the stage built (default: the trained ones), for the memory account."""
        self.ckpt.wait()
        peak = peak_memory_bytes()
        summary = {"stage": self.stage_name, "steps": self.step, **fields,
                   "wall_seconds": time.perf_counter() - self.start_time, "peak_memory_bytes": peak,
                   "memory_account": memory_account(roles or self.trained, peak, self.memory_at_start,
                                                    checkpoint_save_bytes=self.ckpt.last_save_bytes),
                   "checkpoint": str(self.ckpt.latest()), "checkpoint_warnings": self.checkpoint_warnings,
                   "inputs": self.inputs, **self.tracker_state()}
        if experts := expert_modules(roles or self.trained):  # MoE models only: dense summaries are unchanged
            summary["expert_modules"] = experts
        write_summary(self.out, summary)
        self.log.info(message)
        self.heartbeat.close()
        self.log.close(summary)
        return summary


# ---------------------------------------------------------------------- checkpoint lifecycle
def resume_source(cfg: Config, ckpt) -> Path | str | None:
    """Where to resume from: checkpoint.load, else the stage's own complete checkpoint, else
    nothing (a fresh start); see CheckpointManager.has_checkpoint for damaged ones."""
    if cfg.checkpoint.load:
        return cfg.checkpoint.load
    if cfg.checkpoint.resume and ckpt.has_checkpoint():
        return ckpt.stage_dir
    return None


def resume(cfg: Config, ckpt, roles: dict, sampler) -> tuple[int, str | None, dict]:
    """(step, lines for the log, the trainer state; step 0, None and {} on a fresh start).
    Restores the sampler and the non-finite guards of the trained roles."""
    source = resume_source(cfg, ckpt)
    if source is None:
        return 0, None, {}
    state = ckpt.load(roles, source)
    sampler.load_state_dict(state["sampler"])
    for name, guard in state.get("guards", {}).items():
        roles[name].guard.load_state_dict(guard)
    notes = [*state.get("checkpoint_warnings", []), f"resumed from {state['checkpoint']} at step {state['step']}"]
    return state["step"], "\n".join(notes), state


def trainer_state(step: int, consumed_samples: int, sampler, roles: dict, **extra) -> dict:
    """What every stage saves besides the roles: the step, the samples consumed, the data
    order and position, the skipped-step counters, and stage-specific `extra` (RNG states
    are added by the checkpoint manager)."""
    return {"step": step, "consumed_samples": consumed_samples, "sampler": sampler.state_dict(),
            "guards": {name: role.guard.state_dict() for name, role in roles.items()}, **extra}


def skipped_steps(roles: dict, by_role: bool = False) -> dict[str, int]:
    """Optimizer steps skipped so far for a NaN/Inf loss or gradient, per trained role
    (`<role>_skipped_steps`; a stage with one role and by_role False: `skipped_steps`)."""
    return {f"{name}_skipped_steps" if by_role or len(roles) > 1 else "skipped_steps": role.guard.skipped
            for name, role in roles.items()}


def expert_modules(roles: dict) -> dict[str, str]:
    """The class of each role's expert module as built on this rank (megatron's MoE layers'
    `experts`: TEGroupedMLP with Transformer Engine's grouped GEMM, SequentialMLP without), for
    the summary (make gpu-check reports it); roles without MoE layers are left out."""
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    found = {}
    for name, role in roles.items():
        kinds = sorted({type(m.experts).__name__ for m in role.module.modules() if isinstance(m, BaseMoELayer)})
        if kinds:
            found[name] = ", ".join(kinds)
    return found


def write_summary(directory: Path, summary: dict[str, Any]) -> None:
    """summary.json (rank 0); NaN/Inf are written as null, so that strict JSON parsers read it."""
    if dist.get_rank() == 0:
        tmp = directory / "summary.json.tmp"
        tmp.write_text(json.dumps(nonfinite_to_null(summary), indent=2, allow_nan=False) + "\n")
        tmp.replace(directory / "summary.json")


def checkpoint_if_due(ckpt, log, preemption, step: int, total: int, save_interval: int,
                      roles: dict, state: dict | Callable[[], dict]) -> None:
    """Save on the interval, at the last step, or when any rank was signalled; after a
    signalled save, wait for it to be committed and exit for requeue
    (resilience/preemption.py). Commits finished async saves on the way. `state`: the trainer
    state, or a function that makes it (called only when a checkpoint is taken)."""
    preempted = preemption.should_stop()
    # An interval save waits for a good step: a run that keeps producing NaN must stop with
    # its last checkpoint from before the trouble, not one taken in the middle of it.
    in_nonfinite_streak = any(role.guard.consecutive for role in roles.values())
    with preemption.protected():  # the handler's: a signal meanwhile does not cut a checkpoint short
        if (periodic(step, save_interval, total) and not in_nonfinite_streak) or step == total or preempted:
            ckpt.save(step, roles, state() if callable(state) else state)
        ckpt.poll()
        if preempted and step < total:
            ckpt.wait()
            log.info(f"signalled: checkpoint at step {step} saved, exiting for requeue")
            raise Preempted(step)
