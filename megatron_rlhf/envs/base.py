"""The environment interface and what an episode records.

An episode is prompt -> (policy turn -> environment turn)* -> final reward:

    start = env.reset(record)                        # the prompt record: {"prompt": ..., **extra}
    while not done:
        policy writes a turn (token ids; its text decoded from them)
        result = env.step(action_text, action_ids)   # StepResult(observation, done, reward, info)

An Environment is one episode's state: a fresh instance per episode (EnvironmentFactory makes
them), so an environment never has to tell episodes apart. ToolEnvironment is the usual base:
it parses tool calls (envs/tools.py), runs its tools and answers with their output; the
policy's final answer (a turn without calls) ends the episode with `final_reward`.

Failures (issue 39 item 5): the environment's own trouble (a tool that raises, a step that
takes longer than rl.environment.step_timeout_s, an answer that is not a StepResult) ends that
episode with `Episode.failure` set to one of FAILURE_REASONS and never the run;
`check_failed_fraction` stops the stage (TooManyFailedEpisodes) when more than
rl.max_failed_episodes of a batch's episodes failed. An environment service that cannot be
reached stops the stage at once (EnvironmentServiceDown). Both are RewardSourceErrors, so the
RL stage stops the way it does when a reward source fails: after the checkpoints already
started are committed, exit code 4, and a rerun resumes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from megatron_rlhf.envs.tools import ParsedCalls, ToolCall, ToolParser, get_tool_parser
from megatron_rlhf.rewards.base import RewardSourceError, finite_scores

# Why an episode failed (Episode.failure); the environment's fault, never the policy's.
RAISED = "raised"              # the environment or one of its tools raised (HTTP: answered "failure" or 5xx)
TIMED_OUT = "timed_out"        # a reset or step took longer than rl.environment.step_timeout_s
INVALID_OUTPUT = "invalid_output"  # it answered something that is not a StepResult / the schema
FAILURE_REASONS = (RAISED, TIMED_OUT, INVALID_OUTPUT)
# Why an episode ended without the environment saying done (Episode.truncated).
MAX_TURNS, MAX_TOTAL_TOKENS = "max_turns", "max_total_tokens"

# What an environment says: text (tokenized once, then appended as ids) or token ids.
Observation = str | list[int] | None


class EnvironmentFailure(RewardSourceError):
    """The environment stops the RL stage (not one episode): a RewardSourceError, so the stage
    stops as for a failed reward source (checkpoints committed, exit code 4, rerun resumes)."""


class EnvironmentServiceDown(EnvironmentFailure):
    """An environment service did not answer after its retries (refused connections, 503)."""


class TooManyFailedEpisodes(EnvironmentFailure):
    """More than rl.max_failed_episodes of a batch's episodes failed."""


class EpisodeFailed(Exception):
    """Raised inside an environment (or by the HTTP client) to end this episode with `reason`
    (one of FAILURE_REASONS) and `detail`; any other exception ends it as RAISED."""

    def __init__(self, reason: str, detail: str):
        if reason not in FAILURE_REASONS:
            raise ValueError(f"EpisodeFailed: reason {reason!r} is not one of {FAILURE_REASONS}")
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass
class EnvStart:
    """What reset returns: context shown to the policy after the prompt (e.g. the tool list,
    a system note), as text or ids; None: nothing. Never trained on."""

    observation: Observation = None


@dataclass
class StepResult:
    """The environment's answer to one policy turn.

    observation: what the policy reads next (text or ids; None or "" when done).
    done: the episode is over. reward: this turn's reward (None: none; the final turn's
    reward is the episode's outcome reward). tool_calls / tool_errors: the calls this turn
    made and the malformed ones (for the tool-call rate). info: free-form, logged."""

    observation: Observation = None
    done: bool = False
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)


class Environment(ABC):
    """One episode's environment. The episode runner makes one per episode and calls reset,
    step and close from its pool of threads (envs/pool.py), the environments of a turn's
    episodes at the same time, each instance by one thread at a time.

    thread_safe: whether instances of the class may run at the same time (True: they share no
    state that is not thread-safe). A class whose instances share such state (a module-level
    interpreter or tool process, a class attribute they write, the global `random`) sets it
    False: its calls then run one at a time, in episode order, each within step_timeout_s.
    concurrency: the most calls of a thread-safe class run at once (the runner's pool size).
    self_timed: its calls bound their own time (the HTTP client's per-request deadline and
    retries), so the runner does not time them out (a service down must not look like a timeout)."""

    thread_safe: bool = True
    concurrency: int = 32
    self_timed: bool = False

    @abstractmethod
    def reset(self, record: dict[str, Any]) -> EnvStart:
        """Start the episode of prompt record `record` ({"prompt": ..., **extra})."""

    @abstractmethod
    def step(self, action_text: str, action_ids: list[int]) -> StepResult:
        """Answer one policy turn: its ids as sampled and their decoded text."""

    def close(self) -> None:
        """Release what the episode holds (called once it ended, failed or not)."""


class ToolEnvironment(Environment):
    """An environment of tools: `tools` maps a tool name to a function of the call's arguments
    returning the observation text. A turn with calls gets their outputs (in order, joined by
    `separator`); a malformed call gets `error_observation(message)`; a turn without calls is
    the final answer: done, reward = final_reward(action_text)."""

    tools: dict[str, Callable[[dict[str, Any]], str]] = {}
    default_tool_parser = "json"
    separator = "\n"

    def __init__(self, tool_parser: str | None = None):
        self.parser: ToolParser = get_tool_parser(tool_parser or self.default_tool_parser, tuple(self.tools))
        self.record: dict[str, Any] = {}

    def reset(self, record: dict[str, Any]) -> EnvStart:
        self.record = record
        return EnvStart()

    @abstractmethod
    def final_reward(self, action_text: str) -> float:
        """The episode's reward for the policy's final answer (self.record is its prompt record)."""

    def error_observation(self, message: str) -> str:
        return f"error: {message}"

    def step(self, action_text: str, action_ids: list[int]) -> StepResult:
        parsed: ParsedCalls = self.parser.parse(action_text)
        if parsed.is_final_answer:
            return StepResult(done=True, reward=self.final_reward(action_text))
        outputs = [self.error_observation(message) for message in parsed.errors]
        for call in parsed.calls:
            output = self.tools[call.name](call.arguments)
            if not isinstance(output, str):
                raise EpisodeFailed(INVALID_OUTPUT, f"tool {call.name!r} returned {type(output).__name__}, not text")
            outputs.append(output)
        return StepResult(self.separator.join(outputs), tool_calls=parsed.calls, tool_errors=parsed.errors)


EnvironmentFactory = Callable[[], Environment]


# ----------------------------------------------------------------------------- the record


@dataclass
class Turn:
    """One policy turn and the environment's answer, as token ids appended to the trajectory."""

    policy_ids: list[int]
    observation_ids: list[int] = field(default_factory=list)  # template markers included
    reward: float | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Episode:
    """One episode as the trainer logs and trains it.

    tokens: the trajectory after the prompt, in order: start context, then each turn's policy
    ids and observation ids; `policy_mask[i]` is True where the policy sampled tokens[i] (they
    train) and False for environment and template tokens (context only). The ids are exactly
    the sampled and appended ones: nothing is decoded and encoded again."""

    record: dict[str, Any]
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    policy_mask: list[bool] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    done: bool = False
    truncated: str | None = None    # MAX_TURNS | MAX_TOTAL_TOKENS: ended without the environment's done
    failure: str | None = None      # one of FAILURE_REASONS: the environment failed; not trained on
    failure_detail: str = ""

    @property
    def ended(self) -> bool:
        return self.done or self.truncated is not None or self.failure is not None

    @property
    def rewards(self) -> list[float | None]:
        return [turn.reward for turn in self.turns]

    @property
    def final_reward(self) -> float | None:
        """The last turn's reward when the environment ended the episode; None otherwise."""
        return self.turns[-1].reward if self.done and self.turns else None

    @property
    def tool_calls(self) -> int:
        return sum(len(turn.tool_calls) for turn in self.turns)

    @property
    def length(self) -> int:
        """Prompt and trajectory tokens."""
        return len(self.prompt_ids) + len(self.tokens)

    def append(self, ids: list[int], sampled: bool) -> None:
        self.tokens.extend(ids)
        self.policy_mask.extend([sampled] * len(ids))

    def fail(self, reason: str, detail: str) -> None:
        self.failure, self.failure_detail = reason, detail


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """A batch's episode statistics for the trainer's log (failed episodes included)."""
    n = max(len(episodes), 1)
    return {
        "env_turns_per_episode": sum(len(e.turns) for e in episodes) / n,
        "env_tool_calls_per_episode": sum(e.tool_calls for e in episodes) / n,
        "env_tool_call_rate": sum(e.tool_calls > 0 for e in episodes) / n,  # episodes with at least one call
        "env_tool_error_rate": sum(any(t.tool_errors for t in e.turns) for e in episodes) / n,
        "env_episode_length": sum(e.length for e in episodes) / n,
        "env_truncated_fraction": sum(e.truncated is not None for e in episodes) / n,
        "env_failed_fraction": sum(e.failure is not None for e in episodes) / n,
    }


def check_failed_fraction(episodes: list[Episode], max_failed: float,
                          field_name: str = "rl.max_failed_episodes") -> float:
    """The failed fraction of `episodes`; TooManyFailedEpisodes when it is above `max_failed`."""
    failed = [e for e in episodes if e.failure is not None]
    fraction = len(failed) / len(episodes) if episodes else 0.0
    if fraction > max_failed:
        reasons = ", ".join(f"{reason}: {count}" for reason, count in Counter(e.failure for e in failed).most_common())
        raise TooManyFailedEpisodes(
            f"{len(failed)} of {len(episodes)} episodes failed ({fraction:.0%}), more than {field_name}={max_failed} "
            f"({reasons}); the first: {failed[0].failure_detail}. Fix the environment, or raise {field_name} to "
            "train on the episodes that succeed")
    return fraction


def check_step_result(result: Any, vocab_size: int | None) -> StepResult:
    """`result` if it is a StepResult with a usable observation and reward; else
    EpisodeFailed(INVALID_OUTPUT). `vocab_size` None: ids are not checked against a vocabulary."""
    if not isinstance(result, StepResult):
        raise EpisodeFailed(INVALID_OUTPUT, f"step returned {type(result).__name__}, not a StepResult")
    check_observation(result.observation, vocab_size)
    if not isinstance(result.done, bool):
        raise EpisodeFailed(INVALID_OUTPUT, f"done is {result.done!r}, not true or false")
    if not isinstance(result.info, dict):
        raise EpisodeFailed(INVALID_OUTPUT, f"info is {type(result.info).__name__}, not a dict")
    for name, item, kind in (("tool_calls", ToolCall, "ToolCall"), ("tool_errors", str, "str")):
        value = getattr(result, name)
        if not isinstance(value, (list, tuple)):
            raise EpisodeFailed(INVALID_OUTPUT, f"{name} is {type(value).__name__}, not a list of {kind}")
        if wrong := [type(v).__name__ for v in value if not isinstance(v, item)]:
            raise EpisodeFailed(INVALID_OUTPUT, f"{name} holds a {wrong[0]}, not a {kind}")
    if result.reward is not None:
        try:
            finite_scores([result.reward], 1)
        except ValueError as err:
            raise EpisodeFailed(INVALID_OUTPUT, f"the reward: {err}; give a finite number or None") from None
    return result


def check_observation(observation: Any, vocab_size: int | None) -> None:
    if observation is None or isinstance(observation, str):
        return
    if not isinstance(observation, list):
        raise EpisodeFailed(INVALID_OUTPUT, f"the observation is {type(observation).__name__}, not text or token ids")
    for position, token in enumerate(observation):
        if type(token) is not int or not 0 <= token < (vocab_size or token + 1):
            raise EpisodeFailed(INVALID_OUTPUT, f"observation token {position} is {token!r}, not a token id"
                                + (f" in [0, {vocab_size})" if vocab_size else ""))
