"""Helpers for tests that run whole stages as users do: `python -m megatron_rlhf <stage>`."""

import json

from distributed import torchrun

RECIPE = ["--config", "pipelines/tiny_cpu.yaml"]
# Smaller than the recipe so CI stays quick; still enough to learn the task.
SIZES = ["data.task_sizes.sft_train=1024", "data.task_sizes.preference_train=1024",
         "data.task_sizes.sft_eval=128", "data.task_sizes.preference_eval=128"]
SFT_STEPS, RM_STEPS = 60, 60


def stage(nproc, command, root, run, *overrides, **torchrun_kwargs):
    return torchrun(nproc, "-m", "megatron_rlhf", command, *RECIPE, *SIZES,
                    f"checkpoint.root={root}", f"checkpoint.run_name={run}", *overrides, **torchrun_kwargs)


def summary(root, run, name):
    return json.loads((root / run / name / "summary.json").read_text())


def metrics(root, run, name):
    return [json.loads(x) for x in (root / run / name / "metrics.jsonl").read_text().splitlines()]
