"""Helpers for tests that run whole stages as users do: `python -m megatron_rlhf <stage>`."""

import json
import os

import torch

from distributed import read_global_tensors, torchrun

RECIPE = ["--config", "pipelines/tiny_cpu.yaml"]
# Smaller than the recipe so CI stays quick; still enough to learn the task.
SIZES = ["data.task_sizes.sft_train=1024", "data.task_sizes.preference_train=1024",
         "data.task_sizes.sft_eval=128", "data.task_sizes.preference_eval=128"]
SFT_STEPS, RM_STEPS = 60, 60
# A short SFT run the failure tests interrupt: checkpoints at 2, 4, 6, 8; faults hit step 5.
FAULT_SFT_STEPS = 8
FAULT_SFT = [f"sft.steps={FAULT_SFT_STEPS}", "sft.save_interval=2", "sft.eval_interval=4", "sft.log_interval=1",
             "sft.optimizer.warmup_steps=2", "data.task_sizes.sft_train=256", "data.task_sizes.sft_eval=64"]
TIMING = ("_seconds", "tokens_per_s", "_peak_memory_bytes", "samples_per_second", "bytes_per_s",  # wall-clock metrics
          "_busy_fraction", "_idle_fraction", "_seconds_total",
          "time")  # metrics.jsonl's wall-clock time of each row


def stage(nproc, command, root, run, *overrides, recipe=None, **torchrun_kwargs):
    recipe = ["--config", recipe] if recipe else RECIPE
    return torchrun(nproc, "-m", "megatron_rlhf", command, *recipe, *SIZES,
                    f"checkpoint.root={root}", f"checkpoint.run_name={run}", *overrides, **torchrun_kwargs)


def linked_run(root, run, *stages):
    """<root>/<run> whose finished `stages` are the shared fixture's run "main" (symlinks: later
    stages read them and `pipeline` skips them), so that a test's own stages write next to them,
    never into main/ (pytest-xdist runs other modules reading main/ at the same time)."""
    (root / run).mkdir()
    for name in stages:
        os.symlink(root / "main" / name, root / run / name)
    return run


def summary(root, run, name):
    return json.loads((root / run / name / "summary.json").read_text())


def metrics(root, run, name):
    return [json.loads(x) for x in (root / run / name / "metrics.jsonl").read_text().splitlines()]


def deterministic_metrics(root, run, name) -> str:
    """metrics.jsonl without wall-clock fields, as text (a non-finite value is written as null)."""
    lines = [{k: v for k, v in x.items() if not k.endswith(TIMING)} for x in metrics(root, run, name)]
    return json.dumps(lines)


def assert_same_tensors(want_dir, got_dir):
    """Two megatron checkpoints of a role hold bitwise equal weights and optimizer state."""
    want, got = read_global_tensors(want_dir), read_global_tensors(got_dir)
    assert want.keys() == got.keys()
    assert any("optimizer" in k for k in want), "optimizer state missing from the comparison"
    for key in want:
        assert torch.equal(want[key], got[key]), key


def fault(spec: str) -> dict:
    return {"env": {"MEGATRON_RLHF_FAULT": spec}, "check": False}


def iter_dir(root, run, name, step):
    return root / run / name / f"iter_{step:07d}"


def latest(root, run, name) -> str:
    return (root / run / name / "latest").read_text().strip()


def same_state(want, got) -> bool:
    """Equal, with tensors (e.g. DPO's precomputed reference table) compared bit for bit; wall-clock
    entries (keys ending as TIMING says, e.g. the rollout buffer's engine seconds) are not compared."""
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and want.dtype == got.dtype and torch.equal(want, got)
    if isinstance(want, dict):
        return isinstance(got, dict) and want.keys() == got.keys() and all(
            same_state(want[k], got[k]) for k in want if not (isinstance(k, str) and k.endswith(TIMING)))
    if isinstance(want, (list, tuple)):
        return type(want) is type(got) and len(want) == len(got) and all(map(same_state, want, got))
    return want == got


def assert_same_trainer_state(want_dir, got_dir, rng: bool = True):
    """rng=False: runs that built different roles (each role's initialisation draws from the
    global generators) are compared on everything else."""
    for want_file in sorted((want_dir / "trainer_state").iterdir()):
        want = torch.load(want_file, weights_only=False)
        got = torch.load(got_dir / "trainer_state" / want_file.name, weights_only=False)
        assert want.keys() == got.keys()
        for key in want:
            if key not in ("rng", "wall_clock_phases"):  # wall-clock phase totals differ between runs
                assert same_state(want[key], got[key]), key
        if not rng:
            continue
        assert want["rng"]["python"] == got["rng"]["python"]
        assert all((a == b).all() if hasattr(a, "all") else a == b for a, b in zip(want["rng"]["numpy"], got["rng"]["numpy"]))
        assert torch.equal(want["rng"]["torch"], got["rng"]["torch"])
        for name, state in want["rng"]["tracker"].items():
            assert torch.equal(state, got["rng"]["tracker"][name]), name


def assert_same_run(root, want_run, got_run, name, step, roles):
    for role in roles:
        assert_same_tensors(iter_dir(root, want_run, name, step) / role, iter_dir(root, got_run, name, step) / role)
    assert_same_trainer_state(iter_dir(root, want_run, name, step), iter_dir(root, got_run, name, step))
    assert deterministic_metrics(root, got_run, name) == deterministic_metrics(root, want_run, name)
