"""The RL stage: PPO or a critic-free algorithm on colocated megatron roles, time-shared.

    python -m megatron_rlhf rl --config pipelines/tiny_cpu.yaml [key=value ...]   (alias: ppo)

Actor and reference start from the SFT checkpoint (the DPO one when pipeline.stages runs dpo
before rl), the reward model (and PPO's critic) from
the RM checkpoint; without a reward model among rl.rewards the critic starts from the SFT
actor with a fresh value head (rl.critic_from). Each iteration: generate (n samples per prompt;
with dynamic sampling, more groups until the batch is full) -> score (old/reference log-probs,
the reward of rl.rewards: reward model, rule functions, reward services; values) ->
advantages (algorithms/advantages.py, one estimator per rl.algorithm) -> train (epochs x
minibatches) -> eval when due. The math is in algorithms/; this file wires it, with the
records of what an iteration produced and of the trainer state in rl_records.py, the
metrics and summary in rl_metrics.py and the eval in policy_eval.py. Writes <run>/<rl.algorithm>/.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from megatron_rlhf.algorithms.advantages import ESTIMATORS, Settings, group_view, valid_rows
from megatron_rlhf.algorithms.kl import kl_estimate, kl_loss_estimate, make_kl_controller
from megatron_rlhf.algorithms.losses import aggregate, log_importance_ratio, policy_loss, rollout_correction, value_loss
from megatron_rlhf.algorithms.stats import explained_variance, token_sums
from megatron_rlhf.colocation import ColocationScheduler, phases_for
from megatron_rlhf.config import Config, RLConfig, policy_start, warnings_for
from megatron_rlhf.data.encode import EncodedPrompt, encode_prompt_records
from megatron_rlhf.data.sampler import EpochSampler
from megatron_rlhf.logging.reward_hacking import RewardHackingAlarm
from megatron_rlhf.models.batching import by_length, data_parallel, dp_slice, padded_forward
from megatron_rlhf.models.roles import Actor, AdapterFreeReference, Critic, Reference, RewardModel, lora_base_warnings
from megatron_rlhf.parallel.collectives import any_rank, dp_sum, masked_moments
from megatron_rlhf.resilience.faults import FAULTS
from megatron_rlhf.rewards import RewardInputs, RewardSourceError, RewardSources, rm_scores
from megatron_rlhf.rollout import Rollout, SamplingParams, make_engine
from megatron_rlhf.rollout.episodes import EpisodeEngine, sample_rows, with_episodes
from megatron_rlhf.rollout.batch import RolloutBatch
from megatron_rlhf.trainers.rl_async import AsyncRollouts, RolloutAudit
from megatron_rlhf.trainers.rl_inputs import load_inputs
from megatron_rlhf.trainers.policy_eval import EVAL_SEED_OFFSET, PolicyEvaluation
from megatron_rlhf.trainers.rl_metrics import done_message, format_scores, iteration_metrics, measure_routing, rl_summary
from megatron_rlhf.trainers.rl_records import Generation, Iteration, Prompts, Rewards, RLTrainerState
from megatron_rlhf.trainers.runner import StageRunner, skipped_steps
from megatron_rlhf.trainers.stage_data import load_stage_data


# ----------------------------------------------------------------------------- generate
def sequence_rewards(rewards: RewardSources, rollout: Rollout, rows: list[EncodedPrompt], tokenizer,
                     rl: RLConfig) -> Rewards:
    """The rollout's [B] rewards (clip_scores applied) and each source's [B] scores; rows[i]:
    the prompt of row i (its text and extra fields go to rule functions and services)."""
    total, per_source = rewards.score(rollout, lambda: reward_inputs(rollout, rows, tokenizer))
    return Rewards(clip_scores(total, rollout, rl), per_source)


def reward_inputs(rollout: Rollout, rows: list[EncodedPrompt], tokenizer) -> RewardInputs:
    responses = rollout.response_ids()
    return RewardInputs(prompts=[p.example.prompt for p in rows], responses=[tokenizer.decode(r) for r in responses],
                        prompt_ids=[p.ids for p in rows], response_ids=responses, finished=rollout.finished.tolist(),
                        extras=[dict(p.example.extra) for p in rows])


def clip_scores(scores: torch.Tensor, rollout: Rollout, rl: RLConfig) -> torch.Tensor:
    """Missing-EOS penalty applied, clipped to +-rl.reward_clip."""
    if rl.missing_eos_penalty is not None:
        scores = torch.where(rollout.finished, scores, torch.full_like(scores, rl.missing_eos_penalty))
    return scores.clamp(-rl.reward_clip, rl.reward_clip)


@dataclass
class Scoring:
    """How the stage scores rollouts: called, the train phase's rewards (sequence_rewards); as
    eval judges, the combined reward of rl.rewards and the holdout reward model's scores, unclipped."""
    rewards: RewardSources
    tokenizer: Any
    rl: RLConfig
    holdout_rm: RewardModel | None = None   # rm.holdout_fraction > 0: the reward-hacking alarm's judge

    def __call__(self, rollout: Rollout, rows: list[EncodedPrompt]) -> Rewards:
        return sequence_rewards(self.rewards, rollout, rows, self.tokenizer, self.rl)

    def reward(self, rollout: Rollout, rows: list[EncodedPrompt]) -> torch.Tensor:
        return self.rewards.score(rollout, lambda: reward_inputs(rollout, rows, self.tokenizer))[0]

    def holdout(self, rollout: Rollout, rows: list[EncodedPrompt] | None = None) -> torch.Tensor:
        return rm_scores(self.holdout_rm, rollout, self.rl.micro_batch_size, self.rl.micro_batch_tokens)

    def judges(self) -> dict:
        return {"reward": self.reward, **({"holdout_rm": self.holdout} if self.holdout_rm is not None else {})}


@dataclass
class PromptDraw:
    """Each call: this rank's share of the sampler's next `batch_size` train prompts."""
    prompts: list[EncodedPrompt]
    sampler: EpochSampler
    batch_size: int

    def __call__(self) -> list[EncodedPrompt]:
        return [self.prompts[i] for i in self.indices()[1]]

    def indices(self) -> tuple[list[int], list[int]]:
        """The sampler's next batch (global prompt indices) and this rank's share of it."""
        rank, size = data_parallel()
        drawn = self.sampler.next_indices(self.batch_size)
        return drawn, list(dp_slice(drawn, rank, size))


def generate(engine, score_fn, draw_prompts, rl: RLConfig, sampling, seed: int) -> Generation:
    """This rank's rollout: each prompt of `draw_prompts()` sampled n times (a group: n
    consecutive rows). With dynamic sampling, groups whose rewards (`score_fn(rollout, rows)`)
    are all equal are dropped and new prompts drawn, at most rl.max_sampling_rounds rounds
    (every rank runs as many, so the global sampler stays in step); a shortfall is filled with
    dropped groups: then the Generation has the rewards, the rounds, the shortfall
    (uninformative groups this rank had to keep to fill its quota) and which of the rows of
    every round it kept (an EpisodeEngine's episode_metrics reads them)."""
    n = rl.n_samples_per_prompt
    if isinstance(engine, EpisodeEngine):
        engine.new_iteration()  # the episodes counted from here on are this iteration's rounds
    prompts = draw_prompts()
    rows = [p for p in prompts for _ in range(n)]
    rollout = sample_rows(engine, rows, sampling, seed)
    if not rl.dynamic_sampling:
        return Generation(rollout, rows)
    quota, parts, part_rows, scored = len(prompts), [rollout], [rows], [score_fn(rollout, rows)]
    informative = [group_informative(scored[0].total, n, valid_rows(rollout.response_mask()))]
    for extra in range(1, rl.max_sampling_rounds):
        if not any_rank(int(sum(int(i.sum()) for i in informative)) < quota):
            break
        more_rows = [p for p in draw_prompts() for _ in range(n)]
        more = sample_rows(engine, more_rows, sampling, seed + 7919 * extra)
        parts.append(more)
        part_rows.append(more_rows)
        scored.append(score_fn(more, more_rows))
        informative.append(group_informative(scored[-1].total, n, valid_rows(more.response_mask())))
    keep = torch.cat(informative)
    chosen = select_groups(keep, quota, n)
    rollout = Rollout.cat(parts, engine.pad_id).select(chosen)
    all_rows = [p for part in part_rows for p in part]
    rewards = Rewards(torch.cat([r.total for r in scored])[chosen],
                      {k: torch.cat([r.per_source[k] for r in scored])[chosen] for k in scored[0].per_source})
    return Generation(rollout, [all_rows[i] for i in chosen.tolist()], rewards, {
        "sampling_rounds": len(parts), "sampling_shortfall": max(quota - int(keep.sum()), 0)}, kept=chosen)


def select_groups(informative: torch.Tensor, quota: int, n: int) -> torch.Tensor:
    """Row indices of `quota` groups: the informative ones first (in sampling order), then
    uninformative ones to fill a shortfall. informative: [groups] bool -> [quota * n] long."""
    order = torch.cat([informative.nonzero().flatten(), (~informative).nonzero().flatten()])[:quota]
    return (order[:, None] * n + torch.arange(n, device=order.device)).flatten()


def group_informative(scores: torch.Tensor, n: int, valid: torch.Tensor) -> torch.Tensor:
    """[B] scores, [B] bool -> [B / n] bool: the rewards of the group's valid rows are not all
    equal (it carries a learning signal). A row with valid False (no policy token: a failed
    episode) is no sample to the estimators (algorithms/advantages.py), so its reward cannot
    make its group informative; nor can a group of fewer than two valid rows be."""
    groups, ok = group_view(scores, n), group_view(valid, n)
    highest = torch.where(ok, groups, torch.full_like(groups, float("-inf"))).amax(dim=1)
    lowest = torch.where(ok, groups, torch.full_like(groups, float("inf"))).amin(dim=1)
    return highest > lowest


# ----------------------------------------------------------------------------- score
def score(rollout: Rollout, rewards: Rewards, roles: dict, rl: RLConfig, recompute_old: bool = True,
          replay_routes: bool = False) -> RolloutBatch:
    """The train phase's batch from one forward of each role (on the roles' device) and the
    rewards (sequence_rewards' result). recompute_old=False: the rollout's own log-probs are the
    old log-probs (the in-place engine sampled with the actor's current weights;
    rl.reuse_rollout_logprobs), saving the actor's forward. An MoE actor's forward replays the
    rollout's routes (replay_routes; kept for the train phase) or counts where it chose otherwise."""
    seqs = {"tokens": rollout.tokens, "lengths": rollout.lengths}
    forward = partial(padded_forward, batch=seqs, micro_batch_size=rl.micro_batch_size, token_budget=rl.micro_batch_tokens)
    mask = rollout.response_mask()
    values = forward(roles["critic"])["values"] * mask if "critic" in roles else None
    routes = rollout.routes
    if not recompute_old:
        old = rollout.logprobs
    else:
        actor_batch = seqs if routes is None else {**seqs, "routes": routes}
        old = forward(roles["actor"], batch=actor_batch, compare_routes=routes is not None and not replay_routes)["logprobs"]
    return RolloutBatch(
        tokens=rollout.tokens, lengths=rollout.lengths, prompt_lengths=rollout.prompt_lengths, mask=mask,
        group_ids=torch.arange(len(rollout), device=mask.device) // rl.n_samples_per_prompt,
        old_logprobs=old * mask,
        ref_logprobs=forward(roles["reference"])["logprobs"] * mask,
        scores=rewards.total, values=values,
        rollout_logprobs=rollout.logprobs * mask if rl.corrects_mismatch else None,
        routes=routes if replay_routes else None)


def score_iteration(generation: Generation, scoring: Scoring, roles: dict, rl: RLConfig, recompute_old: bool,
                    replay_routes: bool = False) -> Iteration:
    """The score phase: the rewards (unless dynamic sampling scored them already), the batch,
    the holdout reward model's scores if any; with the rollout's routes, how the actor's own
    routing compares with them (measure_routing)."""
    rollout = generation.rollout
    replay_routes = replay_routes and rollout.routes is not None
    rewards = generation.rewards if generation.rewards is not None else scoring(rollout, generation.rows)
    batch = score(rollout, rewards, roles, rl, recompute_old, replay_routes)
    holdout = clip_scores(scoring.holdout(rollout), rollout, rl) if scoring.holdout_rm is not None else None
    routing = measure_routing(rollout, roles["actor"], rl, replay_routes) if rollout.routes is not None and recompute_old else {}
    return Iteration(rollout, batch, sampling=generation.sampling, per_source=rewards.per_source, holdout=holdout,
                     old_logprobs_recomputed=recompute_old, routing=routing)


# ----------------------------------------------------------------------------- advantages
def add_advantages(batch: RolloutBatch, rl: RLConfig, kl_coef: float, max_new_tokens: int) -> dict[str, torch.Tensor]:
    """KL penalty -> the algorithm's advantages (and PPO's returns), set on `batch`. Returns
    this rank's KL sums and, with a critic, the explained variance over all data-parallel ranks."""
    width = max_new_tokens  # the longest response possible: no host sync for the real one
    mask = batch.response_mask(width)
    resp = partial(batch.response, width=width)
    kl = kl_estimate(resp(batch.old_logprobs), resp(batch.ref_logprobs), rl.kl_estimator, rl.kl_clip, mask)
    kl_penalty = -kl_coef * (kl if rl.kl_in_reward else torch.zeros_like(kl))
    values = resp(batch.values) if batch.values is not None else None
    settings = Settings(gamma=rl.gamma, lam=rl.lam, whiten=rl.whiten_advantages, group_size=rl.n_samples_per_prompt,
                        group_std=rl.group_std_normalization, reduce=dp_sum)
    advantages, returns = ESTIMATORS[rl.algorithm](batch.scores, kl_penalty, mask, values, settings)
    batch.advantages = batch.sequence(advantages)
    stats = {"kl": kl.sum(), "kl_tokens": mask.sum()}
    if returns is not None:
        batch.returns = batch.sequence(returns)
        _, _, var_returns = masked_moments(returns, mask)
        _, _, var_residual = masked_moments(returns - values * mask, mask)
        stats["explained_variance"] = explained_variance(var_residual, var_returns)
    return stats


# ----------------------------------------------------------------------------- train
def actor_loss(outputs: dict, microbatch: dict, rl: RLConfig, kl_coef: float):
    """Clipped policy loss - c2 * entropy (+ kl_coef * KL when the KL is in the loss), as
    (sum, units, stats) over rl.loss_aggregation's unit (see models/roles.py: LossFn); the stats
    are token sums whatever the unit (the logged diagnostics are token means)."""
    mb, logprobs = RolloutBatch.of(microbatch), outputs["logprobs"]
    log_ratio = log_importance_ratio(logprobs, mb.old_logprobs, mb.mask, rl.importance_ratio)
    policy, clipped = policy_loss(log_ratio, mb.advantages, rl.clip_eps, rl.clip_eps_high, rl.dual_clip)
    correction = {}
    if mb.rollout_logprobs is not None:  # the rollout engine's distribution differs from pi_old
        weights = rollout_correction(mb.old_logprobs, mb.rollout_logprobs, mb.mask, rl.tis_cap, rl.mismatch_mask_threshold)
        policy = policy * weights
        correction = {"tis_weight_mean": weights, "mismatch_masked_fraction": (weights == 0).float(),
                      **({"tis_capped_fraction": (weights >= rl.tis_cap).float()} if rl.tis_cap is not None else {})}
    objective = policy - rl.entropy_coef * outputs["entropy"]
    if not rl.kl_in_reward:
        objective = objective + kl_coef * kl_loss_estimate(logprobs, mb.ref_logprobs, rl.kl_estimator, rl.kl_clip,
                                                           mb.mask)
    loss, units = aggregate(objective, mb.mask, rl.loss_aggregation)
    token_log_ratio = (logprobs - mb.old_logprobs).detach()
    return loss, units, token_sums(mb.mask, policy_loss=policy.detach(), entropy=outputs["entropy"].detach(),
                                   clip_fraction=clipped.float(), approx_kl=0.5 * token_log_ratio**2,
                                   ratio_mean=log_ratio.detach().exp(), old_logprob_mismatch=token_log_ratio.abs(),
                                   **correction)


def critic_loss(outputs: dict, microbatch: dict, rl: RLConfig):
    mb = RolloutBatch.of(microbatch)
    per_token, clipped = value_loss(outputs["values"], mb.values, mb.returns, rl.value_clip)
    loss, units = aggregate(rl.vf_coef * per_token, mb.mask, rl.loss_aggregation)
    return loss, units, token_sums(mb.mask, value_loss=per_token.detach(), value_clip_fraction=clipped.float())


def train_on_rollout(trained: dict, batch: RolloutBatch, rl: RLConfig, kl_coef: float, seed: int) -> dict[str, float]:
    """rl.epochs x minibatches, reshuffled every epoch, for each role in `trained` (actor
    and/or critic); returns each statistic over the steps (`step_means`)."""
    losses = {"actor": partial(actor_loss, rl=rl, kl_coef=kl_coef), "critic": partial(critic_loss, rl=rl)}
    rows, mini = len(batch), rl.mini_batch_size // data_parallel()[1]
    generator = torch.Generator().manual_seed(seed)
    steps: list[dict[str, float]] = []
    for _ in range(rl.epochs):
        order = torch.randperm(rows, generator=generator).to(batch.tokens.device)
        for start in range(0, rows, mini):
            minibatch = order[start : start + mini]
            mb = batch.select(minibatch[by_length(batch.lengths[minibatch])]).tensors()  # less padding per microbatch
            for role, model in trained.items():
                stats = model.train_step(mb, rl.micro_batch_size, losses[role], rl.micro_batch_tokens)
                steps.append({f"{role}_{k}" if k in ROLE_STATISTICS else k: float(v)
                              for k, v in stats.items() if k not in ("update_ok", "skipped")})
    return step_means(steps)


# a train step's statistics that each trained role reports: logged as <role>_<name>
ROLE_STATISTICS = ("loss", "grad_norm", "lr", "load_balancing_loss", "seq_load_balancing_loss", "z_loss")


def step_means(steps: list[dict[str, float]]) -> dict[str, float]:
    """Each statistic's mean over the train steps that report it, except old_logprob_mismatch
    (mean |log pi - log pi_old| per token), the first step's: only its forward runs at the
    weights pi_old came from, so only there it measures how far the old log-probs the loss uses
    (recomputed, or the engine's with rl.reuse_rollout_logprobs) are from the trainer's own."""
    values: dict[str, list[float]] = {}
    for step in steps:
        for k, v in step.items():
            values.setdefault(k, []).append(v)
    return {k: v[0] if k == "old_logprob_mismatch" else sum(v) / len(v) for k, v in values.items()}


def train_iteration(it: Iteration, trained: dict, rl: RLConfig, kl_coef: float, trains_actor: bool, seed: int,
                    max_new_tokens: int) -> None:
    """The train phase: advantages, then the critic and (after its warm-up) the actor trained on
    the iteration's batch; records what it used and measured on `it`."""
    it.kl_coef, it.trains_actor = kl_coef, trains_actor
    it.kl_stats = add_advantages(it.batch, rl, kl_coef, max_new_tokens)
    training = {k: r for k, r in trained.items() if k == "critic" or trains_actor}
    it.train_stats = train_on_rollout(training, it.batch, rl, kl_coef, seed=seed)


# ----------------------------------------------------------------------------- roles
def build_roles(cfg: Config) -> dict:
    """Actor, reference; the reward model when rl.rewards has a model source; the critic when
    the algorithm has one; the holdout reward model when the RM stage trained one
    (rm.holdout_fraction)."""
    rl = cfg.rl
    # LR schedules run over every optimizer step: epochs x minibatches per iteration
    total_steps = rl.steps * rl.epochs * (rl.samples_per_iteration // rl.mini_batch_size)
    lora = cfg.lora if cfg.lora.applies_to("rl") else None
    actor = Actor(cfg.model, trainable=True, temperature=cfg.sampling.temperature, optimizer=rl.actor_optimizer,
                  total_steps=total_steps, lora=lora, seed=cfg.seed, max_consecutive_nonfinite=cfg.resilience.max_consecutive_nonfinite)
    # with LoRA the reference is the actor's frozen base: no second copy of the weights
    roles = {"actor": actor, "reference": AdapterFreeReference(actor) if lora else Reference(cfg.model, temperature=cfg.sampling.temperature)}
    if rl.has_reward_model:
        roles["reward"] = RewardModel(cfg.model)
    if rl.has_critic:
        roles["critic"] = Critic(cfg.model, trainable=True, optimizer=rl.critic_optimizer, total_steps=total_steps,
                                 lora=lora if lora and lora.critic else None, seed=cfg.seed, max_consecutive_nonfinite=cfg.resilience.max_consecutive_nonfinite)
    if cfg.rm.holdout_fraction > 0:  # the reward-hacking alarm's independent judge
        roles["holdout_reward"] = RewardModel(cfg.model)
    for role in roles.values():
        role.packing = rl.packing
    return roles


# ----------------------------------------------------------------------------- the stage
def train(cfg: Config) -> dict:
    rl = cfg.rl
    runner = StageRunner(cfg, "rl", rl.steps, rl.log_interval, rl.save_interval)
    data = load_stage_data(cfg, ("prompts_train", "prompts_eval"), stage="rl")
    cfg = data.config  # the run's vocabulary and start architecture resolved (stage_data.RunContext)
    # a prompt leaves room for one turn: the whole response, or an episode's first policy turn
    tok, max_prompt = data.tokenizer, rl.episode_token_budget(cfg.model) - cfg.sampling.max_new_tokens
    train_prompts, train_report = encode_prompt_records(data.splits["prompts_train"], tok, max_prompt)
    eval_prompts, _ = encode_prompt_records(data.splits["prompts_eval"], tok, max_prompt)
    prompts = Prompts(train_prompts, train_report, eval_prompts)
    roles = build_roles(cfg)
    sched = ColocationScheduler(roles, phases_for(roles, reward_in_generate=rl.dynamic_sampling,
                                                  engine=cfg.rollout.engine, asynchronous=rl.max_staleness > 0))
    rewards = RewardSources(cfg.rl.rewards, roles.get("reward"), micro_batch_size=rl.micro_batch_size,
                            micro_batch_tokens=rl.micro_batch_tokens)
    try:
        with make_engine(cfg.rollout, cfg.model, roles["actor"], tok.eos_id, tok.pad_id, workdir=runner.out,
                         seed=cfg.seed, verbose=cfg.logging.verbose,
                         routes=rl.replays_routes(cfg.model, cfg.rollout.engine)) as engine:
            return run_iterations(cfg, runner, data, roles, engine, sched, rewards, prompts)
    except RewardSourceError as err:  # stop once the checkpoints already started are committed
        runner.ckpt.wait()
        latest = runner.ckpt.latest()
        where = f"the last checkpoint is {latest}: rerun to resume from it" if latest else "no checkpoint yet: rerun starts over"
        raise RewardSourceError(f"{err}\n{where}") from err
    finally:
        rewards.close()


def run_iterations(cfg: Config, runner: StageRunner, data, roles: dict, engine, sched: ColocationScheduler,
                   rewards: RewardSources, prompts: Prompts) -> dict:
    rl, tok = cfg.rl, data.tokenizer
    engine = with_episodes(cfg, engine, tok)  # rl.environment: multi-turn episodes (rollout/episodes.py)
    trained = {name: roles[name] for name in ("actor", "critic") if name in roles}
    state = RLTrainerState(make_kl_controller(rl.kl_controller, rl.kl_coef, rl.kl_target, rl.kl_horizon),
                           RewardHackingAlarm(rl.reward_hacking_window), sched)
    sampler = EpochSampler(len(prompts.train), seed=cfg.seed)
    saved = runner.resume(trained, sampler)
    if runner.resumed:
        state.restore(saved)
    log = runner.log
    for line in (load_inputs(cfg, roles, fresh_start=not runner.resumed), runner.resumed,
                 f"prompts: {prompts.report}", *(f"warning: {w}" for w in warnings_for(cfg)), *lora_base_warnings(roles)):
        if line:
            log.info(line)
    sampling = SamplingParams.of(cfg.sampling)
    draw_prompts = PromptDraw(prompts.train, sampler, rl.rollout_batch_size)
    scoring = Scoring(rewards, tok, rl, roles.get("holdout_reward"))
    evaluate = PolicyEvaluation(engine, scoring.judges(), tok, data.task, prompts.eval, sampling, cfg.seed + EVAL_SEED_OFFSET)
    dp_rank = data_parallel()[0]

    def seed_of(batch: int) -> int:  # batch k's sampling seed: the step that trains it, as on-policy
        return cfg.seed * 100_003 + batch * 1_009 + dp_rank

    ahead = None  # rl.max_staleness >= 1: the engine's look-ahead (rl_async.py)
    if rl.max_staleness:
        ahead = AsyncRollouts(engine, prompts.train, draw_prompts.indices, rl, sampling, seed_of,
                              RolloutAudit(runner.out / "rollout_audit.jsonl", runner.step, rl.max_staleness))
        if runner.resumed:
            ahead.restore(saved)

    synced = sync_weights(engine, sched)  # False whenever the actor changed since
    with sched.phase("eval") as phase:
        state.latest = evaluate()
        phase.tokens = state.latest.response_tokens
    if not runner.resumed:
        state.before = state.latest.before()  # the starting (SFT) policy
    start = policy_start(cfg)[0].upper()  # SFT, or DPO when the pipeline runs it first
    log.info(f"eval of the {start if not runner.resumed else 'resumed'} policy: {format_scores(state.latest.metrics)}; "
             f"e.g. {state.latest.samples[: cfg.sampling.eval_samples_logged]}")
    sched.step_metrics()  # the first step reports its own phases only
    if not runner.resumed:
        log.log(0, state.latest.metrics)  # the SFT policy: the eval curves start here

    metrics, drain = {}, ahead.saved_state if ahead else None
    for step in runner.steps():
        seed = seed_of(step)
        if ahead:  # the engine must be idle before its refit: the batch it generates ahead lands in the buffer
            with sched.phase("wait"):
                ahead.wait_in_flight()
        synced = synced or sync_weights(engine, sched)
        # a reward source that fails here (no weights changed yet) leaves the last step checkpointed
        with runner.rewind_on((RewardSourceError,), state.samples_seen, ahead.snapshot() if ahead else None,
                              **state.saved()):
            with sched.phase("generate") as phase:
                if ahead:  # the buffered batch; the next one starts generating beside score and train
                    generation, batch = ahead.advance(step, version=step - 1)
                else:
                    generation = generate(engine, scoring, draw_prompts, rl, sampling, seed)
                # rl.max_failed_episodes: too many failed episodes stop the stage here, checkpointed
                env_metrics = engine.episode_metrics(generation.kept) if isinstance(engine, EpisodeEngine) else {}
                phase.tokens = int(generation.rollout.response_lengths().sum())
            runner.heartbeat.beat()
            with sched.phase("score") as phase:
                it = score_iteration(generation, scoring, roles, rl, recomputes_old_logprobs(rl, cfg.rollout.engine, step),
                                     rl.replays_routes(cfg.model, cfg.rollout.engine))
                phase.tokens = int(it.rollout.lengths.sum())
        runner.heartbeat.beat()
        with sched.phase("train") as phase:
            train_iteration(it, trained, rl, state.kl.value, step > rl.critic_warmup_steps, seed,
                            rl.response_width(cfg.model, cfg.sampling))
            synced = synced and not it.trains_actor
            phase.tokens = int(it.rollout.lengths.sum()) * rl.epochs
        metrics = {**iteration_metrics(it, tok, data.task, rl), **env_metrics}
        state.samples_seen += int(metrics.pop("responses"))
        state.last_mismatch.update({k: metrics[k] for k in ("logprob_mismatch", "mismatch_max_ratio") if k in metrics})
        if it.trains_actor:  # the actor does not move during critic warm-up: nothing to steer yet
            state.kl.update(metrics["kl_mean"], int(rl.samples_per_iteration))
        if warning := state.alarm.update(step, metrics):
            log.info(warning)
        evaluated = runner.due(rl.eval_interval)
        if evaluated:
            if ahead and not synced:  # the refit for the eval waits for the batch in flight
                with sched.phase("wait"):
                    ahead.wait_in_flight()
            synced = synced or sync_weights(engine, sched)
            with sched.phase("eval") as phase:
                FAULTS.at("eval")
                state.latest = evaluate(sft=state.before.get("per_prompt"))
                phase.tokens = state.latest.response_tokens
            metrics.update(state.latest.metrics)
            log.info(f"step {step} samples: {state.latest.samples[: cfg.sampling.eval_samples_logged]}")
        metrics.update(it.train_stats, **engine.metrics(), **rewards.pop_stats(), **skipped_steps(trained, by_role=True),
                       **sched.step_metrics(), **(ahead.metrics(step, batch) if ahead else {}))
        runner.end_step(metrics, state.samples_seen, evaluated, drain, **state.saved())

    metrics = {**state.last_mismatch, **metrics}  # the last measured one when the last iteration reused
    return runner.finish({**rl_summary(cfg, state, metrics, roles, data.sources), **(ahead.summary() if ahead else {})},
                         done_message(state.before["eval"], state.latest.metrics), roles=roles)


def recomputes_old_logprobs(rl: RLConfig, engine: str, step: int) -> bool:
    """Whether this iteration's score phase runs the actor for the old log-probs. With
    rl.reuse_rollout_logprobs the in-place engine's own (the same weights and softmax; they
    differ by float rounding only) stand in, except every rl.logprob_recompute_interval-th
    iteration (and the first), which recomputes them and measures the mismatch."""
    if not rl.reuse_rollout_logprobs or engine != "megatron":
        return True
    return step == 1 or (rl.logprob_recompute_interval > 0 and step % rl.logprob_recompute_interval == 0)


def sync_weights(engine, sched) -> bool:
    """Refit a separate rollout engine with the actor's current weights (the `sync` phase);
    the in-place engine samples from the actor itself. True: in sync."""
    if engine.needs_refit:
        with sched.phase("sync"):
            engine.update_weights()
    return True
