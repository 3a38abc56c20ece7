"""rl.environment -> an EnvironmentFactory (a fresh Environment per episode) and an EpisodeRunner.

    class  "file.py:ClassName", imported from its file as rule reward functions are
           (rewards/function.py); a ToolEnvironment gets rl.environment.tool_parser
    http   HttpEnvironmentService(rl.environment.url, ...) (envs/http.py)
"""

from __future__ import annotations

from megatron_rlhf.config import ConfigError
from megatron_rlhf.config.model import ModelConfig
from megatron_rlhf.config.rl import EnvironmentConfig, RLConfig
from megatron_rlhf.envs.base import Environment, EnvironmentFactory, ToolEnvironment
from megatron_rlhf.envs.episode import EpisodeRunner, TurnTemplate
from megatron_rlhf.resilience.preemption import StageInterrupted
from megatron_rlhf.rewards.function import load_function


def load_environment_class(spec: str, field_name: str = "rl.environment.class_path") -> type[Environment]:
    """The Environment subclass `spec` ("path.py:ClassName") names, imported from its file."""
    cls, where = load_function(spec, field_name, kind="class")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"{field_name}={spec!r}: {where} is not a subclass of megatron_rlhf.envs.Environment "
                          "(reset(record) and step(action_text, action_ids); docs/environments.md)")
    return cls


class ClassFactory:
    """Makes one `cls` per episode; a ToolEnvironment with the configured tool parser. Carries
    the class's declarations (thread_safe, concurrency, self_timed) to the episode runner."""

    def __init__(self, cls: type[Environment], tool_parser: str | None, field_name: str):
        if tool_parser is not None and not issubclass(cls, ToolEnvironment):
            raise ConfigError(f"{field_name}.tool_parser={tool_parser!r}: {cls.__name__} is not a ToolEnvironment, "
                              f"so it parses its own actions; remove {field_name}.tool_parser")
        self.cls, self.tool_parser = cls, tool_parser
        self.thread_safe, self.concurrency, self.self_timed = cls.thread_safe, cls.concurrency, cls.self_timed
        if not (isinstance(self.concurrency, int) and self.concurrency >= 1):
            raise ConfigError(f"{field_name}.class_path: {cls.__name__}.concurrency={self.concurrency!r}: the most "
                              "calls of its environments run at once, an integer >= 1")
        try:  # a constructor or parser that fails, fails now, not in the first episode
            self().close()
        except ConfigError:
            raise
        except StageInterrupted:
            raise
        except BaseException as err:  # the user's code, SystemExit included
            raise ConfigError(f"{field_name}.class_path: making a {cls.__name__} and closing it raised "
                              f"{type(err).__name__}: {err}") from err

    def __call__(self) -> Environment:
        return self.cls(tool_parser=self.tool_parser) if issubclass(self.cls, ToolEnvironment) else self.cls()


def environment_factory(env: EnvironmentConfig, field_name: str = "rl.environment") -> EnvironmentFactory:
    if env.type == "class":
        return ClassFactory(load_environment_class(env.class_path, f"{field_name}.class_path"), env.tool_parser,
                            field_name)
    if env.type == "http":
        from megatron_rlhf.envs.http import HttpEnvironmentService

        return HttpEnvironmentService(env.url, step_timeout_s=env.step_timeout_s, max_retries=env.max_retries,
                                      backoff_s=env.backoff_s, max_backoff_s=env.max_backoff_s)
    raise ConfigError(f"{field_name}.type={env.type!r}: no environment to build (single-turn rollouts)")


def turn_template(env: EnvironmentConfig, tokenizer=None) -> TurnTemplate:
    """The turn template of rl.environment: a class's own `turn_template` attribute (the markers
    around observations, the tool-call end); else, when `tokenizer` has a chat template
    (data.chat_template), the one read off it for rl.environment.observation_role
    (envs/chat_turns.py); else none (observations unframed, only EOS ends a turn)."""
    if env.type == "class":
        own = getattr(load_environment_class(env.class_path), "turn_template", None)
        if own is not None:
            return own
    chat = getattr(tokenizer, "chat_template", None)
    if chat is not None:
        from megatron_rlhf.envs.chat_turns import turn_template_from_chat

        return turn_template_from_chat(chat, tokenizer.special_tokens()["eos_token"], env.observation_role)
    return TurnTemplate()


def episode_runner(rl: RLConfig, model: ModelConfig, tokenizer, template: TurnTemplate,
                   turn_tokens: int = 1) -> EpisodeRunner:
    """The RL section's episode runner: its environment, rl.max_turns, rl.max_total_tokens, the
    step timeout; `turn_tokens`: a policy turn's budget (sampling.max_new_tokens)."""
    return EpisodeRunner(environment_factory(rl.environment), tokenizer, template, max_turns=rl.max_turns,
                         max_total_tokens=rl.episode_token_budget(model),
                         step_timeout_s=rl.environment.step_timeout_s, turn_tokens=turn_tokens)
