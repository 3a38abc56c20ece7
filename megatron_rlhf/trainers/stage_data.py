"""Where a run writes (run and stage directories) and the data a stage reads: the splits the
config names, from data files (JSONL, parquet, save_to_disk directories: data/jsonl.py), held
out of a training file, or from the built-in task; the tokenizer (data.tokenizer=auto: see
`auto_tokenizer`) with its chat template, and the model vocabulary it implies.

Where a split comes from (`split_source`), in order: its own file `data.<split>`; for an
eval split, a held-out `data.eval_fraction` of the training file (`data.<x>_train`; the
rest trains); the built-in task `data.task`. `preflight` checks all of it before workers start.

What a run records for later stages and for export-hf (`record_run`, rank 0 of every stage):
its tokenizer, once, as Hugging Face files in <run>/tokenizer/ (with where it came from and a
fingerprint), and the sampling settings it generates with, <run>/sampling.json. Later stages
use the recorded tokenizer (`run_tokenizer`) and take the model architecture from the
checkpoint they start from (`architecture_from_start`), so a run started with
model.init_from_hf=DIR data.tokenizer=DIR needs neither again; a command-line override that
contradicts either is refused, a recipe's value is replaced with a note.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch.distributed as dist

from megatron_rlhf.checkpoint.validate import find_checkpoint, recorded_model_config
from megatron_rlhf.config import ARCHITECTURE_FIELDS, Config, ConfigError, policy_start, validate
from megatron_rlhf.convert.hf_config import RECORDED_GENERATION_CONFIG, RECORDED_SAMPLING, RECORDED_TOKENIZER
from megatron_rlhf.data import jsonl
from megatron_rlhf.data.chat import load_chat_template
from megatron_rlhf.data.tasks import get_task
from megatron_rlhf.data.tasks.base import Task
from megatron_rlhf.data.tokenizers import (RECORD_FILE, Tokenizer, load_tokenizer, read_tokenizer_record,
                                          record_tokenizer)


def run_dir(cfg: Config) -> Path:
    return Path(cfg.checkpoint.root) / cfg.checkpoint.run_name


def stage_dir(cfg: Config, stage: str) -> Path:
    """<run>/<stage>; the RL stage writes under its algorithm's name (<run>/ppo, <run>/grpo,
    ...), so algorithms tried on the same SFT and RM checkpoints do not overwrite each other;
    a stage that trains LoRA adapters under <name>_lora (sft_lora, ppo_lora, ...), so it does
    not overwrite full fine-tuning either (and later stages start from it)."""
    name = cfg.rl.algorithm if stage == "rl" else stage
    return run_dir(cfg) / (name + ("_lora" if cfg.lora.applies_to(stage) else ""))


@dataclass(frozen=True)
class RunContext:
    """What a stage derives from the run at start-up, beside the Config it was given (which is
    never changed): the config as the stage uses it (data.tokenizer the run recorded, the model
    architecture of the checkpoint it starts from, model.vocab_size from the tokenizer), the
    tokenizer, and notes on what was filled in or replaced."""

    config: Config
    tokenizer: Tokenizer
    notes: tuple[str, ...] = ()


def resolve_run(cfg: Config, stage: str | None = None, world_size: int | None = None) -> RunContext:
    """The run context of `stage` (sft, rm, dpo, rl; None: no start checkpoint), validated at
    `world_size` when the architecture changes."""
    cfg, tokenizer, notes = run_tokenizer(cfg, stage)
    if stage is not None:
        cfg, more = architecture_from_start(cfg, stage, world_size)
        notes += more
    cfg, note = resolve_vocab_size(cfg, tokenizer)
    return RunContext(cfg, tokenizer, (*notes, note))


@dataclass
class StageData:
    config: Config  # the run's config as the stage uses it (RunContext.config)
    tokenizer: Tokenizer
    task: Task | None
    splits: dict[str, list]  # split name -> records (only the splits that were asked for)
    sources: dict[str, str] = field(default_factory=dict)  # split name -> where it came from (for the summary)


_READERS = {"sft": jsonl.read_sft, "preference": jsonl.read_preferences, "prompts": jsonl.read_prompts}
_TASK_SPLIT = {"prompts_train": "ppo_prompts", "prompts_eval": "eval_prompts"}
# The splits each command reads; RM normalises rewards over SFT responses when it has them.
STAGE_SPLITS = {"sft": ("sft_train", "sft_eval"), "rm": ("preference_train", "preference_eval"),
                "dpo": ("preference_train", "preference_eval"), "rl": ("prompts_train", "prompts_eval")}


def split_source(cfg: Config, name: str) -> tuple[str, str | None]:
    """("file", path) | ("held_out", training file) | ("task", task name) for split `name`;
    ConfigError when there is none."""
    d = cfg.data
    kind, part = name.rsplit("_", 1)
    train_file, eval_file = getattr(d, f"{kind}_train"), getattr(d, f"{kind}_eval")
    if train_file is not None and eval_file is None and d.eval_fraction > 0:
        return "held_out", train_file  # both parts: eval held out, train the rest
    if getattr(d, name) is not None:
        return "file", getattr(d, name)
    if d.task is not None:
        return "task", d.task
    if part == "eval" and train_file is not None:
        raise ConfigError(f"data.{name}: no file given and data.eval_fraction=0; set data.{name}=<file.jsonl> "
                          f"or data.eval_fraction (e.g. 0.05) to hold out part of data.{kind}_train")
    raise ConfigError(f"data.{name}: no file given and data.task is null; set data.{name}=<file.jsonl> "
                      f"(or data.task=sentiment for the built-in task)")


def held_out(records: list, fraction: float, seed: int, part: str, where: str = "") -> list:
    """The eval (`part`="eval") or train part of `records`: round(fraction * n) records, at
    least one, chosen by a permutation seeded from `seed`; train gets the rest, in file order."""
    n = len(records)
    if n < 2:
        raise jsonl.DataError(f"{where}: {n} record(s), too few to hold out an eval part of; give the eval split its "
                              "own file (data.*_eval) or set data.eval_fraction=0 to use the task's")
    n_eval = min(max(1, round(fraction * n)), n - 1)
    chosen = set(random.Random(seed).sample(range(n), n_eval))
    return [r for i, r in enumerate(records) if (i in chosen) == (part == "eval")]


def load_stage_data(cfg: Config, needed: tuple[str, ...], optional: tuple[str, ...] = (),
                    stage: str | None = None) -> StageData:
    """The splits a stage needs (and those of `optional` that have a source): from files,
    held-out parts of training files, or generated by the built-in task from `seed` (written
    to <run>/data/ for the user to inspect). Uses the run's tokenizer (run_tokenizer) and the
    architecture of the checkpoint `stage` (sft, rm, dpo, rl; None: neither) starts from; sets
    model.vocab_size from the tokenizer and records the run (record_run)."""
    launched = dist.is_initialized()  # a stage's workers are; a unit test reading data is not
    run = resolve_run(cfg, stage, dist.get_world_size() if launched else None)
    cfg, tokenizer = run.config, run.tokenizer
    d = cfg.data
    task = get_task(d.task) if d.task else None
    wanted = [*needed, *(name for name in optional if _has_source(cfg, name))]
    sources = {name: split_source(cfg, name) for name in wanted}
    generated = None
    if any(kind == "task" for kind, _ in sources.values()):
        generated = task.splits(cfg.seed, d.task_sizes)
        if dist.get_rank() == 0:
            generated.write(run_dir(cfg) / "data")
    splits, origins = {}, {}
    for name, (kind, where) in sources.items():
        reader = partial(_READERS[name.rsplit("_", 1)[0]], fields=d.fields)
        if kind == "file":
            splits[name], origins[name] = reader(where), f"data.{name}={where}"
            _check_chat_template(cfg, tokenizer, splits[name], f"data.{name}={where}")
        elif kind == "held_out":
            records = reader(where)
            _check_chat_template(cfg, tokenizer, records, f"data.{name.rsplit('_', 1)[0]}_train={where}")
            splits[name] = held_out(records, d.eval_fraction, cfg.seed, name.rsplit("_", 1)[1],
                                    f"data.{name.rsplit('_', 1)[0]}_train={where}")
            origins[name] = (f"{len(splits[name])} of {len(records)} records of {where} "
                             f"({'held out' if name.endswith('_eval') else 'the rest after holding out'} "
                             f"data.eval_fraction={d.eval_fraction}, seed {cfg.seed})")
        else:
            splits[name] = getattr(generated, _TASK_SPLIT.get(name, name))
            origins[name] = f"built-in task {where} (seed {cfg.seed})"
    if launched and dist.get_rank() == 0:
        # Only once the data was read: a run stopped by a bad file may still change its tokenizer
        # (e.g. to one with the chat template its conversations need).
        record_run(cfg, tokenizer)
    return StageData(cfg, tokenizer, task, splits, origins)


def _has_source(cfg: Config, name: str) -> bool:
    try:
        split_source(cfg, name)
        return True
    except ConfigError:
        return False


def _check_chat_template(cfg: Config, tokenizer: Tokenizer, records: list, named: str) -> None:
    """A file of conversations needs a chat template: refused before any is encoded, naming the fix."""
    conversation = next((r for r in records if getattr(r, "messages", None) is not None
                         or getattr(r, "chosen_messages", None) is not None), None)
    if conversation is None or tokenizer.chat_template is not None:
        return
    why = ("data.chat_template=none" if cfg.data.chat_template == "none" else
           f"data.tokenizer={cfg.data.tokenizer} has no chat template (no \"chat_template\" in its "
           "tokenizer_config.json, no chat_template.jinja)")
    raise jsonl.DataError(f"{named}: holds conversations ('messages' lists), but {why}; set data.chat_template="
                          "<file.jinja> (or data.chat_template=auto with a tokenizer directory that has one), or "
                          "give flat prompt/response records")


def auto_tokenizer(cfg: Config, stage: str | None = None) -> tuple[str, str]:
    """(what data.tokenizer=auto stands for, why): model.init_from_hf's directory when it holds a
    tokenizer; else the tokenizer this run recorded; else the one recorded with the checkpoint
    `stage` starts from (another run's, e.g. rl.sft_from); else builtin."""
    hf = cfg.model.init_from_hf
    if hf and (Path(hf) / "tokenizer.json").is_file():
        return hf, "model.init_from_hf"
    places = [(run_dir(cfg) / RECORDED_TOKENIZER, "the tokenizer this run recorded")]
    if stage is not None and (where := start_checkpoint(cfg, stage)[0]) is not None:
        try:
            iter_dir, _ = find_checkpoint(where)
            places += [(d / RECORDED_TOKENIZER, f"the tokenizer recorded with {iter_dir}")
                       for d in (iter_dir.parent, iter_dir.parent.parent)]
        except FileNotFoundError:  # the stage says what is missing when it loads
            pass
    for directory, why in places:
        if (record := read_tokenizer_record(directory)) is not None:
            return ("builtin" if record["data.tokenizer"] == "builtin" else str(directory)), why
    if hf:
        return "builtin", (f"model.init_from_hf={hf} has no tokenizer.json and no tokenizer is recorded; set "
                           "data.tokenizer=<its tokenizer directory> unless the built-in task's is meant")
    return "builtin", "no model.init_from_hf and no recorded tokenizer"


def _resolve_auto(cfg: Config, stage: str | None) -> tuple[Config, list[str]]:
    if cfg.data.tokenizer != "auto":
        return cfg, []
    spec, why = auto_tokenizer(cfg, stage)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=spec))
    quiet = spec == "builtin" and not cfg.model.init_from_hf  # the toy runs' default: nothing to say
    return cfg, ([] if quiet else [f"data.tokenizer=auto: {spec} ({why})"])


def tokenizer_for(cfg: Config) -> Tokenizer:
    """The tokenizer data.tokenizer names (auto: see auto_tokenizer), with data.chat_template's
    template (a stage uses run_tokenizer, which checks it against the run's)."""
    cfg, _ = _resolve_auto(cfg, None)
    d = cfg.data
    tokenizer = load_tokenizer(d.tokenizer, get_task(d.task).words() if d.task else None)
    tokenizer.chat_template = load_chat_template(d.chat_template, tokenizer, d.chat_loss, cfg.model.max_seq_length)
    return tokenizer


def _overridden(cfg: Config, key: str) -> bool:
    return key in cfg.override_keys or any(k.startswith(f"{key}.") for k in cfg.override_keys)


def run_tokenizer(cfg: Config, stage: str | None = None) -> tuple[Config, Tokenizer, list[str]]:
    """(the config with the run's data.tokenizer, the tokenizer a stage of this run uses, notes).
    data.tokenizer=auto is resolved first (auto_tokenizer; `stage`: the stage whose start
    checkpoint may have recorded one). Before the run has recorded one: data.tokenizer's. After:
    the recorded one; a recipe's data.tokenizer naming another is replaced (by the recorded copy,
    with a note), a command-line one is refused, and so is a tokenizer whose files changed since
    the run recorded them."""
    cfg, notes = _resolve_auto(cfg, stage)
    recorded_dir = run_dir(cfg) / RECORDED_TOKENIZER
    record = read_tokenizer_record(recorded_dir)
    if record is None:
        return cfg, tokenizer_for(cfg), notes
    d, source = cfg.data, record["data.tokenizer"]
    named = f"data.tokenizer={source}" + (f" with data.task={record['data.task']}" if source == "builtin" else "")
    recorded = "builtin" if source == "builtin" else str(recorded_dir)  # the copy: its source may move
    if d.tokenizer not in (source, recorded) and not _overridden(cfg, "data.tokenizer"):
        notes.append(f"data.tokenizer={d.tokenizer} (recipe) replaced by the tokenizer this run recorded "
                     f"({named}, {recorded_dir})")
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(d, tokenizer=recorded))
        d = cfg.data
    tokenizer = tokenizer_for(cfg)
    if tokenizer.fingerprint() != record.get("fingerprint"):
        # The run's checkpoints were trained with the recorded ids: others would be silently wrong.
        if d.tokenizer == recorded != "builtin":  # the recorded copy itself changed: the fix is its files
            raise ConfigError(f"{recorded_dir}: the tokenizer this run recorded ({named}) has changed since: its files "
                              f"no longer match the fingerprint in {recorded_dir / RECORD_FILE}; restore them (copy "
                              f"them again from {source} if it still holds the tokenizer the run started with), or "
                              "start another run (checkpoint.run_name)")
        given = f"data.tokenizer={d.tokenizer}" + (f" (data.task={d.task})" if d.tokenizer == "builtin" else "")
        fix = ("remove the override (later stages use the recorded one)" if _overridden(cfg, "data.tokenizer")
               else "restore its files as they were when the run recorded them")
        use = named if source == "builtin" else f"data.tokenizer={recorded}"
        raise ConfigError(f"{given}: not the tokenizer this run's checkpoints were trained with, which it recorded in "
                          f"{recorded_dir} ({named}); {fix}, set {use}, or start another run (checkpoint.run_name)")
    return cfg, tokenizer, notes


def start_checkpoint(cfg: Config, stage: str) -> tuple[str | Path | None, str]:
    """(the stage or iter_* directory `stage` starts from, or None: a fresh model or the HF
    weights; the field that names it)."""
    if stage == "sft":
        return cfg.sft.init_from, "sft.init_from"
    if stage in ("rm", "dpo"):
        return getattr(cfg, stage).init_from or stage_dir(cfg, "sft"), f"{stage}.init_from"
    policy_stage, given = policy_start(cfg)
    return given or stage_dir(cfg, policy_stage), "rl.sft_from"


def architecture_from_start(cfg: Config, stage: str, world_size: int | None = None) -> tuple[Config, list[str]]:
    """(the config with the model architecture (ARCHITECTURE_FIELDS) the checkpoint `stage`
    starts from recorded, notes). Nothing to do for a run whose model.from_hf_config /
    init_from_hf gives it, or a start that does not exist (yet) or records none. Architecture
    fields of the command-line overrides that differ are refused, the recipe's replaced (with a
    note); max_seq_length, the longest sequence the run trains on, is the start's too unless a
    command-line override sets it (then the run's choice, never refused). The result is
    validated at `world_size`; a stage length longer than the adopted max_seq_length is named
    with the checkpoint's value and the override that lengthens it."""
    where, field_name = start_checkpoint(cfg, stage)
    if where is None or cfg.model.hf_source:
        return cfg, []
    try:
        iter_dir, _ = find_checkpoint(where)
    except FileNotFoundError:  # the stage says what is missing when it loads
        return cfg, []
    recorded = recorded_model_config(iter_dir)
    if recorded is None:
        return cfg, []
    m = cfg.model
    run_length = _overridden(cfg, "model.max_seq_length")  # the command line's: the run's choice
    differ = [f for f in ARCHITECTURE_FIELDS
              if not (f == "max_seq_length" and run_length) and getattr(recorded, f) != getattr(m, f)]
    if refused := [f"model.{f}={getattr(m, f)!r}: the checkpoint recorded {getattr(recorded, f)!r}"
                   for f in differ if _overridden(cfg, f"model.{f}")]:
        raise ConfigError(f"{field_name}: {stage} starts from {iter_dir}, whose model differs from the overrides:\n  "
                          + "\n  ".join(refused) + "\n(remove them: a stage takes the architecture of the checkpoint "
                          "it starts from)")
    if not differ:
        return cfg, []
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(m, **{f: getattr(recorded, f) for f in differ}))
    try:
        validate(cfg, world_size)
    except ConfigError as err:
        if "max_seq_length" not in differ or "model.max_seq_length" not in str(err):
            raise
        raise ConfigError(f"{err}: model.max_seq_length={recorded.max_seq_length} is the length {iter_dir}, the "
                          f"checkpoint {stage} starts from ({field_name}), recorded (the recipe's {m.max_seq_length} "
                          f"is replaced); set model.max_seq_length=<a longer one> on the command line to train "
                          "longer, or shorten the stage") from None
    # unset fields (vocab_size: the tokenizer's, max_position_embeddings) are filled without a note
    if replaced := [f"model.{f}={getattr(m, f)!r} by {getattr(recorded, f)!r}"
                    for f in differ if getattr(m, f) is not None]:
        return cfg, [f"{stage}: the model architecture of {iter_dir}, the checkpoint it starts from, replaces "
                      f"the recipe's: {', '.join(replaced)}"]
    return cfg, []


def record_run(cfg: Config, tokenizer: Tokenizer, only_missing: bool = False) -> None:
    """Rank 0: record the run's tokenizer (once), model.init_from_hf's generation_config.json
    (once: export-hf writes it back) and its sampling settings (every stage: the latest run's;
    `only_missing`: only when none are recorded) for later stages and export-hf
    (<run>/tokenizer/, <run>/hf_generation_config.json, <run>/sampling.json)."""
    directory = run_dir(cfg)
    directory.mkdir(parents=True, exist_ok=True)
    record_tokenizer(tokenizer, cfg.data.tokenizer, cfg.data.task, directory / RECORDED_TOKENIZER)
    generation = Path(cfg.model.init_from_hf or "") / "generation_config.json"
    if cfg.model.init_from_hf and generation.is_file() and not (directory / RECORDED_GENERATION_CONFIG).exists():
        tmp = directory / f"{RECORDED_GENERATION_CONFIG}.tmp{os.getpid()}"
        tmp.write_bytes(generation.read_bytes())
        tmp.replace(directory / RECORDED_GENERATION_CONFIG)
    if only_missing and (directory / RECORDED_SAMPLING).is_file():
        return
    s = cfg.sampling
    sampling = {"do_sample": True, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                "max_new_tokens": s.max_new_tokens}
    tmp = directory / f"{RECORDED_SAMPLING}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(sampling, indent=1) + "\n")
    tmp.replace(directory / RECORDED_SAMPLING)


def resolve_vocab_size(cfg: Config, tokenizer: Tokenizer) -> tuple[Config, str]:
    """(the config with model.vocab_size from the tokenizer when unset, a note); the rule is
    tokenizer size <= model vocabulary (ids beyond the tokenizer are masked like padding rows)."""
    m, size = cfg.model, tokenizer.vocab_size
    if m.vocab_size is None:
        resolved = dataclasses.replace(cfg, model=m.with_vocabulary(size, None))
        return resolved, f"model.vocab_size={size} (the tokenizer's size, data.tokenizer={cfg.data.tokenizer})"
    if size > m.vocab_size:
        # Ids beyond the embedding would index out of range.
        raise ConfigError(f"model.vocab_size={m.vocab_size}: the tokenizer (data.tokenizer={cfg.data.tokenizer}) has "
                          f"{size} tokens, more than the model's embedding rows; remove model.vocab_size (it "
                          f"defaults to the tokenizer's size) or set model.vocab_size={size}")
    resolved = dataclasses.replace(cfg, model=m.with_vocabulary(m.vocab_size, size if size < m.vocab_size else None))
    spare = f", {m.vocab_size - size} ids the tokenizer lacks are masked" if size < m.vocab_size else ""
    return resolved, f"model.vocab_size={m.vocab_size} (tokenizer: {size} tokens{spare})"


def preflight(cfg: Config, command: str) -> list[str]:
    """What the stages of `command` will read, checked before any worker starts: every
    split has a source, every named file exists, the tokenizer loads and fits the model.
    Returns notes for the console; raises ConfigError, DataError or TokenizerError."""
    stages = {"pipeline": cfg.pipeline.stages, "ppo": ["rl"]}.get(command, [command])
    for stage in (s for s in stages if s in STAGE_SPLITS):
        for name in STAGE_SPLITS[stage]:
            kind, where = split_source(cfg, name)
            if kind != "task" and not Path(where).exists():  # a file, or a save_to_disk directory
                field_name = name if kind == "file" else f"{name.rsplit('_', 1)[0]}_train"
                raise jsonl.DataError(f"data.{field_name}={where}: file not found")
    if command in ("import-hf", "export-hf", "stages"):
        return list(cfg.hf_notes)
    if "rl" in stages:  # a rule reward's file must exist before any worker starts
        from megatron_rlhf.rewards.function import resolve_function_file

        for i, src in enumerate(cfg.rl.rewards):
            if src.type == "function":
                resolve_function_file(src.function, f"rl.rewards[{i}].function")
    if "rl" in stages and cfg.rollout.engine == "vllm":
        from megatron_rlhf.rollout.vllm_engine import check_engine_can_run  # imports vLLM: only when asked for

        check_engine_can_run(cfg.model, cfg.logging.verbose)
    first = next((s for s in stages if s in STAGE_SPLITS), None)
    cfg, tokenizer, notes = run_tokenizer(cfg, first)
    for name in dict.fromkeys(name for stage in stages for name in STAGE_SPLITS.get(stage, ())):
        kind, where = split_source(cfg, name)
        if kind != "task":  # conversations need a template: said now, not when a stage starts
            record = jsonl.read_first(where, name.rsplit("_", 1)[0], cfg.data.fields)
            field_name = name if kind == "file" else f"{name.rsplit('_', 1)[0]}_train"
            _check_chat_template(cfg, tokenizer, [record] if record else [], f"data.{field_name}={where}")
    for stage in (s for s in stages if s in STAGE_SPLITS):
        cfg, more = architecture_from_start(cfg, stage)
        notes += more
    cfg, vocab_note = resolve_vocab_size(cfg, tokenizer)
    notes = [*cfg.hf_notes, *notes, vocab_note]
    if tokenizer.pad_defaulted:
        notes.append(f"data.tokenizer={cfg.data.tokenizer} names no pad token: padding uses its eos token "
                     f"(id {tokenizer.eos_id}); lengths and masks never read the pad id")
    return notes
