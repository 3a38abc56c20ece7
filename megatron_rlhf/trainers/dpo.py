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
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from megatron_rlhf import parallel
from megatron_rlhf.algorithms.dpo import PairLogps, dpo_loss, pair_logps, sequence_logps
from megatron_rlhf.checkpoint.manager import resolve_checkpoint
from megatron_rlhf.checkpoint.validate import CheckpointError
from megatron_rlhf.config import Config, DPOConfig
from megatron_rlhf.data.encode import collate_preferences, encode_preferences, encode_prompt_records
from megatron_rlhf.models.batching import data_parallel, padded_forward
from megatron_rlhf.models.roles import Actor, AdapterFreeReference, Reference, lora_base_warnings, lora_summary
from megatron_rlhf.parallel.collectives import dp_sum, dp_sums
from megatron_rlhf.rollout import SamplingParams
from megatron_rlhf.rollout.megatron_engine import MegatronRolloutEngine
from megatron_rlhf.trainers.policy_eval import EVAL_SEED_OFFSET, EvalResult, PolicyEvaluation
from megatron_rlhf.trainers.runner import StageRunner
from megatron_rlhf.trainers.stage_data import load_stage_data, stage_dir
from megatron_rlhf.trainers.start_weights import load_start
from megatron_rlhf.trainers.supervised import Encoded, SupervisedSteps, encode_splits, fit, log_lines, resume, run_steps


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


@dataclass
class DPOEval:
    """The stage's eval: the loss and statistics on the held-out pairs and, with a built-in task,
    the gold score (and, against the starting policy's `before`, the win rate) of responses
    sampled to the held-out prompts. Keeps the latest metrics and samples for the summary."""
    pairs: Callable[[], dict]              # eval_pairs on the held-out pairs
    gold: PolicyEvaluation | None          # None: no built-in task (no gold scorer)
    before: dict | None = None             # the starting policy's evaluation, once measured
    metrics: dict = field(default_factory=dict)
    samples: list[str] = field(default_factory=list)
    per_prompt: dict = field(default_factory=dict)

    def __call__(self) -> dict:
        sampled = (self.gold(sft=self.before and self.before.get("per_prompt")) if self.gold is not None
                   else EvalResult({}, [], 0, {}))
        self.samples, self.per_prompt = sampled.samples, sampled.per_prompt
        self.metrics = {**self.pairs(), **sampled.metrics}
        return self.metrics

    def start(self, saved: dict | None) -> dict:
        """The starting policy's evaluation ("before"): a resumed run's from its checkpoint
        (`saved`), else measured now. The latest metrics and samples until the next eval."""
        if saved is None:
            self()
            saved = {"eval": self.metrics, "samples": self.samples, "per_prompt": self.per_prompt}
        self.before, self.metrics, self.samples = saved, saved["eval"], saved["samples"]
        return saved


@dataclass
class DPOTrainerState:
    """The DPO stage's own part of every checkpoint's trainer state (the runner adds the step, the
    samples consumed, the sampler and the guards), saved under these names."""
    start: tuple[str, str]     # where actor and reference started: ("ckpt" | "hf", directory)
    before: dict               # the starting policy's eval: {"eval", "samples", "per_prompt"}
    reference: dict            # ref_state: precomputed or not, the pairs' fingerprint, rank 0's tables

    def saved(self) -> dict:
        return {"start": list(self.start), "before": self.before, "reference": self.reference}

    @classmethod
    def of(cls, saved: dict) -> DPOTrainerState:
        """From a resumed checkpoint's trainer state (one without a reference part: {})."""
        return cls(tuple(saved["start"]), saved["before"], saved.get("reference") or {})


# ----------------------------------------------------------------------------- the stage
def train(cfg: Config) -> dict:
    d = cfg.dpo
    runner = StageRunner(cfg, "dpo", d.steps, d.log_interval, d.save_interval)
    data = load_stage_data(cfg, ("preference_train", "preference_eval"),
                           optional=("prompts_eval",) if cfg.data.task else (), stage="dpo")
    cfg = data.config  # the run's vocabulary and start architecture resolved (stage_data.RunContext)
    pad = data.tokenizer.pad_id
    pairs = encode_splits(encode_preferences, data.splits["preference_train"], data.splits["preference_eval"],
                          fit(data, d.seq_length, "dpo.seq_length"))

    lora = cfg.lora if cfg.lora.applies_to("dpo") else None
    actor = Actor(cfg.model, trainable=True, optimizer=d.optimizer, total_steps=d.steps, lora=lora, seed=cfg.seed,
                  max_consecutive_nonfinite=cfg.resilience.max_consecutive_nonfinite)
    roles = {"actor": actor}
    state = resume(runner, roles, len(pairs.train), cfg.seed)
    resumed = DPOTrainerState.of(state) if runner.resumed else None
    start = resumed.start if resumed else start_checkpoint(cfg)
    if lora or not runner.resumed:  # a LoRA actor's frozen base also on resume (its checkpoints hold adapters)
        load_start(cfg, actor, start)
    data_id = fingerprint(pairs.train, pairs.eval)
    ref, ref_note = build_reference(cfg, resumed.reference if resumed else {}, start, data_id, pairs, pad, actor)
    hf = " (Hugging Face weights)" if start[0] == "hf" else ""
    log_lines(runner, runner.resumed, f"actor/reference from {start[1]}{hf}", ref_note,
              f"train pairs: {pairs.train_report}; eval pairs: {pairs.eval_report}", *lora_base_warnings(roles))

    evaluate = DPOEval(partial(eval_pairs, actor, ref, pairs.eval, pad, d.seq_length, d),
                       gold_evaluation(cfg, data, actor))
    before = evaluate.start(resumed.before if resumed else None)
    if not resumed:
        runner.log.log(0, before["eval"])  # the starting (SFT) policy: the eval curves start here
    trainer_state = DPOTrainerState(start, before, ref_state(ref, data_id))

    def collate(indices: list[int]) -> dict:
        batch = collate_preferences([pairs.train[i] for i in indices], pad, d.seq_length)
        batch["ref_logps"] = ref("train", indices, batch)
        return batch

    metrics = run_steps(runner, SupervisedSteps(
        actor, collate, partial(pair_loss, dpo=d), micro_rows=2 * d.micro_batch_size,
        global_batch_size=d.global_batch_size, eval_interval=d.eval_interval, step_metrics=train_metrics,
        evaluate=evaluate, inputs=("tokens", "loss_mask", "ref_logps"), trainer_state=trainer_state.saved))

    return runner.finish(dpo_summary(cfg, evaluate, metrics, ref, pairs, data.sources, start, actor),
                         done_message(before["eval"], evaluate.metrics))


def gold_evaluation(cfg: Config, data, actor: Actor) -> PolicyEvaluation | None:
    """The gold eval of responses sampled to the held-out prompts as the RL stage samples them
    (the sampling section, the same seed: the gold scores compare); None without a built-in task."""
    if data.task is None or "prompts_eval" not in data.splits:
        return None
    prompts, _ = encode_prompt_records(data.splits["prompts_eval"], data.tokenizer,
                                       cfg.model.max_seq_length - cfg.sampling.max_new_tokens)
    pad = data.tokenizer.pad_id
    engine = MegatronRolloutEngine(cfg.model, actor, eos_id=data.tokenizer.eos_id, pad_id=pad)
    return PolicyEvaluation(engine, {}, data.tokenizer, data.task, prompts, SamplingParams.of(cfg.sampling),
                            cfg.seed + EVAL_SEED_OFFSET)


def train_metrics(result: dict) -> dict:
    """The logged train metrics: train_step's result but its update flags."""
    return {k: v for k, v in result.items() if k not in ("update_ok", "skipped")}


def build_reference(cfg: Config, saved: dict, start, data_id: str, pairs: Encoded, pad: int,
                    actor: Actor) -> tuple[ReferenceSource, str]:
    """The on-the-fly reference role, or the precomputed tables (from the checkpoint being
    resumed, whose reference part is `saved` ({} fresh), else computed now with a reference role
    that is freed afterwards); and a note. A LoRA actor's reference is the actor with its
    adapters off (no weights of its own)."""
    d, train_set, eval_set = cfg.dpo, pairs.train, pairs.eval
    micro_rows = 2 * d.micro_batch_size
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


def dpo_summary(cfg, evaluate: DPOEval, metrics: dict, ref: ReferenceSource, pairs: Encoded, sources, start,
                actor) -> dict:
    d, before, eval_metrics = cfg.dpo, evaluate.before, evaluate.metrics
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
        "train_data": vars(pairs.train_report), "eval_data": vars(pairs.eval_report), "data_sources": sources,
        "samples_before": before["samples"][: cfg.sampling.eval_samples_logged],
        "samples_after": evaluate.samples[: cfg.sampling.eval_samples_logged],
    }


def done_message(before: dict, after: dict) -> str:
    gold = ("" if after.get("eval_gold_score") is None else
            f"gold {before['eval_gold_score']:.3f} -> {after['eval_gold_score']:.3f}, ")
    return (f"done: {gold}held-out reward accuracy {after['eval_reward_accuracy']:.3f}, "
            f"margin {after['eval_margin']:.3f}, loss {before['eval_loss']:.4f} -> {after['eval_loss']:.4f}")
