"""Reading a recipe: YAML, its `base:` chain, dotted command-line overrides, renamed (legacy)
keys, and every field type-checked. `load_config(path, overrides)` returns the frozen Config;
what the recipe itself set (for rules that depend on it) is its `recipe` record."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

import yaml

from megatron_rlhf.config.errors import ConfigError
from megatron_rlhf.config.hf_architecture import ConvertError, resolve_from_hf
from megatron_rlhf.config.model import ARCHITECTURE_FIELDS, ModelConfig
from megatron_rlhf.config.run import Config, RecipeFacts
from megatron_rlhf.config.sampling import MOVED_FROM_RL


def _check_type(value: Any, annotation: Any, name: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_type(value, option, name)
            except ConfigError:
                pass
        raise ConfigError(f"{name}: expected {annotation}, got {value!r} ({type(value).__name__})")
    if origin is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected a list, got {value!r} ({type(value).__name__})")
        return [_check_type(v, item, f"{name}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(annotation):  # e.g. an item of a list of sections (rl.rewards)
        return from_dict(annotation, value, prefix=f"{name}.")
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):
        try:  # PyYAML reads `1e-4` (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if annotation in (int, float, str, bool):
        if isinstance(value, bool) and annotation is not bool:
            raise ConfigError(f"{name}: expected {annotation.__name__}, got boolean {value!r}")
        if not isinstance(value, annotation):
            raise ConfigError(
                f"{name}: expected {annotation.__name__}, got {value!r} ({type(value).__name__})"
            )
        return value
    return value


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.metadata.get("recipe_key", True)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; known keys: {names}"
            raise ConfigError(f"{full}: unknown key{hint}")
        annotation = hints[key]
        if dataclasses.is_dataclass(annotation):
            kwargs[key] = from_dict(annotation, value, prefix=f"{full}.")
        else:
            kwargs[key] = _check_type(value, annotation, full)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:  # checks in the dataclass itself
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {err}") from err


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def yaml_problem(err: yaml.YAMLError, context_position: bool = True) -> tuple[str, yaml.Mark | None]:
    """PyYAML's error as one line without its position, and the position (None if it has none):
    its own message spans several lines and names the text "<unicode string>"."""
    if not isinstance(err, yaml.MarkedYAMLError) or err.problem_mark is None:
        return " ".join(str(err).split()), None
    context = f" ({err.context}" if err.context else ""
    if context and context_position and err.context_mark is not None:
        context += f" started at line {err.context_mark.line + 1}, column {err.context_mark.column + 1}"
    return f"{err.problem}{context}{')' if context else ''}", err.problem_mark


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["model.hidden_size=128", "seed=3"]` -> nested dict; values parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected key=value, e.g. model.hidden_size=128")
        key, raw = item.split("=", 1)
        if not key.strip():
            raise ConfigError(f"override '{item}': no key before '='; write the dotted key of the field to set, "
                              "e.g. model.hidden_size=128 (print-config lists every key)")
        if "" in [part.strip() for part in key.strip().split(".")]:
            raise ConfigError(f"override '{item}': the key '{key.strip()}' has an empty part (a leading, trailing or "
                              "doubled '.'); name the section and the field, e.g. model.hidden_size=128")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as err:
            problem, _ = yaml_problem(err, context_position=False)  # a position in the value alone misleads
            raise ConfigError(f"override '{item}': the value is not valid YAML: {problem}; fix the value, "
                              "or put it in quotes to pass it as a string") from None
        _set_dotted(tree, key.strip(), value)
    return tree


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def rename_legacy_keys(data: dict[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    """Renamed keys read under their new names, with a note naming each new key: the `ppo`
    section as `rl` (ppo.ppo_epochs as rl.epochs), then rl's sampling fields (max_new_tokens,
    temperature, top_k, top_p, eval_samples_logged) as `sampling.*`. A key set under both names
    is an error."""
    data, notes = _rename_ppo_section(data, where)
    data, more = _move_sampling_fields(data, where)
    return data, notes + more


def _rename_ppo_section(data: dict[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    if "ppo" not in data:
        return data, []
    old = data["ppo"]
    if not isinstance(old, dict):
        raise ConfigError(f"ppo: expected a mapping (the section is now called rl), got {old!r}")
    new = dict(data.get("rl") or {})
    moved = []
    for key, value in old.items():
        target = "epochs" if key == "ppo_epochs" else key
        if target in new:
            raise ConfigError(f"ppo.{key} and rl.{target} are both set ({where}); keep rl.{target} only")
        new[target] = value
        moved.append(f"ppo.{key} -> rl.{target}")
    data = {k: v for k, v in data.items() if k != "ppo"}
    data["rl"] = new
    return data, [f"{where}: the ppo section is now rl; read {', '.join(moved)}"]


def _move_sampling_fields(data: dict[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    rl = data.get("rl")
    if not isinstance(rl, dict) or not (keys := [k for k in MOVED_FROM_RL if k in rl]):
        return data, []
    sampling = dict(data.get("sampling") or {})
    for key in keys:
        if key in sampling:
            raise ConfigError(f"rl.{key} and sampling.{key} are both set ({where}); keep sampling.{key} only")
        sampling[key] = rl[key]
    data = {**data, "rl": {k: v for k, v in rl.items() if k not in keys}, "sampling": sampling}
    return data, [f"{where}: the sampling settings are now the sampling section (the RL and DPO stages read it); "
                  f"read {', '.join(f'rl.{k} -> sampling.{k}' for k in keys)}"]


def _leaf_keys(tree: dict[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for key, value in tree.items():
        keys |= _leaf_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"}
    return keys


def recipe_layers(path: Path, chain: tuple[Path, ...] = ()) -> list[tuple[Path, dict[str, Any], list[str]]]:
    """The files of a recipe's `base:` chain, the deepest base first: (path, its own keys with
    renamed keys read under their new names, the notes on them)."""
    if not path.is_file():
        raise ConfigError(f"{'base' if chain else '--config'}: file not found: {path}")
    if path.resolve() in chain:
        raise ConfigError(f"{path}: base recipes form a cycle: {' -> '.join(map(str, chain))}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason}); "
                          "save the recipe as UTF-8") from None
    except yaml.YAMLError as err:
        problem, mark = yaml_problem(err)
        at = f"{mark.line + 1}:{mark.column + 1}:" if mark is not None else ""
        raise ConfigError(f"{path}:{at} not valid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    data, notes = rename_legacy_keys(data, str(path))
    base = data.pop("base", None)
    own = [(path, data, notes)]
    return own if base is None else recipe_layers(path.parent / base, (*chain, path.resolve())) + own


def read_recipe(path: Path, chain: tuple[Path, ...] = ()) -> tuple[dict[str, Any], list[str], set[str]]:
    """A YAML recipe as a dict, on top of the recipe its `base:` names (a path relative to it);
    the notes on renamed keys; the dotted keys this file itself sets (not its base)."""
    return _combine(recipe_layers(path, chain))


def _combine(layers: list[tuple[Path, dict[str, Any], list[str]]]) -> tuple[dict[str, Any], list[str], set[str]]:
    data: dict[str, Any] = {}
    for _, layer, _ in layers:
        data = _merge(data, layer)
    return data, [note for _, _, notes in layers for note in notes], _leaf_keys(layers[-1][1]) if layers else set()


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """The recipe at `path` (None: the defaults) with `overrides` (dotted key=value), type-checked,
    the architecture filled from model.from_hf_config / init_from_hf; frozen from here on."""
    layers = [] if path is None else recipe_layers(Path(path))
    data, notes, own = _combine(layers)
    cli, cli_notes = rename_legacy_keys(parse_overrides(overrides or []), "overrides")
    cfg = from_dict(Config, _merge(data, cli))
    cli_keys = _leaf_keys(cli)
    sources = {key: "recipe" if i == len(layers) - 1 else f"base {file}"
               for i, (file, layer, _) in enumerate(layers) for key in _leaf_keys(layer)}
    sources.update(dict.fromkeys(cli_keys, "override"))
    model, hf_notes = cfg.model, []
    if model.hf_source:
        levels = [_leaf_keys(data) - own, own, cli_keys]
        model, hf_notes = _architecture_from_hf(model, levels)
        sources.update(dict.fromkeys(_keys_from_hf(cfg.model, model, levels), "config.json"))
    facts = RecipeFacts(notes=tuple(notes + cli_notes), given=frozenset(own | cli_keys),
                        override_keys=frozenset(cli_keys), hf_notes=tuple(hf_notes), sources=sources)
    return dataclasses.replace(cfg, model=model, recipe=facts)


def _checked_level(model: ModelConfig, levels: list[set[str]]) -> int:
    """The index of the level (base recipes, recipe, overrides) that names the HF directory."""
    key = "model.from_hf_config" if model.from_hf_config else "model.init_from_hf"
    return max(i for i, keys in enumerate(levels) if key in keys)


def _keys_from_hf(before: ModelConfig, after: ModelConfig, levels: list[set[str]]) -> list[str]:
    """The model.* leaves config.json gave (resolve_from_hf's rule, for print-config): every
    architecture field not set where the HF directory is named or later (max_seq_length: not set
    anywhere), and the training values it changed (moe_aux_loss_coef)."""
    checked, given = set().union(*levels[_checked_level(before, levels):]), set().union(*levels)

    def set_in(keys: set[str], key: str) -> bool:
        return key in keys or any(k.startswith(f"{key}.") for k in keys)

    keys = []
    for name in ARCHITECTURE_FIELDS:
        key, value = f"model.{name}", getattr(after, name)
        if set_in(checked, key) or (name == "max_seq_length" and set_in(given, key)):
            continue
        keys += [f"{key}.{f.name}" for f in dataclasses.fields(value)] if dataclasses.is_dataclass(value) else [key]
    changed = [f"model.{f.name}" for f in dataclasses.fields(after)
               if f.name not in ARCHITECTURE_FIELDS and getattr(after, f.name) != getattr(before, f.name)]
    return keys + changed


def _architecture_from_hf(model: ModelConfig, levels: list[set[str]]) -> tuple[ModelConfig, list[str]]:
    """`model` with the architecture of the HF config.json it names, and notes. `levels`: the
    keys set by base recipes, the recipe, the overrides; those at or after the level that names
    the HF directory are checked against it, earlier ones replaced (see ModelConfig.from_hf_config)."""
    at = _checked_level(model, levels)
    checked = set().union(*levels[at:])
    replaceable = set().union(*levels[:at]) - checked
    try:
        return resolve_from_hf(model, checked, replaceable)
    except ConvertError as err:
        raise ConfigError(str(err)) from None
