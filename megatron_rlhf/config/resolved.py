"""The resolved config as YAML: what `print-config` prints (each value with where it came from)
and what every stage writes to <stage_dir>/config.yaml at its start. Plain YAML that
load_config reads back to an equal Config (no torch here: print-config must be quick)."""

from __future__ import annotations

import contextlib
import datetime
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from megatron_rlhf.config.errors import ConfigError
from megatron_rlhf.config.run import Config

RESOLVED_CONFIG = "config.yaml"
# A resumed stage whose settings changed keeps the previous start's file beside the new one.
PREVIOUS_CONFIG = "config.yaml.prev"


def yaml_value(value: Any) -> str:
    """One value in YAML flow style, as load_config reads it back (`null`, `1.0e-05`, `[sft, rm]`)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, sort_keys=False).strip()
    return text.removesuffix("\n...").strip()  # a plain scalar is dumped as a document with an end marker


def source_of(key: str, sources: dict[str, str]) -> str:
    """Where the dotted leaf `key` came from: its own entry, else a parent's (a list set whole,
    e.g. rl.rewards), else the default."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        if (found := sources.get(".".join(parts[:end]))) is not None:
            return found
    return "default"


def config_yaml(cfg: Config, sources: dict[str, str] | None = None, header: list[str] = ()) -> str:
    """`cfg` as a YAML recipe, every field, in the dataclasses' order; with `sources` (RecipeFacts.sources)
    each leaf ends in `# from: <where>`. `header`: comment lines written first."""
    lines = [f"# {line}".rstrip() for line in header]

    def emit(node: dict[str, Any], prefix: str, indent: str) -> None:
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            comment = f"  # from: {source_of(dotted, sources)}" if sources is not None else ""
            if isinstance(value, dict):  # a section
                lines.append(f"{indent}{key}:")
                emit(value, f"{dotted}.", indent + "  ")
            elif isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
                lines.append(f"{indent}{key}:{comment}")  # a list of sections (rl.rewards), one block each
                for item in value:
                    item_lines = yaml.safe_dump(item, default_flow_style=False, sort_keys=False).splitlines()
                    lines.extend(f"{indent}{'- ' if i == 0 else '  '}{line}" for i, line in enumerate(item_lines))
            else:
                lines.append(f"{indent}{key}: {yaml_value(value)}{comment}")

    emit(cfg.to_dict(), "", "")
    return "\n".join(lines) + "\n"


def command_line() -> str:
    """This process's command, as a user would type it (`python -m megatron_rlhf ...`)."""
    program = sys.argv[0] if sys.argv else "python"
    if Path(program).parent.name == "megatron_rlhf" and Path(program).name == "__main__.py":
        program = "python -m megatron_rlhf"
    return " ".join([program, *map(shlex.quote, sys.argv[1:])])


def write_resolved_config(cfg: Config, directory: Path) -> Path:
    """<directory>/config.yaml: `cfg` (plain YAML, usable as a recipe) under a header naming the
    command and the time. A resumed stage rewrites it; if the settings differ from the file
    already there, that one is kept as config.yaml.prev (the checkpoints so far were trained
    under it). Call on one rank."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RESOLVED_CONFIG
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    body = config_yaml(cfg)
    text = config_yaml(cfg, header=[f"The resolved config of this stage, written at its start ({now}) by:",
                                    f"  {command_line()}",
                                    "Every field, from defaults, recipe, base recipes, overrides and config.json;",
                                    "to run it again: a recipe with `base: <this file>` (docs/cli.md)", ""])
    for name in (RESOLVED_CONFIG, PREVIOUS_CONFIG):  # before anything is written: nothing is left behind
        if (where := directory / name).is_dir() and not where.is_symlink():
            raise ConfigError(f"{where}: a directory where the stage writes its resolved config (a file, "
                              "rewritten at each start); move it away or delete it, then rerun")
    tmp = directory / f"{RESOLVED_CONFIG}.tmp{os.getpid()}"
    try:
        if path.is_file() and _read_body(path) != body:
            os.replace(path, directory / PREVIOUS_CONFIG)
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise ConfigError(f"{path}: cannot write the stage's resolved config ({e.strerror or e}); fix that "
                          f"(permissions, free space in {directory}), then rerun") from None
    return path


def _read_body(path: Path) -> str | None:
    """The body of a config.yaml written earlier; None: unreadable (kept as config.yaml.prev)."""
    try:
        return _body(path.read_text())
    except (OSError, ValueError):
        return None


def _body(text: str) -> str:
    """A written config without its header comment (which names the time)."""
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith("#"))
