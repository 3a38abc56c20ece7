"""The stages of `pipeline.stages` (default sft -> rm -> rl; also sft -> dpo, sft -> rm ->
dpo -> rl) in one launch: each stage reads an earlier stage's checkpoint (config.STAGE_INPUTS).

    python -m megatron_rlhf pipeline --config pipelines/tiny_cpu.yaml [key=value ...]

A stage whose summary.json exists is skipped; a stage with checkpoints but no summary
resumes from its latest complete checkpoint. At the end, the policy of the last stage that
trains one (rl, else dpo: the only model that is deployed) as a Hugging Face directory in
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

from megatron_rlhf.config import Config, validate
from megatron_rlhf.logging.report import write_report
from megatron_rlhf.trainers import dpo, rl, rm, sft
from megatron_rlhf.trainers.stage_data import resolve_vocab_size, run_dir, stage_dir, tokenizer_for

TRAIN = {"sft": sft.train, "rm": rm.train, "dpo": dpo.train, "rl": rl.train}


def run(cfg: Config) -> dict:
    validate(cfg)  # the stage list first: a bad one must not cost an SFT run
    summaries = {}
    for name in cfg.pipeline.stages:
        train = TRAIN[name]
        if (stage_dir(cfg, name) / "summary.json").exists():
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"[pipeline] {name}: finished earlier, skipped ({stage_dir(cfg, name)}/summary.json)", flush=True)
            continue
        summaries[name] = train(cfg)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    policy = next((s for s in ("rl", "dpo") if s in cfg.pipeline.stages), None)
    if policy is not None:
        export = export_actor(cfg, policy)
        if rank0:
            name = cfg.rl.algorithm if policy == "rl" else policy
            print(f"[pipeline] {name.upper()} actor exported for deployment: {export}", flush=True)
    if rank0:
        report = write_report(run_dir(cfg), [stage_dir(cfg, s).name for s in cfg.pipeline.stages])
        print(f"[pipeline] report: {report}", flush=True)
    return summaries


def export_actor(cfg: Config, stage: str = "rl") -> Path:
    """<run>/export/actor_hf (ppo; <algorithm>_actor_hf for another RL algorithm, dpo_actor_hf
    for `stage` dpo): the final actor of `stage` with its tokenizer, in Hugging Face format
    (written by rank 0 under a temporary name, then renamed; kept if it exists already)."""
    from megatron_rlhf.convert import export_hf

    tokenizer = tokenizer_for(cfg)
    if cfg.model.vocab_size is None:  # every stage finished earlier: none has read the tokenizer
        resolve_vocab_size(cfg, tokenizer)
    name = stage_dir(cfg, stage).name  # ppo, grpo, ..., ppo_lora (merged: a full model), dpo, dpo_lora
    out = run_dir(cfg) / "export" / ("actor_hf" if name == "ppo" else f"{name}_actor_hf")
    if (not dist.is_initialized() or dist.get_rank() == 0) and not out.is_dir():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if cfg.data.tokenizer == "builtin":  # written next to the weights, in HF format
            export_hf(stage_dir(cfg, stage), "actor", tmp, model_cfg=cfg.model,
                      special_token_ids={"eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id})
            tokenizer.save_hf(tmp)
        else:
            export_hf(stage_dir(cfg, stage), "actor", tmp, model_cfg=cfg.model, tokenizer_dir=cfg.data.tokenizer)
        tmp.rename(out)
    if dist.is_initialized():
        dist.barrier()
    return out
