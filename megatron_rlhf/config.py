"""Typed run configuration: dataclasses are the single source of defaults.

`load_config(path, overrides)` reads a YAML recipe, applies dotted `key=value` overrides and
type-checks every field; `validate(cfg, world_size)` checks the cross-field rules (parallel
layout against model shape) before any model is built. Every error names the field.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_rlhf.data.tasks.base import TaskSizes


class ConfigError(ValueError):
    """A bad configuration value; the message names the field and the fix."""


DTYPES = ("float32", "bfloat16", "float16")
# The choices of the ppo section (algorithms/ppo.py implements each).
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_CONTROLLERS = ("fixed", "adaptive")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


@dataclass
class ModelConfig:
    """A Llama-style decoder: RMSNorm, SwiGLU MLP, RoPE, no biases."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    # Grouped-query attention: number of key/value heads. None means one per query head.
    num_query_groups: int | None = None
    ffn_hidden_size: int = 256
    # The tokenizer's vocabulary; the embedding is padded up to a multiple of
    # make_vocab_size_divisible_by (independent of TP, so checkpoints reshard freely).
    vocab_size: int = 128
    make_vocab_size_divisible_by: int = 128
    max_seq_length: int = 128
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-5
    share_embeddings_and_output_weights: bool = False
    init_method_std: float = 0.02
    params_dtype: str = "float32"
    # A local Hugging Face Llama-family directory (config.json + safetensors): a fresh SFT
    # run starts from these weights; the fields above must match its config.json.
    init_from_hf: str | None = None

    @property
    def padded_vocab_size(self) -> int:
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads


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
    # megatron-core's DistributedOptimizer (ZeRO-1 over data-parallel ranks).
    use_distributed_optimizer: bool = True
    # megatron-core's OptimizerParamScheduler: linear warmup, then decay to min_lr.
    warmup_steps: int = 0
    lr_decay_style: str = "constant"


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
    pass


@dataclass
class RMConfig(StageConfig):
    # Normalise rewards to mean 0, std 1 over SFT-data responses; stored with the checkpoint.
    normalize: bool = True
    # Stage (or iter_*) directory of the SFT checkpoint; default: <run>/sft.
    init_from: str | None = None


@dataclass
class PPOConfig:
    steps: int = 40                  # iterations: generate -> score -> train
    rollout_batch_size: int = 32     # prompts per iteration, over all data-parallel ranks
    mini_batch_size: int = 16        # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 8
    ppo_epochs: int = 2              # passes over each rollout batch, reshuffled every epoch
    # Sampling (also the temperature of the recomputed log-probs).
    max_new_tokens: int = 12
    temperature: float = 1.0
    # Must stay 0 / 1.0 for PPO: every log-prob (rollout, old, new, reference) is computed
    # under the full softmax, so a filtered sampler would make the rollout off-policy.
    top_k: int = 0
    top_p: float = 1.0
    # Reward: r_t = -kl_coef * KL_t (kl_in_reward), RM score added at the last response token.
    kl_coef: float = 0.05
    kl_controller: str = "fixed"     # fixed | adaptive (Ziegler et al.)
    kl_target: float = 6.0
    kl_horizon: float = 10000.0
    # k1 | k2 | k3 (algorithms/ppo.py: kl_estimate). In the reward only k1 gives an unbiased
    # policy gradient (k2, k3 are biased there: a warning says so); in the loss k1 has zero
    # expected gradient and is refused, k2 is the gradient of KL(pi||ref), k3 of KL(ref||pi) (GRPO).
    kl_estimator: str = "k1"
    kl_in_reward: bool = True        # False: the KL penalty goes into the actor loss instead
    kl_clip: float | None = 10.0     # bound on each token's KL estimate (null: none)
    # How the actor and critic losses average over the global batch (every microbatch and
    # data-parallel rank): token_mean | seq_mean_token_mean | seq_mean_token_sum.
    loss_aggregation: str = "token_mean"
    missing_eos_penalty: float | None = None  # score given to responses without EOS
    reward_clip: float = 10.0        # clip RM scores to [-reward_clip, reward_clip]
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    clip_eps: float = 0.2
    value_clip: float = 0.2
    vf_coef: float = 1.0
    entropy_coef: float = 0.0
    critic_warmup_steps: int = 0     # iterations that train only the critic
    eval_interval: int = 10
    eval_samples_logged: int = 3
    log_interval: int = 1
    save_interval: int = 0           # 0: save only at the end
    actor_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    critic_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    # Stage (or iter_*) directories of the inputs; default <run>/sft and <run>/rm.
    sft_from: str | None = None
    rm_from: str | None = None


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
    ppo: PPOConfig = field(default_factory=PPOConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["model.hidden_size=128", "seed=3"]` -> nested dict; values parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected key=value, e.g. model.hidden_size=128")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw) if raw != "" else "")
    return tree


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config: file not found: {path}")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
    data = _merge(data, parse_overrides(overrides or []))
    return from_dict(Config, data)


# ---------------------------------------------------------------- cross-field validation


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Check the rules that involve more than one field. Raises ConfigError naming the field."""
    m, p = cfg.model, cfg.parallel
    positive = {
        "model.num_layers": m.num_layers, "model.hidden_size": m.hidden_size,
        "model.num_attention_heads": m.num_attention_heads, "model.ffn_hidden_size": m.ffn_hidden_size,
        "model.vocab_size": m.vocab_size, "model.max_seq_length": m.max_seq_length,
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
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size}: not divisible by "
            f"model.num_attention_heads={m.num_attention_heads}"
        )
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
            f"multiple of parallel.tensor_parallel={tp} so the padded vocabulary splits evenly"
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
    if cfg.data.overflow not in OVERFLOW_POLICIES:
        raise ConfigError(f"data.overflow={cfg.data.overflow!r}: choose one of {OVERFLOW_POLICIES}")
    for name in ("sft", "rm"):
        _validate_stage(name, getattr(cfg, name), m, dp)
    for name in ("optimizer", "sft.optimizer", "rm.optimizer", "ppo.actor_optimizer", "ppo.critic_optimizer"):
        _validate_optimizer(name, _get_dotted(cfg, name))
    _validate_ppo(cfg.ppo, m, dp)
    if cfg.checkpoint.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={cfg.checkpoint.keep_last}: must be >= 1")
    if cfg.resilience.max_consecutive_nonfinite < 0:
        raise ConfigError(f"resilience.max_consecutive_nonfinite={cfg.resilience.max_consecutive_nonfinite}: "
                          "must be >= 0 (0 stops at the first non-finite step)")
    return cfg


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


def _validate_ppo(p: PPOConfig, m: ModelConfig, dp: int) -> None:
    for key in ("steps", "rollout_batch_size", "mini_batch_size", "micro_batch_size", "ppo_epochs",
                "max_new_tokens", "eval_interval", "log_interval"):
        if getattr(p, key) < 1:
            raise ConfigError(f"ppo.{key}={getattr(p, key)}: must be >= 1")
    if p.rollout_batch_size % p.mini_batch_size:
        raise ConfigError(f"ppo.rollout_batch_size={p.rollout_batch_size}: must be a multiple of "
                          f"ppo.mini_batch_size={p.mini_batch_size}")
    if p.mini_batch_size % (p.micro_batch_size * dp):
        raise ConfigError(f"ppo.mini_batch_size={p.mini_batch_size}: must be a multiple of "
                          f"ppo.micro_batch_size={p.micro_batch_size} x data-parallel size {dp}")
    if p.max_new_tokens > m.max_seq_length - 2:  # encode_prompts needs room for >= 2 prompt tokens
        raise ConfigError(f"ppo.max_new_tokens={p.max_new_tokens}: leaves no room for a prompt in "
                          f"model.max_seq_length={m.max_seq_length}; at most {m.max_seq_length - 2}")
    if p.temperature <= 0:
        raise ConfigError(f"ppo.temperature={p.temperature}: must be > 0")
    if not 0 < p.top_p <= 1 or p.top_k < 0:
        raise ConfigError(f"ppo.top_p={p.top_p}, ppo.top_k={p.top_k}: need 0 < top_p <= 1 and top_k >= 0")
    if p.top_k != 0 or p.top_p != 1.0:
        raise ConfigError(
            f"ppo.top_k={p.top_k}, ppo.top_p={p.top_p}: PPO computes every log-prob (rollout, old, new, "
            "reference) under the full softmax, so sampling from a top-k/top-p filtered distribution would "
            "make the rollout off-policy and bias the KL; set ppo.top_k=0 and ppo.top_p=1.0 (use "
            "ppo.temperature to sharpen or flatten sampling)")
    choices = {"kl_estimator": KL_ESTIMATORS, "kl_controller": KL_CONTROLLERS, "loss_aggregation": LOSS_AGGREGATIONS}
    for key, allowed in choices.items():
        if getattr(p, key) not in allowed:
            raise ConfigError(f"ppo.{key}={getattr(p, key)!r}: choose one of {allowed}")
    if not p.kl_in_reward and p.kl_estimator == "k1":
        raise ConfigError(
            "ppo.kl_estimator='k1' with ppo.kl_in_reward=false: in the loss the k1 estimator has zero "
            "expected gradient (E_pi[grad log pi] = 0), so it adds noise and no regularisation; set "
            "ppo.kl_estimator=k2 (gradient of KL(pi||ref)) or k3 (GRPO's convention, gradient of KL(ref||pi)), "
            "or keep k1 in the reward (ppo.kl_in_reward=true)")
    if p.kl_clip is not None and p.kl_clip <= 0:
        raise ConfigError(f"ppo.kl_clip={p.kl_clip}: must be > 0, or null for no bound")
    if p.kl_target <= 0 or p.kl_horizon <= 0:
        raise ConfigError(f"ppo.kl_target={p.kl_target}, ppo.kl_horizon={p.kl_horizon}: must be > 0")
    if not (0 <= p.gamma <= 1 and 0 <= p.lam <= 1):
        raise ConfigError(f"ppo.gamma={p.gamma}, ppo.lam={p.lam}: must be in [0, 1]")
    if p.clip_eps <= 0 or p.value_clip <= 0 or p.reward_clip <= 0:
        raise ConfigError("ppo.clip_eps, ppo.value_clip and ppo.reward_clip must be > 0")


def warnings_for(cfg: Config) -> list[str]:
    """Settings that run but are probably not what the user wants; stages log them at start-up."""
    notes = []
    p = cfg.ppo
    if p.kl_in_reward and p.kl_estimator in ("k2", "k3"):
        notes.append(
            f"ppo.kl_estimator={p.kl_estimator} with ppo.kl_in_reward=true: a reward cannot carry the gradient of "
            f"an estimator that depends on the policy, so the policy gradient of the KL penalty is biased; k1 is "
            f"the unbiased choice in the reward ({p.kl_estimator} belongs in the loss: ppo.kl_in_reward=false)")
    return notes
