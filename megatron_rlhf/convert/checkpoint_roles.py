"""Which role directory of one of our checkpoints a conversion reads, and the model config it
reads it with: shared by export_hf (hf_io) and the PEFT adapter export (lora_export)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from megatron_rlhf.convert.hf_config import ConvertError

log = logging.getLogger(__name__)

VALUE_ROLES = ("reward", "critic")
POLICY_ROLES = ("actor", "reference")


def resolve_role_dir(checkpoint: Path, role: str) -> tuple[Path, Path | None]:
    """(role directory holding .metadata, its iter_* directory or None)."""
    from megatron_rlhf.checkpoint.validate import COMMIT, DamagedNewestCheckpoint, find_checkpoint, read_commit

    if (checkpoint / ".metadata").is_file():  # a role directory itself
        return checkpoint, checkpoint.parent if (checkpoint.parent / "trainer_state").is_dir() else None
    try:  # a damaged newest checkpoint is refused: an older one is exported only when named
        iter_dir, warnings = find_checkpoint(checkpoint, allow_fallback=False)
    except DamagedNewestCheckpoint as e:
        raise ConvertError(f"{e} (export-hf: --iter {int(e.older.name[5:])})") from None
    except FileNotFoundError as e:  # CheckpointError too
        raise ConvertError(f"{checkpoint}: {e}; give a stage directory (with export-hf --iter N: its iter_N), an "
                           "iter_* directory or a role directory of one of our checkpoints") from None
    for line in warnings:
        log.warning(line)
    role_dir = iter_dir / role
    if not (role_dir / ".metadata").is_file():
        roles = read_commit(iter_dir).get("roles", []) if (iter_dir / COMMIT).is_file() else []
        raise ConvertError(f"{iter_dir}: no role {role!r} in this checkpoint (it holds {roles}); "
                           f"choose --role from {roles}")
    return role_dir, iter_dir


def model_config_for(model_cfg, iter_dir: Path | None):
    """The ModelConfig of a conversion: `model_cfg` as given (a ModelConfig, or a dict of its
    fields), else the one the checkpoint at `iter_dir` recorded."""
    from megatron_rlhf.checkpoint.validate import recorded_model_config
    from megatron_rlhf.config import ModelConfig, from_dict

    if isinstance(model_cfg, dict):
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        return from_dict(ModelConfig, {k: v for k, v in model_cfg.items() if k in known}, prefix="model.")
    if model_cfg is not None:
        return model_cfg
    if (saved := recorded_model_config(iter_dir)) is not None:
        return saved
    raise ConvertError("this checkpoint does not record its model config (checkpoints written before model configs "
                       "were recorded): pass model_cfg, the cfg.model of the run that wrote it (export-hf --config "
                       "<the run's recipe> and the same model.* overrides)")
