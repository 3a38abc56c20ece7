"""The long-context code paths where they can only run on GPUs (`make gpu-check` runs this):

1. `split`: Transformer Engine's thd_get_partitioned_indices (the CUDA kernel megatron's THD
   context-parallel split calls) equals parallel.context.partitioned_index, the torch split the
   CPU tests use, for several packings at CP 2 and 4 and every rank.
2. `packed`: the actor's log-probs, entropy and gradients with each microbatch's rows packed into
   one THD row (rl.packing) through TE's attention equal those of the rows apart, in chunks of
   the output layer (model.logits_chunk_tokens) and without.
3. `cp` (world size 2, i.e. 2 GPUs, under torchrun): the same at parallel.context_parallel=2
   (TE's context-parallel attention, packed and not) against DP2 with the same weights.
4. `turns`: multi-turn continuation from the in-place engine's turn cache (rows grown by
   observations, fed as one chunk after the cached keys through TE's attention with the causal
   mask aligned bottom right: models/attention.py te_chunked_inference_attention): the log-probs
   the engine sampled with against the actor's recomputed ones, over three turns.

Each process writes nothing but rank 0's JSON (--out); a missing GPU count or TE says why in it.
`python benchmarks/long_context_check.py --out X.json` (1 GPU: parts 1 and 2);
`torchrun --nproc-per-node 2 benchmarks/long_context_check.py --out X.json` (part 3 too).
On CPU (`--cpu`, for the tests) part 1 is skipped (no TE) and part 2 runs through the SDPA attention.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

import megatron_rlhf  # noqa: F401  (first: it adapts megatron-core before its import)

MODEL = ["model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=4", "model.num_query_groups=2",
         "model.ffn_hidden_size=256", "model.vocab_size=1000", "model.max_seq_length=256", "seed=3"]
LENGTHS = [200, 37, 120, 64, 9, 150]  # unequal, some not multiples of 2 x CP
PACKINGS = [[0, 64], [0, 8, 24, 64], [0, 16, 20, 48, 64, 100, 128]]
# bfloat16 on GPU: TE's THD and context-parallel attention run in its flash/fused kernels (16-bit)
DTYPE = "bfloat16"
# What counts as equal (make gpu-check fails otherwise): bfloat16 weights and activations round
# at ~4e-3 relative, so a packed or CP run differs from its reference by ~1e-2 in a log-prob;
# a wrong mask or split moves log-probs by whole nats and gradients by tens of percents.
TOLERANCE = {"bfloat16": {"logprobs": 0.1, "grad_rel": 0.05}, "float32": {"logprobs": 1e-4, "grad_rel": 1e-4}}


def split_check() -> dict:
    """Part 1: TE's THD split against ours, on the device."""
    try:
        import transformer_engine_torch as tex
    except Exception as e:  # noqa: BLE001  (no TE, or its CUDA libraries missing)
        return {"skipped": f"transformer_engine_torch does not import ({type(e).__name__}: {e})"}
    from megatron_rlhf.parallel.context import partitioned_index

    cases = []
    for cp in (2, 4):
        for packing in PACKINGS:
            if any((b - a) % (2 * cp) for a, b in zip(packing, packing[1:])):
                continue
            cu = torch.tensor(packing, dtype=torch.int32, device="cuda")
            for rank in range(cp):
                theirs = tex.thd_get_partitioned_indices(cu, packing[-1], cp, rank)
                ours = partitioned_index(cu, packing[-1], cp, rank)
                cases.append({"cp": cp, "cu_seqlens": packing, "rank": rank,
                              "equal": bool(torch.equal(theirs.long().cpu(), ours.long().cpu()))})
    return {"cases": len(cases), "all_equal": all(c["equal"] for c in cases),
            "differ": [c for c in cases if not c["equal"]]}


def make_batch(device) -> dict:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor(LENGTHS)
    width = max(LENGTHS)
    tokens = torch.randint(2, 1000, (len(LENGTHS), width), generator=g)
    positions = torch.arange(width)
    tokens = tokens.masked_fill(positions >= lengths[:, None], 0)
    mask = ((positions >= 4) & (positions < lengths[:, None] - 1)).float()
    return {k: v.to(device) for k, v in {"tokens": tokens, "lengths": lengths, "loss_mask": mask}.items()}


def role_outputs(actor, batch, packed: bool) -> dict:
    """Log-probs, entropy, the SFT loss and the flat gradient of `actor` on `batch`."""
    from megatron_rlhf.trainers.sft import sft_loss

    actor.packing = packed
    out = actor.forward(batch, micro_batch_size=2, token_budget=256)
    loss = actor.gradients(batch, 2, sft_loss, token_budget=256)["loss"]
    grad = torch.cat([p.main_grad.detach().flatten().float() for p in actor.module.parameters()])
    actor.packing = False
    return {"logprobs": out["logprobs"], "entropy": out["entropy"], "loss": loss, "grad": grad}


def turn_cache_outputs(actor, model) -> dict:
    """Part 4: three turns of four rows from the engine's turn cache, each row grown by an
    "observation" of its own length between turns; the largest |engine log-prob - recomputed|
    over the sampled tokens (a chunk that saw later keys, or missed cached ones, is off by nats)."""
    from megatron_rlhf.rollout import MegatronRolloutEngine, SamplingParams

    engine = MegatronRolloutEngine(model, actor, eos_id=1, pad_id=0)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16)
    cache = engine.turn_cache(model.max_seq_length)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(2, 1000, (n,), generator=g).tolist() for n in (12, 30, 7, 21)]
    keys, worst = list(range(len(rows))), 0.0
    for turn in range(3):
        out = engine.generate(rows, sampling, seed=turn, cache=cache, keys=keys)
        recomputed = actor.forward({"tokens": out.tokens, "lengths": out.lengths}, micro_batch_size=2)["logprobs"]
        worst = max(worst, ((out.logprobs - recomputed) * out.response_mask()).abs().max().item())
        rows = [out.tokens[i, :n].tolist() + torch.randint(2, 1000, (5 + 3 * i,), generator=g).tolist()
                for i, n in enumerate(out.lengths.tolist())]
    return {"logprobs": worst, "reused_tokens": cache.reused_tokens}


def differences(got: dict, want: dict) -> dict:
    scale = want["grad"].abs().max().item()
    return {"logprobs": (got["logprobs"] - want["logprobs"]).abs().max().item(),
            "entropy": (got["entropy"] - want["entropy"]).abs().max().item(),
            "loss": abs(got["loss"] - want["loss"]),
            "grad_rel": (got["grad"] - want["grad"]).abs().max().item() / max(scale, 1e-30)}


def layout_outputs(overrides: list[str], weights: dict | None, chunks: tuple[int, ...],
                   turns: bool = False) -> tuple[dict, dict]:
    """Start megatron at `overrides`, build the actor (loading `weights` when given: TP1 state
    dicts), and return its outputs {chunk setting: {packed: outputs}} (and, with `turns`,
    "turns": part 4 with the first chunk setting's actor) and its weights."""
    from megatron.core import parallel_state

    from megatron_rlhf.config import load_config
    from megatron_rlhf.models.roles import Actor
    from megatron_rlhf.parallel import device
    from megatron_rlhf.trainers.runner import start_distributed

    cfg = load_config(None, [*MODEL, "optimizer.lr=1e-3", "rollout.engine=vllm", f"model.params_dtype={DTYPE}", *overrides])
    start_distributed(cfg)
    results = {}
    for chunk in chunks:
        model = dataclasses.replace(cfg.model, logits_chunk_tokens=chunk)
        actor = Actor(model, optimizer=cfg.optimizer, seed=cfg.seed, max_consecutive_nonfinite=2)
        if weights is None:
            weights = {k: v.detach().clone() for k, v in actor.module.state_dict().items() if v is not None}
        else:
            actor.module.load_state_dict(weights, strict=False)
        batch = make_batch(device())
        results[chunk] = {packed: role_outputs(actor, batch, packed) for packed in (False, True)}
        if turns and chunk == chunks[0]:
            results["turns"] = turn_cache_outputs(actor, model)
    parallel_state.destroy_model_parallel()
    return results, weights


def passed(report: dict) -> bool:
    """Whether every part that ran is within TOLERANCE (of report["dtype"])."""
    limits = TOLERANCE[report["dtype"]]
    if "skipped" not in report["split"] and not report["split"]["all_equal"]:
        return False
    compared = [d for part in ("packed", "cp") if "skipped" not in report[part] for d in report[part].values()]
    turns_ok = report.get("turns", {}).get("logprobs", 0.0) <= limits["logprobs"]
    return turns_ok and all(d[k] <= limit for d in compared for k, limit in limits.items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cpu", action="store_true", help="run on CPU (the tests): part 1 skipped")
    args = ap.parse_args(argv)
    from megatron_rlhf import parallel

    global DTYPE
    DTYPE = "float32" if args.cpu else DTYPE

    if not args.cpu and not torch.cuda.is_available():
        print("long_context_check: no GPU (pass --cpu to run the CPU parts)", file=sys.stderr)
        return 2
    world = parallel.read_dist_env().world_size
    report = {"split": split_check() if not args.cpu else {"skipped": "--cpu: no Transformer Engine"}}
    chunks = (256, 0)  # chunked output layer (the default) and the whole logits
    base, weights = layout_outputs(["parallel.tensor_parallel=1"], None, chunks, turns=True)
    report["turns"] = base.pop("turns")
    report["packed"] = {f"logits_chunk_tokens={c}": differences(base[c][True], base[c][False]) for c in chunks}
    if world == 2:
        cp, _ = layout_outputs(["parallel.context_parallel=2"], weights, chunks)
        report["cp"] = {f"logits_chunk_tokens={c}, packed={p}": differences(cp[c][p], base[c][p])
                        for c in chunks for p in (False, True)}
    else:
        report["cp"] = {"skipped": f"needs 2 GPUs under torchrun (world size {world})"}
    parallel.destroy()
    report["dtype"], report["tolerance"] = DTYPE, TOLERANCE[DTYPE]
    report["ok"] = passed(report)
    if parallel.read_dist_env().rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
