"""Where a policy stage (sft, dpo) starts: a checkpoint's actor or a Hugging Face directory.

    start = ("ckpt", <stage or iter_* directory>) | ("hf", <Hugging Face directory>)
    load_start(cfg, role, start)

A LoRA policy needs its frozen base as a megatron checkpoint (adapter checkpoints reference it;
export merges onto it): a Hugging Face start is imported once into <run>/hf_import (import-hf's
format, any TP x PP) and the adapters train on that.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from megatron_rlhf.checkpoint.dist import load_model_weights, load_role
from megatron_rlhf.checkpoint.manager import resolve_checkpoint
from megatron_rlhf.checkpoint.safe_load import load_pt
from megatron_rlhf.checkpoint.validate import CheckpointError
from megatron_rlhf.config import Config
from megatron_rlhf.trainers.stage_data import run_dir


def load_start(cfg: Config, role, start: tuple[str, str]) -> str:
    """Collective. The role's starting weights (a LoRA role: its base, also on resume: its
    checkpoint holds only adapters). Returns where they came from."""
    kind, where = start
    if kind == "hf" and getattr(role, "lora", None) is not None:
        kind, where = "ckpt", str(imported_base(cfg, where))
    if kind == "hf":
        from megatron_rlhf.convert import check_model_matches_hf, load_hf_weights

        check_model_matches_hf(role.model_config, where)
        load_hf_weights(role, where)
    elif role.trainable:
        load_model_weights(role, Path(where) / "actor")
    else:
        load_role(role, Path(where) / "actor", with_optimizer=False)
    return where


def imported_base(cfg: Config, hf_dir: str) -> Path:
    """Collective. <run>/hf_import's checkpoint of the Hugging Face model at `hf_dir`, imported
    on first use; a CheckpointError if it holds another model's import."""
    from megatron_rlhf.convert import import_hf

    out = run_dir(cfg) / "hf_import"
    if (out / "latest").exists():
        ckpt = resolve_checkpoint(out)
        imported = load_pt(ckpt / "trainer_state" / "rank_00000.pt").get("imported_from")
        if Path(imported).resolve() != Path(hf_dir).resolve():
            raise CheckpointError(f"{out}: holds an import of {imported}, not of model.init_from_hf={hf_dir}; "
                                  "use another checkpoint.run_name, or delete it to import again")
        return ckpt
    ckpt = import_hf(cfg, hf_dir, out)
    dist.barrier()
    return ckpt
