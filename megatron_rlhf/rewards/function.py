"""Rule rewards: a Python function in a user's file, `rl.rewards: [{type: function, function: path.py:name}]`.

The function is called once per batch with keyword arguments (more may be added; accept
**kwargs):

    def score(prompts, responses, prompt_ids, response_ids, finished, extras, **kwargs) -> list[float]

prompts / responses: text; prompt_ids / response_ids: token ids (response_ids end with the
EOS token when `finished`); extras: each prompt's JSONL fields other than `prompt`. It returns
one finite float per response, in order. rewards/arithmetic.py is an example.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable

from megatron_rlhf.config import ConfigError
from megatron_rlhf.resilience.preemption import StageInterrupted
from megatron_rlhf.rewards.base import RewardInputs, RewardSourceError, finite_scores

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def resolve_function_file(spec: str, field_name: str) -> tuple[Path, str]:
    """(file, function name) of "path.py:name": a relative path from the working directory,
    else from the project root (where the shipped examples live)."""
    file, name = spec.rsplit(":", 1)
    path = Path(file)
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, PROJECT_ROOT / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve(), name
    raise ConfigError(f"{field_name}={spec!r}: file not found (looked in {', '.join(str(c) for c in candidates)})")


def load_function(spec: str, field_name: str, kind: str = "function") -> tuple[Callable, str]:
    """The function (or class: `kind`) `spec` names, imported from its file; (it, "file:name"
    for messages)."""
    path, name = resolve_function_file(spec, field_name)
    module_spec = importlib.util.spec_from_file_location(f"megatron_rlhf_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except StageInterrupted:
        raise
    except BaseException as err:  # the user's file, SystemExit at import included: theirs, named
        raise ConfigError(f"{field_name}={spec!r}: importing {path} failed: {type(err).__name__}: {err}") from err
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{field_name}={spec!r}: {path} has no {kind} {name!r}")
    return fn, f"{path}:{name}"


class FunctionReward:
    """A rule reward: calls the user's function and checks what it returns."""

    def __init__(self, spec: str, label: str, field_name: str):
        self.fn, self.where = load_function(spec, field_name)
        self.label = label

    def score(self, inputs: RewardInputs) -> list[float]:
        try:
            scores = self.fn(prompts=inputs.prompts, responses=inputs.responses, prompt_ids=inputs.prompt_ids,
                             response_ids=inputs.response_ids, finished=inputs.finished, extras=inputs.extras)
        except StageInterrupted:  # a signal (SIGTERM) while the function ran: the stage's, not the function's
            raise
        except BaseException as err:  # the user's code, SystemExit and KeyboardInterrupt included:
            # stop with its file named, exit code 4, never a clean exit or a bare traceback)
            raise RewardSourceError(f"reward function {self.where} raised {type(err).__name__}: {err}") from err
        return check_scores(scores, len(inputs), f"reward function {self.where}")

    def pop_stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def check_scores(scores, count: int, source: str) -> list[float]:
    """One finite real number per response, as floats; RewardSourceError naming the problem."""
    try:
        return finite_scores(scores, count)
    except ValueError as err:
        raise RewardSourceError(f"{source}: {err}") from None
