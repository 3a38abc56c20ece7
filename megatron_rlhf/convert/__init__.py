"""Hugging Face Llama-family checkpoints in and out of our megatron models.

    model_config_from_hf(hf_dir)            ModelConfig fields from config.json
    check_model_matches_hf(cfg, hf_dir)     ConvertError naming each model.<field> that differs
    load_hf_weights(role, hf_dir)           collective: this rank's TP x PP shard from safetensors
    import_hf(cfg, hf_dir, out_dir)         collective: HF -> our stage-style checkpoint
    export_hf(checkpoint, role, out_dir)    one process: our checkpoint -> HF directory

Modules: hf_config (config.json and refusals), hf_weights (the tensor mapping),
safetensors_io (HF files), torch_dist_reader (our checkpoints without torch.distributed),
hf_io (the operations above). Offline only: nothing here contacts the Hugging Face Hub.
"""

from megatron_rlhf.convert.hf_config import ConvertError, check_model_matches_hf, model_config_from_hf
from megatron_rlhf.convert.hf_io import export_hf, import_hf, load_hf_weights

__all__ = ["ConvertError", "check_model_matches_hf", "export_hf", "import_hf", "load_hf_weights",
           "model_config_from_hf"]
