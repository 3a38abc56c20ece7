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


class ConfigError(ValueError):
    """A bad configuration value; the message names the field and the fix."""


DTYPES = ("float32", "bfloat16", "float16")


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


@dataclass
class Config:
    seed: int = 1234
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)

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
    return cls(**kwargs)


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
    return cfg
