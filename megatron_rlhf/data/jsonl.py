"""JSONL datasets: one JSON object per line, validated while it is read.

Every error starts with `path:line: ` and names the field, so one bad record in a
100k-line file is found at once instead of surfacing as a shape error mid-training.

A prompts record may carry fields besides `prompt` (a reference `answer`, unit tests, ...):
they are kept in `PromptExample.extra` for rule rewards, and written back flattened. SFT and
preference records ignore fields they do not use.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

PathLike = str | os.PathLike[str]


class DataError(ValueError):
    """A bad data file; the message starts with `path:line: ` when a line is to blame."""


@dataclass(frozen=True)
class SFTExample:
    """A prompt and the response the policy should learn to give."""

    prompt: str
    response: str


@dataclass(frozen=True)
class PreferenceExample:
    """A prompt with a preferred (`chosen`) and a dispreferred (`rejected`) response."""

    prompt: str
    chosen: str
    rejected: str


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


def read_sft(path: PathLike) -> list[SFTExample]:
    """Read SFT examples (`prompt`, `response`) from a JSONL file."""
    return _read_records(path, _sft_record)


def read_preferences(path: PathLike) -> list[PreferenceExample]:
    """Read preference pairs (`prompt`, `chosen`, `rejected`) from a JSONL file."""
    return _read_records(path, _preference_record)


def read_prompts(path: PathLike) -> list[PromptExample]:
    """Read prompts (`prompt`, plus any other fields, kept in `extra`) from a JSONL file."""
    return _read_records(path, _prompt_record)


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
        return {"prompt": record.prompt, **record.extra}
    return dataclasses.asdict(record)


def _read_records(
    path: PathLike, make_record: Callable[[dict[str, Any], str], Record]
) -> list[Record]:
    records = [make_record(obj, where) for where, obj in _read_objects(Path(path))]
    if not records:
        raise DataError(f"{path}: no records (the file is empty or has only blank lines)")
    return records


def _sft_record(obj: dict[str, Any], where: str) -> SFTExample:
    return SFTExample(_string_field(obj, "prompt", where), _string_field(obj, "response", where))


def _preference_record(obj: dict[str, Any], where: str) -> PreferenceExample:
    prompt, chosen, rejected = (
        _string_field(obj, name, where) for name in ("prompt", "chosen", "rejected")
    )
    if chosen == rejected:
        # A pair with nothing to prefer would only teach the reward model noise.
        raise DataError(f"{where}: fields 'chosen' and 'rejected': identical")
    return PreferenceExample(prompt, chosen, rejected)


def _prompt_record(obj: dict[str, Any], where: str) -> PromptExample:
    prompt = _string_field(obj, "prompt", where)
    extra = {key: value for key, value in obj.items() if key != "prompt"}
    return PromptExample(prompt, extra)


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
        if not isinstance(obj, dict):
            raise DataError(f"{where}: line is not a JSON object (got {_json_type(obj)})")
        yield where, obj


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
