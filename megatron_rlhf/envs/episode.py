"""Running episodes turn by turn on token ids: what the rollout loop calls.

    runner = EpisodeRunner(factory, tokenizer, template, max_turns=..., max_total_tokens=..., step_timeout_s=...)
    episode = runner.start(record, prompt_ids)
    while not episode.ended:
        ids = <generate from prompt_ids + episode.tokens, at most runner.tokens_left(episode) new tokens,
               stopping at any of runner.stop_ids>
        runner.policy_turn(episode, ids)

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

import threading
from dataclasses import dataclass
from typing import Any, Callable

from megatron_rlhf.envs.base import (
    INVALID_OUTPUT, MAX_TOTAL_TOKENS, MAX_TURNS, RAISED, TIMED_OUT, EnvironmentFactory, EnvironmentFailure, EnvStart, Episode,
    EpisodeFailed, Observation, Turn, check_observation, check_step_result,
)


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
    episodes it runs at once are independent (one environment each)."""

    def __init__(self, factory: EnvironmentFactory, tokenizer, template: TurnTemplate, *, max_turns: int,
                 max_total_tokens: int, step_timeout_s: float, turn_tokens: int = 1):
        if max_turns < 1 or max_total_tokens < 1 or step_timeout_s <= 0 or turn_tokens < 1:
            raise ValueError(f"max_turns={max_turns}, max_total_tokens={max_total_tokens}, step_timeout_s="
                             f"{step_timeout_s}, turn_tokens={turn_tokens}: need >= 1, >= 1, > 0, >= 1")
        self.factory, self.tokenizer = factory, tokenizer
        self.max_turns, self.max_total_tokens, self.step_timeout_s = max_turns, max_total_tokens, step_timeout_s
        # An episode goes on only while a whole policy turn (sampling.max_new_tokens) still fits in
        # max_total_tokens: the engine generates every running episode's turn with one budget,
        # so a turn is never cut short by another episode's lack of room.
        self.turn_tokens = turn_tokens
        self.prefix_ids = marker_ids(tokenizer, template.observation_prefix, "observation_prefix")
        self.suffix_ids = marker_ids(tokenizer, template.observation_suffix, "observation_suffix")
        tool_end = marker_ids(tokenizer, template.tool_call_end, "tool_call_end")
        if len(tool_end) > 1:
            raise ValueError(f"TurnTemplate.tool_call_end={template.tool_call_end!r} encodes to {len(tool_end)} "
                             "tokens; the engine stops a turn at one token id: use a single-token marker")
        self.stop_ids = (tokenizer.eos_id, *tool_end)
        self._environments: dict[int, Any] = {}

    # --- the rollout loop's calls
    def start(self, record: dict[str, Any], prompt_ids: list[int]) -> Episode:
        """A new episode of prompt record `record`; the environment's start context (if any) is
        appended to its tokens as context."""
        episode = Episode(record, list(prompt_ids))
        environment = self.factory()
        self._environments[id(episode)] = environment
        start = self._call(episode, environment, environment.reset, record)
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
        self._end_if_over(episode)
        return episode

    def policy_turn(self, episode: Episode, action_ids: list[int], action_text: str | None = None) -> list[int]:
        """Record the policy's turn `action_ids`, step the environment, append its observation.
        Returns the ids appended after the policy's (template markers included; [] once the
        episode ended). `action_text`: the turn's text if the engine has it (else decoded)."""
        if episode.ended:
            raise ValueError("policy_turn on an episode that has ended (episode.ended)")
        episode.append(list(action_ids), sampled=True)
        if episode.length > self.max_total_tokens:
            raise ValueError(f"the policy's turn took the episode to {episode.length} tokens, past max_total_tokens="
                             f"{self.max_total_tokens}: generate at most tokens_left(episode) tokens")
        turn = Turn(list(action_ids))
        episode.turns.append(turn)
        text = self.tokenizer.decode(action_ids) if action_text is None else action_text
        environment = self._environments[id(episode)]
        result = self._call(episode, environment, environment.step, text, list(action_ids))
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
        self._end_if_over(episode)
        return turn.observation_ids

    def tokens_left(self, episode: Episode) -> int:
        """The most tokens the policy's next turn may have."""
        return max(self.max_total_tokens - episode.length, 0)

    def close(self) -> None:
        """Close the environments of episodes still running (a stage that stops early)."""
        for environment in self._environments.values():
            _close_quietly(environment)
        self._environments.clear()

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

    def _call(self, episode: Episode, environment, method: Callable, *args) -> Any:
        """method(*args) within step_timeout_s; a failure of the environment ends the episode
        (recorded) and returns None. EnvironmentFailure (a service down) propagates: it stops the stage."""
        try:
            if environment.self_timed:
                return method(*args)
            return _within(method, args, self.step_timeout_s)
        except EnvironmentFailure:
            raise
        except EpisodeFailed as failed:
            episode.fail(failed.reason, failed.detail)
        except Exception as err:  # the environment's code: any error ends this episode only
            episode.fail(RAISED, f"{type(environment).__name__}.{method.__name__} raised {type(err).__name__}: {err}")
        return None

    def _end_if_over(self, episode: Episode) -> None:
        if episode.ended and (environment := self._environments.pop(id(episode), None)) is not None:
            _close_quietly(environment)


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


def _within(method: Callable, args: tuple, timeout_s: float) -> Any:
    """method(*args) in a daemon thread, waiting at most timeout_s. A Python thread cannot be
    killed: a step that hangs keeps its thread (and its environment, which is dropped) until it
    returns; a service (rl.environment.type=http) contains such tools in another process."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = method(*args)
        except BaseException as err:  # noqa: BLE001  (re-raised in the caller's thread)
            box["error"] = err

    thread = threading.Thread(target=run, name="environment-step", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise EpisodeFailed(TIMED_OUT, f"{getattr(method, '__qualname__', method)} gave no answer within "
                            f"rl.environment.step_timeout_s={timeout_s} s")
    if "error" in box:
        raise box["error"]
    return box["result"]


def _close_quietly(environment) -> None:
    try:
        environment.close()
    except Exception:  # noqa: BLE001  (the episode is over; a failing close must not stop the others)
        pass
