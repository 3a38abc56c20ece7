"""Session fixtures built once per test run, also when pytest-xdist runs the tests in several
worker processes: the first worker to need one builds it under a file lock in the directory all
workers share, the others wait for it and reuse it."""

import os
import shutil
from pathlib import Path
from typing import Callable

from filelock import FileLock


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """<shared temp dir>/<name>, filled by `build(path)` once. A build that failed is retried
    (from scratch) by the next worker that asks, so each reports the failure."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # pytest-of-<user>/pytest-<n>/: the workers' common parent
    root, done = base / name, base / f"{name}.built"
    with FileLock(str(base / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            build(root)
            done.touch()
    return root
