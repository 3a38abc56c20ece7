"""Running episodes turn by turn on token ids: what the rollout loop calls.

    runner = EpisodeRunner(factory, tokenizer, template, max_turns=..., max_total_tokens=..., step_timeout_s=...)
    episodes = runner.start_all(records, prompts)           # runner.start(record, prompt_ids): one
    while running := [e for e in episodes if not e.ended]:
        ids = <generate from each prompt_ids + episode.tokens, at most runner.tokens_left(episode) new tokens,
               stopping at any of runner.stop_ids>
        runner.policy_turns(running, ids)                   # runner.policy_turn(episode, ids): one

A batch's environment calls (the factory's and reset, each turn's steps, the closes) run at
the same time in a bounded pool of threads (envs/pool.py), each within step_timeout_s of its own
start, and the caller waits once for all of them, interruptibly (a signal's StageInterrupted
ends the wait). Their results are applied in the episodes' order, so an episode never depends
on which call finished first. Whatever the environment's code raises, SystemExit and
KeyboardInterrupt included, fails that episode; EnvironmentFailure (a service down) stops the
stage.

Token in, token out: the policy's ids are appended as sampled; an observation is tokenized
once, on its own, and appended between the template's marker ids (encoded once, at start).
The trajectory is never decoded and encoded again, so the ids the trainer sees are the ids
the engine sampled, and `episode.policy_mask` marks which of them the policy wrote.

A turn that calls a tool ends at the tool format's closing tag (`stop_ids`: EOS and that
tag's id); the engine continues the episode after the observation. Limits: rl.max_turns
policy turns; rl.max_total_tokens for prompt and trajectory together (an observation that
does not fit, with room for one more policy token, ends the episode as truncated).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from megatron_rlhf.envs.base import (
    INVALID_OUTPUT, MAX_TOTAL_TOKENS, MAX_TURNS, RAISED, TIMED_OUT, Environment, EnvironmentFactory, EnvironmentFailure,
    EnvStart, Episode, EpisodeFailed, Observation, Turn, check_observation, check_step_result,
)
from megatron_rlhf.envs.pool import Outcome, run_calls


@dataclass(frozen=True)
class TurnTemplate:
    """The text around an observation in the trajectory, and the text that ends a policy turn
    calling a tool (besides EOS). Each must encode to the same ids alone as inside a
    conversation: marker tokens (the word tokenizer's "<obs>", a chat model's special tokens)."""

    observation_prefix: str = ""
    observation_suffix: str = ""
    tool_call_end: str = ""  # e.g. "</calc>", "</tool_call>"; "" when only EOS ends a turn


class EpisodeRunner:
    """Steps episodes of a factory's environments on token ids. One per rollout worker; the
    episodes it runs at once are independent (one environment each).

    The rollout loop calls it a batch at a time: `start_all` resets every episode's environment,
    `policy_turns` steps every running episode's: their calls run at the same time (envs/pool.py:
    at most `workers`, each within step_timeout_s of its own start), and their results are
    applied in the episodes' order, so what an episode becomes never depends on which call
    finished first. The factory says how its environments may run (`environment_policy`): a
    class with `thread_safe = False` runs one call at a time, in episode order."""

    def __init__(self, factory: EnvironmentFactory, tokenizer, template: TurnTemplate, *, max_turns: int,
                 max_total_tokens: int, step_timeout_s: float, turn_tokens: int = 1, workers: int | None = None):
        if max_turns < 1 or max_total_tokens < 1 or step_timeout_s <= 0 or turn_tokens < 1:
            raise ValueError(f"max_turns={max_turns}, max_total_tokens={max_total_tokens}, step_timeout_s="
                             f"{step_timeout_s}, turn_tokens={turn_tokens}: need >= 1, >= 1, > 0, >= 1")
        self.factory, self.tokenizer = factory, tokenizer
        self.max_turns, self.max_total_tokens, self.step_timeout_s = max_turns, max_total_tokens, step_timeout_s
        # An episode goes on only while a whole policy turn (sampling.max_new_tokens) still fits in
        # max_total_tokens: the engine generates every running episode's turn with one budget,
        # so a turn is never cut short by another episode's lack of room.
        self.turn_tokens = turn_tokens
        self.workers, self.self_timed = environment_policy(factory, workers)
        self.prefix_ids = marker_ids(tokenizer, template.observation_prefix, "observation_prefix")
        self.suffix_ids = marker_ids(tokenizer, template.observation_suffix, "observation_suffix")
        tool_end = marker_ids(tokenizer, template.tool_call_end, "tool_call_end")
        if len(tool_end) > 1:
            raise ValueError(f"TurnTemplate.tool_call_end={template.tool_call_end!r} encodes to {len(tool_end)} "
                             "tokens; the engine stops a turn at one token id: use a single-token marker")
        self.stop_ids = (tokenizer.eos_id, *tool_end)
        self._environments: dict[int, Any] = {}

    # --- the rollout loop's calls
    def start_all(self, records: list[dict[str, Any]], prompts: list[list[int]]) -> list[Episode]:
        """A new episode per prompt record (records[i] with prompts[i]): each gets a fresh
        environment (the factory's call is the episode's: a constructor that fails fails that
        episode), reset with its record; the start context (if any) is appended as context."""
        episodes = [Episode(record, list(ids)) for record, ids in zip(records, prompts)]
        made: list[Any] = [None] * len(episodes)

        def begin(index: int) -> Any:
            made[index] = environment = self.factory()
            return environment.reset(episodes[index].record)

        outcomes = self._run([partial(begin, i) for i in range(len(episodes))])
        for episode, environment, outcome in zip(episodes, made, outcomes):
            if environment is not None:
                self._environments[id(episode)] = environment
            where = (f"{type(environment).__name__}.reset" if environment is not None
                     else f"making the environment ({_name(self.factory)})")
            start = self._result(episode, outcome, where)
            if episode.failure is None:
                try:
                    if not isinstance(start, EnvStart):
                        raise EpisodeFailed(INVALID_OUTPUT, f"reset returned {type(start).__name__}, not an EnvStart")
                    check_observation(start.observation, self.tokenizer.vocab_size)
                    self._observe(episode, start.observation, ends_turn=False)
                except EpisodeFailed as failed:
                    episode.fail(failed.reason, failed.detail)
            if episode.length + self.turn_tokens > self.max_total_tokens and not episode.ended:
                episode.truncated = MAX_TOTAL_TOKENS  # the prompt leaves no room for a whole turn
        self._close_ended(episodes)
        return episodes

    def policy_turns(self, episodes: list[Episode], actions: list[list[int]],
                     texts: list[str | None] | None = None) -> list[list[int]]:
        """Record each episode's policy turn `actions[i]`, step their environments (at the same
        time), append their observations. Returns each episode's ids appended after the policy's
        (template markers included; [] once it ended). `texts[i]`: the turn's text if the engine
        has it (else decoded)."""
        texts = texts if texts is not None else [None] * len(episodes)
        for episode, action_ids in zip(episodes, actions):
            if episode.ended:
                raise ValueError("policy_turn on an episode that has ended (episode.ended)")
            if episode.length + len(action_ids) > self.max_total_tokens:
                raise ValueError(f"the policy's turn took the episode to {episode.length + len(action_ids)} tokens, "
                                 f"past max_total_tokens={self.max_total_tokens}: generate at most "
                                 "tokens_left(episode) tokens")
        calls, turns = [], []
        for episode, action_ids, text in zip(episodes, actions, texts):
            episode.append(list(action_ids), sampled=True)
            turns.append(Turn(list(action_ids)))
            episode.turns.append(turns[-1])
            text = self.tokenizer.decode(action_ids) if text is None else text
            calls.append(partial(self._environments[id(episode)].step, text, list(action_ids)))
        outcomes = self._run(calls)
        for episode, turn, outcome in zip(episodes, turns, outcomes):
            where = f"{type(self._environments[id(episode)]).__name__}.step"
            result = self._result(episode, outcome, where)
            if episode.failure is None:
                try:
                    result = check_step_result(result, self.tokenizer.vocab_size)
                except EpisodeFailed as failed:
                    episode.fail(failed.reason, failed.detail)
            if episode.failure is None:
                turn.reward, turn.info = result.reward, result.info
                turn.tool_calls, turn.tool_errors = list(result.tool_calls), list(result.tool_errors)
                episode.done = result.done
                if not result.done:
                    if len(episode.turns) >= self.max_turns:
                        episode.truncated = MAX_TURNS
                    else:
                        turn.observation_ids = self._observe(episode, result.observation, ends_turn=True)
        self._close_ended(episodes)
        return [turn.observation_ids for turn in turns]

    def start(self, record: dict[str, Any], prompt_ids: list[int]) -> Episode:
        """One episode: start_all of one."""
        return self.start_all([record], [prompt_ids])[0]

    def policy_turn(self, episode: Episode, action_ids: list[int], action_text: str | None = None) -> list[int]:
        """One episode's turn: policy_turns of one."""
        return self.policy_turns([episode], [action_ids], [action_text])[0]

    def tokens_left(self, episode: Episode) -> int:
        """The most tokens the policy's next turn may have."""
        return max(self.max_total_tokens - episode.length, 0)

    def close(self) -> None:
        """Close the environments of episodes still running (a stage that stops early)."""
        environments = list(self._environments.values())
        self._environments.clear()
        self._close(environments)

    # --- inside
    def _observe(self, episode: Episode, observation: Observation, ends_turn: bool) -> list[int]:
        """Append `observation` between the template's markers as context; [] when there is
        none at the start, or when it does not fit (then the episode is truncated)."""
        if not observation and not ends_turn:
            return []
        ids = observation if isinstance(observation, list) else self.tokenizer.encode(observation or "")
        framed = [*self.prefix_ids, *ids, *self.suffix_ids]
        if episode.length + len(framed) + self.turn_tokens > self.max_total_tokens:  # no room for the next turn
            episode.truncated = MAX_TOTAL_TOKENS
            return []
        episode.append(framed, sampled=False)
        return framed

    def _run(self, calls: list[Callable[[], Any]]) -> list[Outcome]:
        """The calls' outcomes (envs/pool.py). EnvironmentFailure (a service down) raised by any
        of them is raised here at once: it stops the stage."""
        return run_calls(calls, self.workers, None if self.self_timed else self.step_timeout_s,
                         stop_on=EnvironmentFailure)

    def _result(self, episode: Episode, outcome: Outcome, where: str) -> Any:
        """The call's value; or None with the episode failed: a call past step_timeout_s, or
        anything the environment's code raised (any BaseException: a tool's SystemExit fails
        its episode, not the stage)."""
        if outcome.timed_out:
            episode.fail(TIMED_OUT, f"{where} gave no answer within rl.environment.step_timeout_s="
                                    f"{self.step_timeout_s} s")
        elif isinstance(outcome.error, EpisodeFailed):
            episode.fail(outcome.error.reason, outcome.error.detail)
        elif outcome.error is not None:
            err = outcome.error
            episode.fail(RAISED, f"{where} raised {type(err).__name__}" + (f": {err}" if str(err) else ""))
        return outcome.value

    def _close_ended(self, episodes: list[Episode]) -> None:
        self._close([self._environments.pop(id(e)) for e in episodes if e.ended and id(e) in self._environments])

    def _close(self, environments: list[Any]) -> None:
        """Close `environments` (best effort: what a close raises or a close that hangs changes nothing)."""
        if environments:
            run_calls([environment.close for environment in environments], self.workers,
                      None if self.self_timed else self.step_timeout_s)


def environment_policy(factory: EnvironmentFactory, workers: int | None = None) -> tuple[int, bool]:
    """(how many of the factory's environment calls may run at once, whether they bound their own
    time): read off the factory (a class, loading.ClassFactory, the HTTP service), as the class
    declares them (Environment.thread_safe, .concurrency, .self_timed; a plain function's
    environments are taken to be the defaults'). `workers` overrides the pool size of a
    thread-safe factory."""
    def declared(name: str) -> Any:
        return getattr(factory, name, getattr(Environment, name))

    size = workers if workers is not None else declared("concurrency")
    if size < 1:
        raise ValueError(f"workers={size}: need >= 1")
    return (size if declared("thread_safe") else 1), bool(declared("self_timed"))


def marker_ids(tokenizer, text: str, name: str) -> list[int]:
    """The ids of a template marker; ValueError when the tokenizer does not know it."""
    if not text:
        return []
    ids = tokenizer.encode(text)
    unk = getattr(tokenizer, "unk_id", None)
    if not ids or (unk is not None and unk in ids):
        raise ValueError(f"TurnTemplate.{name}={text!r} is not in the tokenizer's vocabulary (it encodes to {ids}); "
                         "a built-in task must list its markers among its words")
    return ids


def _name(factory) -> str:
    """A factory's name for messages: its class's (loading.ClassFactory), its own, or its type's."""
    return (getattr(getattr(factory, "cls", None), "__name__", None) or getattr(factory, "__qualname__", None)
            or type(factory).__name__)
