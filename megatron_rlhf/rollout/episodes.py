"""Multi-turn rollouts: episodes of an environment (rl.environment) run turn by turn with any
rollout engine, token in and token out.

Each turn, the episodes still running are generated together (one budget, sampling.max_new_tokens:
an episode goes on only while a whole turn fits in rl.max_total_tokens) from their whole trajectory so
far (prompt + every earlier turn's ids, as ids: the engine's `generate` with the trajectory as
its prompt; vLLM's prompt token ids, the in-place engine's prefill of it), each row stopping at
EOS, at the tool-call end marker (SamplingParams.stop_token_ids) or at the turn's token budget;
then the environment answers every turn (envs/episode.py: EpisodeRunner) and its observation ids
are appended. Nothing is decoded and encoded again: the ids trained on are the ids sampled.

The in-place engine keeps its KV cache from one turn to the next (its `turn_cache`, sized for
rl.max_total_tokens): a turn feeds each row only what it has not cached (the last turn's final
token and the observation), as one chunk after the cached keys, and decodes from there; rows of
episodes that ended are dropped from the cache. vLLM gets each turn's whole trajectory as prompt
token ids and computes it again (its prefix cache is off: see rollout/vllm_engine.py).

Process discipline: the engine's generate is collective over the replica (model-parallel and
context-parallel ranks hold the same rows). The environments run on the replica's first rank
only (a service must see each step once), which hands every turn's episodes to the others
(`broadcast_object_list`: host objects, once per turn). Every data-parallel rank runs as many
turns as the one with the most (an expert-parallel engine's forward is collective over them);
a rank whose episodes have all ended takes part without rows (the in-place engine idles in the
others' forwards: generates_without_rows) or generates for a stand-in row and drops it.

The rollout built at the end is a Rollout (right-padded, sequence layout) whose policy_mask
marks the tokens the policy sampled and env_reward holds each episode's reward (the sum of its
turns' rewards); `finished` is True for episodes the environment ended (done), not truncated
or failed. A failed episode keeps its row, with a policy_mask of zeros: a group keeps its size
and the episode trains on nothing. An MoE actor's routes (routing replay) are each position's
experts as the turn that fed it recorded them (EpisodeRoutes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlhf.envs.base import Episode
from megatron_rlhf.envs.episode import EpisodeRunner
from megatron_rlhf.parallel import device
from megatron_rlhf.parallel.collectives import any_rank, errors_agreed
from megatron_rlhf.rollout.base import Rollout, SamplingParams

# the seed of turn k's generate: distinct per turn, the same for a rerun of the iteration
_TURN_SEED_STRIDE = 1_000_003


def replica_groups() -> list:
    """The groups over which one data-parallel replica's ranks hold the same rows: megatron's
    model-parallel group, then (context parallelism) the CP group. Empty outside a distributed run."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized() or not ps.model_parallel_is_initialized():
        return []
    groups = [ps.get_model_parallel_group()]
    if ps.get_context_parallel_world_size() > 1:
        groups.append(ps.get_context_parallel_group())
    return [g for g in groups if dist.get_world_size(g) > 1]


def runs_environments() -> bool:
    """Whether this rank steps the replica's environments (the first rank of each replica group)."""
    return all(dist.get_rank() == dist.get_process_group_ranks(g)[0] for g in replica_groups())


def share_episodes(episodes: list[Episode] | None) -> list[Episode]:
    """The replica's first rank's `episodes` on every rank of the replica (None elsewhere)."""
    for group in replica_groups():
        box = [episodes]
        dist.broadcast_object_list(box, src=dist.get_process_group_ranks(group)[0], group=group)
        episodes = box[0]
    return episodes


def generate_episodes(engine, runner: EpisodeRunner | None, prompts: list[list[int]], records: list[dict[str, Any]],
                      sampling: SamplingParams, seed: int) -> tuple[Rollout, list[Episode]]:
    """One episode per prompt (records[i]: prompt i's record for the environment's reset),
    generated with `engine`, stepped by `runner` (None on ranks that do not run environments:
    runs_environments), within the runner's max_total_tokens (prompt included; rl.max_total_tokens);
    `sampling.max_new_tokens` is the runner's turn_tokens. Returns the rollout and the episodes, the same on every rank of a replica."""
    mine = runs_environments()
    episodes = None
    with _stops_every_rank():
        if mine:  # every episode's environment made and reset at the same time (the runner's pool)
            episodes = runner.start_all(records, prompts)
    episodes = share_episodes(episodes)
    logprobs: list[list[float]] = [[0.0] * len(e.tokens) for e in episodes]  # per trajectory token
    turn_sampling = dataclasses.replace(sampling, stop_token_ids=tuple(runner.stop_ids[1:]) if mine else ())
    turn_sampling, capacity = _same_on_replica(turn_sampling, runner.max_total_tokens if mine else 0)
    cache = engine.turn_cache(capacity) if hasattr(engine, "turn_cache") else None
    routes = EpisodeRoutes(len(episodes), capacity)
    turn = 0
    while any_rank(any(not e.ended for e in episodes)):
        active = [i for i, e in enumerate(episodes) if not e.ended]
        keys, sequences = active, [episodes[i].prompt_ids + episodes[i].tokens for i in active]
        if not active and not getattr(engine, "generates_without_rows", False):
            # a stand-in row (one token, key None) keeps a rank whose episodes ended in the
            # collective turns of the others (the in-place engine takes part without one)
            keys, sequences = [None], [episodes[0].prompt_ids[:1]]
        # every running episode has room for a whole turn (the runner's turn_tokens): one budget for all
        turn_seed = seed + _TURN_SEED_STRIDE * turn
        out = (engine.generate(sequences, turn_sampling, turn_seed, cache=cache, keys=keys) if cache is not None
               else engine.generate(sequences, turn_sampling, turn_seed))
        if active:
            routes.add_turn(out.routes, active)
        new_ids, new_logprobs = _new_tokens(out, [len(s) for s in sequences])
        with _stops_every_rank():
            if mine and active:  # the turn's environment steps at the same time, applied in episode order
                runner.policy_turns([episodes[i] for i in active], new_ids[:len(active)])
        if active:
            for i, lps in zip(active, new_logprobs):
                logprobs[i].extend(lps)
            episodes = share_episodes(episodes if mine else None)
            for i in active:  # observation ids appended after the policy's: context, log-prob 0
                logprobs[i] = logprobs[i][:_policy_end(episodes[i])]
                logprobs[i].extend([0.0] * (len(episodes[i].tokens) - len(logprobs[i])))
        turn += 1
    return build_rollout(episodes, logprobs, engine.pad_id, routes.tensor), episodes


class EpisodeRoutes:
    """The experts an MoE actor's routers chose for every position of each episode (routing
    replay: models/routing.py), put together from the turns' rollouts: a turn's routes cover
    the positions it fed, and only those (with the in-place engine's turn cache: the last turn's
    final token, the observation and the new tokens; positions cached from earlier turns keep
    the routes recorded when they were fed; vLLM, which computes every turn's trajectory again,
    covers the whole trajectory but its last token). A position no turn fed (a trajectory's last
    token) stays unrouted, as in a single-turn rollout. `tensor`: [episodes, width, layers, k] on
    the device, or None when the engine returns no routes."""

    def __init__(self, episodes: int, capacity: int):
        self.episodes, self.capacity = episodes, capacity
        self.tensor: torch.Tensor | None = None

    def add_turn(self, turn: torch.Tensor | None, rows: list[int]) -> None:
        """`turn`: a generate's routes [len(rows), w, layers, k] for the episodes `rows`."""
        if turn is None:
            return
        unrouted = torch.iinfo(turn.dtype).max
        if self.tensor is None:
            self.tensor = torch.full((self.episodes, self.capacity, *turn.shape[2:]), unrouted, dtype=turn.dtype,
                                     device=turn.device)
        index = torch.tensor(rows, device=turn.device)
        width = turn.size(1)
        known = self.tensor[index, :width]
        self.tensor[index, :width] = torch.where(turn == unrouted, known, turn)


def _stops_every_rank():
    """An environment failure that stops the stage (a service down: EnvironmentFailure), raised
    where the environments run, is raised on every rank of the world after the block (no rank
    left waiting in the next turn's collectives); the others say where to look."""
    from megatron_rlhf.envs.base import EnvironmentFailure

    return errors_agreed(lambda: EnvironmentFailure("the environment of another data-parallel replica stopped the "
                                                    "stage (see that rank's error)"), catch=EnvironmentFailure)


def _same_on_replica(sampling: SamplingParams, capacity: int) -> tuple[SamplingParams, int]:
    """The first rank's stop ids and episode capacity (max_total_tokens) on every rank of the
    replica (only it has the runner)."""
    box = [(sampling.stop_token_ids, capacity)]
    for group in replica_groups():
        dist.broadcast_object_list(box, src=dist.get_process_group_ranks(group)[0], group=group)
    stops, capacity = box[0]
    return dataclasses.replace(sampling, stop_token_ids=tuple(stops)), capacity


def _policy_end(episode: Episode) -> int:
    """Trajectory tokens up to and including the last token the policy sampled."""
    mask = episode.policy_mask
    return max((i + 1 for i, sampled in enumerate(mask) if sampled), default=0)


def _new_tokens(out: Rollout, starts: list[int]) -> tuple[list[list[int]], list[list[float]]]:
    """Each row's generated ids and their log-probs (host lists: one read per turn)."""
    tokens, logprobs, lengths = out.tokens.tolist(), out.logprobs.tolist(), out.lengths.tolist()
    return ([row[s:n] for row, s, n in zip(tokens, starts, lengths)],
            [lp[s - 1:n - 1] for lp, s, n in zip(logprobs, starts, lengths)])


def build_rollout(episodes: list[Episode], logprobs: list[list[float]], pad_id: int,
                  routes: torch.Tensor | None = None) -> Rollout:
    """The episodes as a Rollout (see the module docstring), on this rank's device; `routes`
    (EpisodeRoutes.tensor): each episode's routes, cut to the rollout's width."""
    width = max(len(e.prompt_ids) + len(e.tokens) for e in episodes)
    batch = len(episodes)
    tokens = torch.full((batch, width), pad_id, dtype=torch.long)
    logprob = torch.zeros(batch, width)
    policy = torch.zeros(batch, width)
    for row, (e, lps) in enumerate(zip(episodes, logprobs)):
        p, n = len(e.prompt_ids), len(e.prompt_ids) + len(e.tokens)
        tokens[row, :n] = torch.tensor(e.prompt_ids + e.tokens, dtype=torch.long)
        if n > p:  # position t predicts token t+1: the trajectory's token j sits at p + j
            logprob[row, p - 1:n - 1] = torch.tensor(lps[:n - p])
            if e.failure is None:
                policy[row, p - 1:n - 1] = torch.tensor(e.policy_mask, dtype=torch.float)
    lengths = torch.tensor([len(e.prompt_ids) + len(e.tokens) for e in episodes])
    prompt_lengths = torch.tensor([len(e.prompt_ids) for e in episodes])
    finished = torch.tensor([e.done and e.failure is None and e.truncated is None for e in episodes])
    reward = torch.tensor([episode_reward(e) for e in episodes], dtype=torch.float32)
    dev = device()
    return Rollout(tokens.to(dev), prompt_lengths.to(dev), lengths.to(dev), (logprob * policy).to(dev), finished.to(dev),
                   routes=routes[:, :width].contiguous() if routes is not None else None,
                   policy_mask=policy.to(dev), env_reward=reward.to(dev))


def episode_reward(episode: Episode) -> float:
    """The environment's reward of an episode: the sum of its turns' rewards (0 when failed)."""
    if episode.failure is not None:
        return 0.0
    return float(sum(t.reward for t in episode.turns if t.reward is not None))


class EpisodeEngine:
    """A rollout engine whose generate runs multi-turn episodes (generate_episodes) with
    `engine`; `runner` steps the environments (None on ranks that do not: runs_environments).

    An iteration may generate several times (rl.dynamic_sampling: one generate per sampling
    round), so the engine keeps the episodes of every generate since `new_iteration()` (or the
    last `episode_metrics`), in order; `episode_metrics(kept)` reports those the iteration trains
    on (global means) and stops the stage (TooManyFailedEpisodes) when more than `max_failed` of
    all of them failed: a round of failures must not hide behind a clean later round.
    `check_evaluation` holds an evaluation's episodes to the same limit (trainers/policy_eval.py)."""

    runs_episodes = True

    def __init__(self, engine, runner: EpisodeRunner | None, max_failed: float):
        self.engine, self.runner = engine, runner
        self.max_failed = max_failed
        self.needs_refit, self.pad_id = engine.needs_refit, engine.pad_id
        self.episodes: list[Episode] = []  # this rank's, of the last generate
        self.iteration_episodes: list[Episode] = []  # this rank's, of every generate not yet reported

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seed: int,
                 records: list[dict[str, Any]] | None = None) -> Rollout:
        records = records if records is not None else [{} for _ in prompts]
        rollout, self.episodes = generate_episodes(self.engine, self.runner, prompts, records, sampling, seed)
        self.iteration_episodes.extend(self.episodes)
        return rollout

    def new_iteration(self) -> None:
        """Forget the episodes generated since the last report (an evaluation's): the next
        `episode_metrics` counts the generates from here on."""
        self.iteration_episodes = []

    def episode_metrics(self, kept: torch.Tensor | None = None) -> dict[str, float]:
        """Statistics of the episodes generated since `new_iteration` (or the last call), over
        every data-parallel rank, which it then forgets. Collective: every rank calls it once per
        iteration. The env_* means (envs/base.py: episode_metrics) describe the episodes trained
        on: `kept`, the indices of the kept rows among every row generated (Generation.kept;
        None: all). The failure limit counts every episode generated (its fraction is
        env_failed_fraction_all_rounds): above rl.max_failed_episodes, TooManyFailedEpisodes is
        raised on every rank."""
        from megatron_rlhf.envs.base import episode_metrics
        from megatron_rlhf.parallel.collectives import dp_sum

        generated, self.iteration_episodes = self.iteration_episodes, []
        trained = generated if kept is None else [generated[i] for i in kept.tolist()]
        local, n = episode_metrics(trained), len(trained)
        failed = [e for e in generated if e.failure is not None]
        counts = [n, len(failed), len(generated)]
        totals = dp_sum(torch.tensor([v * n for v in local.values()] + counts, dtype=torch.float64, device=device()))
        *sums, n_trained, n_failed, n_generated = totals.tolist()
        metrics = {k: v / max(n_trained, 1) for k, v in zip(local, sums)}
        metrics["env_failed_fraction_all_rounds"] = n_failed / max(n_generated, 1)
        self._limit_failures(metrics["env_failed_fraction_all_rounds"], failed,
                             "of the episodes generated this iteration (every sampling round)")
        return metrics

    def check_evaluation(self) -> dict[str, float]:
        """rl.max_failed_episodes for an evaluation: the episodes of the last generate (the
        eval's), over every data-parallel rank; above it, TooManyFailedEpisodes on every rank
        (an eval of failed episodes scores nothing). Returns their statistics (envs/base.py
        episode_metrics, means over every rank) as eval_env_*: the held-out tool-call rate.
        Collective: every rank calls it."""
        from megatron_rlhf.envs.base import episode_metrics
        from megatron_rlhf.parallel.collectives import dp_sum

        failed = [e for e in self.episodes if e.failure is not None]
        local, mine = episode_metrics(self.episodes), len(self.episodes)
        n_failed, n, *sums = dp_sum(torch.tensor([len(failed), mine, *(v * mine for v in local.values())],
                                                 dtype=torch.float64, device=device())).tolist()
        self._limit_failures(n_failed / max(n, 1), failed, "of the evaluation's episodes")
        return {f"eval_{name}": total / max(n, 1) for name, total in zip(local, sums)}

    def _limit_failures(self, fraction: float, failed: list[Episode], which: str) -> None:
        from megatron_rlhf.envs.base import TooManyFailedEpisodes

        if fraction > self.max_failed:
            first = f"; here, e.g. {failed[0].failure}: {failed[0].failure_detail}" if failed else ""
            raise TooManyFailedEpisodes(
                f"{fraction:.0%} {which} failed, more than rl.max_failed_episodes={self.max_failed}{first}. Fix the "
                "environment, or raise rl.max_failed_episodes to train on the episodes that succeed")

    def update_weights(self) -> None:
        self.engine.update_weights()

    def metrics(self) -> dict[str, float]:
        return self.engine.metrics()

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.close()
        self.engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def records_of(rows) -> list[dict[str, Any]]:
    """The environment's reset records of prompt rows (data/encode.py EncodedPrompt): the prompt
    text and the record's other fields."""
    return [{"prompt": p.example.prompt, **dict(p.example.extra)} for p in rows]


def sample_rows(engine, rows, sampling: SamplingParams, seed: int) -> Rollout:
    """`engine`'s rollout of prompt rows; a multi-turn engine gets each row's record too."""
    ids = [p.ids for p in rows]
    if getattr(engine, "runs_episodes", False):
        return engine.generate(ids, sampling, seed, records=records_of(rows))
    return engine.generate(ids, sampling, seed)


def with_episodes(cfg, engine, tokenizer):
    """`engine` as the RL stage uses it: wrapped in an EpisodeEngine when rl.environment is set
    (its runner on the ranks that run environments), else itself."""
    rl = cfg.rl
    if not rl.multi_turn:
        return engine
    from megatron_rlhf.envs.loading import episode_runner, turn_template

    runner = (episode_runner(rl, cfg.model, tokenizer, turn_template(rl.environment, tokenizer),
                             cfg.sampling.max_new_tokens)
              if runs_environments() else None)
    return EpisodeEngine(engine, runner, rl.max_failed_episodes)
