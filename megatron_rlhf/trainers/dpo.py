"""The DPO stage: the policy learns from preference pairs directly, against a frozen reference.

    python -m megatron_rlhf dpo --config pipelines/tiny_cpu_dpo.yaml [key=value ...]

Actor and reference start from the SFT checkpoint (dpo.init_from, else <run>/sft, else the
Hugging Face weights of model.init_from_hf). The reference's log-probs come from a resident
reference role at the actor's TP x PP (on the fly), or, with dpo.precompute_reference, are
computed once for every pair, the reference freed, and the table kept in the stage's
checkpoints (exact resume at any layout). Each step: policy log-probs of the global batch's
pairs (chosen and rejected of a pair in one microbatch) -> algorithms/dpo.py's loss, a true
mean over the global batch's pairs. Eval: the same on the held-out pairs and, with a built-in
task, the gold score of responses sampled as the RL stage samples (the sampling section)
against the SFT policy's. Writes <run>/dpo/ (actor role, like SFT).
With LoRA (lora.stages has dpo) the actor trains adapters on the frozen start, the reference
is that start (the actor with its adapters off, no second copy) and the stage writes
<run>/dpo_lora/.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from functools import partial

import torch

from megatron_rlhf import parallel
from megatron_rlhf.algorithms.dpo import PairLogps, dpo_loss, pair_logps, sequence_logps
from megatron_rlhf.checkpoint.manager import resolve_checkpoint
from megatron_rlhf.checkpoint.validate import CheckpointError
from megatron_rlhf.config import Config, DPOConfig
from megatron_rlhf.data.encode import collate_preferences, encode_preferences, encode_prompt_records
from megatron_rlhf.data.sampler import EpochSampler
from megatron_rlhf.models.batching import data_parallel, dp_slice, padded_forward
from megatron_rlhf.models.roles import Actor, AdapterFreeReference, Reference, lora_base_warnings, lora_summary
from megatron_rlhf.parallel.collectives import dp_sum, dp_sums
from megatron_rlhf.rollout import SamplingParams
from megatron_rlhf.rollout.megatron_engine import MegatronRolloutEngine
from megatron_rlhf.trainers.rl import EVAL_SEED_OFFSET
from megatron_rlhf.trainers.rl import evaluate as sample_and_score
from megatron_rlhf.trainers.runner import StageRunner, skipped_steps
from megatron_rlhf.trainers.stage_data import load_stage_data, stage_dir
from megatron_rlhf.trainers.start_weights import load_start


# ----------------------------------------------------------------------------- loss
def pair_loss(outputs: dict, microbatch: dict, dpo: DPOConfig):
    """LossFn (models/roles.py): the DPO loss summed over the microbatch's pairs (rows alternate
    chosen, rejected; `ref_logps` [rows] the reference's summed response log-probs)."""
    policy = pair_logps(outputs["logprobs"], microbatch["loss_mask"])
    ref = microbatch["ref_logps"].to(policy.chosen.device, policy.chosen.dtype)
    reference = PairLogps(ref[0::2], ref[1::2], policy.chosen_tokens, policy.rejected_tokens)
    losses, stats = dpo_loss(policy, reference, dpo.beta, dpo.loss, dpo.label_smoothing, dpo.sft_weight)
    return losses.sum(), torch.ones_like(losses, dtype=torch.int32).sum(), {k: v.sum() for k, v in stats.items()}


# ----------------------------------------------------------------------------- reference
def reference_logps(reference: Reference, batch: dict, micro_rows: int) -> torch.Tensor:
    """[rows] summed response log-probs under the reference (the on-the-fly path)."""
    logprobs = padded_forward(reference, {"tokens": batch["tokens"]}, micro_rows)["logprobs"]
    return sequence_logps(logprobs, batch["loss_mask"])[0]


def precompute(reference: Reference, pairs: list, pad_id: int, seq_len: int, micro_pairs: int) -> torch.Tensor:
    """[pairs, 2] (chosen, rejected) summed reference log-probs of every pair, float32, on every
    rank: each data-parallel rank computes its share in batches of 64 micro batches, one sum
    fills the table (its other rows are zeros there, so the sum is exact)."""
    rank, size = data_parallel()
    table = torch.zeros(len(pairs), 2, device=parallel.device())
    mine = list(range(rank, len(pairs), size))
    chunk = 64 * micro_pairs
    for start in range(0, len(mine), chunk):
        rows = mine[start:start + chunk]
        batch = collate_preferences([pairs[i] for i in rows], pad_id, seq_len)
        sums = reference_logps(reference, batch, 2 * micro_pairs).to(table.device)
        table[torch.tensor(rows, device=table.device)] = sums.view(-1, 2)
    return dp_sum(table)


def fingerprint(*datasets: list) -> str:
    """The encoded pairs (ids and prompt lengths, in order) that a checkpoint's sampler position
    and precomputed table index: a resume on other data is refused."""
    h = hashlib.sha256()
    for pairs in datasets:
        h.update(array("q", [len(pairs)]).tobytes())
        for p in pairs:
            h.update(array("q", [p.prompt_len, len(p.chosen), *p.chosen, len(p.rejected), *p.rejected]).tobytes())
    return h.hexdigest()[:16]


class ReferenceSource:
    """Each batch's reference log-probs: from the resident role or the precomputed tables
    ("train", "eval": [pairs, 2] tensors, in the trainer state of every checkpoint)."""

    def __init__(self, role: Reference | None, tables: dict | None, micro_rows: int):
        self.role, self.tables, self.micro_rows = role, tables, micro_rows

    def __call__(self, split: str, indices: list[int], batch: dict) -> torch.Tensor:
        if self.tables is None:
            return reference_logps(self.role, batch, self.micro_rows)
        table = self.tables[split]
        return table[torch.tensor(indices, device=table.device)].flatten()  # chosen, rejected, chosen, ...


def start_checkpoint(cfg: Config) -> tuple[str, str]:
    """("ckpt", dir) or ("hf", dir): where actor and reference start (module docstring)."""
    d = cfg.dpo
    if d.init_from:
        return "ckpt", str(resolve_checkpoint(d.init_from, "dpo.init_from"))
    sft = stage_dir(cfg, "sft")
    if (sft / "latest").exists():
        return "ckpt", str(resolve_checkpoint(sft, "dpo.init_from"))
    if cfg.model.init_from_hf:
        return "hf", cfg.model.init_from_hf
    raise CheckpointError(f"dpo: no SFT checkpoint at {sft} to start from; run the sft stage first, or set "
                          "dpo.init_from=<an SFT stage or iter_* directory> or model.init_from_hf=<a Hugging Face directory>")


# ----------------------------------------------------------------------------- eval
def eval_pairs(actor: Actor, ref: ReferenceSource, pairs: list, pad_id: int, seq_len: int, dpo: DPOConfig) -> dict:
    """The loss and statistics on the held-out pairs, over data-parallel shards (eval_*)."""
    rank, size = data_parallel()
    indices = list(range(rank, len(pairs), size))
    batch = collate_preferences([pairs[i] for i in indices], pad_id, seq_len)
    batch["ref_logps"] = ref("eval", indices, batch)
    logprobs = padded_forward(actor, {"tokens": batch["tokens"]}, 2 * dpo.micro_batch_size)["logprobs"]
    loss, count, stats = pair_loss({"logprobs": logprobs}, batch, dpo)
    sums = dp_sums({"loss": loss, "pairs": count, **stats}, parallel.device())
    return {f"eval_{k}": v / sums["pairs"] for k, v in sums.items() if k != "pairs"}


def gold_eval(engine, data, prompts, cfg: Config, before: dict | None) -> tuple[dict, list[str], dict]:
    """The gold score (and, against `before`, the win rate) of sampled responses; no-op
    without a built-in task."""
    if engine is None:
        return {}, [], {}
    sampling = SamplingParams.of(cfg.sampling)  # as the RL stage samples: the gold scores compare
    metrics, samples, _, per_prompt = sample_and_score(engine, {}, data.tokenizer, data.task, prompts, sampling,
                                                       cfg.seed + EVAL_SEED_OFFSET,
                                                       sft=before and before.get("per_prompt"))
    return metrics, samples, per_prompt


# ----------------------------------------------------------------------------- the stage
def train(cfg: Config) -> dict:
    d = cfg.dpo
    runner = StageRunner(cfg, "dpo", d.steps, d.log_interval, d.save_interval)
    data = load_stage_data(cfg, ("preference_train", "preference_eval"),
                           optional=("prompts_eval",) if cfg.data.task else (), stage="dpo")
    cfg = data.config  # the run's vocabulary and start architecture resolved (stage_data.RunContext)
    pad = data.tokenizer.pad_id
    fit = {"tokenizer": data.tokenizer, "max_len": d.seq_length, "overflow": cfg.data.overflow,
           "max_len_field": "dpo.seq_length"}
    train_set, train_report = encode_preferences(data.splits["preference_train"], **fit)
    eval_set, eval_report = encode_preferences(data.splits["preference_eval"], **fit)

    lora = cfg.lora if cfg.lora.applies_to("dpo") else None
    actor = Actor(cfg.model, trainable=True, optimizer=d.optimizer, total_steps=d.steps, lora=lora, seed=cfg.seed,
                  max_consecutive_nonfinite=cfg.resilience.max_consecutive_nonfinite)
    roles = {"actor": actor}
    sampler = EpochSampler(len(train_set), seed=cfg.seed)
    state = runner.resume(roles, sampler)
    start = tuple(state["start"]) if runner.resumed else start_checkpoint(cfg)
    if lora or not runner.resumed:  # a LoRA actor's frozen base also on resume (its checkpoints hold adapters)
        load_start(cfg, actor, start)
    data_id = fingerprint(train_set, eval_set)
    ref, ref_note = build_reference(cfg, state, start, data_id, (train_set, eval_set, pad), actor)
    log = runner.log
    for line in (runner.resumed, f"actor/reference from {start[1]}" + (" (Hugging Face weights)" if start[0] == "hf" else ""),
                 ref_note, f"train pairs: {train_report}; eval pairs: {eval_report}", *lora_base_warnings(roles)):
        if line:
            log.info(line)

    engine, prompts = None, []
    if data.task is not None and "prompts_eval" in data.splits:
        prompts, _ = encode_prompt_records(data.splits["prompts_eval"], data.tokenizer,
                                           cfg.model.max_seq_length - cfg.sampling.max_new_tokens)
        engine = MegatronRolloutEngine(cfg.model, actor, eos_id=data.tokenizer.eos_id, pad_id=pad)
    evaluate = partial(eval_pairs, actor, ref, eval_set, pad, d.seq_length, d)
    if runner.resumed:
        before = state["before"]
    else:
        gold, samples, per_prompt = gold_eval(engine, data, prompts, cfg, None)
        before = {"eval": {**evaluate(), **gold}, "samples": samples, "per_prompt": per_prompt}
        log.log(0, before["eval"])  # the starting (SFT) policy: the eval curves start here
    dp_rank, dp_size = data_parallel()

    metrics, eval_metrics, samples = {}, before["eval"], before["samples"]
    kept = dict(start=list(start), before=before, reference=ref_state(ref, data_id))  # what checkpoints add
    for step in runner.steps():
        t0 = time.perf_counter()
        indices = dp_slice(sampler.next_indices(d.global_batch_size), dp_rank, dp_size)
        batch = collate_preferences([train_set[i] for i in indices], pad, d.seq_length)
        batch["ref_logps"] = ref("train", indices, batch)
        result = actor.train_step({k: batch[k] for k in ("tokens", "loss_mask", "ref_logps")},
                                  2 * d.micro_batch_size, partial(pair_loss, dpo=d))
        tokens = dp_sums({"tokens": int(batch["lengths"].sum())}, parallel.device())["tokens"]
        metrics = {k: v for k, v in result.items() if k not in ("update_ok", "skipped")}
        metrics.update(**skipped_steps(roles), tokens_per_s=tokens / (time.perf_counter() - t0))
        evaluated = runner.due(d.eval_interval)
        if evaluated:
            gold, samples, _ = gold_eval(engine, data, prompts, cfg, before)
            eval_metrics = {**evaluate(), **gold}
            metrics.update(eval_metrics)
        runner.end_step(metrics, step * d.global_batch_size, evaluated, **kept)

    return runner.finish(dpo_summary(cfg, before, eval_metrics, metrics, samples, ref, train_report, eval_report,
                                     data.sources, start, actor),
                         done_message(before["eval"], eval_metrics))


def build_reference(cfg: Config, state: dict, start, data_id: str, encoded, actor: Actor) -> tuple[ReferenceSource, str]:
    """The on-the-fly reference role, or the precomputed tables (from the checkpoint being
    resumed, else computed now with a reference role that is freed afterwards); and a note.
    A LoRA actor's reference is the actor with its adapters off (no weights of its own)."""
    d, (train_set, eval_set, pad) = cfg.dpo, encoded
    micro_rows, saved = 2 * d.micro_batch_size, state.get("reference") or {}
    if saved and saved["data"] != data_id:  # the sampler's position and any stored table index these pairs
        raise CheckpointError(
            f"dpo: the checkpoint being resumed was trained on other preference data (fingerprint {saved['data']}, "
            f"now {data_id}); restore the data it was trained on, or start the stage afresh "
            "(checkpoint.resume=false, or another checkpoint.run_name)")
    if d.precompute_reference and saved.get("precomputed"):
        tables = {split: broadcast_table(saved.get("tables"), split, len(pairs))
                  for split, pairs in (("train", train_set), ("eval", eval_set))}
        return ReferenceSource(None, tables, micro_rows), "reference log-probs: precomputed, read from the checkpoint"
    switched = (f" (the checkpoint was trained with dpo.precompute_reference={str(not d.precompute_reference).lower()}:"
                " the same loss up to float rounding, not a bitwise resume)") if saved and "precomputed" in saved else ""
    if actor.lora is not None:
        reference, role = AdapterFreeReference(actor), "the LoRA actor with its adapters off"
    else:
        reference, role = Reference(cfg.model), "reference role freed"
        load_start(cfg, reference, start)
    if not d.precompute_reference:
        return ReferenceSource(reference, None, micro_rows), f"reference log-probs: on the fly{switched}" + (
            f" ({role})" if actor.lora is not None else "")
    t0 = time.perf_counter()
    tables = {split: precompute(reference, pairs, pad, d.seq_length, d.micro_batch_size)
              for split, pairs in (("train", train_set), ("eval", eval_set))}
    del reference  # the frozen weights are not needed again: training runs without them
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return ReferenceSource(None, tables, micro_rows), (
        f"reference log-probs: precomputed for {len(train_set) + len(eval_set)} pairs in "
        f"{time.perf_counter() - t0:.1f} s, {role}{switched}")


def broadcast_table(saved: dict | None, split: str, pairs: int) -> torch.Tensor:
    """Rank 0's saved table (only rank 0 keeps one in its trainer state), on every rank's device."""
    table = torch.zeros(pairs, 2, device=parallel.device())
    if torch.distributed.get_rank() == 0:
        table.copy_(saved[split])
    torch.distributed.broadcast(table, src=0)
    return table


def ref_state(ref: ReferenceSource, data_id: str) -> dict:
    """What a checkpoint keeps of the reference: whether it is precomputed, the data's
    fingerprint and, on rank 0 only (the other ranks read it from there), the tables."""
    tables = None
    if ref.tables is not None and torch.distributed.get_rank() == 0:
        tables = {k: v.cpu() for k, v in ref.tables.items()}
    return {"precomputed": ref.tables is not None, "data": data_id, "tables": tables}


def dpo_summary(cfg, before, eval_metrics, metrics, samples, ref, train_report, eval_report, sources, start,
                actor) -> dict:
    d = cfg.dpo
    return {
        "loss_type": d.loss, "beta": d.beta, "label_smoothing": d.label_smoothing, "sft_weight": d.sft_weight,
        "reference": "precomputed" if ref.tables is not None else "on the fly",
        "started_from": start[1], "lora": lora_summary({"actor": actor}), "final_train_loss": metrics.get("loss"),
        **{k: v for k, v in eval_metrics.items() if not k.startswith("eval_gold") and "win_rate" not in k},
        "eval_reward_accuracy_before": before["eval"].get("eval_reward_accuracy"),
        # sampled responses to the held-out prompts, scored by the task's gold scorer (null without one)
        "gold_score_eval_before": before["eval"].get("eval_gold_score"),
        "gold_score_eval_after": eval_metrics.get("eval_gold_score"),
        "win_rate_gold_final": eval_metrics.get("eval_win_rate_gold"),
        "train_data": vars(train_report), "eval_data": vars(eval_report), "data_sources": sources,
        "samples_before": before["samples"][: cfg.sampling.eval_samples_logged],
        "samples_after": samples[: cfg.sampling.eval_samples_logged],
    }


def done_message(before: dict, after: dict) -> str:
    gold = ("" if after.get("eval_gold_score") is None else
            f"gold {before['eval_gold_score']:.3f} -> {after['eval_gold_score']:.3f}, ")
    return (f"done: {gold}held-out reward accuracy {after['eval_reward_accuracy']:.3f}, "
            f"margin {after['eval_margin']:.3f}, loss {before['eval_loss']:.4f} -> {after['eval_loss']:.4f}")
