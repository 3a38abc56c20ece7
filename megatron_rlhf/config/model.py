"""The model section: a Llama-style decoder's architecture (dense, or with mixture-of-experts
MLPs) and its rules (no torch here, so a config error is reported before anything heavy is
imported)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_rlhf.config.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")

# Hugging Face model families our GPTModel computes exactly (megatron_rlhf/convert maps them);
# of qwen3_moe and mixtral only the model section and config.json so far (config/rules.py
# refuses a run with experts until models/ builds them).
MODEL_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
# The families whose MLPs are mixtures of experts (model.num_experts set exactly for these).
MOE_FAMILIES = ("qwen3_moe", "mixtral")
ROPE_SCALING_TYPES = ("llama3", "linear")
# How a router scores experts (megatron's moe_router_score_function).
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
# megatron's load-balancing losses that model.moe_load_balancing_type offers (models/moe_fixes.py)
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss")
# The mixture-of-experts fields an HF config.json fixes (moe_aux_loss_coef and moe_z_loss_coef
# are training choices, not among them).
MOE_ARCHITECTURE_FIELDS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_score_function",
                           "moe_norm_topk_prob", "moe_dense_layers")
# ModelConfig fields that describe the network (what config.json of an HF model fixes);
# params_dtype, init_method_std and make_vocab_size_divisible_by stay the run's choice.
ARCHITECTURE_FIELDS = ("family", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim",
                       "ffn_hidden_size", "vocab_size", "max_seq_length", "max_position_embeddings", "rotary_base",
                       "rope_scaling",
                       "norm_epsilon", "qkv_bias", "qk_layernorm", "share_embeddings_and_output_weights",
                       *MOE_ARCHITECTURE_FIELDS)

@dataclass(frozen=True)
class RopeScalingConfig:
    """RoPE frequency scaling, as Hugging Face's rope_scaling / rope_parameters. We compute
    the scaled frequencies ourselves (models/gpt.py) because megatron-core 0.19.2 hard-codes
    Llama 3's low/high frequency factors and original window."""

    # null: plain RoPE. llama3: Llama 3.1-3.3's frequency-dependent scaling. linear: positions / factor.
    type: str | None = None
    factor: float = 1.0
    low_freq_factor: float = 1.0            # llama3 only
    high_freq_factor: float = 4.0           # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only: the pre-training context


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, SwiGLU MLP (or a mixture of SwiGLU experts), RoPE, no
    biases except Qwen2's q/k/v."""

    # The Hugging Face architecture export-hf writes (and import-hf read): llama (Llama 2, 3.x,
    # and models trained from scratch), mistral, qwen2 (Qwen2, Qwen2.5; needs qkv_bias), qwen3
    # (dense Qwen3; needs qk_layernorm), and with experts (num_experts): qwen3_moe (Qwen3-MoE;
    # needs qk_layernorm) and mixtral.
    family: str = "llama"
    num_layers: int = 2              # decoder layers (HF num_hidden_layers)
    hidden_size: int = 64            # width of the residual stream (HF hidden_size)
    num_attention_heads: int = 4     # query heads per layer
    # Grouped-query attention: number of key/value heads. None means one per query head.
    num_query_groups: int | None = None
    # Channels per attention head. null: hidden_size / num_attention_heads (Qwen3 and
    # Mistral-Nemo-style models set it explicitly).
    head_dim: int | None = None
    ffn_hidden_size: int = 256       # the SwiGLU MLP's intermediate size (HF intermediate_size)
    # Embedding rows before padding. null: the tokenizer's size (set when a stage loads its
    # tokenizer). It may exceed the tokenizer's (Hugging Face models often have spare rows):
    # ids the tokenizer lacks are masked like padding rows. Padded up to a multiple of
    # make_vocab_size_divisible_by (independent of TP, so checkpoints reshard freely).
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int = 128
    max_seq_length: int = 128        # longest sequence in tokens (prompt + response); each stage's seq_length <= this
    # The longest context the weights are meant for (an HF model's max_position_embeddings,
    # capped by a sliding window): export-hf writes it, so a deployed model keeps its context
    # (e.g. 131072 for Llama 3.1+ trained at 4096). null: max_seq_length.
    max_position_embeddings: int | None = None
    rotary_base: float = 10000.0     # RoPE base frequency (HF rope_theta)
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    norm_epsilon: float = 1e-5       # RMSNorm epsilon (HF rms_norm_eps)
    qkv_bias: bool = False       # Qwen2: biases on the q, k, v projections (none on the output projection)
    qk_layernorm: bool = False   # Qwen3: RMSNorm over each head's queries and keys, before RoPE
    share_embeddings_and_output_weights: bool = False  # the LM head is the input embedding (HF tie_word_embeddings)
    # Mixture of experts (qwen3_moe, mixtral). null: a dense model (every layer an MLP of
    # ffn_hidden_size). Else each layer not in moe_dense_layers routes every token to
    # moe_router_topk of num_experts SwiGLU experts.
    num_experts: int | None = None
    moe_router_topk: int = 2                 # experts per token (HF num_experts_per_tok)
    # Each expert's intermediate size (HF Qwen3-MoE moe_intermediate_size, Mixtral's
    # intermediate_size). null: ffn_hidden_size.
    moe_ffn_hidden_size: int | None = None
    moe_router_score_function: str = "softmax"  # softmax | sigmoid (megatron's moe_router_score_function)
    # HF norm_topk_prob. true: the top-k probabilities renormalised to sum to 1, which is a
    # softmax over the top-k logits (megatron moe_router_pre_softmax=false; Mixtral always).
    # false: softmax over all experts, then top-k, not renormalised (moe_router_pre_softmax=true).
    # megatron renormalises sigmoid scores whenever top-k > 1, so sigmoid needs true.
    moe_norm_topk_prob: bool = True
    # 0-based indices of the layers with a dense MLP (ffn_hidden_size) instead of experts: HF
    # Qwen3-MoE's mlp_only_layers and the layers its decoder_sparse_step skips.
    moe_dense_layers: list[int] = field(default_factory=list)
    # Training choices, not architecture: the load-balancing loss coefficient (HF
    # router_aux_loss_coef, which from_hf_config / init_from_hf take unless the recipe sets this)
    # and the router z-loss coefficient (HF configs have none: off).
    moe_aux_loss_coef: float = 0.0
    # Which load-balancing loss moe_aux_loss_coef weighs, megatron's definitions: aux_loss (the
    # Switch loss over each micro batch's tokens: Qwen3-MoE, Mixtral) | seq_aux_loss (the same
    # over each sequence, averaged over the micro batch's sequences: DeepSeek-V3's sequence-wise
    # balance loss). Both are per micro batch, so their gradient depends on how the batch is split
    # into micro batches (docs/moe.md). megatron's global_aux_loss is refused (see _check_experts).
    moe_load_balancing_type: str = "aux_loss"
    moe_z_loss_coef: float = 0.0     # the router z-loss coefficient (0: off)
    init_method_std: float = 0.02    # std of the normal initialisation of fresh weights
    params_dtype: str = "float32"    # float32 | bfloat16 | float16: the dtype of the weights and of the compute
    # megatron-core activation recomputation of trained roles (memory for compute): null |
    # selective (each layer's core attention, whose [b, heads, s, s] scores dominate activations
    # without flash attention) | full (whole layers: recompute_method uniform | block, and
    # recompute_num_layers, as megatron's --recompute-* flags).
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    # Log-probs and entropy (actor, reference) computed from the output layer's logits this many
    # tokens (sequence positions x micro batch rows) at a time, in forward and again in backward,
    # so the [tokens x vocab/TP] logits never exist whole; 0 or null: all at once (the logits
    # kept for backward). 256: benchmarks/memory.py's lowest peak (135M shape, 4k tokens, full
    # recomputation: 0.57-0.64 x the unchunked peak; 1024: 0.72), for ~5 % more step time.
    logits_chunk_tokens: int | None = 256
    # A local Hugging Face directory (config.json + safetensors): a fresh SFT run starts from
    # these weights. Implies from_hf_config (unless that is set).
    init_from_hf: str | None = None
    # A local Hugging Face directory whose config.json gives the architecture fields above:
    # fields set in the same place as this one (or later: recipe < overrides) are checked
    # against it, every difference reported at once; fields set earlier (a base recipe, or the
    # recipe when this is an override) are replaced, with a note.
    from_hf_config: str | None = None

    # The tokenizer's size when it is smaller than vocab_size (with_vocabulary sets it; not a
    # field: a recipe cannot set it, and neither the checkpoint's recorded model nor a stage's
    # fingerprint holds it): sampling and log-probs never give mass to ids it cannot decode.
    tokenizer_vocab_size = None

    def with_vocabulary(self, vocab_size: int, tokenizer_vocab_size: int | None) -> ModelConfig:
        """This section with the vocabulary a stage resolved from its tokenizer (a new one: the
        config is never changed after loading)."""
        resolved = dataclasses.replace(self, vocab_size=vocab_size)
        object.__setattr__(resolved, "tokenizer_vocab_size", tokenizer_vocab_size)  # see above: not a field
        return resolved

    @property
    def token_vocab_size(self) -> int:
        """Ids that are real tokens: the tokenizer's size, else vocab_size."""
        return self.tokenizer_vocab_size or self.vocab_size

    @property
    def padded_vocab_size(self) -> int:
        if self.vocab_size is None:
            raise ConfigError("model.vocab_size is not known yet: a stage sets it from its tokenizer (data.tokenizer); "
                              "set model.vocab_size=N to build a model without one")
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Each expert's intermediate size: moe_ffn_hidden_size, else ffn_hidden_size."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def moe_layer_pattern(self) -> list[int] | None:
        """None for a dense model; else one entry per layer, 1: experts, 0: a dense MLP (the list
        form of megatron's moe_layer_freq)."""
        if self.num_experts is None:
            return None
        dense = set(self.moe_dense_layers)
        return [0 if i in dense else 1 for i in range(self.num_layers)]

    @property
    def hf_source(self) -> str | None:
        """The HF directory whose config.json fixes the architecture, if any."""
        return self.from_hf_config or self.init_from_hf

    def check(self) -> None:
        """The rules of the model section alone (the layout's are ParallelConfig.check's)."""
        m = self
        positive = {
            "model.num_layers": m.num_layers, "model.hidden_size": m.hidden_size,
            "model.num_attention_heads": m.num_attention_heads, "model.ffn_hidden_size": m.ffn_hidden_size,
            "model.vocab_size": 1 if m.vocab_size is None else m.vocab_size, "model.max_seq_length": m.max_seq_length,
            "model.make_vocab_size_divisible_by": m.make_vocab_size_divisible_by,
        }
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"{name}={value}: must be >= 1")
        if m.params_dtype not in DTYPES:
            raise ConfigError(f"model.params_dtype={m.params_dtype!r}: choose one of {DTYPES}")
        if m.head_dim is None and m.hidden_size % m.num_attention_heads:
            raise ConfigError(f"model.hidden_size={m.hidden_size}: not divisible by model.num_attention_heads="
                              f"{m.num_attention_heads}; set model.head_dim if the heads are not hidden_size / heads wide")
        if m.head_dim is not None and (m.head_dim < 2 or m.head_dim % 2):
            raise ConfigError(f"model.head_dim={m.head_dim}: must be an even number >= 2 (RoPE rotates channel pairs)")
        if m.max_position_embeddings is not None and m.max_seq_length > m.max_position_embeddings:
            raise ConfigError(f"model.max_seq_length={m.max_seq_length}: longer than model.max_position_embeddings="
                              f"{m.max_position_embeddings} (the context the weights are meant for); lower max_seq_length")
        if m.recompute_granularity not in (None, "selective", "full"):
            raise ConfigError(f"model.recompute_granularity={m.recompute_granularity!r}: choose null, selective or full")
        if m.recompute_granularity == "full" and (m.recompute_method not in ("uniform", "block")
                                                   or not m.recompute_num_layers or m.recompute_num_layers < 1):
            raise ConfigError(f"model.recompute_granularity=full: set model.recompute_method (uniform | block, got "
                              f"{m.recompute_method!r}) and model.recompute_num_layers >= 1 (got {m.recompute_num_layers})")
        if m.logits_chunk_tokens is not None and m.logits_chunk_tokens < 0:
            raise ConfigError(f"model.logits_chunk_tokens={m.logits_chunk_tokens}: a token count > 0, or 0 / null "
                              "to compute the logits all at once")
        if m.recompute_granularity != "full" and (m.recompute_method or m.recompute_num_layers):
            raise ConfigError(f"model.recompute_method={m.recompute_method!r}, model.recompute_num_layers="
                              f"{m.recompute_num_layers}: only for model.recompute_granularity=full; unset them")
        if m.family not in MODEL_FAMILIES:
            raise ConfigError(f"model.family={m.family!r}: choose one of {MODEL_FAMILIES}")
        # Each family's attention is fixed by transformers: Qwen2 always has q/k/v biases, Qwen3
        # and Qwen3-MoE always normalise q and k, Llama, Mistral and Mixtral do neither.
        if m.qkv_bias != (m.family == "qwen2"):
            raise ConfigError(f"model.qkv_bias={m.qkv_bias} with model.family={m.family!r}: q/k/v biases are Qwen2's "
                              f"(and only Qwen2's); set model.family=qwen2 with model.qkv_bias=true, or model.qkv_bias=false")
        if m.qk_layernorm != (m.family in ("qwen3", "qwen3_moe")):
            raise ConfigError(f"model.qk_layernorm={m.qk_layernorm} with model.family={m.family!r}: per-head q/k RMSNorm "
                              "is Qwen3's and Qwen3-MoE's (and only theirs); set model.family=qwen3 (or qwen3_moe) with "
                              "model.qk_layernorm=true, or model.qk_layernorm=false")
        r = m.rope_scaling
        if r.type is not None and r.type not in ROPE_SCALING_TYPES:
            raise ConfigError(f"model.rope_scaling.type={r.type!r}: choose null (plain RoPE) or one of {ROPE_SCALING_TYPES}")
        if r.type is not None and not r.factor >= 1.0:
            raise ConfigError(f"model.rope_scaling.factor={r.factor}: must be >= 1 (how much longer than the "
                              "pre-training context the model reads)")
        if r.type == "llama3" and not (0 < r.low_freq_factor < r.high_freq_factor and r.original_max_position_embeddings > 0):
            raise ConfigError(f"model.rope_scaling: low_freq_factor={r.low_freq_factor}, high_freq_factor="
                              f"{r.high_freq_factor}, original_max_position_embeddings={r.original_max_position_embeddings}"
                              ": need 0 < low_freq_factor < high_freq_factor and a positive original window (Llama 3.1: 1, 4, 8192)")
        if m.num_query_groups is not None and (
            m.num_query_groups < 1 or m.num_attention_heads % m.num_query_groups
        ):
            raise ConfigError(
                f"model.num_query_groups={m.num_query_groups}: must divide "
                f"model.num_attention_heads={m.num_attention_heads}"
            )
        m._check_experts()

    def _check_experts(self) -> None:
        """The mixture-of-experts rules (check's)."""
        m = self
        for name in ("moe_aux_loss_coef", "moe_z_loss_coef"):
            if not getattr(m, name) >= 0:
                raise ConfigError(f"model.{name}={getattr(m, name)}: must be >= 0 (0: off)")
        if m.moe_load_balancing_type == "global_aux_loss":
            raise ConfigError("model.moe_load_balancing_type=global_aux_loss: megatron-core 0.19.2 divides the expert "
                              "counts it accumulates over micro batches by the current micro batch's token count "
                              "(NVIDIA/Megatron-LM#7197), which is wrong when micro batches hold different numbers of "
                              "tokens, as RL's always do; choose aux_loss or seq_aux_loss")
        if m.moe_load_balancing_type not in MOE_LOAD_BALANCING_TYPES:
            raise ConfigError(f"model.moe_load_balancing_type={m.moe_load_balancing_type!r}: choose one of "
                              f"{MOE_LOAD_BALANCING_TYPES}")
        if m.moe_router_score_function not in MOE_SCORE_FUNCTIONS:
            raise ConfigError(f"model.moe_router_score_function={m.moe_router_score_function!r}: choose one of "
                              f"{MOE_SCORE_FUNCTIONS}")
        if m.moe_ffn_hidden_size is not None and m.moe_ffn_hidden_size < 1:
            raise ConfigError(f"model.moe_ffn_hidden_size={m.moe_ffn_hidden_size}: must be >= 1 (null: ffn_hidden_size)")
        if m.num_experts is None:
            if m.family in MOE_FAMILIES:
                raise ConfigError(f"model.num_experts=null with model.family={m.family!r}: a mixture-of-experts family "
                                  "needs its expert count; set model.num_experts (or model.from_hf_config=<HF directory>)")
            # a dense model has no experts to size or skip: a value here is a mistake, not a no-op
            for name, value in (("moe_ffn_hidden_size", m.moe_ffn_hidden_size), ("moe_dense_layers", m.moe_dense_layers),
                                ("moe_load_balancing_type", m.moe_load_balancing_type != "aux_loss" and m.moe_load_balancing_type)):
                if value:
                    raise ConfigError(f"model.{name}={value} with model.num_experts=null: only for a mixture-of-experts "
                                      f"model (model.family qwen3_moe or mixtral with model.num_experts); unset it")
            return
        if m.family not in MOE_FAMILIES:
            raise ConfigError(f"model.num_experts={m.num_experts} with model.family={m.family!r}: experts are in the "
                              f"{MOE_FAMILIES} families only; set model.family to one of them, or model.num_experts=null")
        if m.num_experts < 2:
            raise ConfigError(f"model.num_experts={m.num_experts}: must be >= 2 (null: a dense model)")
        if m.moe_load_balancing_type != "aux_loss" and not m.moe_aux_loss_coef:
            raise ConfigError(f"model.moe_load_balancing_type={m.moe_load_balancing_type} with model.moe_aux_loss_coef=0: "
                              "there is no load-balancing loss for it to choose; set model.moe_aux_loss_coef > 0, or "
                              "remove model.moe_load_balancing_type")
        if not 1 <= m.moe_router_topk <= m.num_experts:
            raise ConfigError(f"model.moe_router_topk={m.moe_router_topk}: must be between 1 and model.num_experts="
                              f"{m.num_experts}")
        if m.moe_router_score_function == "sigmoid" and not m.moe_norm_topk_prob:
            raise ConfigError("model.moe_norm_topk_prob=false with model.moe_router_score_function=sigmoid: megatron "
                              "renormalises sigmoid top-k scores; set model.moe_norm_topk_prob=true")
        dense = m.moe_dense_layers
        if len(set(dense)) != len(dense) or any(not 0 <= i < m.num_layers for i in dense):
            raise ConfigError(f"model.moe_dense_layers={dense}: list distinct layer indices in [0, model.num_layers="
                              f"{m.num_layers})")
        if len(dense) == m.num_layers:
            raise ConfigError(f"model.moe_dense_layers={dense}: every layer is dense; leave at least one layer with "
                              "experts, or make the model dense (model.num_experts=null and a dense model.family)")
