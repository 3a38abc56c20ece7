"""Tool-call parsers: a policy turn's text -> the tool calls it makes, by the name of a format
(rl.environment.tool_parser).

    json   <tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>
           (the Hermes / Qwen chat templates' format; "arguments" may also be a JSON string)
    tag    <calc>12*34</calc>   one tag per tool, named by the tool: ToolCall("calc", {"input": "12*34"})

A turn may hold several calls; text around them is ignored. A turn without calls is the
policy's final answer. A malformed call (bad JSON, no "name", an unclosed tag, a tool the
environment does not have) is the policy's mistake, not the environment's: it becomes an
entry of `ParsedCalls.errors`, which ToolEnvironment answers with an error observation, and
the episode goes on (the policy can learn to call tools properly; an episode failure would
instead drop the episode from training and count toward rl.max_failed_episodes).

`close_tag` is where a turn that calls a tool ends: the rollout engine stops the policy's
turn there (as it stops at EOS), and the environment answers.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass
class ParsedCalls:
    """The well-formed calls of a turn, in order, and one message per malformed one."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def is_final_answer(self) -> bool:
        """No call at all, well-formed or not: the policy answered."""
        return not self.calls and not self.errors


class ToolParser(ABC):
    """Finds the tool calls in a policy turn. `tool_names`: the environment's tools (a call to
    another name is an error)."""

    name: str
    open_tag: str
    close_tag: str

    def __init__(self, tool_names: tuple[str, ...]):
        self.tool_names = tuple(tool_names)

    @abstractmethod
    def parse(self, text: str) -> ParsedCalls:
        """The calls in `text`; never raises on what the policy wrote."""

    @abstractmethod
    def format(self, call: ToolCall) -> str:
        """The text of `call` in this format (demonstrations, tests): parse(format(c)) == [c]."""

    def _known(self, call: ToolCall, parsed: ParsedCalls) -> None:
        if call.name in self.tool_names:
            parsed.calls.append(call)
        else:
            parsed.errors.append(f"unknown tool {call.name!r}; the tools are {list(self.tool_names)}")


class JsonToolParser(ToolParser):
    name, open_tag, close_tag = "json", "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedCalls:
        parsed = ParsedCalls()
        bodies, unclosed = _blocks(text, self.open_tag, self.close_tag)
        for body in bodies:
            try:
                obj = json.loads(body)
            except ValueError as err:
                parsed.errors.append(f"a tool call is not JSON ({err.args[0] if err.args else err})")
                continue
            arguments = obj.get("arguments", {}) if isinstance(obj, dict) else None
            if isinstance(arguments, str):  # some templates write the arguments as a JSON string
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    arguments = None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(arguments, dict):
                parsed.errors.append('a tool call must be {"name": "<tool>", "arguments": {...}}')
                continue
            self._known(ToolCall(obj["name"], arguments), parsed)
        if unclosed:
            parsed.errors.append(f"{self.open_tag} is not closed ({self.close_tag})")
        return parsed

    def format(self, call: ToolCall) -> str:
        return f"{self.open_tag}{json.dumps({'name': call.name, 'arguments': call.arguments})}{self.close_tag}"


class TagToolParser(ToolParser):
    """`<tool>input</tool>` for each tool name; the input (stripped) is arguments["input"].
    A turn ends at the first closing tag of any tool; `close_tag` is the first tool's."""

    name = "tag"

    def __init__(self, tool_names: tuple[str, ...]):
        super().__init__(tool_names)
        if not self.tool_names:
            raise ValueError("the tag tool-call format needs the environment's tool names (one tag per tool)")
        self.open_tag, self.close_tag = f"<{self.tool_names[0]}>", f"</{self.tool_names[0]}>"
        names = "|".join(re.escape(n) for n in self.tool_names)
        self._any_tag = re.compile(rf"<(/?)({names})>")

    def parse(self, text: str) -> ParsedCalls:
        parsed, open_at = ParsedCalls(), None
        for tag in self._any_tag.finditer(text):
            closing, name = tag.group(1) == "/", tag.group(2)
            if not closing:
                if open_at is not None:
                    parsed.errors.append(f"<{open_at[0]}> is not closed before <{name}>")
                open_at = (name, tag.end())
            elif open_at is None or open_at[0] != name:
                parsed.errors.append(f"</{name}> closes no <{name}>")
                open_at = None
            else:
                parsed.calls.append(ToolCall(name, {"input": text[open_at[1]:tag.start()].strip()}))
                open_at = None
        if open_at is not None:
            parsed.errors.append(f"<{open_at[0]}> is not closed (</{open_at[0]}>)")
        return parsed

    def format(self, call: ToolCall) -> str:
        return f"<{call.name}> {call.arguments['input']} </{call.name}>"


def _blocks(text: str, open_tag: str, close_tag: str) -> tuple[list[str], bool]:
    """The bodies between open_tag and close_tag, and whether the last open_tag is unclosed."""
    bodies, start = [], 0
    while (begin := text.find(open_tag, start)) >= 0:
        end = text.find(close_tag, begin + len(open_tag))
        if end < 0:
            return bodies, True
        bodies.append(text[begin + len(open_tag):end])
        start = end + len(close_tag)
    return bodies, False


# Keyed by rl.environment.tool_parser (config/rl.py TOOL_PARSERS names the same formats).
TOOL_PARSERS: dict[str, type[ToolParser]] = {"json": JsonToolParser, "tag": TagToolParser}


def get_tool_parser(name: str, tool_names: tuple[str, ...], field_name: str = "rl.environment.tool_parser") -> ToolParser:
    if name not in TOOL_PARSERS:
        from megatron_rlhf.config import ConfigError

        raise ConfigError(f"{field_name}={name!r}: choose one of {tuple(TOOL_PARSERS)}")
    return TOOL_PARSERS[name](tool_names)
