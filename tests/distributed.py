"""Helpers for tests that launch real multi-process jobs with torchrun (gloo on CPU)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

REPO = Path(__file__).resolve().parent.parent

# A tiny Llama-style model: GQA (4 heads, 2 kv groups), 4 layers so PP=2 splits them, and a
# vocabulary of 100 padded to 128 so the padded-logit masking is exercised.
TINY_MODEL = [
    "model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4",
    "model.num_query_groups=2", "model.ffn_hidden_size=128", "model.vocab_size=100",
    "model.max_seq_length=64",
]


def still_running(pids: list[int], within: float) -> list[int]:
    """Of `pids`, those still running (not gone, not zombies) after waiting up to `within` seconds
    for all of them to end."""
    deadline = time.time() + within
    while (alive := [p for p in pids if _running(p)]) and time.time() < deadline:
        time.sleep(0.2)
    return alive


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def torchrun(nproc: int, script: str, *args: str, timeout: int = 600, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """`script` is a path under the repo, or "-m" followed by a module name in `args`;
    `env` adds environment variables; `check=False` returns a failed run instead of raising."""
    target = [script] if script == "-m" else [str(REPO / script)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", *target, *args]
    # tests/ on the path: workers import their shared start-up from tests/workers/__init__.py
    pythonpath = os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))
    inherited = {k: v for k, v in os.environ.items() if k != "MEGATRON_RLHF_FAULT"}  # faults only when asked
    env = {**inherited, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": pythonpath, **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
            f"--- stderr\n{proc.stderr[-12000:]}"
        )
    return proc


def read_global_tensors(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """A megatron torch_dist checkpoint as full (unsharded) tensors, read in this process."""
    out = checkpoint_dir.parent / (checkpoint_dir.name + ".full.pt")
    dcp_to_torch_save(checkpoint_dir, out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
