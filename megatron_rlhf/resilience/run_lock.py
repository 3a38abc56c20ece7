"""One writer per stage directory.

A stage directory (<run>/sft, <run>/ppo, ...) holds one run's checkpoints, metrics.jsonl and
summary.json. Two processes writing it at once (a user re-running a command, a second job on
the same checkpoint.run_name) interleave the metrics and mix their checkpoints, so the stage's
rank 0 holds an exclusive lock on <stage>/.writer.lock from before anything is written until
the process ends. The lock is flock(2): the kernel releases it when the holder dies, however
it dies, so a crashed run never blocks its own resume; a process the holder forked (an async
checkpoint writer) keeps it until it has finished writing. A second writer is refused with a
config error (exit 2) naming the holder's host and pid. Readers (report, export-hf, a later
stage loading this one's checkpoint) take no lock.

On a filesystem without locks (some NFS mounts, Lustre without -o flock) the stage warns once
and runs unguarded.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
import warnings
from pathlib import Path

from megatron_rlhf.config.errors import ConfigError

LOCK_FILE = ".writer.lock"
_HELD: dict[str, int] = {}  # realpath of a stage directory -> the open, locked lock file (kept for the process's life)
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def lock_stage_directory(directory: Path) -> str | None:
    """Take <directory>/.writer.lock for this process, for good; None when taken (or already
    held by this process, or unsupported here), else who holds it ("host H, pid P, since T:
    command")."""
    key = os.path.realpath(directory)
    if key in _HELD:
        return None
    Path(directory).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(directory) / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            holder = _holder(fd)
            os.close(fd)
            return holder
        os.close(fd)
        if err.errno in _UNSUPPORTED:
            warnings.warn(f"{directory}: this filesystem does not support file locks ({err.strerror}); a second "
                          "run writing the same stage directory would not be detected", stacklevel=2)
            _HELD[key] = -1
            return None
        raise
    record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join(sys.argv[1:3])}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    _HELD[key] = fd
    return None


def stage_directory_holder(directory: Path) -> str | None:
    """Who holds <directory>/.writer.lock now (None: nobody), without taking it: the launcher's
    pre-flight, so that a second run stops before its workers start."""
    path = Path(directory) / LOCK_FILE
    if os.path.realpath(directory) in _HELD or not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as err:
        return _holder(fd) if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
    finally:
        os.close(fd)  # releases the probe's shared lock, if it got one
    return None


def busy_error(directory: Path, run_name: str, holder: str) -> ConfigError:
    return ConfigError(f"checkpoint.run_name={run_name}: {directory} is being written by another run ({holder}); a "
                       "stage directory has one writer. Wait for that run to end or stop it, or give this one another "
                       "checkpoint.run_name")


def hold_stage_directory(directory: Path, cfg) -> None:
    """Collective over the whole world: rank 0 takes the stage directory's lock; if another run
    holds it, every rank raises the same ConfigError (exit 2) before anything is written."""
    import torch.distributed as dist

    holder = [lock_stage_directory(directory) if dist.get_rank() == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(holder, src=0)
    if holder[0] is not None:
        raise busy_error(directory, cfg.checkpoint.run_name, holder[0])


def _holder(fd: int) -> str:
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"host {record['host']}, pid {record['pid']}, since {record['since']}: {record['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet said who it is"
