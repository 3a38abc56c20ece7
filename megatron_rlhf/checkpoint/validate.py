"""Is a checkpoint complete, and which checkpoint of a stage directory should be loaded?

A checkpoint is complete when its `commit.json` (written last, by the manager, once every
rank had finished writing) parses and every file it records is present with the recorded
size. Anything else (no commit record, a missing or truncated file, a missing role) makes
it damaged: loading it could fail half-way through or, worse, succeed with wrong tensors.
Only file metadata is read here (no checkpoint data), so checking is cheap.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

COMMIT = "commit.json"
LATEST = "latest"
_ITER = re.compile(r"^iter_(\d{7})$")
_TMP = re.compile(r"^iter_(\d{7})\.tmp$")


class CheckpointError(FileNotFoundError):
    """No usable checkpoint where one was asked for (a FileNotFoundError, so callers that
    treat 'nothing to load' as missing keep working; the message says what is wrong)."""


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def checkpoint_dirs(stage_dir: Path) -> tuple[dict[int, Path], dict[int, Path]]:
    """(committed-looking iter_* dirs, unfinished iter_*.tmp dirs), each by step."""
    done, unfinished = {}, {}
    if stage_dir.is_dir():
        for p in stage_dir.iterdir():
            if (m := _ITER.match(p.name)) and p.is_dir():
                done[int(m.group(1))] = p
            elif (m := _TMP.match(p.name)) and p.is_dir():
                unfinished[int(m.group(1))] = p
    return done, unfinished


def read_commit(path: Path) -> dict:
    return json.loads((Path(path) / COMMIT).read_text())


def recorded_model_config(iter_dir: Path | None):
    """The ModelConfig a checkpoint recorded in its trainer state (every stage and import-hf
    write it; fields of other versions are dropped), or None for checkpoints older than that."""
    from megatron_rlhf.checkpoint.safe_load import load_pt
    from megatron_rlhf.config import ModelConfig, from_dict

    state_file = iter_dir / "trainer_state" / "rank_00000.pt" if iter_dir else None
    if state_file is None or not state_file.is_file():
        return None
    saved = load_pt(state_file).get("model_config")
    if not saved:
        return None
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return from_dict(ModelConfig, {k: v for k, v in saved.items() if k in known}, prefix="model.")


def validate(path: str | Path) -> list[str]:
    """What is wrong with the checkpoint at `path` (an iter_* directory); [] = complete."""
    path = Path(path)
    if not path.is_dir():
        return ["directory missing"]
    if not (path / COMMIT).is_file():
        return [f"{COMMIT}: missing (the save was never committed)"]
    try:
        record = read_commit(path)
        files, roles = dict(record["files"]), list(record["roles"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{COMMIT}: unreadable ({type(e).__name__}: {e})"]
    problems = [f"{role}/: missing" for role in roles if not (path / role).is_dir()]
    for rel, size in sorted(files.items()):
        try:
            actual = (path / rel).stat().st_size
        except OSError:
            problems.append(f"{rel}: missing")
            continue
        if actual != size:
            problems.append(f"{rel}: {actual} bytes, {size} when committed")
    return problems


def _is_iter_dir(path: Path) -> bool:
    return bool(_ITER.match(path.name) or _TMP.match(path.name)) or (path / COMMIT).exists()


def find_checkpoint(path: str | Path) -> tuple[Path, list[str]]:
    """A stage directory or an iter_* directory -> (the complete iter_* directory to load,
    warnings about what was skipped). Raises FileNotFoundError when there is nothing to
    load, CheckpointError (a FileNotFoundError) when there is only damaged checkpoints.

    An iter_* directory is used as given or not at all (no silent substitute). In a stage
    directory the checkpoint `latest` names is tried first, then the older ones, newest
    first; checkpoints newer than `latest` are ignored (a crash between the rename and the
    `latest` update leaves one: consistent, but never announced as the stage's checkpoint).
    """
    path = Path(path)
    if _is_iter_dir(path):
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint not found: {path}")
        if problems := validate(path):
            raise CheckpointError(f"checkpoint {path} is damaged ({'; '.join(problems)}); "
                                  f"pick another iter_* directory or the stage directory")
        return path, []
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint in {path}: the directory does not exist")

    done, unfinished = checkpoint_dirs(path)
    warnings = [f"{p.name}: an unfinished save (interrupted while writing); ignored"
                for _, p in sorted(unfinished.items())]
    newest_first = [done[s] for s in sorted(done, reverse=True)]
    candidates = newest_first
    marker = path / LATEST
    named = marker.read_text().strip() if marker.is_file() else None
    if named is None:
        if done:
            warnings.append(f"no '{LATEST}' marker in {path}; using the newest complete checkpoint")
    elif (m := _ITER.match(named)) and int(m.group(1)) in done:
        latest_step = int(m.group(1))
        warnings += [f"{p.name} is newer than the checkpoint '{LATEST}' names ({named}); ignored"
                     for p in newest_first if int(p.name[5:]) > latest_step]
        candidates = [p for p in newest_first if int(p.name[5:]) <= latest_step]
    else:
        warnings.append(f"'{LATEST}' names {named!r}, which does not exist")

    damaged = []
    for candidate in candidates:
        if problems := validate(candidate):
            damaged.append(f"checkpoint {candidate.name} is damaged ({'; '.join(problems)})")
            continue
        return candidate, warnings + [f"{d}; falling back to {candidate.name}" for d in damaged]
    if not damaged and not unfinished:
        raise FileNotFoundError(f"no checkpoint in {path}")
    raise CheckpointError(f"no complete checkpoint in {path}: " + "; ".join(damaged + warnings))
