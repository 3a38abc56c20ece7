"""One-rank worker for tests/test_lora_units.py (a bare `python` process: rank 0 of 1, gloo): the
vLLM refit of a LoRA actor (random B, so the adapters change every weight they sit on), one HF
tensor per bucket. At every bucket it measures the tensor memory the refit holds beyond the
model and that bucket (live tensors' storages, found by the garbage collector, that were not
there before); afterwards it refits the same actor with the adapters folded into its weights by
hand and switched off, which must send the same tensors bit for bit. Writes a JSON summary to
argv[1]; argv[2:]: config overrides (under torchrun, e.g. parallel.tensor_parallel=2: rank 0's
summary)."""

import gc
import json
import sys

import torch
from distributed import TINY_MODEL

from megatron_rlhf import parallel
from megatron_rlhf.config import load_config
from megatron_rlhf.models.gpt import build_model
from megatron_rlhf.models.lora import adapters_disabled, apply_lora, lora_layers
from megatron_rlhf.rollout.refit import RefitPlan, expected_hf_shapes, group_of, stream_hf_weights
from megatron_rlhf.trainers.runner import start_distributed

TARGETS = ["qkv", "proj", "fc1", "fc2", "output"]


def live_storages() -> dict[int, int]:
    """data pointer -> bytes of every storage a live tensor object uses."""
    storages = (o.untyped_storage() for o in gc.get_objects() if issubclass(type(o), torch.Tensor))
    return {s.data_ptr(): s.nbytes() for s in storages if s.nbytes()}


def refit(model, cfg, plan, measure: bool, held_at: dict | None = None):
    """({HF name: tensor}, the most bytes the refit held beyond the model and the bucket at a yield);
    `held_at`: filled with those bytes at each bucket, by the bucket's (one) tensor name."""
    before = live_storages() if measure else {}
    received, peak = {}, 0
    for bucket in stream_hf_weights(model, cfg.model, plan, bucket_bytes=1):
        if measure:
            ours = {t.untyped_storage().data_ptr() for t in [*bucket.values(), *received.values()]}
            held = sum(n for ptr, n in live_storages().items() if ptr not in before and ptr not in ours)
            peak = max(peak, held)
            if held_at is not None:
                held_at[next(iter(bucket))] = held
        received.update({name: t.clone() for name, t in bucket.items()})
    return received, peak


def main() -> None:
    cfg = load_config(None, [*TINY_MODEL, *sys.argv[2:]])
    start_distributed(cfg)
    model = build_model(cfg.model)
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=TARGETS, seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in lora_layers(model):
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * 0.1)
    plan = RefitPlan.build(model, cfg.model)
    lora, peak = refit(model, cfg, plan, measure=True)
    with adapters_disabled(model):
        base, _ = refit(model, cfg, plan, measure=False)
        with torch.no_grad():
            for layer in lora_layers(model):
                layer.weight += (layer.lora_B @ layer.lora_A) * layer.lora_scale
        folded, _ = refit(model, cfg, plan, measure=False)
    group_bytes: dict[int, int] = {}
    for name, shape in expected_hf_shapes(cfg.model).items():
        group_bytes[group_of(name)] = group_bytes.get(group_of(name), 0) + 4 * torch.Size(shape).numel()
    adapted = {f"{n}.weight" for n, m in model.named_modules() if m in lora_layers(model)}
    merged_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n in adapted)
    summary = {
        "peak_held_bytes": peak, "largest_group_bytes": max(group_bytes.values()), "all_merged_bytes": merged_bytes,
        "names_equal": sorted(lora) == sorted(folded) == sorted(base),
        "differ_from_folded": sorted(n for n in lora if not torch.equal(lora[n], folded[n])),
        "changed_by_adapters": sorted(n for n in lora if not torch.equal(lora[n], base[n])),
        "under_adapters": sorted(n for n in lora if "norm" not in n and "embed" not in n),
    }
    if torch.distributed.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(summary, f)
    parallel.destroy()


if __name__ == "__main__":
    main()
