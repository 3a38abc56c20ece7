"""Hugging Face checkpoints (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE, Mixtral) in and out of our
megatron models.

    model_config_from_hf(hf_dir)            ModelConfig fields from config.json
    resolve_from_hf(model_cfg, ...)         a config's architecture from model.from_hf_config / init_from_hf
    check_model_matches_hf(model, hf_dir)   ConvertError naming each model.<field> that differs
    load_hf_weights(role, hf_dir)           collective: this rank's TP x PP x EP shard from safetensors
    import_hf(cfg, hf_dir, out_dir)         collective: HF -> our stage-style checkpoint
    export_hf(checkpoint, role, out_dir)    one process: our checkpoint -> HF directory (LoRA: merged)
    lora_export.export_peft_adapter(...)    one process: a LoRA policy's adapters -> PEFT adapter directory

Modules: hf_config (config.json and refusals; no torch), hf_weights (the tensor mapping;
hf_moe_weights: its expert layers),
safetensors_io (HF files), torch_dist_reader (our checkpoints without torch.distributed),
hf_io (the operations above), lora_export (LoRA checkpoints merged, or as PEFT adapters). Offline only: nothing here contacts the Hugging Face Hub.
The hf_io names are imported on first use, so reading a config does not import torch.
"""

from megatron_rlhf.convert.hf_config import (
    ConvertError, check_model_matches_hf, hf_overrides, model_config_from_hf, resolve_from_hf,
)

_HF_IO = ("export_hf", "import_hf", "load_hf_weights")


def __getattr__(name: str):
    if name in _HF_IO:
        from megatron_rlhf.convert import hf_io

        return getattr(hf_io, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ConvertError", "check_model_matches_hf", "export_hf", "hf_overrides", "import_hf", "load_hf_weights",
           "model_config_from_hf", "resolve_from_hf"]
