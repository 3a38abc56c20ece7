"""Build megatron-core GPTModels (Llama-style) for this process's pipeline stage.

The layer spec is Transformer Engine's when TE imports (GPU nodes), megatron-core's local
spec with torch SDPA core attention otherwise (CPU; models/attention.py). Value models
(reward model, critic) are the same network with the vocabulary projection replaced by a
TP-aware scalar head.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from megatron_rlhf import parallel
from megatron_rlhf.config import ConfigError, ModelConfig
from megatron_rlhf.models import moe_fixes


def transformer_engine_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # TE raises assorted errors when its CUDA libraries are missing
        return False
    return True


# A core attention with context parallelism for the CPU spec. None ships: megatron's local
# attention has none (context parallelism is Transformer Engine's), so a CPU run with
# parallel.context_parallel > 1 is refused. The tests set a reference one
# (tests/workers/context_parallel_attention.py) to run the CP code paths around it end to end.
cpu_context_parallel_attention = None


def layer_spec(m: ModelConfig, config: TransformerConfig):
    """The decoder's spec for this pipeline stage: Transformer Engine's modules on GPU, else
    megatron-core's local modules with SDPA core attention and an RMSNorm that allows sequence
    parallelism (cpu_modules)."""
    from megatron.core.models.gpt import gpt_layer_specs

    # megatron's block spec: a dense or an expert layer each (config.moe_layer_freq), this stage's only
    te = transformer_engine_available()
    cp_attention = cpu_context_parallel_attention if config.context_parallel_size > 1 else None
    if config.context_parallel_size > 1 and not te and cp_attention is None:
        raise ConfigError(f"parallel.context_parallel={config.context_parallel_size}: context parallelism runs in "
                          "Transformer Engine's attention on GPUs; megatron's local attention (this machine has no "
                          "GPU or no Transformer Engine) has none. Set parallel.context_parallel=1, or run on GPU "
                          "nodes with Transformer Engine installed")
    block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm")
    if te:
        from megatron_rlhf.models.attention import te_chunked_inference_attention

        return dataclasses.replace(block, layer_specs=[with_core_attention(spec, te_chunked_inference_attention())
                                                       for spec in block.layer_specs])
    return dataclasses.replace(block, layer_specs=[cpu_modules(spec, cp_attention) for spec in block.layer_specs],
                               layer_norm=RMSNorm)


def local_layer_spec(m: ModelConfig):
    """megatron-core's local spec as megatron ships it (unfused baddbmm + softmax attention)."""
    from megatron.core.models.gpt import gpt_layer_specs

    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=m.qk_layernorm)


def sdpa_layer_spec(m: ModelConfig):
    """The local spec of one layer with the CPU modules (cpu_modules)."""
    return cpu_modules(local_layer_spec(m))


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, built as megatron builds its norms, that also runs under sequence
    parallelism (megatron's WrappedTorchNorm refuses it). There each TP rank normalises its own
    slice of the sequence, so the weight's gradient is a partial sum: marked `sequence_parallel`,
    megatron's finalize_model_grads sums it over the TP group (as it does for TE's norms)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def with_core_attention(spec, core_attention):
    """A transformer layer spec with `core_attention` as its self-attention's core attention."""
    attention = spec.submodules.self_attention
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(attention.submodules,
                                                                              core_attention=core_attention))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))


def cpu_modules(spec, core_attention=None):
    """A local-spec transformer layer with torch's SDPA as its core attention (models/attention.py;
    or `core_attention`) and RMSNorm in place of megatron's torch norm wrapper; every other module
    is the local spec's."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_rlhf.models.attention import SDPADotProductAttention

    def norm(module):
        return RMSNorm if module is WrappedTorchNorm else module

    layer = spec.submodules
    attention = layer.self_attention
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, core_attention=core_attention or SDPADotProductAttention,
        q_layernorm=norm(attention.submodules.q_layernorm), k_layernorm=norm(attention.submodules.k_layernorm)))
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        layer, self_attention=attention, input_layernorm=norm(layer.input_layernorm),
        pre_mlp_layernorm=norm(layer.pre_mlp_layernorm)))


def transformer_config(m: ModelConfig, per_token_loss: bool = False, routes: bool = False) -> TransformerConfig:
    """megatron's TransformerConfig for the model section, at the TP x PP layout megatron's
    parallel_state was started with (parallel.initialize). `per_token_loss`: megatron's
    calculate_per_token_loss, for a trained role (models/roles.py; MoE routers read it when built).
    `routes`: an MoE model's routers can record and replay their choices (models/routing.py)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    sequence_parallel = parallel.sequence_parallel() and tp > 1
    dtype = getattr(torch, m.params_dtype)
    fused = transformer_engine_available()  # fused kernels need TE/apex on a GPU
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.kv_heads,
        ffn_hidden_size=m.ffn_hidden_size,
        kv_channels=m.kv_channels,
        calculate_per_token_loss=per_token_loss,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        sequence_parallel=sequence_parallel,
        # Stages exchange each microbatch's shape first: microbatches are cut to their longest
        # row and sized by a token budget (Role._run), so shapes vary within a batch.
        variable_seq_lengths=pp > 1,
        **expert_settings(m, routes),
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=True,  # SwiGLU
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=m.qkv_bias,  # Qwen2
        qk_layernorm=m.qk_layernorm,  # Qwen3: RMSNorm of each head's q and k (eps = norm_epsilon)
        recompute_granularity=m.recompute_granularity,
        recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers,
        hidden_dropout=0.0,  # RL roles run without dropout (PPO checklist item 8)
        attention_dropout=0.0,
        init_method_std=m.init_method_std,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        gradient_accumulation_fusion=fused,
        masked_softmax_fusion=fused,
        bias_activation_fusion=fused,
        bias_dropout_fusion=fused,
        apply_rope_fusion=fused,
        persist_layer_norm=fused,
    )


def _without_sequence_parallel(config: TransformerConfig) -> TransformerConfig:
    plain = copy.copy(config)
    plain.sequence_parallel = False
    return plain


def expert_settings(m: ModelConfig, routes: bool = False) -> dict:
    """TransformerConfig's mixture-of-experts fields for the model section (none for a dense
    model), at the expert-parallel layout parallel.initialize started. Dropless (no capacity
    factor) as the HF models are; tokens reach their experts by all-to-all. `routes`: each
    router gets megatron's record/replay hook (idle until models/routing.py drives it)."""
    if m.num_experts is None:
        # megatron refuses its default (allgather) dispatcher with variable_seq_lengths, even without experts
        return {"moe_token_dispatcher_type": "alltoall"}
    aux = m.moe_aux_loss_coef
    return dict(
        num_moe_experts=m.num_experts,
        moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.expert_ffn_hidden_size,
        moe_layer_freq=m.moe_layer_pattern,
        moe_router_score_function=m.moe_router_score_function,
        # HF's norm_topk_prob: top-k probabilities renormalised = a softmax over the top-k logits
        moe_router_pre_softmax=not m.moe_norm_topk_prob,
        # aux_loss (per micro batch) or seq_aux_loss (per sequence); the count both read is fixed
        # for TP > 1 in models/moe_fixes.py
        moe_router_load_balancing_type=m.moe_load_balancing_type if aux > 0 else "none",
        moe_aux_loss_coeff=aux,
        moe_z_loss_coeff=m.moe_z_loss_coef or None,
        moe_router_dtype="fp32",  # HF routes in fp32 too (softmax over float32 logits)
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=transformer_engine_available(),  # TE's grouped expert GEMM on GPU; SequentialMLP on CPU
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        moe_enable_routing_replay=routes,
    )


class ValueHead(tensor_parallel.RowParallelLinear):
    """hidden -> 1 scalar. Row-parallel: each TP rank holds hidden/TP input columns and the
    partial dot products are all-reduced, so the head shards like the rest of the model.
    Initialised N(0, 1/sqrt(d_model + 1)), bias 0 (PPO checklist item 6).

    Under sequence parallelism the decoder's output is split along the sequence: the head
    gathers it first (megatron's row-parallel layer would instead reduce-scatter its output,
    and refuses a replicated input there). Everything after the gather is replicated over TP, so
    the gather's backward keeps this rank's slice of the gradient instead of summing."""

    def __init__(self, config: TransformerConfig):
        std = 1.0 / math.sqrt(config.hidden_size + 1)
        super().__init__(
            config.hidden_size, 1, config=_without_sequence_parallel(config),
            init_method=lambda w: torch.nn.init.normal_(w, mean=0.0, std=std),
            bias=True, input_is_parallel=False, skip_bias_add=False,
        )
        self.gathers_sequence = config.sequence_parallel

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [s, b, h] (or [s/TP, b, h]) -> [b, s]
        if self.gathers_sequence:
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False)
        values, _ = super().forward(hidden_states)
        return values.squeeze(-1).transpose(0, 1).float()


class GPTValueModel(GPTModel):
    """GPTModel whose output layer is a scalar value head instead of the vocabulary
    projection (same attribute name, so megatron's checkpoint logic for it still applies)."""

    def __init__(self, *args, **kwargs):
        kwargs["share_embeddings_and_output_weights"] = False
        super().__init__(*args, **kwargs)
        if self.post_process:
            self.output_layer = ValueHead(self.config)


def scaled_inv_freq(inv_freq: torch.Tensor, m: ModelConfig) -> torch.Tensor:
    """RoPE frequencies after model.rope_scaling, as transformers computes them ('linear':
    every frequency / factor; 'llama3': long wavelengths / factor, short ones kept, a smooth
    blend between). Ours rather than megatron-core's rope_scaling, which fixes the low/high
    frequency factors (1, 4) and the original window (8192) that config.json may set."""
    r = m.rope_scaling
    if r.type == "linear":
        return inv_freq / r.factor
    if r.type != "llama3":
        return inv_freq
    low_wavelen = r.original_max_position_embeddings / r.low_freq_factor
    high_wavelen = r.original_max_position_embeddings / r.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq)
    smooth = (r.original_max_position_embeddings / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    blended = (1 - smooth) * scaled / r.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


# Module attributes through which megatron's layers read sequence parallelism at forward time
# (those megatron's own set_model_to_sequence_parallel switches).
_SEQUENCE_PARALLEL_ATTRIBUTES = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")


@contextlib.contextmanager
def sequence_parallel_disabled(model: torch.nn.Module):
    """The model runs without sequence parallelism inside (decoding: one new token cannot be
    split along the sequence, and megatron's static inference refuses it for dense layers); the
    weights are the same either way. Every switched attribute is restored on exit. Megatron's
    set_model_to_sequence_parallel does the same but caches modules by id() across models."""
    config = model.config
    if not config.sequence_parallel:
        yield
        return
    saved = [(module, name, getattr(module, name)) for module in model.modules()
             for name in _SEQUENCE_PARALLEL_ATTRIBUTES if hasattr(module, name)]
    try:
        config.sequence_parallel = False
        for module, name, _ in saved:
            setattr(module, name, False)
        yield
    finally:
        config.sequence_parallel = True
        for module, name, value in saved:
            setattr(module, name, value)


def build_model(m: ModelConfig, value_head: bool = False, spec=None, per_token_loss: bool = False,
                routes: bool = False) -> GPTModel:
    """The model of section `m`: the chunk for this rank's pipeline stage (no virtual pipeline)
    at the layout parallel.initialize started. `spec`: the transformer layer or block spec
    (default: layer_spec). `routes`: see transformer_config."""
    cls = GPTValueModel if value_head else GPTModel
    if m.num_experts is not None:
        moe_fixes.apply()  # megatron's router token count at TP > 1, before any router is built
    config = transformer_config(m, per_token_loss, routes)
    model = cls(
        config=config,
        transformer_layer_spec=spec if spec is not None else layer_spec(m, config),
        vocab_size=m.padded_vocab_size,
        max_sequence_length=m.max_seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,  # keep logits vocab-parallel: never gather them across TP
        share_embeddings_and_output_weights=m.share_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=int(m.rotary_base),
    )
    if m.rope_scaling.type is not None:  # before the first forward: megatron caches the embedding per length
        model.rotary_pos_emb.inv_freq = scaled_inv_freq(model.rotary_pos_emb.inv_freq, m)
    dtype = getattr(torch, m.params_dtype)
    if dtype != torch.float32:
        # The local spec's torch RMSNorm ignores params_dtype and stays float32; megatron's
        # DistributedOptimizer groups parameters by dtype and its checkpoint code then pairs
        # mismatched shapes. One dtype for every parameter, as megatron's Float16Module does.
        model.to(dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
