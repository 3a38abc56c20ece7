"""Export of LoRA checkpoints (megatron_rlhf/models/lora.py): merged, or as a PEFT adapter.

A LoRA role's checkpoint holds only what it trained: `<layer>.lora_A` [rank, in] and
`<layer>.lora_B` [out, rank] (layer-stacked like the weights; B's rows in the fused QKV /
SwiGLU layouts of the weight they adapt), a critic's value head, and optimizer state. Its
common `extra` state names the checkpoint the frozen base weights came from (`lora_base`: a
full checkpoint, or another LoRA checkpoint, merged in turn) and the adapter shape (`lora`:
rank, alpha, targets).

- merged (export_hf calls `merged_view`): a checkpoint view whose adapted weights read as
  W + (alpha/rank) B A (float32, on the full tensors), everything else from the base except
  the weights the LoRA checkpoint holds itself (a critic's value head); export_hf then maps
  it as any checkpoint.
- export_peft_adapter: adapter_config.json + adapter_model.safetensors that `peft` loads
  onto the base model exported with export_hf; fused adapters are split like their weights
  (B's rows into q/k/v and gate/up, each part with the shared A); an LM-head adapter
  (target `output`) becomes lm_head's, its vocabulary padding dropped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megatron_rlhf.checkpoint.safe_load import restricted_dcp_unpickling
from megatron_rlhf.convert.checkpoint_roles import POLICY_ROLES, VALUE_ROLES, model_config_for, resolve_role_dir
from megatron_rlhf.convert.hf_config import ConvertError
from megatron_rlhf.convert.hf_weights import Dims, hf_layer
from megatron_rlhf.convert.safetensors_io import check_export_dir, written_atomically
from megatron_rlhf.convert.torch_dist_reader import TorchDistCheckpoint

_A, _B, _OPTIMIZER = ".lora_A", ".lora_B", "optimizer."
# LoRA target -> (checkpoint key of the adapted layer, HF modules of its parts)
TARGETS = {
    "qkv": ("self_attention.linear_qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "proj": ("self_attention.linear_proj", ("self_attn.o_proj",)),
    "fc1": ("mlp.linear_fc1", ("mlp.gate_proj", "mlp.up_proj")),
    "fc2": ("mlp.linear_fc2", ("mlp.down_proj",)),
}


def lora_info(ck: TorchDistCheckpoint) -> dict | None:
    """The checkpoint's common `extra` state if it is a LoRA adapter checkpoint, else None."""
    with restricted_dcp_unpickling(ck.path):
        extra = ck.common_state().get("extra", {}) or {}
    return extra if extra.get("lora") else None


def _scale(info: dict) -> float:
    return float(info["lora"]["alpha"]) / int(info["lora"]["rank"])


class MergedLoRACheckpoint(TorchDistCheckpoint):
    """A LoRA checkpoint read as the full model it trains: TorchDistCheckpoint's interface
    (what export_hf uses; its own lookups over `tensors`), tensors from the base checkpoint,
    adapted weights merged. Reads through the two checkpoints it holds, not a file of its own."""

    def __init__(self, adapters: TorchDistCheckpoint, info: dict, base_dir: str | os.PathLike | None = None):
        self.adapters, self.path, self.scale = adapters, adapters.path, _scale(info)
        given = base_dir is not None
        if not (base_dir := base_dir or info.get("lora_base")):
            raise ConvertError(f"{self.path}: a LoRA adapter checkpoint that records no base checkpoint "
                               "(lora_base); give it: export_hf(lora_base=...) / export-hf --lora-base DIR")
        base_dir = Path(base_dir)
        fix = ("restore the base checkpoint there (the adapters only apply to the weights they were trained "
               "on), or give its new location: export_hf(lora_base=...) / export-hf --lora-base DIR")
        if not (base_dir / ".metadata").is_file():
            what = "does not exist" if not base_dir.exists() else "is not a torch_dist checkpoint (no .metadata)"
            where = "the given lora_base" if given else "the base checkpoint it records for its frozen weights"
            raise ConvertError(f"{self.path}: a LoRA adapter checkpoint; {where}, {base_dir}, {what}: {fix}")
        try:
            with restricted_dcp_unpickling(base_dir):
                self.base = merged_view(TorchDistCheckpoint(base_dir))  # a LoRA base: itself merged
        except Exception as e:  # noqa: BLE001  (a damaged or foreign .metadata)
            raise ConvertError(f"{self.path}: its LoRA base checkpoint {base_dir} cannot be read ({e}): {fix}") from e
        # weight key -> (A key, B key); weights the adapter checkpoint holds itself (a value head)
        self.adapted: dict[str, tuple[str, str]] = {}
        for key in adapters.tensors:
            if key.endswith(_A) and not key.startswith(_OPTIMIZER):
                layer = key.removesuffix(_A)
                self.adapted[f"{layer}.weight"] = (key, layer + _B)
        self.own = {k for k in adapters.tensors if not k.startswith(_OPTIMIZER) and not k.endswith((_A, _B))}
        for weight, (a, b) in self.adapted.items():
            if b not in adapters:
                raise ConvertError(f"{self.path}: adapter {a} without its {b}")
            if weight not in self.base:
                raise ConvertError(f"{self.path}: adapter {a} adapts {weight}, which the base checkpoint {base_dir} "
                                   "does not hold: is it the full checkpoint these adapters were trained on?")
            w, sa, sb = self.base.shape(weight), adapters.shape(a), adapters.shape(b)
            if sa[:-2] != w[:-2] or sb[:-2] != w[:-2] or (sb[-2], sa[-1]) != w[-2:] or sb[-1] != sa[-2]:
                raise ConvertError(f"{self.path}: adapter shapes A {list(sa)}, B {list(sb)} do not fit {weight} "
                                   f"{list(w)} of the base checkpoint {base_dir}")
        if not self.adapted:
            raise ConvertError(f"{self.path}: a LoRA checkpoint without adapter tensors (*.lora_A)")
        self.tensors = {**self.base.tensors, **{k: adapters.tensors[k] for k in self.own}}  # key -> metadata

    def read_many(self, requests: dict[str, tuple[int, int] | None]) -> dict[str, torch.Tensor]:
        """As TorchDistCheckpoint.read_many; an adapted weight comes as float32 W + (alpha/rank) B A."""
        own = {k: span for k, span in requests.items() if k in self.own}
        for key, span in requests.items():
            if key in self.adapted:
                own.update(dict.fromkeys(self.adapted[key], span))
        got = self.adapters.read_many(own) if own else {}
        base = {k: span for k, span in requests.items() if k not in self.own}
        got.update(self.base.read_many(base) if base else {})
        for key in requests:
            if key in self.adapted:
                a, b = (got.pop(k).float() for k in self.adapted[key])
                got[key] = got[key].float() + self.scale * (b @ a)
        return got

    def common_state(self) -> dict:
        return self.adapters.common_state()


def merged_view(ck: TorchDistCheckpoint, lora_base: str | os.PathLike | None = None):
    """`ck` itself, or for a LoRA adapter checkpoint the merged full model (its base read from
    `lora_base`, default: the path the checkpoint recorded)."""
    info = lora_info(ck)
    if info is None:
        if lora_base is not None:
            raise ConvertError(f"{ck.path}: lora_base given, but this is not a LoRA adapter checkpoint")
        return ck
    return MergedLoRACheckpoint(ck, info, lora_base)


# ----------------------------------------------------------------------------- PEFT


def _adapter_shapes(d: Dims) -> dict[str, tuple[int, int]]:
    """target -> (rows of B, columns of A): the adapted weight's full [out, in]."""
    attn = d.heads * d.head_dim
    return {"qkv": ((d.heads + 2 * d.kv_heads) * d.head_dim, d.hidden), "proj": (d.hidden, attn),
            "fc1": (2 * d.ffn, d.hidden), "fc2": (d.hidden, d.ffn)}


def peft_tensors(ck: TorchDistCheckpoint, info: dict, d: Dims) -> tuple[dict[str, torch.Tensor], list[str]]:
    """PEFT's adapter tensors (base_model.model.model.layers.<i>.<module>.lora_{A,B}.weight)
    and target_modules, from the LoRA checkpoint's full (TP1-layout) adapters."""
    out: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    hd, qpg = d.head_dim, d.q_per_group
    for target in info["lora"]["targets"]:
        if target == "output":  # the LM head: B's rows are the padded vocabulary
            if "output_layer" + _A not in ck:
                raise ConvertError(f"{ck.path}: LoRA target 'output' but no output_layer{_A} in the checkpoint")
            got = ck.read_many({"output_layer" + _A: None, "output_layer" + _B: None})
            out["base_model.model.lm_head.lora_A.weight"] = got["output_layer" + _A].clone()
            out["base_model.model.lm_head.lora_B.weight"] = got["output_layer" + _B][: d.vocab].clone()
            modules.append("lm_head")
            continue
        if target not in TARGETS:
            raise ConvertError(f"{ck.path}: LoRA target {target!r} has no PEFT export (known: {list(TARGETS)})")
        layer_key, parts = TARGETS[target]
        modules += [p.split(".")[-1] for p in parts]
        for i in range(d.num_layers):
            stacked = f"decoder.layers.{layer_key}"
            if f"{stacked}{_A}" in ck:
                got = ck.read_many({f"{stacked}{_A}": (i, i + 1), f"{stacked}{_B}": (i, i + 1)})
                a, b = (got[f"{stacked}{s}"][0] for s in (_A, _B))
            elif f"decoder.layers.{i}.{layer_key}{_A}" in ck:
                per_layer = f"decoder.layers.{i}.{layer_key}"
                got = ck.read_many({per_layer + _A: None, per_layer + _B: None})
                a, b = got[per_layer + _A], got[per_layer + _B]
            else:
                raise ConvertError(f"{ck.path}: no adapter {stacked}{_A} (layer {i}) for LoRA target {target!r}")
            want = _adapter_shapes(d)[target]
            if (b.shape[0], a.shape[1]) != want:
                raise ConvertError(f"{ck.path}: {layer_key} adapters of layer {i} are B {list(b.shape)}, A "
                                   f"{list(a.shape)}: the model config gives {want[0]} output rows and {want[1]} "
                                   "input columns (pass the model_cfg of the run that wrote it)")
            if target == "qkv":  # rows grouped per query group: [q heads of g; k_g; v_g] (hf_weights.py)
                q, k, v = torch.split(b.reshape(d.kv_heads, (qpg + 2) * hd, -1), [qpg * hd, hd, hd], dim=1)
                bs = [t.reshape(-1, b.shape[-1]) for t in (q, k, v)]
            elif target == "fc1":  # [all gate rows; all up rows]
                bs = [b[: d.ffn], b[d.ffn:]]
            else:
                bs = [b]
            for part, b_part in zip(parts, bs):
                name = f"base_model.model.{hf_layer(i)}.{part}"
                out[f"{name}.lora_A.weight"] = a.clone()  # one file tensor each (safetensors)
                out[f"{name}.lora_B.weight"] = b_part.clone()
    return out, modules


def export_peft_adapter(checkpoint: str | os.PathLike, role: str, out_dir: str | os.PathLike, model_cfg=None,
                        base_model: str | os.PathLike | None = None) -> Path:
    """Write the adapters of a LoRA policy checkpoint as a PEFT LoRA adapter directory
    `out_dir` (adapter_config.json + adapter_model.safetensors) for the base model that
    export_hf writes from the checkpoint the adapters were trained on (its `lora_base`):
    PeftModel.from_pretrained(<that model>, out_dir). `base_model`: recorded as
    base_model_name_or_path (e.g. that export's directory). `checkpoint` and `model_cfg`
    as for export_hf. Fused adapters are split like their weights: QKV's B rows into
    q/k/v_proj and FC1's into gate/up_proj, each with the shared A; tensors keep the
    checkpoint's dtype. Policies (actor, reference) only: PEFT's LoRA on a value model
    would also need the value head, which export_hf of the merged model carries."""
    from safetensors.torch import save_file

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if role in VALUE_ROLES:
        raise ConvertError(f"role={role!r}: PEFT adapters are exported for policies {POLICY_ROLES}; export a value "
                           "model's LoRA checkpoint merged with export-hf (export_hf)")
    if role not in POLICY_ROLES:
        raise ConvertError(f"role={role!r}: choose one of {POLICY_ROLES}")
    check_export_dir(out_dir)
    role_dir, iter_dir = resolve_role_dir(checkpoint, role)
    m = model_config_for(model_cfg, iter_dir)
    with restricted_dcp_unpickling(role_dir):
        ck = TorchDistCheckpoint(role_dir)
    info = lora_info(ck)
    if info is None:
        raise ConvertError(f"{role_dir}: not a LoRA adapter checkpoint (its extra state has no 'lora'); "
                           "export full checkpoints with export-hf")
    tensors, modules = peft_tensors(ck, info, Dims.of(m))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(info["lora"]["rank"]),
        "lora_alpha": info["lora"]["alpha"], "target_modules": modules, "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True,
        "base_model_name_or_path": str(base_model) if base_model is not None else None,
    }
    with written_atomically(out_dir) as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
