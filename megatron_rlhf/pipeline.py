"""SFT -> RM -> PPO in one launch: each stage reads the previous stage's checkpoint.

    python -m megatron_rlhf pipeline --config pipelines/tiny_cpu.yaml [key=value ...]

A stage whose summary.json exists is skipped; a stage with checkpoints but no summary
resumes from its latest complete checkpoint. At the end, <run>/report.md and PNG plots.
"""

from __future__ import annotations

import torch.distributed as dist

from megatron_rlhf.config import Config
from megatron_rlhf.logging.report import write_report
from megatron_rlhf.trainers import ppo, rm, sft
from megatron_rlhf.trainers.common import run_dir, stage_dir

STAGES = (("sft", sft.train), ("rm", rm.train), ("ppo", ppo.train))


def run(cfg: Config) -> dict:
    summaries = {}
    for name, train in STAGES:
        if (stage_dir(cfg, name) / "summary.json").exists():
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"[pipeline] {name}: finished earlier, skipped ({stage_dir(cfg, name)}/summary.json)", flush=True)
            continue
        summaries[name] = train(cfg)
    if not dist.is_initialized() or dist.get_rank() == 0:
        report = write_report(run_dir(cfg))
        print(f"[pipeline] report: {report}", flush=True)
    return summaries
