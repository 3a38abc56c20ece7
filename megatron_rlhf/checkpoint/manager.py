"""Stage checkpoints: crash-safe commits, self-validation, fallback on load, retention, and
optional async saving.

    <stage_dir>/
      iter_0000040/              one committed checkpoint
        actor/ critic/ ...       megatron dist checkpoint per trained role (model + optimizer + LR)
        trainer_state/           rank_00000.pt ... (step, data position, RNG states, ...)
        commit.json              the commit record, written last (see below)
      iter_0000042.tmp/          a save in progress, or the debris of a crashed one
      latest                     name of the newest committed checkpoint

Guarantees:
- A checkpoint is written under `iter_*.tmp/`. Only after every rank has finished writing
  does rank 0 write `commit.json` ({step, roles, world_size, layout: {tp, pp, dp}, files:
  {relative path: bytes}}), rename the directory to `iter_*`, and then replace `latest`
  atomically. A crash at any point leaves the previous committed checkpoint untouched.
- Loading checks the chosen checkpoint against its commit record (validate.py). Resuming
  (load) falls back to the next older complete one, with a loud warning naming what was
  damaged (logged, and in the stage's summary); starting from another stage's checkpoint
  (resolve_checkpoint) refuses a damaged newest one and names the older one to pick
  explicitly; an explicit iter_* directory that is damaged is an error, never replaced.
- Symlinks inside a stage directory are never followed: a planted one (an iter_*, .tmp,
  role directory or file) is removed as a link by save and retention, and a checkpoint
  holding one is neither loaded nor committed, so every write stays under the stage directory.
- Nothing is written from NaN/Inf weights (NonFiniteError on every rank, no directory).
- RNG states are restored only at the layout (TP, PP, DP) they were saved at; model and
  optimizer state reshard to any layout (megatron dist checkpointing).
- Loading runs no code from the checkpoint (safe_load.py): trainer states hold only plain
  values (RNG states included) and load with weights_only=True, role checkpoints load under
  restricted_dcp_unpickling; a file holding anything else is a CheckpointError naming it.
- A save adds at most one tensor's copy to the process's memory at DP=1, not a copy of the
  state (streaming_writer.py, models/optimizer.py live_param_state_at_dp1); `last_save_bytes`
  is what the last one added (the stage summary's memory_account.checkpoint_save_bytes).
- Retention keeps the newest `keep_last` complete checkpoints and never the one just
  committed; `.tmp` debris of steps up to the committed one is removed after the commit.
- async_save: the role files are written by a forked process per save (megatron-core's
  TemporalAsyncCaller) while training continues, and still hold the values at save time
  although training updates tensors in place: megatron copies GPU tensors to host while
  planning the save (and, at DP > 1, gathers DistributedOptimizer state into copies), and the
  fork, taken inside save(), freezes the rest copy-on-write (on CPU all of it: weights, DDP
  buffers, Adam moments); the writer process copies views one at a time (streaming_writer.py).
  `poll()` (every step) / `wait()` commit it as a collective finalize step once every
  rank's writer has finished. One save is in flight at a time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import re
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_rlhf.checkpoint.dist import load_role, save_role
from megatron_rlhf.checkpoint.safe_load import load_pt
from megatron_rlhf.checkpoint.validate import (  # noqa: F401  (re-exported API)
    COMMIT, LATEST, CheckpointError, DamagedNewestCheckpoint, checkpoint_dirs, find_checkpoint, iter_name,
    read_commit, symlinks_in, validate,
)
from megatron_rlhf.logging.memory import MemoryGrowth
from megatron_rlhf.resilience.faults import FAULTS
from megatron_rlhf.parallel.collectives import errors_agreed
from megatron_rlhf.resilience.nonfinite import ensure_finite_weights

log = logging.getLogger(__name__)


def rng_state() -> dict[str, Any]:
    """Every RNG stream of this process as plain values (tensors, ints, floats, strings,
    tuples, dicts), so trainer states load with torch.load(weights_only=True)."""
    from megatron.core import tensor_parallel

    return {
        "python": random.getstate(), "numpy": _numpy_state(), "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    _set_numpy_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _numpy_state() -> tuple:
    # numpy's (legacy) state tuple with its uint32 ndarray key as an int64 tensor
    kind, key, *rest = np.random.get_state()
    return (kind, torch.from_numpy(key.astype(np.int64)), *rest)


def _set_numpy_state(saved: tuple) -> None:
    kind, key, *rest = saved  # key: a tensor; an ndarray in trainer states written before
    np.random.set_state((kind, np.asarray(key, dtype=np.uint32), *rest))


def current_layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size()}


def _describe(layout: dict[str, int]) -> str:
    return f"TP{layout['tp']} PP{layout['pp']} DP{layout['dp']}"


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _agreed(fn):
    """Run `fn` on rank 0 and hand its result (or its exception) to every rank, so all
    ranks load the same checkpoint or all raise the same error."""
    if not dist.is_initialized():
        return fn()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as e:  # noqa: BLE001  (re-raised on every rank below)
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def resolve_checkpoint(path: str | Path, setting: str | None = None) -> Path:
    """A stage directory, an iter_* directory or STAGE_DIR@iter_N -> the complete iter_*
    directory to start from (validate.find_checkpoint); what was skipped is logged as warnings
    (rank 0). Strict: a stage whose newest checkpoint is damaged is DamagedNewestCheckpoint,
    telling to set `setting` (the config field naming `path`, e.g. rm.init_from) to the older
    one, not silently built on."""
    try:
        found, warnings = find_checkpoint(path, allow_fallback=False)
    except DamagedNewestCheckpoint as e:
        raise DamagedNewestCheckpoint(e.stage_dir, e.damage, e.older, setting) from None
    if _rank0():
        for line in warnings:
            log.warning(line)
    return found


def _remove(path: Path) -> None:
    """Delete a file, a directory tree or a symlink; a symlink as a link, never what it points
    to (rmtree refuses a symlink, and its ignore_errors hid that)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # leftover or planted (a symlink): "x" then creates, never follows
    with open(tmp, "x") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _run_in_order(calls: list) -> None:
    # One writer process per save runs every role's writes in turn: megatron's writers all
    # report to one process-wide results queue that each role's finalize reads with
    # get_nowait(), so concurrent writers could hand a role another role's results.
    for fn, args, kwargs in calls:
        fn(*args, **kwargs)


def _merge_requests(requests: list, commit) -> Any:
    """The roles' megatron AsyncRequests as one request: one writer, then every role's
    finalize (`.metadata`, metadata.json), then `commit`."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    calls, finalize_fns = [], []
    for req in requests:
        if req.async_fn is not None:
            args = list(req.async_fn_args)
            if req.preload_fn is not None:  # device -> host copy now (as megatron's caller does)
                args[1] = req.preload_fn()
            calls.append((req.async_fn, tuple(args), req.async_fn_kwargs))
        finalize_fns += req.finalize_fns
    return AsyncRequest(_run_in_order if calls else None, (calls,), [*finalize_fns, commit])


_ITER_NAME = re.compile(r"^iter_(\d+)$")


def _agreed_trainer_state(path: Path) -> dict[str, Any]:
    """Collective. This rank's trainer state (rank 0's when the checkpoint has fewer ranks),
    or the refusal (safe_load.load_pt, check_trainer_state) raised on every rank: the ranks that
    could read theirs would otherwise go on to train and wait for the refused one forever."""
    rank_file = path / "trainer_state" / f"rank_{dist.get_rank():05d}.pt"
    with errors_agreed(lambda: CheckpointError(f"{path}/trainer_state: a file was refused on another rank "
                                               "(see its error)"), catch=CheckpointError):
        state_file = rank_file if rank_file.exists() else path / "trainer_state" / "rank_00000.pt"
        state = check_trainer_state(load_pt(state_file), state_file)
    return state


def check_trainer_state(state: Any, state_file: Path) -> dict[str, Any]:
    """`state`, read from <iter_dir>/trainer_state/`state_file`, as a stage resumes from it: a
    mapping whose `step` is an integer >= 0, that of its iter_N directory (a resume restarts the
    step count, the data position and the schedules from it); a CheckpointError naming the file
    and the fix otherwise."""
    iter_dir = state_file.parent.parent
    named = int(m.group(1)) if (m := _ITER_NAME.match(iter_dir.name)) else None  # None: a copy, renamed
    if not isinstance(state, dict):
        why = f"holds a {type(state).__name__}, not the mapping of a trainer state"
    elif "step" not in state:
        why = "has no step"
    elif type(state["step"]) is not int or state["step"] < 0 or named not in (None, state["step"]):
        why = f"step={state['step']!r}" + (f", in {iter_dir.name} (saved at step {named})" if named is not None
                                           else ": expected an integer >= 0")
    else:
        return state
    raise CheckpointError(f"{state_file}: {why}: the file was changed after its save; move {iter_dir} out of "
                          f"{iter_dir.parent} to resume from the checkpoint before it")


def _resume_choice(where: str | Path) -> tuple[Path, list[str]]:
    """find_checkpoint with the fallback, the fallback said loudly (logged on rank 0)."""
    try:
        return find_checkpoint(where, allow_fallback=False)
    except DamagedNewestCheckpoint as unusable:
        path, warnings = find_checkpoint(where)
        loud = (f"RESUMING FROM AN OLDER CHECKPOINT, {path.name}: {'; '.join(unusable.damage)}; "
                f"the training after step {int(path.name[5:])} is done again")
        log.warning(loud)
        return path, [*warnings, loud]


def _model_section(roles: dict):
    """The model section a checkpoint of `roles` records: the first role's `model_config`, the
    section it was built from (models/roles.py: Role); None when no role names one."""
    return next((r.model_config for r in roles.values() if getattr(r, "model_config", None) is not None), None)


class CheckpointManager:
    """Saves and loads the complete state of one stage under `stage_dir`."""

    def __init__(self, stage_dir: str | Path, keep_last: int = 2, async_save: bool = False):
        self.stage_dir = Path(stage_dir)
        self.keep_last = max(1, keep_last)
        self.async_save = async_save
        # what this process's memory rose by during the last save() (logging/memory.py
        # MemoryGrowth; an async save's writing happens in its forked writer, not counted)
        self.last_save_bytes = 0
        self._queue = None
        if async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._queue = AsyncCallsQueue(persistent=False)  # a forked writer per save

    def latest(self) -> Path | None:
        """The complete checkpoint `load()` would use, or None (nothing complete: logged)."""
        try:
            return find_checkpoint(self.stage_dir)[0]
        except CheckpointError as e:
            if _rank0():
                log.warning(f"{e}; starting without it")
            return None
        except FileNotFoundError:
            return None

    def has_checkpoint(self) -> bool:
        """Collective; rank 0 scans the (shared) stage directory for all. Whether there is a
        complete checkpoint to resume from. Committed checkpoints that are all damaged raise
        CheckpointError: starting over would silently throw away the training they hold."""

        def scan() -> bool:
            try:
                find_checkpoint(self.stage_dir)
            except CheckpointError as err:
                if checkpoint_dirs(self.stage_dir)[0]:
                    raise CheckpointError(f"{err}. Nothing was loaded or deleted: repair or move the damaged "
                                          "checkpoints, or set checkpoint.resume=false to start over") from None
                return False  # only an unfinished first save: nothing complete to resume from
            except FileNotFoundError:
                return False
            return True

        return _agreed(scan)

    def save(self, step: int, roles: dict, trainer_state: dict[str, Any]) -> Path:
        """Collective. `trainer_state` is this rank's (it may differ per rank, e.g. RNG).
        Sync: committed on return. Async: committed by a later poll()/wait()."""
        self.wait()
        ensure_finite_weights(roles)
        rank = dist.get_rank()
        final = self.stage_dir / iter_name(step)
        tmp = final.with_name(final.name + ".tmp")
        with errors_agreed(lambda: RuntimeError(f"rank 0 could not create {tmp}"), catch=OSError):
            if rank == 0:
                _remove(tmp)  # an earlier attempt at this step crashed
                (tmp / "trainer_state").mkdir(parents=True)
        with MemoryGrowth() as growth:
            requests = [save_role(role, tmp / name, async_save=self.async_save) for name, role in roles.items()]
            # The model config goes with the weights: export-hf and later stages read it from here.
            model_cfg = _model_section(roles)
            recorded = {"model_config": dataclasses.asdict(model_cfg)} if model_cfg is not None else {}
            torch.save({**recorded, **trainer_state, "rng": rng_state()}, tmp / "trainer_state" / f"rank_{rank:05d}.pt")
            record = {"step": step, "roles": list(roles), "world_size": dist.get_world_size(),
                      "layout": current_layout()}
            commit = partial(self._commit, tmp, final, record)
            if self.async_save:
                merged = _merge_requests(requests, commit)
            else:
                commit()
        self.last_save_bytes = growth.bytes
        if self.async_save:  # forks the writer: after the sampling thread has stopped
            self._queue.schedule_async_request(merged)
        return final

    def poll(self) -> None:
        """Collective. Commit the async saves every rank has finished writing (no-op when sync)."""
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        """Collective. Block until every pending async save is committed (no-op when sync)."""
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=True)

    def _commit(self, tmp: Path, final: Path, record: dict) -> None:
        """Collective: every rank's files are written; rank 0 makes them the checkpoint."""
        FAULTS.at("save", record["step"])  # tests: a rank dies with its files written, uncommitted
        dist.barrier()
        # Every rank learns whether rank 0 committed, instead of waiting for it forever.
        with errors_agreed(lambda: RuntimeError(f"rank 0 failed to commit checkpoint {final.name}"), catch=OSError):
            if dist.get_rank() == 0:
                if links := symlinks_in(tmp):
                    raise CheckpointError(f"{tmp}: not committed, it holds a symlink ({'; '.join(links)}); "
                                          "a checkpoint is never written or read through one")
                files = sorted(p for p in tmp.rglob("*") if p.is_file())
                record = {**record, "files": {p.relative_to(tmp).as_posix(): p.stat().st_size for p in files}}
                _write_atomic(tmp / COMMIT, json.dumps(record, indent=1) + "\n")
                if os.path.lexists(final):  # the same step saved again (or a planted link): replaced
                    _remove(final)
                os.replace(tmp, final)
                _write_atomic(self.stage_dir / LATEST, final.name + "\n")
                _fsync_dir(self.stage_dir)
                self._apply_retention(record["step"])

    def _apply_retention(self, committed: int) -> None:
        done, unfinished = checkpoint_dirs(self.stage_dir)
        complete = [s for s in sorted(done, reverse=True) if not validate(done[s])]
        keep = {committed, *complete[: self.keep_last]}
        # Only what is not newer than the committed step: newer ones belong to a run this one
        # was not resumed from (e.g. checkpoint.load of an older step) and are not ours to drop.
        doomed = [p for s, p in done.items() if s <= committed and s not in keep]
        doomed += [p for s, p in unfinished.items() if s <= committed]  # debris of crashed saves
        for path in doomed:
            try:
                _remove(path)
            except OSError as e:  # the commit stands; what could not be deleted is said
                log.warning(f"retention: could not delete {path} ({e})")

    def load(self, roles: dict, checkpoint: str | Path | None = None) -> dict[str, Any]:
        """Collective. Loads every role (at this process's layout) from the stage's newest
        complete checkpoint, or from `checkpoint` (a stage or iter_* directory), and returns
        this rank's trainer state plus "checkpoint" (its path) and "checkpoint_warnings"
        (lines for the log and the stage's summary: damaged or unfinished checkpoints skipped,
        RNG not restored). A damaged newest checkpoint is not an error here: resuming from the
        newest complete one is what saving under .tmp and committing last is for."""
        self.wait()
        path, warnings = _agreed(lambda: _resume_choice(checkpoint or self.stage_dir))
        record = read_commit(path)
        if missing := [name for name in roles if name not in record["roles"]]:
            raise CheckpointError(f"checkpoint {path} holds {record['roles']}, not {missing}")
        for name, role in roles.items():
            load_role(role, path / name)
        state = _agreed_trainer_state(path)
        rng = state.pop("rng")
        saved, now = record["layout"], current_layout()
        # The per-rank RNG streams only mean the same thing at the same layout.
        if record["world_size"] == dist.get_world_size() and saved == now:
            set_rng_state(rng)
        else:
            warnings.append(f"RNG states not restored: saved at {_describe(saved)}, running at {_describe(now)}")
        return {**state, "checkpoint": str(path), "checkpoint_warnings": warnings}
