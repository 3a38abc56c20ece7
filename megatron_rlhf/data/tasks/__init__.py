"""Built-in tasks, looked up by the name given in `data.task`."""

from __future__ import annotations

from megatron_rlhf.data.tasks.arithmetic import ArithmeticTask
from megatron_rlhf.data.tasks.calculator import CalculatorTask
from megatron_rlhf.data.tasks.base import Task, TaskSizes, TaskSplits
from megatron_rlhf.data.tasks.sentiment import SentimentTask

TASKS: dict[str, type[Task]] = {"sentiment": SentimentTask, "arithmetic": ArithmeticTask, "calculator": CalculatorTask}

__all__ = [
    "TASKS", "ArithmeticTask", "CalculatorTask", "SentimentTask", "Task", "TaskSizes", "TaskSplits", "get_task",
]


def get_task(name: str) -> Task:
    """The built-in task called `name`."""
    if name not in TASKS:
        known = ", ".join(sorted(TASKS))
        raise ValueError(f"data.task: unknown task {name!r}; known tasks: {known}")
    return TASKS[name]()
