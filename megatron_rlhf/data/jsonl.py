"""Datasets of records, validated while they are read: JSONL (one JSON object per line), and
through data/readers.py a parquet file or a `datasets.save_to_disk` directory, chosen by path.

Every error starts with `path:line: ` (`path:row N: ` for parquet and Arrow) and names the
field, so one bad record in a 100k-line file is found at once instead of surfacing as a shape
error mid-training. `RecordFields` maps each record field to the column it is read from.

Records are flat (`prompt`/`response`, `prompt`/`chosen`/`rejected`, `prompt`) or
conversations: a `messages` list of {role: system|user|assistant|tool, content} (SFT: the whole
conversation; prompts: without the answer), a `prompt` list of messages with a `response`
list (SFT) or with `chosen`/`rejected` (preferences: each a list of messages, one message,
or a string: the assistant's answer); a preference record without `prompt` takes the
messages its `chosen` and `rejected` lists share. data/chat.py renders conversations.
Tool use, as transformers' apply_chat_template takes it: an assistant message may carry
`tool_calls` (then its content may be empty or null), a `tool` message (a tool's result, after
an assistant or another tool message) `tool_call_id` and `name`; a conversation record's
`tools` (function schemas: a list, or a JSON string of one) is passed to the template.

A prompts record may carry fields besides `prompt` (a reference `answer`, unit tests, ...):
they are kept in `PromptExample.extra` for rule rewards, and written back flattened. SFT and
preference records ignore fields they do not use.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from megatron_rlhf.data.errors import DataError

PathLike = str | os.PathLike[str]


ROLES = ("system", "user", "assistant", "tool")
# A conversation record's function schemas, passed to the chat template as `tools=`.
TOOLS_FIELD = "tools"
# Levels of lists and objects a record may nest: more than any real record has, few enough that
# nothing downstream (pickling a prompt's extra fields, json, templates) runs out of recursion.
MAX_NESTING = 100
Messages = tuple[dict[str, Any], ...]  # {"role": ..., "content": ...} each (+ tool_calls, tool_call_id, name)
Tools = tuple[dict[str, Any], ...]  # function schemas, as apply_chat_template(tools=...) takes them


@dataclass(frozen=True)
class RecordFields:
    """The column (JSONL key, parquet / Arrow column) each record field is read from."""

    # The prompt: a string, or (conversations) a list of {role, content} messages.
    prompt: str = "prompt"
    # An SFT record's answer: a string, or the assistant message(s) after a `prompt` list.
    response: str = "response"
    # A preference record's preferred answer: a string, a message, or a list of messages.
    chosen: str = "chosen"
    # A preference record's dispreferred answer, in the shape of `chosen`.
    rejected: str = "rejected"
    # A conversation (SFT: ending with the assistant's answer; prompts: without it).
    messages: str = "messages"


@dataclass(frozen=True)
class SFTExample:
    """A prompt and the response the policy should learn to give. A conversation record has
    `messages`, trained on its assistant messages from index `first_trained` on (prompt and
    response then hold its last user and assistant texts, for display)."""

    prompt: str
    response: str
    messages: Messages | None = field(default=None, hash=False)
    first_trained: int = 0
    tools: Tools | None = field(default=None, hash=False)  # the record's `tools`, for the template


@dataclass(frozen=True)
class PreferenceExample:
    """A prompt with a preferred (`chosen`) and a dispreferred (`rejected`) response. A
    conversation record has the three as message lists too (`*_messages`)."""

    prompt: str
    chosen: str
    rejected: str
    prompt_messages: Messages | None = field(default=None, hash=False)
    chosen_messages: Messages | None = field(default=None, hash=False)
    rejected_messages: Messages | None = field(default=None, hash=False)
    tools: Tools | None = field(default=None, hash=False)  # the record's `tools`, for the template

    def chosen_example(self) -> SFTExample:
        """The prompt and the chosen response as an SFT example."""
        if self.chosen_messages is None:
            return SFTExample(self.prompt, self.chosen)
        prompt = self.prompt_messages or ()
        return SFTExample(self.prompt, self.chosen, prompt + self.chosen_messages, len(prompt), self.tools)


@dataclass(frozen=True)
class PromptExample:
    """A prompt for the policy to answer during PPO or evaluation.

    `extra` holds the record's other JSON fields (e.g. a reference `answer`), which rule
    rewards receive next to the response. It never holds `prompt`: written out, the record is
    `{"prompt": ..., **extra}`, so such a key would overwrite the prompt.
    """

    prompt: str
    # hash=False keeps instances hashable (a dict is not); equality still compares extras.
    extra: dict[str, Any] = field(default_factory=dict, hash=False)
    # A conversation to answer (rendered with the chat template and its generation prompt);
    # `prompt` is then its last user message, which reward functions receive.
    messages: Messages | None = field(default=None, hash=False)
    # The record's `tools` (also kept in `extra` as written), passed to the template.
    tools: Tools | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.extra, dict):
            raise TypeError(
                f"PromptExample.extra: expected a dict, got {type(self.extra).__name__}"
            )
        if "prompt" in self.extra:
            raise ValueError(
                "PromptExample.extra: must not contain the key 'prompt' (the prompt is the "
                "`prompt` field); rename that extra field"
            )
        # JSON object keys are strings; any other key would come back as a different key.
        bad_keys = [key for key in self.extra if not isinstance(key, str)]
        if bad_keys:
            raise ValueError(f"PromptExample.extra: keys must be strings, got {bad_keys!r}")


Record = TypeVar("Record", SFTExample, PreferenceExample, PromptExample)


def read_sft(path: PathLike, fields: RecordFields = RecordFields()) -> list[SFTExample]:
    """Read SFT examples (`prompt`, `response`, or `messages`) from a JSONL, parquet or Arrow dataset."""
    return _read_records(path, _sft_record, fields)


def read_preferences(path: PathLike, fields: RecordFields = RecordFields()) -> list[PreferenceExample]:
    """Read preference pairs (`prompt`, `chosen`, `rejected`) from a JSONL, parquet or Arrow dataset."""
    return _read_records(path, _preference_record, fields)


def read_prompts(path: PathLike, fields: RecordFields = RecordFields()) -> list[PromptExample]:
    """Read prompts (`prompt` or `messages`, plus any other fields, kept in `extra`) from a
    JSONL, parquet or Arrow dataset."""
    return _read_records(path, _prompt_record, fields)


def read_first(path: PathLike, kind: str, fields: RecordFields = RecordFields()) -> Any:
    """The first record of a data file of `kind` (sft, preference, prompts), or None when it has
    none: a look at its shape (flat or conversations) without reading it all."""
    make_record = {"sft": _sft_record, "preference": _preference_record, "prompts": _prompt_record}[kind]
    for where, obj in _read_rows(Path(path)):
        return make_record(obj, where, fields)
    return None


def write_jsonl(path: PathLike, records: Iterable[Any]) -> int:
    """Write dataclass records as one UTF-8 JSON object per line; returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w", encoding="utf-8", newline="\n") as handle:
        for record in records:
            if not dataclasses.is_dataclass(record) or isinstance(record, type):
                raise TypeError(
                    f"{path}: write_jsonl takes dataclass instances, got {type(record).__name__}"
                )
            # ensure_ascii=False keeps non-English text readable in the file.
            handle.write(json.dumps(_json_object(record), ensure_ascii=False) + "\n")
            count += 1
    return count


def _json_object(record: Any) -> dict[str, Any]:
    """The JSON object a record is written as; the inverse of its reader."""
    if isinstance(record, PromptExample):
        # Flattened, as users write prompt files: `extra` is not a field name in the file.
        head = {"prompt": record.prompt} if record.messages is None else {"messages": list(record.messages)}
        return {**head, **record.extra}
    if isinstance(record, SFTExample) and record.messages is not None:
        k, messages = record.first_trained, list(record.messages)
        tools = {} if record.tools is None else {TOOLS_FIELD: list(record.tools)}
        return {"messages": messages, **tools} if k == 0 else {"prompt": messages[:k], "response": messages[k:], **tools}
    if isinstance(record, PreferenceExample) and record.chosen_messages is not None:
        tools = {} if record.tools is None else {TOOLS_FIELD: list(record.tools)}
        return {"prompt": list(record.prompt_messages or ()), "chosen": list(record.chosen_messages),
                "rejected": list(record.rejected_messages), **tools}
    return {key: value for key, value in dataclasses.asdict(record).items()
            if key in ("prompt", "response", "chosen", "rejected")}


def _read_records(path: PathLike, make_record: Callable[..., Record], fields: RecordFields) -> list[Record]:
    records = [make_record(obj, where, fields) for where, obj in _read_rows(Path(path))]
    if not records:
        raise DataError(f"{path}: no records (the file is empty or has only blank lines)")
    return records


def _read_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(`path:line` or `path:row N`, record) of a JSONL file, a parquet file or a save_to_disk directory."""
    if path.is_dir() or path.suffix == ".parquet":
        from megatron_rlhf.data.readers import arrow_rows  # imports pyarrow: only when asked for

        return arrow_rows(path)
    return _read_objects(path)


# ShareGPT (`conversations` of {from, value}): refused with the conversion, not read as something else.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
SHAREGPT_FIX = ("convert it to 'messages' of {role, content}: from " + ", ".join(f"{a} -> role {b}" for a, b in
                SHAREGPT_ROLES.items()) + "; value -> content (docs/data.md, \"ShareGPT records\", has a one-line "
                "conversion)")


def _refuse_sharegpt(obj: dict[str, Any], where: str, fields: RecordFields, needed: str) -> None:
    """A ShareGPT record lacking the field `needed`: refused naming the format and the conversion."""
    conversations = obj.get("conversations")
    if (needed not in obj and fields.messages not in obj and isinstance(conversations, list)
            and any(isinstance(m, dict) and "from" in m and "value" in m for m in conversations)):
        raise DataError(f"{where}: field 'conversations': a ShareGPT record ({{from, value}} messages); {SHAREGPT_FIX}")


def _sft_record(obj: dict[str, Any], where: str, fields: RecordFields) -> SFTExample:
    _refuse_sharegpt(obj, where, fields, fields.prompt)
    if obj.get(fields.messages) is not None:  # (a parquet row has every column; null: not this record's)
        messages = _messages(obj, fields.messages, where)
        _ends_with(messages, "assistant", fields.messages, where)
        return SFTExample(_last(messages, "user"), messages[-1]["content"], messages, 0, _tools(obj, where))
    if isinstance(obj.get(fields.prompt), list):  # a conversation's prompt and its answer
        prompt = _messages(obj, fields.prompt, where)
        response = _answer(obj, fields.response, where)
        return SFTExample(_last(prompt, "user"), response[-1]["content"], prompt + response, len(prompt),
                          _tools(obj, where))
    return SFTExample(_string_field(obj, fields.prompt, where), _string_field(obj, fields.response, where))


def _preference_record(obj: dict[str, Any], where: str, fields: RecordFields) -> PreferenceExample:
    _refuse_sharegpt(obj, where, fields, fields.prompt)
    names = (fields.prompt, fields.chosen, fields.rejected)
    if any(isinstance(obj.get(name), (list, dict)) for name in names):
        return _chat_preference(obj, where, fields)
    prompt, chosen, rejected = (_string_field(obj, name, where) for name in names)
    if chosen == rejected:
        # A pair with nothing to prefer would only teach the reward model noise.
        raise DataError(f"{where}: fields '{fields.chosen}' and '{fields.rejected}': identical")
    return PreferenceExample(prompt, chosen, rejected)


def _chat_preference(obj: dict[str, Any], where: str, fields: RecordFields) -> PreferenceExample:
    chosen, rejected = _answer(obj, fields.chosen, where), _answer(obj, fields.rejected, where)
    if isinstance(obj.get(fields.prompt), list):
        prompt = _messages(obj, fields.prompt, where)
    else:  # implicit prompt: the messages both sides share (a text prompt beside them, as
        # UltraFeedback's, repeats their first user message: TRL reads such records this way too)
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if not prompt:
            raise DataError(f"{where}: field '{fields.prompt}': missing, and '{fields.chosen}' and "
                            f"'{fields.rejected}' share no messages to take it from")
    if chosen == rejected:
        raise DataError(f"{where}: fields '{fields.chosen}' and '{fields.rejected}': identical")
    for side, name in ((chosen, fields.chosen), (rejected, fields.rejected)):
        _ends_with(side, "assistant", name, where)
    return PreferenceExample(_last(prompt, "user"), chosen[-1]["content"], rejected[-1]["content"],
                             prompt, chosen, rejected, _tools(obj, where))


def _prompt_record(obj: dict[str, Any], where: str, fields: RecordFields) -> PromptExample:
    _refuse_sharegpt(obj, where, fields, fields.prompt)
    extra = {key: value for key, value in obj.items() if key not in (fields.prompt, fields.messages, "prompt")}
    column = fields.messages if obj.get(fields.messages) is not None else fields.prompt
    if isinstance(obj.get(column), list):
        messages = _messages(obj, column, where)
        if messages[-1]["role"] == "assistant":
            raise DataError(f"{where}: field '{column}': ends with an assistant message; a prompt ends with "
                            "the message the policy answers (leave the answer out, or put it in another field)")
        return PromptExample(_last(messages, "user"), extra, messages, _tools(obj, where))
    return PromptExample(_string_field(obj, fields.prompt, where), extra)


def _messages(obj: dict[str, Any], name: str, where: str) -> Messages:
    """The list of {role, content} messages in field `name` (other keys of a message are left out)."""
    value = obj.get(name)
    if name not in obj:
        raise DataError(f"{where}: field '{name}': missing")
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field '{name}': expected a non-empty list of {{role, content}} messages, "
                        f"got {_json_type(value) if value != [] else 'an empty list'}")
    messages = []
    for i, message in enumerate(value):
        at = f"{where}: field '{name}'[{i}]"
        if not isinstance(message, dict):
            raise DataError(f"{at}: expected a {{role, content}} object, got {_json_type(message)}")
        if "role" not in message and "from" in message and "value" in message:
            raise DataError(f"{at}: a ShareGPT message ({{from, value}}), not {{role, content}}; {SHAREGPT_FIX}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise DataError(f"{at}: role {role!r}: expected one of {ROLES}")
        calls = message.get("tool_calls") or None  # (a parquet row's null or empty list: no calls)
        if calls is not None:
            if role != "assistant":
                raise DataError(f"{at}: tool_calls on a {role!r} message; only an assistant message calls tools")
            _check_tool_calls(calls, at)
            content = "" if content is None else content  # a turn that only calls tools
        if role == "tool" and (not messages or messages[-1]["role"] not in ("assistant", "tool")):
            raise DataError(f"{at}: a tool message (a tool's result) must follow the assistant message that "
                            "called the tool (or another tool message)")
        may_be_empty = role in ("system", "tool") or calls is not None
        if not isinstance(content, str) or (not may_be_empty and not content.strip()):
            got = _json_type(content) if not isinstance(content, str) else "an empty string"
            hint = "; json.dumps a structured tool result" if role == "tool" and content is not None else ""
            raise DataError(f"{at}: content: expected a non-empty string, got {got}{hint}")
        kept: dict[str, Any] = {"role": role, "content": content}
        if calls is not None:
            kept["tool_calls"] = calls
        for key in ("tool_call_id", "name") if role == "tool" else ():
            if message.get(key) is not None:
                if not isinstance(message[key], str):
                    raise DataError(f"{at}: {key}: expected a string, got {_json_type(message[key])}")
                kept[key] = message[key]
        messages.append(kept)
    return tuple(messages)


def _check_tool_calls(calls: Any, at: str) -> None:
    """An assistant message's tool_calls: a list of {type: function, function: {name, arguments}}
    (or {name, arguments}), arguments an object or a JSON string, as apply_chat_template takes them."""
    shape = "{type: function, function: {name, arguments}}"
    if not isinstance(calls, list):
        raise DataError(f"{at}: tool_calls: expected a list of {shape} objects, got {_json_type(calls)}")
    for j, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name.strip():
            raise DataError(f"{at}: tool_calls[{j}]: expected {shape} with a non-empty name, got {call!r:.200}")
        arguments = function.get("arguments", {})
        if not isinstance(arguments, (dict, str)):
            raise DataError(f"{at}: tool_calls[{j}]: arguments: expected an object or a JSON string, got "
                            f"{_json_type(arguments)}")


def _tools(obj: dict[str, Any], where: str) -> Tools | None:
    """A conversation record's `tools` (function schemas): a list of objects, or a JSON string of
    one (as datasets often store it); None when the record has none."""
    value = obj.get(TOOLS_FIELD)
    if value is None or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError, ValueError) as exc:
            raise DataError(f"{where}: field '{TOOLS_FIELD}': a string that is not JSON ({exc}); give a list of "
                            "function schemas") from None
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise DataError(f"{where}: field '{TOOLS_FIELD}': expected a list of function schema objects "
                        "({type: function, function: {name, description, parameters}}), got "
                        f"{_json_type(value)}")
    return tuple(value) or None


def _answer(obj: dict[str, Any], name: str, where: str) -> Messages:
    """A response field of a conversation: a list of messages, one message, or the assistant's text."""
    value = obj.get(name)
    if isinstance(value, str):
        return ({"role": "assistant", "content": _string_field(obj, name, where)},)
    if isinstance(value, dict):
        return _messages({name: [value]}, name, where)
    return _messages(obj, name, where)


def _ends_with(messages: Messages, role: str, name: str, where: str) -> None:
    if messages[-1]["role"] != role:
        raise DataError(f"{where}: field '{name}': the last message is the {messages[-1]['role']}'s; "
                        f"it must be the {role}'s (the answer trained on)")


def _last(messages: Messages, role: str) -> str:
    return next((m["content"] for m in reversed(messages) if m["role"] == role), "")


def _read_objects(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (`path:line`, object) for every non-blank line."""
    try:
        # Bytes, decoded line by line, so invalid UTF-8 is reported at its own line.
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None
    for number, line_bytes in enumerate(raw.split(b"\n"), start=1):
        where = f"{path}:{number}"
        try:
            # utf-8-sig on the first line drops a BOM that some editors write.
            line = line_bytes.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(
                f"{where}: invalid UTF-8 ({exc.reason} at byte {exc.start} of the line)"
            ) from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        except RecursionError:
            raise DataError(f"{where}: JSON nested too deeply to read (more levels than Python's recursion limit, "
                            f"{sys.getrecursionlimit()}); flatten the record") from None
        except ValueError:  # (not a JSONDecodeError) an integer of more digits than Python reads
            raise DataError(f"{where}: an integer of more than {sys.get_int_max_str_digits()} digits, which Python "
                            "will not read; write it as a string") from None
        if not isinstance(obj, dict):
            raise DataError(f"{where}: line is not a JSON object (got {_json_type(obj)})")
        if line.count("[") + line.count("{") > MAX_NESTING:  # (a quick look first: most lines nest a few levels)
            _check_nesting(obj, where)
        if "\\u" in line:  # only an escape can write a lone surrogate (\ud800-\udfff), which is not text
            _check_encodable(obj, where)
        yield where, obj


def _check_nesting(obj: dict[str, Any], where: str) -> None:
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_NESTING:
            raise DataError(f"{where}: lists and objects nested more than {MAX_NESTING} levels deep; flatten the "
                            "record (a level this deep is no conversation, and pickling it would fail later)")
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((item, depth + 1) for item in items if isinstance(item, (dict, list)))


def _check_encodable(obj: dict[str, Any], where: str) -> None:
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(f"{where}: a string holds a lone UTF-16 surrogate ({exc.object[exc.start:exc.end]!r}), which "
                        "is not text (a \\ud800-\\udfff escape without its pair); fix or drop it") from None


def _string_field(obj: dict[str, Any], name: str, where: str) -> str:
    if name not in obj:
        raise DataError(f"{where}: field '{name}': missing")
    value = obj[name]
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{name}': expected a string, got {_json_type(value)}")
    if value == "":
        raise DataError(f"{where}: field '{name}': empty string")
    if not value.strip():
        raise DataError(f"{where}: field '{name}': whitespace-only string")
    return value


def _json_type(value: Any) -> str:
    # Python names (int, list, NoneType) are what the examples in errors use; null reads better.
    return "null" if value is None else type(value).__name__
