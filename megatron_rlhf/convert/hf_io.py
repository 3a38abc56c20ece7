"""Hugging Face checkpoints in and out: load into a role, import to, and export from, our
megatron checkpoints.

- load_hf_weights(role, hf_dir): collective; every rank reads only the slices of its own
  TP x PP x EP shard from the HF safetensors.
- import_hf(cfg, hf_dir, out_dir): collective; a frozen role loaded from HF, saved as a
  stage-style checkpoint (CheckpointManager: iter_0000000/<role> + commit.json + latest)
  that loads at any TP x PP x EP (ppo.sft_from, rm.init_from, ppo.rm_from). It keeps the HF
  model's tokenizer (out_dir/tokenizer/), special-token ids and generation_config.json.
- export_hf(checkpoint, role, out_dir, ...): one process, no torch.distributed; reads our
  torch_dist checkpoint (any layout) one layer at a time and writes an HF directory,
  complete: the model config and tokenizer recorded with the checkpoint
  (hf_config.RECORDED_TOKENIZER: in its run directory, or an import's own) give config.json's
  bos/eos/pad ids and the tokenizer files; generation_config.json is the HF model's own (kept
  by import_hf, or recorded by a run started from model.init_from_hf) with those ids, never the
  run's rollout sampling settings (sampling.json, only checked); an import's original ids come
  back as they were.

Value models (reward model, critic) are <Family>ForSequenceClassification with num_labels=1:
HF's `score` is a bias-free [1, hidden] projection read at the last non-pad token, our
value head is the same projection plus a bias. On export the reward model's stored
normalisation (mean, std) is folded in (score = w / std) so HF scores equal our RewardModel's
rewards; an effective bias (b - mean) / std that is not zero cannot be represented, so
export refuses unless `drop_score_bias=True`, which exports scores shifted by that constant
(pairwise preferences and rankings are unchanged) and records it in config.json under
"megatron_rlhf_export.score_offset".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from megatron_rlhf.checkpoint.safe_load import load_pt, restricted_dcp_unpickling
from megatron_rlhf.convert.hf_config import (
    RECORDED_GENERATION_CONFIG, RECORDED_SAMPLING, RECORDED_TOKENIZER, ConvertError, check_model_matches_hf,
    hf_config_dict, read_hf_config, read_recorded_generation_config, read_recorded_sampling,
)
from megatron_rlhf.convert.checkpoint_roles import POLICY_ROLES, VALUE_ROLES, model_config_for, resolve_role_dir
from megatron_rlhf.convert.hf_moe_weights import ExpertRanks, check_checkpoint_experts, fused_experts_hint
from megatron_rlhf.convert.hf_weights import (
    CKPT_LAYER_KEYS, Dims, hf_expected_shapes, hf_layer_tensors, layer_kinds, shard_for_param,
)
from megatron_rlhf.convert.lora_export import MergedLoRACheckpoint, merged_view
from megatron_rlhf.convert.safetensors_io import (
    HFWeights, check_export_dir, group_bytes, write_shards, written_atomically,
)
from megatron_rlhf.convert.torch_dist_reader import TorchDistCheckpoint
from megatron_rlhf.data.tokenizers import TOKENIZER_FILES, read_tokenizer_record

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' classic max_shard_size="5GB"
SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# HF tensors that carry no weights of ours (old checkpoints saved the RoPE buffer).
_IGNORED_HF = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------- import


def _check_hf_tensors(weights: HFWeights, expected: dict[str, tuple[int, ...]], optional: set[str]) -> None:
    for name, shape in expected.items():
        if name not in weights:
            raise ConvertError(f"{weights.dir}: tensor {name!r} is missing (expected shape {list(shape)})"
                               + fused_experts_hint(weights.files))
        if weights.shape(name) != shape:
            raise ConvertError(f"{weights.dir}: tensor {name!r} has shape {list(weights.shape(name))}, "
                               f"expected {list(shape)} from config.json")
    extra = [n for n in weights.files if n not in expected and n not in optional and not n.endswith(_IGNORED_HF)]
    if extra:
        raise ConvertError(f"{weights.dir}: unexpected tensors {extra[:5]}{' ...' if len(extra) > 5 else ''}: "
                           "tensors that config.json's model_type does not have (extra biases or norms?); such "
                           "models do not convert")


def _load_shards(role, hf_dir: Path) -> None:
    from megatron.core import parallel_state as ps

    hf = read_hf_config(hf_dir)
    check_model_matches_hf(role.model_config, hf_dir)
    value_model = bool(getattr(role, "value_head", False))
    if hf.is_value_model and not value_model:
        raise ConvertError(f"{hf_dir}/config.json: architectures=[{hf.architecture!r}] is a reward/value model "
                           f"(score head, no lm_head): load it into a RewardModel or Critic, not a "
                           f"{type(role).__name__}")
    d = Dims.of(role.model_config)
    if value_model:
        d = dataclasses.replace(d, tied=False)  # GPTValueModel never ties its (value) head
    weights = HFWeights(hf_dir)
    expected = hf_expected_shapes(Dims.of(role.model_config), value_model=hf.is_value_model)
    _check_hf_tensors(weights, expected, optional={"lm_head.weight"})
    module = role.module
    layers = module.decoder.layers

    def global_layer(i: int) -> int:
        return layers[i].layer_number - 1

    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    experts = ExpertRanks.current() if d.moe is not None else ExpertRanks()
    with torch.no_grad():
        for name, param in module.state_dict(keep_vars=True).items():
            if name.endswith("_extra_state"):
                continue
            shard = shard_for_param(name, weights.read, d, tp_rank, tp_size, global_layer, value_model,
                                    hf.is_value_model, param.dtype, experts)
            if shard is None:
                continue
            if tuple(shard.shape) != tuple(param.shape):
                raise ConvertError(f"{name}: the HF tensors give this rank a {list(shard.shape)} shard, the "
                                   f"model has {list(param.shape)} (model config out of sync with the model?)")
            param.data.copy_(shard)  # copy_ casts to the parameter's dtype


def load_hf_weights(role, hf_dir: str | os.PathLike) -> None:
    """Collective. Fill this rank's TP x PP x EP shard of `role.module` from the HF model at
    `hf_dir` (reading only this rank's slices). Value models (Critic, RewardModel) get
    everything but the value head, which is loaded (bias 0) only from a
    *ForSequenceClassification checkpoint's `score.weight`. A trainable role's optimizer
    copies the new weights into its main params. An error on any rank raises on all."""
    from megatron_rlhf.parallel.collectives import errors_agreed

    with errors_agreed(lambda: ConvertError(f"loading {hf_dir} failed on another rank (see its error)")):
        _load_shards(role, Path(hf_dir))
    if getattr(role, "optimizer", None) is not None:
        role.optimizer.reload_model_params()


def _build_role(model_cfg, role: str):
    """A frozen `role` of the model section `model_cfg`."""
    from megatron_rlhf.models.roles import Actor, Critic, Reference, RewardModel

    return {"actor": lambda: Actor(model_cfg, trainable=False), "reference": lambda: Reference(model_cfg),
            "reward": lambda: RewardModel(model_cfg), "critic": lambda: Critic(model_cfg, trainable=False)}[role]()


def _record_hf_tokenizer(hf_dir: Path, out_dir: Path) -> None:
    from megatron_rlhf.data.tokenizers import HFTokenizer, TokenizerError, record_tokenizer

    try:
        tokenizer = HFTokenizer(hf_dir)
    except TokenizerError as e:
        log.warning(f"{out_dir}: no tokenizer recorded with the import ({e}); export-hf of it needs --tokenizer DIR")
        return
    record_tokenizer(tokenizer, str(hf_dir), None, out_dir / RECORDED_TOKENIZER)


def import_hf(cfg, hf_dir: str | os.PathLike, out_dir: str | os.PathLike, role: str | None = None) -> Path:
    """Collective. The HF model at `hf_dir` as our checkpoint under `out_dir` (a new stage
    directory): out_dir/iter_0000000/<role> + commit.json + latest, loadable at any TP x PP x EP.
    `role` defaults to "actor" for *ForCausalLM and "reward" for *ForSequenceClassification
    (so `ppo.sft_from`, `rm.init_from` and `ppo.rm_from` can point at out_dir). Its
    tokenizer is recorded in out_dir/tokenizer/, config.json's bos/eos/pad ids and
    generation_config.json in the trainer state (export_hf writes them back). Starts
    torch.distributed / megatron for `cfg` itself if the caller has not. Returns the
    iter_0000000 directory."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rlhf import parallel
    from megatron_rlhf.checkpoint.manager import CheckpointManager
    from megatron_rlhf.checkpoint.validate import LATEST, checkpoint_dirs
    from megatron_rlhf.config import validate

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    hf = read_hf_config(hf_dir)
    role = role or ("reward" if hf.is_value_model else "actor")
    if role not in VALUE_ROLES + POLICY_ROLES:
        raise ConvertError(f"role={role!r}: choose one of {POLICY_ROLES + VALUE_ROLES}")
    if (role in VALUE_ROLES) != hf.is_value_model:
        if role in VALUE_ROLES:
            why = ("a *ForSequenceClassification (num_labels=1) model; to start a reward model from a "
                   "policy, import it as the actor and point rm.init_from at out_dir")
        else:
            why = "a *ForCausalLM model; import this reward/value model as role 'reward' or 'critic'"
        raise ConvertError(f"{hf_dir}/config.json: architectures=[{hf.architecture!r}]: role {role!r} needs {why}")
    check_model_matches_hf(cfg.model, hf_dir)
    done, unfinished = checkpoint_dirs(out_dir)
    if done or unfinished or (out_dir / LATEST).exists():
        raise ConvertError(f"{out_dir}: already holds checkpoints; import into a new directory")
    started = not parallel_state.model_parallel_is_initialized()
    if started:  # validated for this launch first: a config error before any process group
        validate(cfg, world_size=parallel.read_dist_env().world_size)
        parallel.initialize(cfg.parallel, cfg.seed)
    try:
        model = _build_role(cfg.model, role)
        load_hf_weights(model, hf_dir)
        generation = hf_dir / "generation_config.json"
        state = {"step": 0, "imported_from": str(hf_dir), "hf_architecture": hf.architecture,
                 "model_config": dataclasses.asdict(cfg.model),
                 "hf_token_ids": {key: getattr(hf, key) for key in SPECIAL_TOKEN_IDS},
                 "hf_generation_config": json.loads(generation.read_text()) if generation.is_file() else {}}
        saved = CheckpointManager(out_dir).save(0, {role: model}, state)
        if dist.get_rank() == 0:
            _record_hf_tokenizer(hf_dir, out_dir)
        return saved
    finally:
        if started:
            parallel.destroy()


# ----------------------------------------------------------------------------- export


def checkpoint_model_config(checkpoint: str | os.PathLike, role: str, overrides=None, keys: set[str] = frozenset()):
    """The ModelConfig role `role` of `checkpoint` recorded (None: it records none). The
    architecture fields named in `keys` (dotted model.* override keys) must agree with it in
    `overrides` (a ModelConfig); a ConvertError lists every one that does not."""
    from megatron_rlhf.config import ARCHITECTURE_FIELDS

    from megatron_rlhf.checkpoint.validate import recorded_model_config

    _, iter_dir = resolve_role_dir(Path(checkpoint), role)
    if (recorded := recorded_model_config(iter_dir)) is None:
        return None
    fields = [f for f in ARCHITECTURE_FIELDS if any(k == f"model.{f}" or k.startswith(f"model.{f}.") for k in keys)]
    if lines := [f"model.{f}={getattr(overrides, f)!r}: the checkpoint recorded {getattr(recorded, f)!r}"
                 for f in fields if getattr(overrides, f) != getattr(recorded, f)]:
        raise ConvertError(f"{checkpoint}: the overrides differ from the model config the checkpoint recorded:\n  "
                           + "\n  ".join(lines) + "\n(export-hf needs no model.* overrides for it)")
    return recorded


class _Layers:
    """Full tensors of one layer, from layer-stacked keys (decoder.layers.<name> [L, ...]) or
    per-layer keys (decoder.layers.<i>.<name>, megatron's non-homogeneous format: models with experts)."""

    def __init__(self, ck: TorchDistCheckpoint, d: Dims):
        self.ck = ck
        self.kinds = [layer_kinds(d, i) for i in range(d.num_layers)]  # _check_checkpoint: they are there

    def key(self, kind: str, layer: int) -> tuple[str, tuple[int, int] | None]:
        for name in self.kinds[layer][kind]:
            if f"decoder.layers.{name}" in self.ck:
                return f"decoder.layers.{name}", (layer, layer + 1)
            if f"decoder.layers.{layer}.{name}" in self.ck:
                return f"decoder.layers.{layer}.{name}", None
        raise ConvertError(f"{self.ck.path}: no tensor for decoder.layers.{self.kinds[layer][kind][0]} "
                           f"(layer {layer}) in the checkpoint")

    def shape(self, kind: str, layer: int) -> tuple[int, ...]:
        key, span = self.key(kind, layer)
        return self.ck.shape(key)[1:] if span else self.ck.shape(key)

    def read(self, layer: int) -> dict[str, torch.Tensor]:
        keys = {kind: self.key(kind, layer) for kind in self.kinds[layer]}
        got = self.ck.read_many(dict(keys.values()))
        return {kind: got[key][0] if span else got[key] for kind, (key, span) in keys.items()}


def _check_checkpoint(ck: TorchDistCheckpoint, layers: _Layers, d: Dims, value_model: bool) -> None:
    """The checkpoint's shapes against model_cfg, naming the model.* field that is off."""
    emb, fix = "embedding.word_embeddings.weight", "give `export-hf --config <the run's recipe>` (or model.* overrides)"
    if emb not in ck:
        raise ConvertError(f"{ck.path}: no {emb} (a checkpoint of a GPT model of ours?)")
    rows, hidden = ck.shape(emb)
    if hidden != d.hidden:
        raise ConvertError(f"{ck.path}: hidden size {hidden}, but model.hidden_size={d.hidden}; {fix}")
    if rows != d.padded_vocab:
        raise ConvertError(f"{ck.path}: {rows} embedding rows, but model.vocab_size={d.vocab} padded to "
                           f"model.make_vocab_size_divisible_by gives {d.padded_vocab}; {fix}")
    key, span = layers.key("qkv", 0)
    stored = ck.shape(key)[0] if span else sum(
        1 for k in ck.tensors if k.startswith("decoder.layers.") and k.endswith(CKPT_LAYER_KEYS["qkv"][0]))
    if stored != d.num_layers:
        raise ConvertError(f"{ck.path}: {stored} layers, but model.num_layers={d.num_layers}; {fix}")
    check_checkpoint_experts(ck.path, ck.tensors, layers.shape, d.family, d.num_layers, d.hidden, d.moe)
    dense = [i for i in range(d.num_layers) if not d.has_experts(i)]
    checks = {"qkv": (0, (d.heads + 2 * d.kv_heads) * d.head_dim, "model.num_attention_heads / model.num_query_groups "
                      "/ model.head_dim"), **({"fc1": (dense[0], 2 * d.ffn, "model.ffn_hidden_size")} if dense else {})}
    for kind, (layer, want, field) in checks.items():
        key, _ = layers.key(kind, layer)
        if (got := layers.shape(kind, layer)[0]) != want:
            raise ConvertError(f"{ck.path}: {key} has {got} rows, {field} give {want}; {fix}")
    for kind, (keys, field, wanted) in {"qkv_bias": (("linear_qkv.bias",), "model.qkv_bias", d.qkv_bias),
                                        "qk_norm": (("q_layernorm.weight",), "model.qk_layernorm", d.qk_norm)}.items():
        present = any(k.startswith("decoder.layers.") and k.endswith(keys) for k in ck.tensors)
        if present != wanted:
            raise ConvertError(f"{ck.path}: the checkpoint {'has' if present else 'has no'} {kind.replace('_', ' ')} "
                               f"tensors, but {field}={wanted} (model.family={d.family!r}); {fix}")
    head = ck.shape("output_layer.weight") if "output_layer.weight" in ck else None
    is_value = head is not None and head[0] == 1 and "output_layer.bias" in ck
    if is_value != value_model:
        what = "a value model (scalar head)" if is_value else "a policy (vocabulary head)"
        raise ConvertError(f"{ck.path}: this checkpoint is {what}; choose the role accordingly "
                           f"(policies: {POLICY_ROLES}, value models: {VALUE_ROLES})")


def _recorded_with_checkpoint(iter_dir: Path | None) -> tuple[Path | None, dict[str, Any], dict[str, Any]]:
    """(tokenizer directory, sampling settings, trainer state) recorded with the checkpoint at
    `iter_dir`: the first two by import_hf next to it (in its stage directory), or by the
    stages of its run in the run directory. The state's "hf_generation_config" is the HF
    model's generation config: import_hf's own, else the one the run recorded
    (RECORDED_GENERATION_CONFIG), else absent."""
    if iter_dir is None:
        return None, {}, {}
    tokenizer, sampling, generation = None, {}, None
    for where in (iter_dir.parent, iter_dir.parent.parent):
        if tokenizer is None and read_tokenizer_record(where / RECORDED_TOKENIZER) is not None:
            tokenizer = where / RECORDED_TOKENIZER
        if not sampling and (where / RECORDED_SAMPLING).exists():
            sampling = read_recorded_sampling(where / RECORDED_SAMPLING)
        if generation is None and (where / RECORDED_GENERATION_CONFIG).exists():
            generation = read_recorded_generation_config(where / RECORDED_GENERATION_CONFIG)
    state_file = iter_dir / "trainer_state" / "rank_00000.pt"
    state = load_pt(state_file) if state_file.is_file() else {}
    if not state.get("hf_generation_config") and generation is not None:
        state = {**state, "hf_generation_config": generation}
    return tokenizer, sampling, state


def _token_ids(tokenizer_dir: Path | None, vocab_size: int) -> dict[str, int | None]:
    """bos/eos/pad ids named by a tokenizer directory's config files (best effort)."""
    if tokenizer_dir is None:
        return {}
    if not tokenizer_dir.is_dir():
        raise ConvertError(f"tokenizer directory not found: {tokenizer_dir}")
    names: dict[str, str] = {}
    for file in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        path = tokenizer_dir / file
        if path.is_file():
            try:
                data = json.loads(path.read_text())
            except ValueError as e:
                raise ConvertError(f"{path}: not valid JSON ({e})") from None
            for key in ("bos_token", "eos_token", "pad_token"):
                value = data.get(key)
                value = value.get("content") if isinstance(value, dict) else value
                if isinstance(value, str) and value:
                    names[key] = value
    ids: dict[str, int | None] = {}
    if (tokenizer_dir / "tokenizer.json").is_file():
        import tokenizers

        tok = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        size = tok.get_vocab_size(with_added_tokens=True)
        if size > vocab_size:
            raise ConvertError(f"{tokenizer_dir}/tokenizer.json has {size} tokens, more than model.vocab_size="
                               f"{vocab_size}: not the tokenizer this model was trained with")
        for key, token in names.items():
            ids[key.replace("_token", "_token_id")] = tok.token_to_id(token)
    return ids


def _value_head(ck: TorchDistCheckpoint, role: str, drop_bias: bool) -> tuple[torch.Tensor, dict[str, Any]]:
    """score.weight (float32) and what was folded or dropped."""
    w = ck.read("output_layer.weight").float()
    b = float(ck.read("output_layer.bias").float()[0])
    with restricted_dcp_unpickling(ck.path):
        extra = ck.common_state().get("extra", {}) or {}
    mean, std = float(extra.get("reward_mean", 0.0)), float(extra.get("reward_std", 1.0))
    info: dict[str, Any] = {"role": role}
    if (mean, std) != (0.0, 1.0):
        info.update(reward_mean=mean, reward_std=std)
        w = w / std
    offset = (b - mean) / std
    if offset != 0.0:
        if not drop_bias:
            normalised = (f", minus the stored reward_mean {mean:.6g}, over reward_std {std:.6g}"
                          if (mean, std) != (0.0, 1.0) else "")
            raise ConvertError(
                f"{ck.path}: output_layer.bias (value-head bias {b:.6g}{normalised}"
                f") gives scores a constant offset {offset:.6g}, which *ForSequenceClassification cannot "
                "hold (its score has no bias); export with --drop-score-bias (export_hf(drop_score_bias=True)) "
                "to write scores shifted by "
                f"{-offset:.6g} (rankings and pairwise preferences unchanged; the offset is recorded in "
                "config.json as megatron_rlhf_export.score_offset)")
        info["score_offset"] = offset
        log.warning(f"{ck.path}: value-head offset {offset:.6g} dropped: exported scores = ours - ({offset:.6g})")
    return w, info


def export_hf(checkpoint: str | os.PathLike, role: str, out_dir: str | os.PathLike, model_cfg=None,
              tokenizer_dir: str | os.PathLike | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              dtype: str | None = None, drop_score_bias: bool = False,
              special_token_ids: dict[str, int] | None = None, lora_base: str | os.PathLike | None = None) -> Path:
    """Write role `role` of our checkpoint as a Hugging Face model directory `out_dir`.

    `checkpoint`: a stage directory (its latest complete checkpoint), an iter_* directory or
    a role directory; saved at any TP x PP x EP x DP. One process, no torch.distributed; reads one
    layer at a time. `model_cfg`: the ModelConfig (or its dict) of the run; optional for
    checkpoints that record it (every stage and import_hf write it). Policies (actor,
    reference) become <model.family>ForCausalLM, value models (reward, critic)
    <model.family>ForSequenceClassification with num_labels=1 (see the module docstring
    for the value-head bias and drop_score_bias).
    Vocabulary padding rows are dropped. `dtype` ("float32", "bfloat16", "float16"):
    default the checkpoint's. The tokenizer (`tokenizer_dir`, default: the one its run or
    import recorded) is copied and its bos/eos/pad ids written to
    config.json and generation_config.json: the HF model's own generation config (import_hf's,
    or the one a run from model.init_from_hf recorded; none: the ids alone), not the run's
    rollout sampling settings, which stay in <run>/sampling.json; an
    import's original ids win over the tokenizer's, `special_token_ids` ({"eos_token_id": 1,
    "pad_token_id": 0, ...}) over both. A policy without an eos id is exported with a warning.
    Weights go to safetensors shards of at most max_shard_bytes (model.safetensors when one
    suffices, else model-0000X-of-0000N.safetensors + model.safetensors.index.json).
    `out_dir` must not exist or be empty; it appears complete or not at all.
    A LoRA adapter checkpoint (models/lora.py) is exported merged: its base weights from the
    full checkpoint it records (`lora_base` overrides that path), each adapted weight
    W + (alpha/rank) B A (convert/lora_export.py); a critic's value head is its own."""
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if role not in POLICY_ROLES + VALUE_ROLES:
        raise ConvertError(f"role={role!r}: choose one of {POLICY_ROLES + VALUE_ROLES}")
    check_export_dir(out_dir)
    role_dir, iter_dir = resolve_role_dir(checkpoint, role)
    m = model_config_for(model_cfg, iter_dir)
    # what the run recorded, checked before any weight is read (hf_config.read_recorded_sampling:
    # sampling.json is checked, not exported)
    recorded_tokenizer, _, state = _recorded_with_checkpoint(iter_dir)
    with restricted_dcp_unpickling(role_dir):
        ck = merged_view(TorchDistCheckpoint(role_dir), lora_base)
    value_model = role in VALUE_ROLES
    tied = not value_model and "output_layer.weight" not in ck  # megatron stores a tied head once
    d = dataclasses.replace(Dims.of(m), tied=tied)
    layers = _Layers(ck, d)
    _check_checkpoint(ck, layers, d, value_model)
    out_dtype = ck.dtype("embedding.word_embeddings.weight") if dtype is None else getattr(torch, dtype, None)
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConvertError(f"dtype={dtype!r}: choose float32, bfloat16 or float16")
    dtype_name = str(out_dtype).removeprefix("torch.")

    export_info: dict[str, Any] = {"source": str(role_dir), "role": role}
    if isinstance(ck, MergedLoRACheckpoint):
        export_info["lora_merged_onto"] = str(ck.base.path)
    score = None
    if value_model:
        score, info = _value_head(ck, role, drop_score_bias)
        export_info.update(info)
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else recorded_tokenizer
    token_ids = _token_ids(tokenizer_dir, d.vocab)
    token_ids.update({k: v for k, v in (state.get("hf_token_ids") or {}).items() if v is not None})
    token_ids.update(special_token_ids or {})

    shapes = hf_expected_shapes(d, value_model)
    element = torch.empty((), dtype=out_dtype).element_size()
    groups = [("embed", group_bytes([shapes["model.embed_tokens.weight"]], element))]
    per_layer: list[list[tuple[int, ...]]] = [[] for _ in range(d.num_layers)]
    for name, shape in shapes.items():
        if name.startswith("model.layers."):
            per_layer[int(name.split(".")[2])].append(shape)
    groups += [(f"layer.{i}", group_bytes(s, element)) for i, s in enumerate(per_layer)]
    groups.append(("final", group_bytes([s for n, s in shapes.items() if n in ("model.norm.weight", "lm_head.weight",
                                                                                 "score.weight")], element)))

    def make_group(group: str) -> dict[str, torch.Tensor]:
        if group == "embed":
            out = {"model.embed_tokens.weight": ck.read("embedding.word_embeddings.weight")[: d.vocab]}
        elif group.startswith("layer."):
            layer = int(group.split(".")[1])
            got = layers.read(layer)
            out = hf_layer_tensors(layer, got.__getitem__, d)
        else:
            out = {"model.norm.weight": ck.read("decoder.final_layernorm.weight")}
            if value_model:
                out["score.weight"] = score
            elif not tied:
                out["lm_head.weight"] = ck.read("output_layer.weight")[: d.vocab]
        for name, t in out.items():
            if tuple(t.shape) != shapes[name]:
                raise ConvertError(f"{ck.path}: {name} came out {list(t.shape)}, expected {list(shapes[name])}")
        return {name: t.to(out_dtype) for name, t in out.items()}

    with written_atomically(out_dir) as tmp:
        write_shards(tmp, groups, make_group, max_shard_bytes)
        config = hf_config_dict(m, value_model, dtype_name, token_ids, extra={"megatron_rlhf_export": export_info})
        config["tie_word_embeddings"] = tied
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        # the HF model's own generation config (none: a minimal one, the ids alone); the run's
        # rollout settings (sampling.json: max_new_tokens, temperature, ...) are not the model's
        gen = {**(state.get("hf_generation_config") or {}), **{k: v for k, v in token_ids.items() if v is not None}}
        if not value_model and gen:
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if not value_model and gen.get("eos_token_id") is None:
            why = (f"{tokenizer_dir} names no eos token" if tokenizer_dir is not None else
                   f"{checkpoint} records no tokenizer (written before runs recorded theirs) and none was given")
            log.warning(f"{out_dir}: no eos_token_id ({why}): generation with the exported model never stops at the "
                        "end of a response; export with --tokenizer DIR (export_hf(tokenizer_dir=...)) or "
                        "special_token_ids={'eos_token_id': ...}")
        if tokenizer_dir is not None:
            copied = [f for f in TOKENIZER_FILES if (Path(tokenizer_dir) / f).is_file()]
            if not {"tokenizer.json", "tokenizer.model"} & set(copied):
                raise ConvertError(f"{tokenizer_dir}: no tokenizer.json or tokenizer.model to copy")
            for f in copied:
                shutil.copy2(Path(tokenizer_dir) / f, tmp / f)
        if value_model and config.get("pad_token_id") is not None and config["pad_token_id"] == config.get("eos_token_id"):
            log.warning(f"{out_dir}: pad_token_id = eos_token_id = {config['pad_token_id']}: transformers' sequence "
                        "classification reads the score at the last token that is not the pad id: the token before "
                        "a final EOS, one earlier than our reward model; for scores equal to ours export with "
                        "special_token_ids={'pad_token_id': <any id that is not EOS>}")
        if value_model and config.get("pad_token_id") is None:
            log.warning(f"{out_dir}: no pad_token_id (pass tokenizer_dir or special_token_ids): transformers' "
                        "sequence classification then reads the last position, so only unpadded batches score right")
    return out_dir
