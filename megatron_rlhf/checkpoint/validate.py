"""Is a checkpoint complete, and which checkpoint of a stage directory should be loaded?

A checkpoint is complete when its `commit.json` (written last, by the manager, once every
rank had finished writing) parses and every file it records is present with the recorded
size. Anything else (no commit record, a missing or truncated file, a missing role) makes
it damaged: loading it could fail half-way through or, worse, succeed with wrong tensors.
Only file metadata is read here (no checkpoint data), so checking is cheap. A symlink
anywhere in a checkpoint (the iter_* directory, a role directory, a file) is damage too: it
would make loading read, and a commit publish, files outside the stage directory.

Which checkpoint: a stage directory means the one `latest` names. When that one is damaged,
resuming falls back to the newest complete older one (crash safety, announced loudly);
starting another stage from it or exporting it must not (find_checkpoint's allow_fallback):
an older checkpoint is used there only when named, as `STAGE_DIR@iter_N` or its iter_* path.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

from megatron_rlhf.checkpoint.errors import CheckpointError

COMMIT = "commit.json"
LATEST = "latest"
_ITER = re.compile(r"^iter_(\d{7})$")
_TMP = re.compile(r"^iter_(\d{7})\.tmp$")
_EXPLICIT = re.compile(r"^(.+)@iter_(\d+)$")  # STAGE_DIR@iter_3 or STAGE_DIR@iter_0000003


class DamagedNewestCheckpoint(CheckpointError):
    """A stage directory's newest checkpoint is damaged (or `latest` names a missing one) and
    an older one is complete: callers that must not build on a silent substitute refuse, and
    say how to pick the older one explicitly. `setting`: the config field that picks it."""

    def __init__(self, stage_dir: Path, damage: list[str], older: Path, setting: str | None = None):
        self.stage_dir, self.damage, self.older, self.setting = stage_dir, damage, older, setting
        explicit = f"{stage_dir}@iter_{int(older.name[5:])}"
        how = f"set {setting}={explicit}" if setting else f"name it explicitly: {explicit} (or {older})"
        super().__init__(f"{setting + ': ' if setting else ''}the newest checkpoint of {stage_dir} is not usable: "
                         f"{'; '.join(damage)}. An older checkpoint is not used in its place unless asked for: to "
                         f"use the newest complete one, {older.name}, {how}")

    def __reduce__(self):  # crosses ranks pickled (manager._agreed)
        return type(self), (self.stage_dir, self.damage, self.older, self.setting)


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def checkpoint_dirs(stage_dir: Path) -> tuple[dict[int, Path], dict[int, Path]]:
    """(committed-looking iter_* dirs, unfinished iter_*.tmp dirs), each by step."""
    done, unfinished = {}, {}
    if stage_dir.is_dir():
        for p in stage_dir.iterdir():
            # a symlink is listed whatever it points to: validate() calls it damage, retention
            # and save remove it (as a link)
            if not (p.is_dir() or p.is_symlink()):
                continue
            if m := _ITER.match(p.name):
                done[int(m.group(1))] = p
            elif m := _TMP.match(p.name):
                unfinished[int(m.group(1))] = p
    return done, unfinished


def symlinks_in(root: Path) -> list[str]:
    """Every symlink at or under `root` (never entered), described with its target."""
    if root.is_symlink():
        return [f"{root.name} is a symlink to {os.readlink(root)}"]
    links = []
    for dirpath, dirnames, filenames in os.walk(root):  # followlinks=False: a linked dir is listed, not entered
        for name in sorted(dirnames + filenames):
            if os.path.islink(entry := os.path.join(dirpath, name)):
                links.append(f"{Path(entry).relative_to(root).as_posix()}: a symlink to {os.readlink(entry)}")
    return links


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
    if links := symlinks_in(path):
        return [*links, "a checkpoint is never read through a symlink: copy the files in place of the link"]
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
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            problems.append(f"{rel}: recorded outside the checkpoint directory")
            continue
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


def find_checkpoint(path: str | Path, allow_fallback: bool = True) -> tuple[Path, list[str]]:
    """A stage directory, an iter_* directory or `STAGE_DIR@iter_N` -> (the complete iter_*
    directory to load, warnings about what was skipped). Raises FileNotFoundError when there
    is nothing to load, CheckpointError (a FileNotFoundError) when there is only damaged
    checkpoints.

    An iter_* directory (`STAGE_DIR@iter_N` names one) is used as given or not at all (no
    silent substitute). In a stage directory the checkpoint `latest` names is the one; when it
    is damaged (or `latest` names none), with allow_fallback the older ones are tried, newest
    first, each skipped one named in the warnings; without it, DamagedNewestCheckpoint names
    the damage and the older one to pick explicitly. Checkpoints newer than `latest` are
    ignored (a crash between the rename and the `latest` update leaves one: consistent, but
    never announced as the stage's checkpoint).
    """
    path = Path(path)
    if m := _EXPLICIT.match(str(path)):
        stage, step = Path(m.group(1)), int(m.group(2))
        path = stage / iter_name(step)
        if not os.path.lexists(path):
            steps = sorted(checkpoint_dirs(stage)[0])
            raise FileNotFoundError(f"checkpoint not found: {path} ({stage}@iter_{step}); "
                                    + (f"{stage} has iter_{', iter_'.join(map(str, steps))}" if steps else
                                       f"{stage} has no checkpoints"))
    if _is_iter_dir(path):
        if not os.path.lexists(path):
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
    named, marker_problems = None, []
    if marker.is_symlink():
        marker_problems.append(f"'{LATEST}' is a symlink to {os.readlink(marker)}, never followed")
    elif marker.is_file():
        named = marker.read_text().strip()
    if named is None:
        if done and not marker_problems:
            warnings.append(f"no '{LATEST}' marker in {path}; using the newest complete checkpoint")
    elif (m := _ITER.match(named)) and int(m.group(1)) in done:
        latest_step = int(m.group(1))
        warnings += [f"{p.name} is newer than the checkpoint '{LATEST}' names ({named}); ignored"
                     for p in newest_first if int(p.name[5:]) > latest_step]
        candidates = [p for p in newest_first if int(p.name[5:]) <= latest_step]
    else:
        marker_problems.append(f"'{LATEST}' names {named!r}, which does not exist")

    damaged = []
    for candidate in candidates:
        if problems := validate(candidate):
            damaged.append(f"checkpoint {candidate.name} is damaged ({'; '.join(problems)})")
            continue
        if (marker_problems or damaged) and not allow_fallback:
            raise DamagedNewestCheckpoint(path, marker_problems + damaged, candidate)
        return candidate, warnings + marker_problems + [f"{d}; falling back to {candidate.name}" for d in damaged]
    if not damaged and not unfinished:
        raise FileNotFoundError(f"no checkpoint in {path}")
    raise CheckpointError(f"no complete checkpoint in {path}: " + "; ".join(damaged + marker_problems + warnings))
