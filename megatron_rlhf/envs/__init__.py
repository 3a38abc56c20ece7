"""Multi-turn environments and tools: what an episode is made of (rollout/episodes.py runs them in the RL stage).

    base.py        Environment (reset / step), ToolEnvironment, StepResult, the Episode record,
                   failure reasons, check_failed_fraction, episode_metrics
    tools.py       tool-call parsers by name: json (<tool_call>{...}</tool_call>), tag (<calc>...</calc>)
    episode.py     EpisodeRunner: runs episodes turn by turn on token ids (token in, token out),
                   with the step timeout, rl.max_turns and rl.max_total_tokens; TurnTemplate
    pool.py        a turn's environment calls at the same time (bounded, hung calls replaced)
    http.py        the environment service schema (megatron_rlhf.env.v1) and its client
    server.py      any Environment class served over that schema (tests, demos)
    loading.py     rl.environment -> a factory of environments ("file.py:Class" or a URL), a runner
    calculator.py  CalculatorEnv: the built-in `calculator` task's environment

docs/environments.md: writing an environment, the HTTP schema, parsers, failure handling.
"""

from megatron_rlhf.envs.base import (
    FAILURE_REASONS, EnvironmentFailure, EnvironmentServiceDown, EnvStart, Environment, Episode, EpisodeFailed,
    StepResult, ToolEnvironment, TooManyFailedEpisodes, Turn, check_failed_fraction, episode_metrics,
)
from megatron_rlhf.envs.episode import EpisodeRunner, TurnTemplate
from megatron_rlhf.envs.tools import TOOL_PARSERS, ParsedCalls, ToolCall, get_tool_parser

__all__ = [
    "FAILURE_REASONS", "TOOL_PARSERS", "EnvStart", "Environment", "EnvironmentFailure", "EnvironmentServiceDown",
    "Episode", "EpisodeFailed", "EpisodeRunner", "ParsedCalls", "StepResult", "ToolCall", "ToolEnvironment",
    "TooManyFailedEpisodes", "Turn", "TurnTemplate", "check_failed_fraction", "episode_metrics", "get_tool_parser",
]
