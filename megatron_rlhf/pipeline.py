"""The stages of `pipeline.stages` (default sft -> rm -> rl; also sft -> dpo, sft -> rm ->
dpo -> rl) in one launch: each stage reads an earlier stage's checkpoint (config.STAGE_INPUTS).

    python -m megatron_rlhf pipeline --config pipelines/tiny_cpu.yaml [key=value ...]

A finished stage (its summary.json exists) is skipped when its recorded inputs (data, tokenizer,
settings, start checkpoint) are this run's and continued when its steps were raised; otherwise the
run stops before anything trains, unless pipeline.rerun lists it (trainers/stage_inputs.py: plan).
A stage with checkpoints but no summary resumes from its latest complete checkpoint. At the
end, the policy of the last stage that trains one (rl, else dpo: the only model that is deployed)
as a Hugging Face directory in
<run>/export/actor_hf/ (<run>/export/<algorithm>_actor_hf for an RL algorithm other than ppo
or with LoRA, e.g. ppo_lora_actor_hf with the adapters merged,
<run>/export/dpo_actor_hf for dpo, dpo_lora_actor_hf with LoRA), and <run>/report.md with PNG
plots. With lora.stages, a LoRA stage writes <run>/<stage>_lora and the next stage starts from
it (its adapters merged into its base).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from megatron_rlhf import parallel
from megatron_rlhf.config import Config, validate
from megatron_rlhf.logging.report import write_report
from megatron_rlhf.trainers import dpo, rl, rm, sft
from megatron_rlhf.trainers.runner import start_distributed
from megatron_rlhf.trainers.stage_data import record_run, resolve_vocab_size, run_dir, run_tokenizer, stage_dir
from megatron_rlhf.trainers.stage_inputs import plan, replaced_name

TRAIN = {"sft": sft.train, "rm": rm.train, "dpo": dpo.train, "rl": rl.train}


def run(cfg: Config) -> dict:
    validate(cfg)  # the stage list first: a bad one must not cost an SFT run
    plans = plan(cfg)  # every finished stage checked against its recorded inputs before anything trains
    rank0 = parallel.read_dist_env().rank == 0
    policy = next((s for s in ("rl", "dpo") if s in cfg.pipeline.stages), None)
    replaced = [d for p in plans.values() for d in p.replaces]
    if policy is not None and plans[policy].action != "skip" and export_dir(cfg, policy).exists():
        replaced.append(export_dir(cfg, policy))  # the old policy's: export_actor keeps an existing one
    if replaced:
        move_aside(cfg, replaced)
    summaries = {}
    for name in cfg.pipeline.stages:
        if rank0:
            print(f"[pipeline] {plans[name].note}", flush=True)
        if plans[name].action != "skip":
            summaries[name] = TRAIN[name](cfg)
    if policy is not None:
        export = export_actor(cfg, policy)
        if rank0:
            name = cfg.rl.algorithm if policy == "rl" else policy
            print(f"[pipeline] {name.upper()} actor exported for deployment: {export}", flush=True)
    if rank0:
        report = write_report(run_dir(cfg))  # every stage directory of the run, also those of earlier configs
        print(f"[pipeline] report: {report}", flush=True)
    return summaries


def move_aside(cfg: Config, directories: list[Path]) -> None:
    """Collective. Rename each directory to <name>.replaced-<time> (rank 0), once every rank has
    planned from the directories as they were."""
    start_distributed(cfg)
    dist.barrier()
    if dist.get_rank() == 0:
        for directory in directories:
            directory.rename(aside := replaced_name(directory))
            print(f"[pipeline] {directory} moved to {aside.name}", flush=True)
    dist.barrier()


def export_dir(cfg: Config, stage: str) -> Path:
    name = stage_dir(cfg, stage).name  # ppo, grpo, ..., ppo_lora (merged: a full model), dpo, dpo_lora
    return run_dir(cfg) / "export" / ("actor_hf" if name == "ppo" else f"{name}_actor_hf")


def export_actor(cfg: Config, stage: str = "rl") -> Path:
    """<run>/export/actor_hf (ppo; <algorithm>_actor_hf for another RL algorithm, dpo_actor_hf
    for `stage` dpo): the final actor of `stage` in Hugging Face format, as export-hf writes it:
    with the model config its checkpoint recorded and the tokenizer and sampling settings its
    run recorded, not those of `cfg` (written by rank 0 under a temporary name, then renamed;
    kept if it exists already)."""
    from megatron_rlhf.convert import export_hf
    from megatron_rlhf.convert.hf_io import checkpoint_model_config

    out = export_dir(cfg, stage)
    if (not dist.is_initialized() or dist.get_rank() == 0) and not out.is_dir():
        cfg, tokenizer, _ = run_tokenizer(cfg)
        record_run(cfg, tokenizer, only_missing=True)  # a run whose stages all ran before runs recorded theirs
        checkpoint = stage_dir(cfg, stage)
        model_cfg = None  # the checkpoint's own
        if checkpoint_model_config(checkpoint, "actor") is None:  # older checkpoints: the run's config describes them
            if cfg.model.vocab_size is None:
                cfg, _ = resolve_vocab_size(cfg, tokenizer)
            model_cfg = cfg.model
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        export_hf(checkpoint, "actor", tmp, model_cfg=model_cfg)
        tmp.rename(out)
    if dist.is_initialized():
        dist.barrier()
    return out
