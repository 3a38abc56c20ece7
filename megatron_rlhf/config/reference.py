"""docs/config_reference.md, generated from the config dataclasses: every recipe key (dotted),
its type, its default and its help text. The help text is the `#` comment block directly above
the field in its source file plus a comment at the end of its line, read with `tokenize`, so
the comments stay the one place a field is documented. A section's intro is its class
docstring, else the comment above it in its parent section.

    python -m megatron_rlhf.config.reference --write     # regenerate docs/config_reference.md
    make config-reference                                # the same

tests/test_config_reference.py fails when the committed file is not what this prints.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import sys
import tokenize
import typing
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from megatron_rlhf.config.resolved import yaml_value
from megatron_rlhf.config.run import Config

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "config_reference.md"
REGENERATE = "python -m megatron_rlhf.config.reference --write"


@dataclass(frozen=True)
class Key:
    name: str  # dotted, as a recipe or an override writes it; `rl.rewards[].type` for an item of a list
    type: str  # as annotated
    default: Any
    help: str


@dataclass(frozen=True)
class Section:
    name: str  # dotted; "" for the top level
    intro: str
    keys: list[Key]


@cache
def _comments(source_file: str) -> tuple[dict[int, str], set[int], list[str]]:
    """{line: comment text} of a source file, the lines that hold only a comment, and its lines."""
    text = Path(source_file).read_text()
    comments, alone = {}, set()
    lines = text.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            line = token.start[0]
            comments[line] = token.string.lstrip("#").strip()
            if not lines[line - 1][:token.start[1]].strip():
                alone.add(line)
    return comments, alone, lines


@cache
def _field_nodes(cls: type) -> dict[str, tuple[int, int, ast.AnnAssign]]:
    """The annotated assignments of `cls`'s own body (not its bases'), by name, with their first
    and last line in the source file."""
    source, start = inspect.getsourcelines(cls)
    body = ast.parse("".join(source)).body[0].body
    return {n.target.id: (start - 1 + n.lineno, start - 1 + n.end_lineno, n)
            for n in body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _owner(cls: type, name: str) -> type:
    """The class in `cls`'s MRO whose body declares field `name` (SFTConfig's optimizer: StageConfig)."""
    return next(c for c in cls.__mro__ if name in _field_nodes(c))


def field_help(cls: type, name: str) -> str:
    """The comment lines directly above field `name` of `cls`, then the comment ending its line.
    A field with neither, in a group of fields without blank lines between them, has the help of
    the group's comment block above it that names it (`# Policy loss: ... clip_eps_high ...`)."""
    owner = _owner(cls, name)
    first, last, _ = _field_nodes(owner)[name]
    comments, alone, lines = _comments(inspect.getsourcefile(owner))
    trailing = [comments[n] for n in range(first, last + 1) if n in comments and n not in alone]
    line = first - 1
    while line > 0 and lines[line - 1].strip():  # up through the group: comment blocks and fields
        if line in alone:
            block, start = [], line
            while start in alone:
                block.insert(0, comments[start])
                start -= 1
            if line == first - 1 or re.search(rf"\b{re.escape(name)}\b", " ".join(block)):
                return " ".join(part for part in (*block, *trailing) if part)
            line = start
        else:
            line -= 1
    return " ".join(trailing)


def _annotation(cls: type, name: str) -> str:
    return ast.unparse(_field_nodes(_owner(cls, name))[name][2].annotation)


def _section_type(annotation: Any) -> type | None:
    """The dataclass of a section field (a dataclass, or the item of a list of them: rl.rewards)."""
    if dataclasses.is_dataclass(annotation):
        return annotation
    if typing.get_origin(annotation) is list and dataclasses.is_dataclass(item := typing.get_args(annotation)[0]):
        return item
    return None


def sections(cls: type = Config, name: str = "", intro: str = "") -> list[Section]:
    """The sections of `cls` (depth first, in field order), each with its own leaf keys."""
    hints = typing.get_type_hints(cls)
    instance = cls()
    keys, nested = [], []
    for f in dataclasses.fields(cls):
        if not f.metadata.get("recipe_key", True):  # Config.recipe: not a key
            continue
        dotted = f"{name}.{f.name}" if name else f.name
        if (section := _section_type(hints[f.name])) is not None:
            listed = section is not hints[f.name]
            doc = inspect.getdoc(section) if section.__doc__ and not section.__doc__.startswith(section.__name__ + "(") \
                else ""
            parent = field_help(cls, f.name)
            if listed:  # a list of sections: its default list is one key, each item's fields the section's keys
                keys.append(Key(dotted, _annotation(cls, f.name), getattr(instance, f.name), parent))
            nested += sections(section, f"{dotted}[]" if listed else dotted, " ".join(p for p in (doc, parent) if p))
        else:
            keys.append(Key(dotted, _annotation(cls, f.name), getattr(instance, f.name), field_help(cls, f.name)))
    return [Section(name, intro, keys), *nested]


def all_keys() -> list[Key]:
    return [key for section in sections() for key in section.keys]


def _plain(value: Any) -> Any:
    """A default as a recipe writes it (rl.rewards: a list of mappings, not of dataclasses)."""
    if isinstance(value, list):
        return [dataclasses.asdict(item) if dataclasses.is_dataclass(item) else item for item in value]
    return value


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """docs/config_reference.md."""
    out = ["# Config reference", "",
           f"<!-- Generated by `{REGENERATE}` from megatron_rlhf/config/*.py; do not edit. -->", "",
           "Every key a recipe (pipelines/*.yaml) or a `key=value` override can set, with its type, its default and "
           "what it does. `python -m megatron_rlhf print-config --config RECIPE [key=value ...]` prints a run's "
           "resolved values and where each came from; `python -m megatron_rlhf <command> --help` names the sections "
           "a command reads (docs/cli.md).", ""]
    for section in sections():
        out += [f"## {section.name or 'Top level'}", ""]
        if section.intro:
            out += [section.intro, ""]
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        out += [f"| `{key.name}` | `{_cell(key.type)}` | `{_cell(yaml_value(_plain(key.default)))}` | {_cell(key.help)} |"
                for key in section.keys]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--write"]:
        REFERENCE.write_text(render())
        print(f"wrote {REFERENCE} ({len(all_keys())} keys)")
        return 0
    if argv:
        print(f"usage: {REGENERATE} (or without --write: print it)", file=sys.stderr)
        return 2
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
