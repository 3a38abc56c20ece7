"""CalculatorEnv: the built-in multi-turn task's environment (data/tasks/calculator.py).

    rl.environment: {type: class, class_path: megatron_rlhf/envs/calculator.py:CalculatorEnv}

One tool, `calc`, in the tag format by default (<calc> 3 4 7 * 2 1 </calc>): it evaluates +, -
and * on integers with the task's own parser (no eval) and answers the value spelled digit by
digit, or "error" for an expression it cannot evaluate (the policy's mistake: the episode goes
on). The final turn "answer <number>" ends the episode with reward 1.0 when the number is the
prompt record's `answer`, else 0.0 (the task's gold scorer judges the same text the same way).
TURN_TEMPLATE frames observations with the vocabulary's "<obs>" / "</obs>" and ends a tool
turn at "</calc>".
"""

from __future__ import annotations

from typing import Any

from megatron_rlhf.data.tasks.calculator import (
    CALL_CLOSE, ERROR, OBSERVATION_CLOSE, OBSERVATION_OPEN, TOOL_NAME, CalculatorError, evaluate, final_answer, spell,
)
from megatron_rlhf.envs.base import ToolEnvironment
from megatron_rlhf.envs.episode import TurnTemplate

TURN_TEMPLATE = TurnTemplate(observation_prefix=OBSERVATION_OPEN, observation_suffix=OBSERVATION_CLOSE,
                             tool_call_end=CALL_CLOSE)


def calculator(arguments: dict[str, Any]) -> str:
    """The `calc` tool: the value of arguments["input"] (tag format) or arguments["expression"] (json)."""
    expression = arguments.get("input", arguments.get("expression"))
    if not isinstance(expression, str):
        return ERROR
    try:
        return spell(evaluate(expression))
    except CalculatorError:
        return ERROR


class CalculatorEnv(ToolEnvironment):
    tools = {TOOL_NAME: calculator}
    turn_template = TURN_TEMPLATE
    default_tool_parser = "tag"
    separator = " "  # the word tokenizer's only separator

    def reset(self, record: dict[str, Any]):
        if "answer" not in record:
            raise ValueError(f"CalculatorEnv: the prompt record has no 'answer' (its fields: {sorted(record)}); use "
                             "data.task=calculator's prompts, or give each record its exact answer")
        return super().reset(record)

    def error_observation(self, message: str) -> str:
        return ERROR  # in the vocabulary; the message's words are not

    def final_reward(self, action_text: str) -> float:
        return 1.0 if final_answer(action_text) == int(self.record["answer"]) else 0.0
