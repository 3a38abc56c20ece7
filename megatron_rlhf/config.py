"""Typed run configuration: dataclasses are the single source of defaults.

`load_config(path, overrides)` reads a YAML recipe, applies dotted `key=value` overrides and
type-checks every field; `validate(cfg, world_size)` checks the cross-field rules (parallel
layout against model shape) before any model is built. Every error names the field.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_rlhf.data.tasks.base import TaskSizes


class ConfigError(ValueError):
    """A bad configuration value; the message names the field and the fix."""


DTYPES = ("float32", "bfloat16", "float16")
# The choices of the rl section (algorithms/ implements each).
RL_ALGORITHMS = ("ppo", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "batch_mean")
CRITIC_FREE = tuple(a for a in RL_ALGORITHMS if a != "ppo")
GROUP_BASELINES = ("grpo", "rloo", "reinforce_pp_baseline")  # need n_samples_per_prompt >= 2
# Fields only a critic uses: refused when set with a critic-free algorithm.
CRITIC_FIELDS = ("critic_optimizer", "vf_coef", "value_clip", "critic_warmup_steps", "lam", "whiten_advantages",
                 "critic_from")
IMPORTANCE_RATIOS = ("token", "sequence")
STAGES = ("sft", "rm", "dpo", "rl")
DEFAULT_STAGES = ("sft", "rm", "rl")
# What each stage starts from: an earlier stage in pipeline.stages, or the field naming its checkpoint.
STAGE_INPUTS = {"rm": {"sft": "rm.init_from"}, "dpo": {"sft": "dpo.init_from"},
                "rl": {"sft": "rl.sft_from", "rm": "rl.rm_from"}}
# ... unless the stage does not need that input (see _stage_needs)
DPO_LOSSES = ("sigmoid", "ipo")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_CONTROLLERS = ("fixed", "adaptive")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


# Hugging Face model families our GPTModel computes exactly (megatron_rlhf/convert maps them).
MODEL_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_SCALING_TYPES = ("llama3", "linear")
# ModelConfig fields that describe the network (what config.json of an HF model fixes);
# params_dtype, init_method_std and make_vocab_size_divisible_by stay the run's choice.
ARCHITECTURE_FIELDS = ("family", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim",
                       "ffn_hidden_size", "vocab_size", "max_seq_length", "max_position_embeddings", "rotary_base",
                       "rope_scaling",
                       "norm_epsilon", "qkv_bias", "qk_layernorm", "share_embeddings_and_output_weights")


@dataclass
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


@dataclass
class ModelConfig:
    """A Llama-style decoder: RMSNorm, SwiGLU MLP, RoPE, no biases except Qwen2's q/k/v."""

    # The Hugging Face architecture export-hf writes (and import-hf read): llama (Llama 2, 3.x,
    # and models trained from scratch), mistral, qwen2 (Qwen2, Qwen2.5; needs qkv_bias), qwen3
    # (dense Qwen3; needs qk_layernorm).
    family: str = "llama"
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    # Grouped-query attention: number of key/value heads. None means one per query head.
    num_query_groups: int | None = None
    # Channels per attention head. null: hidden_size / num_attention_heads (Qwen3 and
    # Mistral-Nemo-style models set it explicitly).
    head_dim: int | None = None
    ffn_hidden_size: int = 256
    # Embedding rows before padding. null: the tokenizer's size (set when a stage loads its
    # tokenizer). It may exceed the tokenizer's (Hugging Face models often have spare rows):
    # ids the tokenizer lacks are masked like padding rows. Padded up to a multiple of
    # make_vocab_size_divisible_by (independent of TP, so checkpoints reshard freely).
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int = 128
    max_seq_length: int = 128
    # The longest context the weights are meant for (an HF model's max_position_embeddings,
    # capped by a sliding window): export-hf writes it, so a deployed model keeps its context
    # (e.g. 131072 for Llama 3.1+ trained at 4096). null: max_seq_length.
    max_position_embeddings: int | None = None
    rotary_base: float = 10000.0
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    norm_epsilon: float = 1e-5
    qkv_bias: bool = False       # Qwen2: biases on the q, k, v projections (none on the output projection)
    qk_layernorm: bool = False   # Qwen3: RMSNorm over each head's queries and keys, before RoPE
    share_embeddings_and_output_weights: bool = False
    init_method_std: float = 0.02
    params_dtype: str = "float32"
    # megatron-core activation recomputation of trained roles (memory for compute): null |
    # selective (each layer's core attention, whose [b, heads, s, s] scores dominate activations
    # without flash attention) | full (whole layers: recompute_method uniform | block, and
    # recompute_num_layers, as megatron's --recompute-* flags).
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    # A local Hugging Face directory (config.json + safetensors): a fresh SFT run starts from
    # these weights. Implies from_hf_config (unless that is set).
    init_from_hf: str | None = None
    # A local Hugging Face directory whose config.json gives the architecture fields above:
    # fields set in the same place as this one (or later: recipe < overrides) are checked
    # against it, every difference reported at once; fields set earlier (a base recipe, or the
    # recipe when this is an override) are replaced, with a note.
    from_hf_config: str | None = None

    # The tokenizer's size when it is smaller than vocab_size (set with it, not a recipe
    # field): sampling and log-probs never give mass to ids it cannot decode.
    tokenizer_vocab_size = None

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
    def hf_source(self) -> str | None:
        """The HF directory whose config.json fixes the architecture, if any."""
        return self.from_hf_config or self.init_from_hf


@dataclass
class ParallelConfig:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    # "auto": NCCL when CUDA is available, gloo otherwise.
    backend: str = "auto"


@dataclass
class OptimizerConfig:
    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # megatron-core's DistributedOptimizer (ZeRO-1 over data-parallel ranks), also at DP=1: it and
    # the non-distributed one (false) cannot load each other's checkpoints, so true keeps the
    # optimizer state loadable at any DP (models/optimizer.py).
    use_distributed_optimizer: bool = True
    # megatron-core's OptimizerParamScheduler: linear warmup, then decay to min_lr.
    warmup_steps: int = 0
    lr_decay_style: str = "constant"


@dataclass
class LoRAConfig:
    """Low-rank adapters (models/lora.py) on the trained policy and critic of the stages listed;
    their base weights stay frozen. rank 0: off (full fine-tuning)."""

    rank: int = 0
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input, in training only; sft and dpo only (rl refuses it)
    # which linear layers of every decoder layer: qkv, proj (attention output), fc1, fc2; and
    # output: the policy's LM head (untied embeddings only; a critic's value head trains in full)
    targets: list[str] = field(default_factory=lambda: ["qkv", "proj", "fc1", "fc2"])
    # sft, dpo, rl: the stages that train adapters (a later stage starting from a LoRA
    # checkpoint starts from its base with the adapters merged)
    stages: list[str] = field(default_factory=lambda: ["rl"])
    critic: bool = True  # the critic gets adapters of its own (value head trained in full); false: full critic

    def applies_to(self, stage: str) -> bool:
        return self.rank > 0 and stage in self.stages


LORA_TARGETS = ("qkv", "proj", "fc1", "fc2", "output")
LORA_STAGES = ("sft", "dpo", "rl")


LR_DECAY_STYLES = ("constant", "linear", "cosine")
OVERFLOW_POLICIES = ("truncate", "drop")


@dataclass
class DataConfig:
    # A built-in task (megatron_rlhf/data/tasks) generates every split from `seed`; a JSONL
    # path given below replaces that split. task: null means all needed paths must be given.
    task: str | None = "sentiment"
    task_sizes: TaskSizes = field(default_factory=TaskSizes)
    # "builtin": the task's word-level tokenizer; otherwise a local HF tokenizer directory.
    tokenizer: str = "builtin"
    sft_train: str | None = None
    sft_eval: str | None = None
    preference_train: str | None = None
    preference_eval: str | None = None
    prompts_train: str | None = None
    prompts_eval: str | None = None
    # Sequences longer than the stage's seq_length: "truncate" or "drop" (always counted).
    overflow: str = "truncate"
    # A *_train file without its *_eval file: this fraction of its records (chosen from
    # `seed`) is held out for evaluation and the rest trains; recorded in the stage summary.
    eval_fraction: float = 0.05


@dataclass
class StageConfig:
    steps: int = 100
    # In sequences (SFT) or preference pairs (RM), summed over data-parallel ranks.
    global_batch_size: int = 32
    micro_batch_size: int = 8
    seq_length: int = 64
    eval_interval: int = 50
    log_interval: int = 10
    # 0: save only at the end of the stage.
    save_interval: int = 0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)


@dataclass
class SFTConfig(StageConfig):
    # Stage (or iter_*) directory of a checkpoint with an actor to start from (an earlier
    # stage, import-hf's output); default: model.init_from_hf, else a fresh initialisation.
    init_from: str | None = None


@dataclass
class RMConfig(StageConfig):
    # Normalise rewards to mean 0, std 1 over SFT-data responses; stored with the checkpoint.
    normalize: bool = True
    # Stage (or iter_*) directory of the SFT checkpoint; default: <run>/sft.
    init_from: str | None = None
    # > 0: hold out this fraction of the training pairs (chosen from `seed`) and train a
    # second, independent reward model on them (<run>/rm_holdout). The RL stage scores with
    # it too: a proxy reward that rises while the holdout score falls is reward hacking.
    holdout_fraction: float = 0.0


@dataclass
class DPOConfig(StageConfig):
    """Direct preference optimisation (python -m megatron_rlhf dpo; algorithms/dpo.py): batch
    sizes in preference pairs, like rm. Writes <run>/dpo/ (an actor role, like sft)."""

    # sigmoid: DPO's -log sigmoid(beta x (log-ratio chosen - log-ratio rejected)), log-ratios
    # summed over the response tokens; ipo: (h - 1/(2 beta))^2 with log-ratios averaged over them.
    loss: str = "sigmoid"
    beta: float = 0.1
    # sigmoid only: conservative DPO, the preference label is wrong with this probability (< 0.5).
    label_smoothing: float = 0.0
    # Weight of an extra NLL term on the chosen response (mean over its tokens; 0: none).
    sft_weight: float = 0.0
    # false: a reference role resident at the actor's TP x PP computes each batch's reference
    # log-probs; true: computed once for every pair at the start, the reference freed, and the
    # table kept in the stage's checkpoints (no reference forward or weights during training).
    precompute_reference: bool = False
    # Stage (or iter_*) directory of the starting checkpoint (actor and reference); default:
    # <run>/sft, or, when that has no checkpoint, model.init_from_hf.
    init_from: str | None = None


REWARD_SOURCE_TYPES = ("model", "function", "http")
# Fields each reward source type reads (beyond type, weight, name); others must stay unset.
REWARD_SOURCE_FIELDS = {"model": (), "function": ("function",),
                        "http": ("url", "timeout_s", "max_retries", "backoff_s", "max_backoff_s", "batch_size",
                                 "max_concurrency")}


@dataclass
class RewardSourceConfig:
    """One term of the RL reward: weight x this source's score for each response
    (megatron_rlhf/rewards/; README "Reward sources")."""

    # model: the reward model of the RM stage (the `reward` role, rl.rm_from); function: a
    # rule function in a Python file; http: a reward service (python -m megatron_rlhf serve-reward).
    type: str = "model"
    weight: float = 1.0
    # Logged as reward_<name>; default: rm, the function's name, or http.
    name: str | None = None
    # function: "path/to/file.py:function_name" (a relative path from the working directory,
    # else from the project root); signature in rewards/arithmetic.py and the README.
    function: str | None = None
    # http: the scoring endpoint, e.g. http://rm-host:8000/score (schema: docs/reward_service.md).
    url: str | None = None
    timeout_s: float = 30.0          # per request
    max_retries: int = 4             # after the first attempt; exponential backoff with jitter
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    batch_size: int = 64             # responses per request
    max_concurrency: int = 4         # requests in flight per data-parallel replica

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.type == "function" and self.function:
            return self.function.rsplit(":", 1)[-1]
        return {"model": "rm"}.get(self.type, self.type)


@dataclass
class RLConfig:
    """The RL stage (python -m megatron_rlhf rl): PPO or a critic-free algorithm. Writes
    <run>/<algorithm>/. The old section name `ppo` is still read (with a note)."""

    # ppo (actor + critic, GAE) | grpo | rloo | reinforce_pp | reinforce_pp_baseline | batch_mean
    # (critic-free: no critic is built; algorithms/advantages.py has each estimator).
    algorithm: str = "ppo"
    steps: int = 40                  # iterations: generate -> score -> train
    rollout_batch_size: int = 32     # prompts per iteration, over all data-parallel ranks
    n_samples_per_prompt: int = 1    # responses per prompt (the group of grpo/rloo)
    # Drop groups whose rewards are all equal (no learning signal; DAPO) and generate more
    # groups, at most max_sampling_rounds generation rounds per iteration; a shortfall is
    # filled with dropped groups (logged as sampling_shortfall) so batch shapes stay fixed.
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3
    mini_batch_size: int = 16        # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 8
    # > 0: score and train microbatches hold as many length-sorted sequences as fit in this many
    # token slots (rows x longest row) instead of micro_batch_size rows; >= model.max_seq_length.
    micro_batch_tokens: int = 0
    epochs: int = 2                  # passes over each rollout batch, reshuffled every epoch
    # Sampling (also the temperature of the recomputed log-probs).
    max_new_tokens: int = 12
    temperature: float = 1.0
    # Must stay 0 / 1.0: every log-prob (rollout, old, new, reference) is computed under the
    # full softmax, so a filtered sampler would make the rollout off-policy.
    top_k: int = 0
    top_p: float = 1.0
    # Reward: r_t = -kl_coef * KL_t (kl_in_reward), the combined reward of rl.rewards added at
    # the last response token.
    kl_coef: float = 0.05
    kl_controller: str = "fixed"     # fixed | adaptive (Ziegler et al.)
    kl_target: float = 6.0
    kl_horizon: float = 10000.0
    # k1 | k2 | k3 (algorithms/kl.py: kl_estimate). In the reward only k1 gives an unbiased
    # policy gradient (k2, k3 are biased there: a warning says so); in the loss k1 has zero
    # expected gradient and is refused, k2 is the gradient of KL(pi||ref), k3 of KL(ref||pi) (GRPO).
    kl_estimator: str = "k1"
    kl_in_reward: bool = True        # False: the KL penalty goes into the actor loss instead
    # Bound on each token's KL estimate (null: none). In the reward and metrics the estimate is
    # clamped; in the loss the log ratio is, with its gradient passed through, so the tokens that
    # drifted furthest keep a bounded, non-zero KL gradient (algorithms/kl.py: kl_loss_estimate).
    kl_clip: float | None = 10.0
    # How the actor and critic losses average over the global batch (every microbatch and
    # data-parallel rank): token_mean | seq_mean_token_mean | seq_mean_token_sum.
    loss_aggregation: str = "token_mean"
    missing_eos_penalty: float | None = None  # score given to responses without EOS
    reward_clip: float = 10.0        # clip the combined reward to [-reward_clip, reward_clip]
    gamma: float = 1.0
    # Policy loss: ratio clipped to [1 - clip_eps, 1 + clip_eps_high] (null: clip_eps;
    # "clip-higher" sets it above clip_eps); dual_clip c > 1 bounds the loss of a negative
    # advantage at c * |A|; importance_ratio: token | sequence (GSPO, use small clip ranges).
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dual_clip: float | None = None
    importance_ratio: str = "token"
    # Train/rollout mismatch correction (off by default): the rollout engine's per-token
    # log-probs pi_rollout can differ from the trainer's pi_old (another engine, other kernels).
    # tis_cap: each token's policy loss weighted by min(pi_old / pi_rollout, tis_cap) (truncated
    # importance sampling); mismatch_mask_threshold t: rows whose geometric-mean ratio
    # exp(mean_t log(pi_old / pi_rollout)) lies outside [1/t, t] get no policy gradient.
    tis_cap: float | None = None
    mismatch_mask_threshold: float | None = None
    # Old log-probs: the in-place engine (rollout.engine=megatron) samples with the actor's
    # current weights under the same softmax, so its per-token log-probs are pi_old up to float
    # rounding (~1e-7 in CPU fp32; larger in bf16: make gpu-check reports it); reusing them skips
    # the actor's forward in the score phase. Every logprob_recompute_interval-th iteration (and
    # the first) still recomputes them and logs the mismatch (0: only the first).
    reuse_rollout_logprobs: bool = False
    logprob_recompute_interval: int = 10
    group_std_normalization: bool = True  # grpo: divide by the group's std (false: Dr.GRPO)
    entropy_coef: float = 0.0
    # Critic (ppo only; setting one with a critic-free algorithm is an error).
    lam: float = 0.95
    whiten_advantages: bool = True
    value_clip: float = 0.2
    vf_coef: float = 1.0
    critic_warmup_steps: int = 0     # iterations that train only the critic
    eval_interval: int = 10
    eval_samples_logged: int = 3
    log_interval: int = 1
    save_interval: int = 0           # 0: save only at the end
    # Reward-hacking alarm: the proxy (RM) score's trend over this many iterations against an
    # independent one (gold scorer, or the holdout RM of rm.holdout_fraction); 0: off.
    reward_hacking_window: int = 10
    actor_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    critic_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    # The reward: the weighted sum of these sources' scores (missing_eos_penalty and
    # reward_clip then apply to the sum). Without a `model` source no reward model is built
    # or loaded and the pipeline needs no rm stage.
    rewards: list[RewardSourceConfig] = field(default_factory=lambda: [RewardSourceConfig()])
    # Where PPO's critic starts: rm (the reward model, its normalisation folded into the value
    # head), sft (the SFT actor with a fresh value head) or a checkpoint directory (its critic
    # role, else its reward role). Default: rm with a model reward source, else sft.
    critic_from: str | None = None
    # Stage (or iter_*) directories of the inputs; default <run>/sft (<run>/dpo when
    # pipeline.stages runs dpo before rl: the actor and reference start from the DPO policy) and <run>/rm.
    sft_from: str | None = None
    rm_from: str | None = None

    @property
    def has_critic(self) -> bool:
        return self.algorithm not in CRITIC_FREE

    @property
    def has_reward_model(self) -> bool:
        return any(source.type == "model" for source in self.rewards)

    @property
    def critic_start(self) -> str:
        """rm | sft | a checkpoint directory: where the critic starts (with a critic)."""
        return self.critic_from or ("rm" if self.has_reward_model else "sft")

    @property
    def needs_rm_checkpoint(self) -> bool:
        return self.has_reward_model or (self.has_critic and self.critic_start == "rm")

    @property
    def corrects_mismatch(self) -> bool:
        return self.tis_cap is not None or self.mismatch_mask_threshold is not None

    @property
    def samples_per_iteration(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt


ROLLOUT_ENGINES = ("megatron", "vllm")
# Head sizes vLLM's CPU attention backend supports (its GPU backends take more).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


@dataclass
class RolloutConfig:
    """Which engine generates the RL stage's responses (rollout/)."""

    # megatron: in place, with the actor's own weights (no copy, no refit). vllm: a vLLM
    # engine per data-parallel replica, in its own process next to the trainer, refit with the
    # actor's weights before every generation (README: "Rollout engines").
    engine: str = "megatron"
    # vllm only. The engine's own tensor parallelism (independent of the training layout).
    tensor_parallel: int = 1
    # KV cache budget on CPU (bytes); on GPU the engine takes gpu_memory_utilization of the
    # device (weights + KV cache) and, with sleep_level > 0, frees it while training runs.
    kv_cache_bytes: int = 64 * 2**20
    gpu_memory_utilization: float = 0.3
    sleep_level: int = 1             # GPU: 0 keep, 1 offload weights + drop KV, 2 drop both
    refit_bucket_bytes: int = 256 * 2**20  # largest bucket of HF tensors sent to the engine at once
    enforce_eager: bool = True       # no CUDA graphs / torch.compile in the engine


@dataclass
class PipelineConfig:
    # Stages `pipeline` (and slurm/submit_pipeline.sh, megatron_rlhf.launch) run in order,
    # from sft, rm, dpo, rl: e.g. [sft, rm, rl] (default), [sft, dpo], [sft, rm, dpo, rl].
    # Each starts from an earlier stage's checkpoint or its *_from field.
    stages: list[str] = field(default_factory=lambda: list(DEFAULT_STAGES))
    # A finished stage is reused only on the inputs its summary.json recorded (data, tokenizer,
    # settings, start checkpoint; trainers/stage_inputs.py); one whose inputs changed stops the
    # run, unless listed here: then it trains again from scratch, its old directory renamed
    # <stage>.replaced-<time> (as are later stages that start from it: list them too).
    # Unchanged stages are still reused, so a repeated or requeued command trains nothing twice.
    rerun: list[str] = field(default_factory=list)


@dataclass
class CheckpointConfig:
    # Stages write to <root>/<run_name>/<stage>/.
    root: str = "checkpoints"
    run_name: str = "default"
    keep_last: int = 2
    # Resume from the stage's own latest complete checkpoint when there is one.
    resume: bool = True
    # Resume from this stage or iter_* directory instead (e.g. a copy of another run).
    load: str | None = None
    # Write checkpoints in background processes (megatron-core async dist-checkpointing):
    # training continues while the files are written; the checkpoint is committed (renamed,
    # named in `latest`) only once every rank has finished writing.
    async_save: bool = False


@dataclass
class ResilienceConfig:
    # A step whose loss or gradients are NaN/Inf on any rank is skipped (no optimizer update);
    # this many skipped steps in a row stop the run with an error (0: stop at the first).
    max_consecutive_nonfinite: int = 3


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    # Show every third-party warning at start-up (the CLI flag --verbose does the same);
    # false hides the known harmless ones (megatron_rlhf/logging/quiet.py lists them).
    verbose: bool = False


@dataclass
class Config:
    seed: int = 1234
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # Used by roles built outside a stage (smoke run, tests); each stage has its own.
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rm: RMConfig = field(default_factory=RMConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # Set by load_config (not part of the recipe): notes on renamed keys, and the dotted keys
    # the recipe itself (not a base recipe) and the overrides set.
    # Plain class attributes, not fields: a recipe cannot set them and to_dict leaves them out.
    notes = ()
    given = frozenset()
    # The dotted keys the command-line overrides set (a subset of `given`): a later stage refuses
    # these when they contradict what its run recorded, and replaces a recipe's (stage_data.py).
    override_keys = frozenset()
    # Architecture fields a recipe set that model.from_hf_config / init_from_hf replaced
    # (printed by the pre-flight check).
    hf_notes = ()


# ---------------------------------------------------------------- building from dicts


def _check_type(value: Any, annotation: Any, name: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_type(value, option, name)
            except ConfigError:
                pass
        raise ConfigError(f"{name}: expected {annotation}, got {value!r} ({type(value).__name__})")
    if origin is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected a list, got {value!r} ({type(value).__name__})")
        return [_check_type(v, item, f"{name}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(annotation):  # e.g. an item of a list of sections (rl.rewards)
        return from_dict(annotation, value, prefix=f"{name}.")
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):
        try:  # PyYAML reads `1e-4` (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if annotation in (int, float, str, bool):
        if isinstance(value, bool) and annotation is not bool:
            raise ConfigError(f"{name}: expected {annotation.__name__}, got boolean {value!r}")
        if not isinstance(value, annotation):
            raise ConfigError(
                f"{name}: expected {annotation.__name__}, got {value!r} ({type(value).__name__})"
            )
        return value
    return value


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; known keys: {names}"
            raise ConfigError(f"{full}: unknown key{hint}")
        annotation = hints[key]
        if dataclasses.is_dataclass(annotation):
            kwargs[key] = from_dict(annotation, value, prefix=f"{full}.")
        else:
            kwargs[key] = _check_type(value, annotation, full)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:  # checks in the dataclass itself
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {err}") from err


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def yaml_problem(err: yaml.YAMLError, context_position: bool = True) -> tuple[str, yaml.Mark | None]:
    """PyYAML's error as one line without its position, and the position (None if it has none):
    its own message spans several lines and names the text "<unicode string>"."""
    if not isinstance(err, yaml.MarkedYAMLError) or err.problem_mark is None:
        return " ".join(str(err).split()), None
    context = f" ({err.context}" if err.context else ""
    if context and context_position and err.context_mark is not None:
        context += f" started at line {err.context_mark.line + 1}, column {err.context_mark.column + 1}"
    return f"{err.problem}{context}{')' if context else ''}", err.problem_mark


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["model.hidden_size=128", "seed=3"]` -> nested dict; values parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected key=value, e.g. model.hidden_size=128")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as err:
            problem, _ = yaml_problem(err, context_position=False)  # a position in the value alone misleads
            raise ConfigError(f"override '{item}': the value is not valid YAML: {problem}; fix the value, "
                              "or put it in quotes to pass it as a string") from None
        _set_dotted(tree, key.strip(), value)
    return tree


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def rename_legacy_keys(data: dict[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    """The `ppo` section read as `rl` (and ppo.ppo_epochs as rl.epochs), with a note naming
    each new key. A key set under both names is an error."""
    if "ppo" not in data:
        return data, []
    old = data["ppo"]
    if not isinstance(old, dict):
        raise ConfigError(f"ppo: expected a mapping (the section is now called rl), got {old!r}")
    new = dict(data.get("rl") or {})
    moved = []
    for key, value in old.items():
        target = "epochs" if key == "ppo_epochs" else key
        if target in new:
            raise ConfigError(f"ppo.{key} and rl.{target} are both set ({where}); keep rl.{target} only")
        new[target] = value
        moved.append(f"ppo.{key} -> rl.{target}")
    data = {k: v for k, v in data.items() if k != "ppo"}
    data["rl"] = new
    return data, [f"{where}: the ppo section is now rl; read {', '.join(moved)}"]


def _leaf_keys(tree: dict[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for key, value in tree.items():
        keys |= _leaf_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"}
    return keys


def read_recipe(path: Path, chain: tuple[Path, ...] = ()) -> tuple[dict[str, Any], list[str], set[str]]:
    """A YAML recipe as a dict, on top of the recipe its `base:` names (a path relative to it);
    the notes on renamed keys; the dotted keys this file itself sets (not its base)."""
    if not path.is_file():
        raise ConfigError(f"{'base' if chain else '--config'}: file not found: {path}")
    if path.resolve() in chain:
        raise ConfigError(f"{path}: base recipes form a cycle: {' -> '.join(map(str, chain))}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason}); "
                          "save the recipe as UTF-8") from None
    except yaml.YAMLError as err:
        problem, mark = yaml_problem(err)
        at = f"{mark.line + 1}:{mark.column + 1}:" if mark is not None else ""
        raise ConfigError(f"{path}:{at} not valid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    data, notes = rename_legacy_keys(data, str(path))
    base = data.pop("base", None)
    own = _leaf_keys(data)
    if base is None:
        return data, notes, own
    parent, parent_notes, _ = read_recipe(path.parent / base, (*chain, path.resolve()))
    return _merge(parent, data), parent_notes + notes, own


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    data, notes, own = ({}, [], set()) if path is None else read_recipe(Path(path))
    cli, cli_notes = rename_legacy_keys(parse_overrides(overrides or []), "overrides")
    cfg = from_dict(Config, _merge(data, cli))
    cfg.notes = notes + cli_notes
    cli_keys = _leaf_keys(cli)
    cfg.given = frozenset(own | cli_keys)
    cfg.override_keys = frozenset(cli_keys)
    if cfg.model.hf_source:
        cfg.hf_notes = tuple(_architecture_from_hf(cfg, [_leaf_keys(data) - own, own, cli_keys]))
    return cfg


def _architecture_from_hf(cfg: Config, levels: list[set[str]]) -> list[str]:
    """Fill cfg.model's architecture from the HF config.json it names. `levels`: the keys set
    by base recipes, the recipe, the overrides; those at or after the level that names the HF
    directory are checked against it, earlier ones replaced (see ModelConfig.from_hf_config)."""
    from megatron_rlhf.convert.hf_config import ConvertError, resolve_from_hf

    key = "model.from_hf_config" if cfg.model.from_hf_config else "model.init_from_hf"
    at = max(i for i, keys in enumerate(levels) if key in keys)
    checked = set().union(*levels[at:])
    replaceable = set().union(*levels[:at]) - checked
    try:
        cfg.model, notes = resolve_from_hf(cfg.model, checked, replaceable)
    except ConvertError as err:
        raise ConfigError(str(err)) from None
    return notes


# ---------------------------------------------------------------- cross-field validation


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Check the rules that involve more than one field. Raises ConfigError naming the field."""
    m, p = cfg.model, cfg.parallel
    positive = {
        "model.num_layers": m.num_layers, "model.hidden_size": m.hidden_size,
        "model.num_attention_heads": m.num_attention_heads, "model.ffn_hidden_size": m.ffn_hidden_size,
        "model.vocab_size": 1 if m.vocab_size is None else m.vocab_size, "model.max_seq_length": m.max_seq_length,
        "model.make_vocab_size_divisible_by": m.make_vocab_size_divisible_by,
        "parallel.tensor_parallel": p.tensor_parallel, "parallel.pipeline_parallel": p.pipeline_parallel,
    }
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"{name}={value}: must be >= 1")
    if m.params_dtype not in DTYPES:
        raise ConfigError(f"model.params_dtype={m.params_dtype!r}: choose one of {DTYPES}")
    if p.backend not in ("auto", "nccl", "gloo"):
        raise ConfigError(f"parallel.backend={p.backend!r}: choose auto, nccl or gloo")
    _validate_model(m)
    if m.num_query_groups is not None and (
        m.num_query_groups < 1 or m.num_attention_heads % m.num_query_groups
    ):
        raise ConfigError(
            f"model.num_query_groups={m.num_query_groups}: must divide "
            f"model.num_attention_heads={m.num_attention_heads}"
        )
    tp = p.tensor_parallel
    if m.num_attention_heads % tp:
        raise ConfigError(
            f"parallel.tensor_parallel={tp}: does not divide model.num_attention_heads="
            f"{m.num_attention_heads}; choose a TP size that divides the head count"
        )
    if m.kv_heads % tp:
        raise ConfigError(
            f"parallel.tensor_parallel={tp}: does not divide the key/value heads "
            f"(model.num_query_groups={m.kv_heads}); lower TP or raise num_query_groups"
        )
    if m.ffn_hidden_size % tp:
        raise ConfigError(f"parallel.tensor_parallel={tp}: does not divide model.ffn_hidden_size={m.ffn_hidden_size}")
    if m.make_vocab_size_divisible_by % tp:
        raise ConfigError(
            f"model.make_vocab_size_divisible_by={m.make_vocab_size_divisible_by}: must be a "
            f"multiple of parallel.tensor_parallel={tp} so the padded vocabulary splits evenly; "
            f"set model.make_vocab_size_divisible_by={math.lcm(m.make_vocab_size_divisible_by, tp)}"
        )
    pp = p.pipeline_parallel
    if pp > m.num_layers:
        raise ConfigError(
            f"parallel.pipeline_parallel={pp}: larger than model.num_layers={m.num_layers}; "
            f"each pipeline stage needs at least one layer"
        )
    if m.num_layers % pp:
        raise ConfigError(
            f"parallel.pipeline_parallel={pp}: does not divide model.num_layers={m.num_layers}"
        )
    if world_size is not None and world_size % (tp * pp):
        raise ConfigError(
            f"parallel.tensor_parallel={tp} x parallel.pipeline_parallel={pp} = {tp * pp} does not "
            f"divide the world size {world_size}; launch a multiple of TP*PP processes"
        )
    dp = (world_size or tp * pp) // (tp * pp)
    if not 0 <= cfg.data.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction={cfg.data.eval_fraction}: must be in [0, 1) (e.g. 0.05); 0 needs "
                          "an *_eval file (or data.task) for every *_train file")
    if not 0 <= cfg.rm.holdout_fraction < 1:
        raise ConfigError(f"rm.holdout_fraction={cfg.rm.holdout_fraction}: must be in [0, 1) (e.g. 0.5; 0: no holdout RM)")
    if cfg.data.overflow not in OVERFLOW_POLICIES:
        raise ConfigError(f"data.overflow={cfg.data.overflow!r}: choose one of {OVERFLOW_POLICIES}")
    for name in ("sft", "rm", "dpo"):
        _validate_stage(name, getattr(cfg, name), m, dp)
    _validate_dpo(cfg.dpo)
    for name in ("optimizer", "sft.optimizer", "rm.optimizer", "dpo.optimizer", "rl.actor_optimizer",
                 "rl.critic_optimizer"):
        _validate_optimizer(name, _get_dotted(cfg, name))
    _validate_rl(cfg.rl, m, dp, cfg.given)
    _validate_rollout(cfg.rollout, m, p)
    _validate_lora(cfg.lora)
    if cfg.lora.applies_to("sft") and not (cfg.sft.init_from or m.init_from_hf):
        raise ConfigError("lora.stages has sft: adapters train on a pretrained model, and sft would start from a "
                          "fresh initialisation; set sft.init_from=<a checkpoint with an actor: an earlier stage, "
                          "import-hf's output> or model.init_from_hf=<a Hugging Face directory>, or remove sft")
    if cfg.lora.rank > 0 and "output" in cfg.lora.targets and m.share_embeddings_and_output_weights:
        raise ConfigError("lora.targets has output with model.share_embeddings_and_output_weights=true: an adapter on "
                          "a tied LM head would change the input embedding's twin only; remove output from lora.targets")
    if cfg.rl.reuse_rollout_logprobs and cfg.rollout.engine != "megatron":
        raise ConfigError(f"rl.reuse_rollout_logprobs=true with rollout.engine={cfg.rollout.engine}: only the in-place "
                          "megatron engine samples with the actor's own weights and softmax; a separate engine's "
                          "log-probs are not pi_old. Set rl.reuse_rollout_logprobs=false or rollout.engine=megatron")
    _validate_pipeline(cfg)
    if cfg.checkpoint.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={cfg.checkpoint.keep_last}: must be >= 1")
    if cfg.resilience.max_consecutive_nonfinite < 0:
        raise ConfigError(f"resilience.max_consecutive_nonfinite={cfg.resilience.max_consecutive_nonfinite}: "
                          "must be >= 0 (0 stops at the first non-finite step)")
    return cfg


def _validate_model(m: ModelConfig) -> None:
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
    if m.recompute_granularity != "full" and (m.recompute_method or m.recompute_num_layers):
        raise ConfigError(f"model.recompute_method={m.recompute_method!r}, model.recompute_num_layers="
                          f"{m.recompute_num_layers}: only for model.recompute_granularity=full; unset them")
    if m.family not in MODEL_FAMILIES:
        raise ConfigError(f"model.family={m.family!r}: choose one of {MODEL_FAMILIES}")
    # Each family's attention is fixed by transformers: Qwen2 always has q/k/v biases, Qwen3
    # always normalises q and k, Llama and Mistral do neither.
    if m.qkv_bias != (m.family == "qwen2"):
        raise ConfigError(f"model.qkv_bias={m.qkv_bias} with model.family={m.family!r}: q/k/v biases are Qwen2's "
                          f"(and only Qwen2's); set model.family=qwen2 with model.qkv_bias=true, or model.qkv_bias=false")
    if m.qk_layernorm != (m.family == "qwen3"):
        raise ConfigError(f"model.qk_layernorm={m.qk_layernorm} with model.family={m.family!r}: per-head q/k RMSNorm "
                          "is Qwen3's (and only Qwen3's); set model.family=qwen3 with model.qk_layernorm=true, or "
                          "model.qk_layernorm=false")
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


def _validate_lora(lo: LoRAConfig) -> None:
    if lo.rank < 0:
        raise ConfigError(f"lora.rank={lo.rank}: must be >= 0 (0: no adapters, full fine-tuning; typical 8-64)")
    if lo.rank == 0:
        return
    if not lo.alpha > 0:
        raise ConfigError(f"lora.alpha={lo.alpha}: must be > 0 (the adapter output is scaled by alpha / rank; e.g. 2 x rank)")
    if not 0 <= lo.dropout < 1:
        raise ConfigError(f"lora.dropout={lo.dropout}: must be in [0, 1)")
    bad = [t for t in lo.targets if t not in LORA_TARGETS]
    if bad or not lo.targets or len(set(lo.targets)) != len(lo.targets):
        raise ConfigError(f"lora.targets={lo.targets}: choose distinct layers from {LORA_TARGETS} (at least one)")
    bad = [s for s in lo.stages if s not in LORA_STAGES]
    if bad:
        raise ConfigError(f"lora.stages={lo.stages}: LoRA trains the policy of {LORA_STAGES} (and the rl critic); "
                          f"remove {bad}")
    if lo.dropout > 0 and "rl" in lo.stages:
        raise ConfigError(f"lora.dropout={lo.dropout} with rl in lora.stages={lo.stages}: the RL stage's old "
                          "log-probs and values come from eval-mode forwards, so adapter dropout in its training "
                          "forwards makes the first minibatch's ratios differ from 1 and shifts the value clipping; "
                          "set lora.dropout=0 or remove rl from lora.stages (sft and dpo keep adapter dropout)")


def _get_dotted(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _validate_optimizer(name: str, o: OptimizerConfig) -> None:
    if o.lr_decay_style not in LR_DECAY_STYLES:
        raise ConfigError(f"{name}.lr_decay_style={o.lr_decay_style!r}: choose one of {LR_DECAY_STYLES}")
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(f"{name}.lr={o.lr}, {name}.min_lr={o.min_lr}: need 0 <= min_lr <= lr and lr > 0")
    if o.warmup_steps < 0:
        raise ConfigError(f"{name}.warmup_steps={o.warmup_steps}: must be >= 0")


def _validate_stage(name: str, st: StageConfig, m: ModelConfig, dp: int) -> None:
    for key in ("steps", "global_batch_size", "micro_batch_size", "seq_length", "eval_interval", "log_interval"):
        if getattr(st, key) < 1:
            raise ConfigError(f"{name}.{key}={getattr(st, key)}: must be >= 1")
    if st.save_interval < 0:
        raise ConfigError(f"{name}.save_interval={st.save_interval}: must be >= 0 (0 = only at the end)")
    if st.seq_length < 2:
        raise ConfigError(f"{name}.seq_length={st.seq_length}: must be >= 2 (a prompt token and one to learn)")
    if st.seq_length > m.max_seq_length:
        raise ConfigError(
            f"{name}.seq_length={st.seq_length}: longer than model.max_seq_length={m.max_seq_length}"
        )
    if st.global_batch_size % (st.micro_batch_size * dp):
        raise ConfigError(
            f"{name}.global_batch_size={st.global_batch_size}: must be a multiple of "
            f"{name}.micro_batch_size={st.micro_batch_size} x data-parallel size {dp}"
        )
    if st.optimizer.warmup_steps > st.steps:
        raise ConfigError(f"{name}.optimizer.warmup_steps={st.optimizer.warmup_steps}: more than {name}.steps={st.steps}")


def _validate_rl(p: RLConfig, m: ModelConfig, dp: int, given: frozenset = frozenset()) -> None:
    for key in ("steps", "rollout_batch_size", "mini_batch_size", "micro_batch_size", "epochs", "n_samples_per_prompt", "max_sampling_rounds",
                "max_new_tokens", "eval_interval", "log_interval"):
        if getattr(p, key) < 1:
            raise ConfigError(f"rl.{key}={getattr(p, key)}: must be >= 1")
    if p.reward_hacking_window != 0 and p.reward_hacking_window < 5:
        raise ConfigError(f"rl.reward_hacking_window={p.reward_hacking_window}: a trend needs >= 5 iterations "
                          "(e.g. 10), or 0 to turn the alarm off")
    if p.algorithm not in RL_ALGORITHMS:
        raise ConfigError(f"rl.algorithm={p.algorithm!r}: choose one of {RL_ALGORITHMS}")
    if p.samples_per_iteration % p.mini_batch_size:
        raise ConfigError(f"rl.rollout_batch_size={p.rollout_batch_size} x rl.n_samples_per_prompt="
                          f"{p.n_samples_per_prompt}: must be a multiple of rl.mini_batch_size={p.mini_batch_size}")
    if p.rollout_batch_size % dp:  # a prompt's group stays on one data-parallel rank
        raise ConfigError(f"rl.rollout_batch_size={p.rollout_batch_size}: must be a multiple of the "
                          f"data-parallel size {dp} (each rank samples whole groups)")
    if p.mini_batch_size % (p.micro_batch_size * dp):
        raise ConfigError(f"rl.mini_batch_size={p.mini_batch_size}: must be a multiple of "
                          f"rl.micro_batch_size={p.micro_batch_size} x data-parallel size {dp}")
    if p.micro_batch_tokens and p.micro_batch_tokens < m.max_seq_length:
        raise ConfigError(f"rl.micro_batch_tokens={p.micro_batch_tokens}: a sequence of up to model.max_seq_length="
                          f"{m.max_seq_length} tokens must fit; set it >= {m.max_seq_length}, or 0 for "
                          "rl.micro_batch_size rows per microbatch")
    if p.max_new_tokens > m.max_seq_length - 2:  # encode_prompts needs room for >= 2 prompt tokens
        raise ConfigError(f"rl.max_new_tokens={p.max_new_tokens}: leaves no room for a prompt in "
                          f"model.max_seq_length={m.max_seq_length}; at most {m.max_seq_length - 2}")
    if p.temperature <= 0:
        raise ConfigError(f"rl.temperature={p.temperature}: must be > 0")
    if not 0 < p.top_p <= 1 or p.top_k < 0:
        raise ConfigError(f"rl.top_p={p.top_p}, rl.top_k={p.top_k}: need 0 < top_p <= 1 and top_k >= 0")
    if p.top_k != 0 or p.top_p != 1.0:
        raise ConfigError(
            f"rl.top_k={p.top_k}, rl.top_p={p.top_p}: The RL stage computes every log-prob (rollout, old, new, "
            "reference) under the full softmax, so sampling from a top-k/top-p filtered distribution would "
            "make the rollout off-policy and bias the KL; set rl.top_k=0 and rl.top_p=1.0 (use "
            "rl.temperature to sharpen or flatten sampling)")
    choices = {"kl_estimator": KL_ESTIMATORS, "kl_controller": KL_CONTROLLERS, "loss_aggregation": LOSS_AGGREGATIONS}
    for key, allowed in choices.items():
        if getattr(p, key) not in allowed:
            raise ConfigError(f"rl.{key}={getattr(p, key)!r}: choose one of {allowed}")
    if not p.kl_in_reward and p.kl_estimator == "k1":
        raise ConfigError(
            "rl.kl_estimator='k1' with rl.kl_in_reward=false: in the loss the k1 estimator has zero "
            "expected gradient (E_pi[grad log pi] = 0), so it adds noise and no regularisation; set "
            "rl.kl_estimator=k2 (gradient of KL(pi||ref)) or k3 (GRPO's convention, gradient of KL(ref||pi)), "
            "or keep k1 in the reward (rl.kl_in_reward=true)")
    if p.kl_clip is not None and p.kl_clip <= 0:
        raise ConfigError(f"rl.kl_clip={p.kl_clip}: must be > 0, or null for no bound")
    if p.kl_target <= 0 or p.kl_horizon <= 0:
        raise ConfigError(f"rl.kl_target={p.kl_target}, rl.kl_horizon={p.kl_horizon}: must be > 0")
    if not (0 <= p.gamma <= 1 and 0 <= p.lam <= 1):
        raise ConfigError(f"rl.gamma={p.gamma}, rl.lam={p.lam}: must be in [0, 1]")
    if p.clip_eps <= 0 or p.value_clip <= 0 or p.reward_clip <= 0:
        raise ConfigError("rl.clip_eps, rl.value_clip and rl.reward_clip must be > 0")


    if p.algorithm in GROUP_BASELINES and p.n_samples_per_prompt < 2:
        raise ConfigError(f"rl.n_samples_per_prompt={p.n_samples_per_prompt}: rl.algorithm={p.algorithm} compares "
                          "the samples of one prompt with each other; set rl.n_samples_per_prompt >= 2 (e.g. 4)")
    if p.dynamic_sampling and p.n_samples_per_prompt < 2:
        raise ConfigError("rl.dynamic_sampling=true drops groups whose rewards are all equal, which a group of one "
                          "always is; set rl.n_samples_per_prompt >= 2")
    if not p.has_critic:
        set_for_critic = sorted(k for k in given if k.startswith("rl.") and k.split(".")[1] in CRITIC_FIELDS)
        if set_for_critic:
            raise ConfigError(
                f"{set_for_critic[0]}: rl.algorithm={p.algorithm} has no critic, so this setting would be ignored; "
                f"remove {', '.join(set_for_critic)} from the recipe and the overrides, or keep them in a base recipe "
                "and set the algorithm in one that starts with `base: <that recipe>` (as pipelines/tiny_cpu_grpo.yaml)")
    if "rl.group_std_normalization" in given and p.algorithm != "grpo":
        raise ConfigError(f"rl.group_std_normalization: only rl.algorithm=grpo divides by the group's std "
                          f"(rl.algorithm={p.algorithm}); remove it")
    if p.importance_ratio not in IMPORTANCE_RATIOS:
        raise ConfigError(f"rl.importance_ratio={p.importance_ratio!r}: choose one of {IMPORTANCE_RATIOS}")
    if p.clip_eps_high is not None and p.clip_eps_high <= 0:
        raise ConfigError(f"rl.clip_eps_high={p.clip_eps_high}: must be > 0, or null for rl.clip_eps")
    if p.logprob_recompute_interval < 0:
        raise ConfigError(f"rl.logprob_recompute_interval={p.logprob_recompute_interval}: must be >= 0 "
                          "(0: recompute only in the first iteration)")
    if p.reuse_rollout_logprobs and p.corrects_mismatch:
        raise ConfigError("rl.reuse_rollout_logprobs=true with rl.tis_cap / rl.mismatch_mask_threshold: the "
                          "correction weighs pi_old against pi_rollout, which reusing makes the same; "
                          "set rl.reuse_rollout_logprobs=false")
    if p.tis_cap is not None and p.tis_cap < 1:
        raise ConfigError(f"rl.tis_cap={p.tis_cap}: must be >= 1 (typical 2), or null for no correction")
    if p.mismatch_mask_threshold is not None and p.mismatch_mask_threshold <= 1:
        raise ConfigError(f"rl.mismatch_mask_threshold={p.mismatch_mask_threshold}: must be > 1 (typical 2), "
                          "or null for none")
    _validate_rewards(p)
    if p.dual_clip is not None and p.dual_clip <= 1:
        raise ConfigError(f"rl.dual_clip={p.dual_clip}: must be > 1 (the bound c * |A| on a negative "
                          "advantage's loss; typical 3), or null for none")


def _validate_dpo(d: DPOConfig) -> None:
    if d.loss not in DPO_LOSSES:
        raise ConfigError(f"dpo.loss={d.loss!r}: choose one of {DPO_LOSSES}")
    if not (math.isfinite(d.beta) and d.beta > 0):
        raise ConfigError(f"dpo.beta={d.beta}: must be > 0 (typical 0.1; smaller lets the policy move further "
                          "from the reference)")
    if not 0 <= d.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing={d.label_smoothing}: must be in [0, 0.5) (the probability that a "
                          "preference label is wrong; 0: plain DPO)")
    if d.label_smoothing and d.loss != "sigmoid":
        raise ConfigError(f"dpo.label_smoothing={d.label_smoothing} with dpo.loss={d.loss}: conservative DPO's label "
                          "smoothing belongs to the sigmoid loss; set dpo.loss=sigmoid or dpo.label_smoothing=0")
    if not (math.isfinite(d.sft_weight) and d.sft_weight >= 0):
        raise ConfigError(f"dpo.sft_weight={d.sft_weight}: must be >= 0 (0: no NLL term on the chosen response)")


def policy_start(cfg: Config) -> tuple[str, str | None]:
    """Where the RL stage's actor and reference start: (stage name, rl.sft_from or None for
    <run>/<stage>): dpo when pipeline.stages runs dpo before rl, else sft."""
    stages = cfg.pipeline.stages
    after_dpo = "dpo" in stages and "rl" in stages and stages.index("dpo") < stages.index("rl")
    return ("dpo" if after_dpo else "sft"), cfg.rl.sft_from


def _validate_rewards(p: RLConfig) -> None:
    if not p.rewards:
        raise ConfigError("rl.rewards: empty; give at least one reward source, e.g. [{type: model}]")
    labels = []
    for i, src in enumerate(p.rewards):
        where = f"rl.rewards[{i}]"
        if src.type not in REWARD_SOURCE_TYPES:
            raise ConfigError(f"{where}.type={src.type!r}: choose one of {REWARD_SOURCE_TYPES}")
        defaults = RewardSourceConfig()
        for other, fields in REWARD_SOURCE_FIELDS.items():
            stray = [f for f in fields if other != src.type and f not in REWARD_SOURCE_FIELDS[src.type]
                     and getattr(src, f) != getattr(defaults, f)]
            if stray:
                raise ConfigError(f"{where}.{stray[0]}: only a reward source of type {other} reads it "
                                  f"({where}.type={src.type}); remove it")
        if not math.isfinite(src.weight) or src.weight == 0:
            raise ConfigError(f"{where}.weight={src.weight}: must be a finite non-zero number")
        if src.type == "function" and (not src.function or ":" not in src.function
                                       or not src.function.rsplit(":", 1)[0].endswith(".py")):
            raise ConfigError(f"{where}.function={src.function!r}: give the file and the function, e.g. "
                              "rewards/arithmetic.py:score")
        if src.type == "http":
            if not src.url or not src.url.startswith(("http://", "https://")):
                raise ConfigError(f"{where}.url={src.url!r}: give the scoring endpoint, e.g. "
                                  "http://127.0.0.1:8000/score (python -m megatron_rlhf serve-reward)")
            if src.timeout_s <= 0 or src.backoff_s < 0 or src.max_backoff_s < src.backoff_s:
                raise ConfigError(f"{where}: timeout_s={src.timeout_s}, backoff_s={src.backoff_s}, max_backoff_s="
                                  f"{src.max_backoff_s}: need timeout_s > 0 and 0 <= backoff_s <= max_backoff_s")
            if src.max_retries < 0 or src.batch_size < 1 or src.max_concurrency < 1:
                raise ConfigError(f"{where}: max_retries={src.max_retries}, batch_size={src.batch_size}, "
                                  f"max_concurrency={src.max_concurrency}: need >= 0, >= 1, >= 1")
        labels.append(src.label)
    if sum(src.type == "model" for src in p.rewards) > 1:
        raise ConfigError("rl.rewards: more than one source of type model; the RL stage has one reward model role "
                          "(serve another checkpoint with serve-reward and add it as type http)")
    if len(set(labels)) != len(labels):
        raise ConfigError(f"rl.rewards: two sources are called {sorted(set(l for l in labels if labels.count(l) > 1))}; "
                          "give them distinct `name`s (each is logged as reward_<name>)")


def _validate_rollout(r: RolloutConfig, m: ModelConfig, p: ParallelConfig) -> None:
    if r.engine not in ROLLOUT_ENGINES:
        raise ConfigError(f"rollout.engine={r.engine!r}: choose one of {ROLLOUT_ENGINES}")
    if r.tensor_parallel < 1 or r.kv_cache_bytes < 1 or r.refit_bucket_bytes < 1:
        raise ConfigError("rollout.tensor_parallel, rollout.kv_cache_bytes and rollout.refit_bucket_bytes must be >= 1")
    if not 0 < r.gpu_memory_utilization < 1 or r.sleep_level not in (0, 1, 2):
        raise ConfigError(f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} must be in (0, 1) and "
                          f"rollout.sleep_level={r.sleep_level} one of 0, 1, 2")
    if r.engine != "vllm":
        return
    tp = r.tensor_parallel
    if m.num_attention_heads % tp or (m.kv_heads % tp and tp % m.kv_heads):
        raise ConfigError(f"rollout.tensor_parallel={r.tensor_parallel}: vLLM splits attention heads "
                          f"({m.num_attention_heads}, {m.kv_heads} key/value) over it; choose a divisor of "
                          f"model.num_attention_heads")
    if r.tensor_parallel > p.tensor_parallel * p.pipeline_parallel:
        raise ConfigError(f"rollout.tensor_parallel={r.tensor_parallel}: the engine of a data-parallel replica "
                          f"uses that replica's devices (parallel.tensor_parallel x pipeline_parallel = "
                          f"{p.tensor_parallel * p.pipeline_parallel}); choose at most that")


def check_vllm_cpu_model(m: ModelConfig) -> None:
    """vLLM's CPU attention supports only some head sizes: refuse others before any engine starts."""
    if m.kv_channels not in VLLM_CPU_HEAD_DIMS:
        raise ConfigError(
            f"rollout.engine=vllm on CPU: the model's head size is {m.kv_channels} (model.hidden_size / "
            f"model.num_attention_heads, or model.head_dim) and vLLM's CPU backend supports only {VLLM_CPU_HEAD_DIMS}; "
            "use a recipe with such a head size (pipelines/tiny_cpu_vllm.yaml) or rollout.engine=megatron")


def _validate_pipeline(cfg: Config) -> None:
    stages = cfg.pipeline.stages
    for name in stages:
        if name not in STAGES:
            hint = " (the RL stage is rl; its algorithm is rl.algorithm)" if name in RL_ALGORITHMS else ""
            raise ConfigError(f"pipeline.stages: unknown stage {name!r}{hint}; choose from {STAGES}")
    if len(set(stages)) != len(stages) or not stages:
        raise ConfigError(f"pipeline.stages={stages}: list each stage once, at least one")
    for i, name in enumerate(stages):
        for needed, field_name in STAGE_INPUTS.get(name, {}).items():
            if name == "rl" and needed == "rm" and not cfg.rl.needs_rm_checkpoint:
                continue  # no reward model source and the critic does not start from one
            if name == "dpo" and cfg.model.init_from_hf:
                continue  # starts from the Hugging Face weights
            if needed not in stages[:i] and _get_dotted(cfg, field_name) is None:
                raise ConfigError(f"pipeline.stages={stages}: {name} starts from a {needed} checkpoint; put {needed} "
                                  f"before {name} or set {field_name} to an existing {needed} stage directory")
    if stray := [name for name in cfg.pipeline.rerun if name not in stages]:
        hint = " (the RL stage is rl)" if any(name in RL_ALGORITHMS for name in stray) else ""
        raise ConfigError(f"pipeline.rerun={cfg.pipeline.rerun}: {stray} not in pipeline.stages={stages}{hint}; "
                          "name stages of this pipeline, e.g. pipeline.rerun=[" + ",".join(stages[:1]) + "]")


def warnings_for(cfg: Config) -> list[str]:
    """Settings that run but are probably not what the user wants; stages log them at start-up."""
    notes = list(cfg.notes)
    p = cfg.rl
    if p.kl_in_reward and p.kl_estimator in ("k2", "k3"):
        notes.append(
            f"rl.kl_estimator={p.kl_estimator} with rl.kl_in_reward=true: a reward cannot carry the gradient of "
            f"an estimator that depends on the policy, so the policy gradient of the KL penalty is biased; k1 is "
            f"the unbiased choice in the reward ({p.kl_estimator} belongs in the loss: rl.kl_in_reward=false)")
    if p.importance_ratio == "sequence" and p.loss_aggregation != "seq_mean_token_mean":
        notes.append(
            f"rl.importance_ratio=sequence with rl.loss_aggregation={p.loss_aggregation}: GSPO's objective weighs "
            "every sequence the same (rl.loss_aggregation=seq_mean_token_mean); here tokens of long responses "
            "weigh more")
    if "rl.max_sampling_rounds" in cfg.given and not p.dynamic_sampling:
        notes.append("rl.max_sampling_rounds is set but rl.dynamic_sampling=false: one generation round per iteration")
    return notes
