"""What a stage was trained on, and whether `pipeline` may reuse a finished stage.

Every stage records its inputs in summary.json (`inputs`, written by the stage runner): one flat
mapping `{what: value}` with

    data.<split>        the split's source: a file's content hash (held-out parts: with the fraction
                        and seed), or the built-in task, its seed and size
    tokenizer           the tokenizer's fingerprint (its files' contents, or the built-in word list)
    <section>.<field>   the settings the result depends on: seed, model (as the stage resolves it:
                        vocab_size from the tokenizer, the architecture its start checkpoint
                        recorded), the stage's own section (rl: with the sampling section, under
                        its old rl.* names), lora when it trains adapters, rl's
                        reward sources (a rule function's file by content)
    start[.<role>]      the checkpoint it started from (its iter_*, commit record hash and the
                        inputs hash of the stage that wrote it), a Hugging Face directory, or fresh

Left out, because the trained weights do not depend on them: cadences (log, eval, save), the
microbatch split, the parallel layout, the rollout engine, paths (contents count instead), and
`steps`, compared on its own: more steps continue a finished stage, fewer are a change.

`plan(cfg)` decides, before anything trains, what the pipeline does with each stage: skip it
(finished on the same inputs), continue it (more steps), train it (fresh or resuming a partial
run), or train it again from scratch (`pipeline.rerun`, its old directory moved aside to
<stage>.replaced-<time>). A finished stage whose inputs changed, or one that starts from a stage
trained again, is a ConfigError naming what changed, unless pipeline.rerun lists it. (Another
tokenizer needs another run directory in any case: the run records its tokenizer, run_tokenizer.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rlhf.checkpoint.validate import CheckpointError, find_checkpoint
from megatron_rlhf.config import MOE_ARCHITECTURE_FIELDS, Config, ConfigError, policy_start
from megatron_rlhf.config.rl import MULTI_TURN_FIELDS
from megatron_rlhf.logging.report import read_summary
from megatron_rlhf.trainers.stage_data import (
    STAGE_SPLITS, resolve_run, run_dir, split_source, stage_dir,
)

# Fields of a stage's section that do not change what it trains (steps: see plan).
NOT_INPUTS = ("steps", "log_interval", "eval_interval", "save_interval", "eval_samples_logged",
              "reward_hacking_window", "micro_batch_size", "micro_batch_tokens",
              "init_from", "sft_from", "rm_from", "critic_from")  # the start checkpoint is fingerprinted instead
MODEL_NOT_INPUTS = ("recompute_granularity", "recompute_method", "recompute_num_layers",  # memory for compute
                    "init_from_hf", "from_hf_config")  # the weights are `start`, the architecture the fields
# The expert fields of a dense model (num_experts null) change nothing it trains; left out, a dense
# stage finished before they existed is still reused.
DENSE_NOT_INPUTS = (*MOE_ARCHITECTURE_FIELDS, "moe_aux_loss_coef", "moe_z_loss_coef", "moe_load_balancing_type")
# Splits a stage reads when they have a source (rm.py: normalisation over SFT responses).
OPTIONAL_SPLITS = {"rm": ("sft_eval",)}
_TASK_SIZE = {"prompts_train": "ppo_prompts", "prompts_eval": "eval_prompts"}
_SHOWN_CHANGES = 6
_HASH = re.compile(r"sha256:[0-9a-f]+…?")
REPLACED = ".replaced-"  # <stage>.replaced-<time>: a directory pipeline.rerun moved aside


def stage_inputs(cfg: Config, stage: str) -> dict[str, Any]:
    """The fingerprint of `stage` (sft, rm, dpo, rl) under `cfg`, as summary.json records it."""
    run = resolve_run(cfg, stage)  # as the stage resolves it (load_stage_data)
    cfg, tokenizer = run.config, run.tokenizer
    inputs: dict[str, Any] = {"seed": cfg.seed}
    model = dataclasses.asdict(cfg.model)
    left_out = MODEL_NOT_INPUTS + (DENSE_NOT_INPUTS if cfg.model.num_experts is None else ())
    if cfg.model.moe_load_balancing_type == "aux_loss":  # the default: MoE stages from before it are still reused
        left_out += ("moe_load_balancing_type",)
    inputs.update(_flat({k: v for k, v in model.items() if k not in left_out}, "model."))
    inputs["data.overflow"] = cfg.data.overflow
    # How records are read and templated; only when not the defaults, so runs from before these
    # settings existed are still reused (an auto template is part of the tokenizer's files).
    d, defaults = cfg.data, type(cfg.data)()
    if d.fields != defaults.fields:
        inputs.update(_flat(dataclasses.asdict(d.fields), "data.fields."))
    if d.chat_loss != defaults.chat_loss:
        inputs["data.chat_loss"] = d.chat_loss
    if d.chat_template not in ("auto", "none"):
        inputs["data.chat_template file"] = _file_hash(d.chat_template)
    for split in (*STAGE_SPLITS[stage], *OPTIONAL_SPLITS.get(stage, ())):
        if (source := _split_fingerprint(cfg, split, optional=split not in STAGE_SPLITS[stage])) is not None:
            inputs[f"data.{split}"] = source
    kind = f"builtin ({cfg.data.task})" if cfg.data.tokenizer == "builtin" else "files"
    inputs["tokenizer"] = f"{kind} sha256:{tokenizer.fingerprint()}"  # where its files lie does not count
    section = dataclasses.asdict(getattr(cfg, stage))
    left_out = NOT_INPUTS
    if stage == "rl" and not cfg.rl.multi_turn:
        # single-turn: the environment's settings change nothing it trains; left out, an RL stage
        # finished before they existed is still reused
        left_out = (*NOT_INPUTS, "environment", *MULTI_TURN_FIELDS)
    inputs.update(_flat({k: v for k, v in section.items() if k not in left_out}, f"{stage}."))
    if cfg.lora.applies_to(stage):
        inputs.update(_flat({k: v for k, v in dataclasses.asdict(cfg.lora).items() if k != "stages"}, "lora."))
    if stage == "rl":
        # The sampling settings the RL stage trains with, under the rl.* names they had before
        # the sampling section existed: a run finished then is still reused.
        inputs.update({f"rl.{k}": v for k, v in dataclasses.asdict(cfg.sampling).items() if k not in NOT_INPUTS})
        if cfg.rl.has_critic:
            inputs["rl.critic_start"] = cfg.rl.critic_start if cfg.rl.critic_start in ("rm", "sft") else "checkpoint"
        for i, source in enumerate(cfg.rl.rewards):
            if source.type == "function":
                inputs[f"rl.rewards[{i}].function file"] = _reward_file_hash(source.function, i)
    for role, (kind, where) in start_points(cfg, stage).items():
        inputs[role] = _start_fingerprint(kind, where)
    return inputs


def start_points(cfg: Config, stage: str) -> dict[str, tuple[str, str | None]]:
    """{"start" or "start.<role>": (kind, where)} with kind "ckpt" (a stage or iter_* directory),
    "hf" (a Hugging Face directory) or "fresh": where `stage` starts, as the stage resolves it."""
    if stage == "sft":
        if cfg.sft.init_from:
            return {"start": ("ckpt", cfg.sft.init_from)}
        return {"start": ("hf", cfg.model.init_from_hf) if cfg.model.init_from_hf else ("fresh", None)}
    if stage == "rm":
        return {"start": ("ckpt", cfg.rm.init_from or str(stage_dir(cfg, "sft")))}
    if stage == "dpo":  # trainers/dpo.py start_checkpoint
        if cfg.dpo.init_from:
            return {"start": ("ckpt", cfg.dpo.init_from)}
        sft = stage_dir(cfg, "sft")
        if (sft / "latest").exists() or not cfg.model.init_from_hf:
            return {"start": ("ckpt", str(sft))}
        return {"start": ("hf", cfg.model.init_from_hf)}
    rl = cfg.rl  # trainers/rl_inputs.py load_inputs
    policy_stage, given = policy_start(cfg)
    starts = {"start.policy": ("ckpt", given or str(stage_dir(cfg, policy_stage)))}
    if rl.needs_rm_checkpoint:
        starts["start.reward_model"] = ("ckpt", rl.rm_from or str(stage_dir(cfg, "rm")))
    if cfg.rm.holdout_fraction > 0:
        starts["start.holdout_reward_model"] = ("ckpt", str(stage_dir(cfg, "rm_holdout")))
    if rl.has_critic and rl.critic_start not in ("rm", "sft"):
        starts["start.critic"] = ("ckpt", rl.critic_start)
    return starts


def inputs_digest(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def changes(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two fingerprints, one line each ("data.sft_train: was ..., now ...")."""
    current = json.loads(json.dumps(current))  # as summary.json holds it (tuples as lists, ...)
    lines = []
    for key in sorted(recorded.keys() | current.keys()):
        if key not in current:
            lines.append(f"{key}: was {_short(recorded[key])}, not an input now")
        elif key not in recorded:
            lines.append(f"{key}: not an input before, now {_short(current[key])}")
        elif recorded[key] != current[key]:
            was, now = recorded[key], current[key]
            if _same_file_other_contents(was, now):
                lines.append(f"{key}: other contents ({_short(_HASH.search(was)[0])} -> "
                             f"{_short(_HASH.search(now)[0])})")
            else:
                lines.append(f"{key}: was {_short(was)}, now {_short(now)}")
    return lines


# ---------------------------------------------------------------------- the pipeline's decision
@dataclass
class StagePlan:
    # skip | train (fresh, or resuming a partial run) | continue (more steps) | rerun (from scratch)
    # | refused (plan raises)
    action: str
    note: str  # the console line
    replaces: list[Path] = field(default_factory=list)  # moved aside to <name>.replaced-<time> first (rerun)


def plan(cfg: Config) -> dict[str, StagePlan]:
    """What `pipeline` does with each stage of pipeline.stages (module docstring); reads only.
    Raises ConfigError for every finished stage it may not reuse, before anything trains."""
    plans: dict[str, StagePlan] = {}
    refused: dict[str, str] = {}  # stage -> why
    for stage in cfg.pipeline.stages:
        out = stage_dir(cfg, stage)
        written = [out, *([run_dir(cfg) / "rm_holdout"] if stage == "rm" else [])]
        upstream = upstream_stages(cfg, stage)
        retrained = [up for up in upstream if plans[up].action in ("train", "continue", "rerun")]
        changed_above = [up for up in upstream if plans[up].action == "refused"]
        summary = _read_summary(out)
        if summary is None and not any(_has_content(d) for d in written):
            plans[stage] = StagePlan("train", f"{stage}: training ({out})")
            continue
        if retrained or changed_above:
            again = f"{'is' if len(retrained) == 1 else 'are'} trained again in this run"
            why = [f"starts from {' and '.join(ups)}, which {what}"
                   for ups, what in ((retrained, again), (changed_above, "changed")) if ups]
        elif summary is None:
            plans[stage] = StagePlan("train", f"{stage}: no summary.json in {out}: resuming from its checkpoints")
            continue
        else:
            why = _differences(cfg, stage, summary)
        if not why:
            plans[stage] = _reuse(cfg, stage, out, summary)
        elif stage in cfg.pipeline.rerun:
            moved = [d for d in written if d.exists()]
            plans[stage] = StagePlan("rerun", f"{stage}: training again from scratch ({_limited(why)})", moved)
        else:
            refused[stage] = f"{out}: {_limited(why)}"
            plans[stage] = StagePlan("refused", refused[stage])
    if refused:
        rerun = [s for s in cfg.pipeline.stages if s in refused or s in cfg.pipeline.rerun]
        raise ConfigError(
            f"pipeline: {'; '.join(refused.values())}. A finished stage is reused only on the inputs it was trained "
            f"on: to train on the new ones, use another run directory (checkpoint.run_name={_free_run_name(cfg)}) "
            f"or train again here with pipeline.rerun=[{','.join(rerun)}] (the old directories are kept, renamed "
            f"<name>{REPLACED}<time>); to reuse them, undo the change")
    return plans


def upstream_stages(cfg: Config, stage: str) -> list[str]:
    """The stages before `stage` in pipeline.stages whose directories it starts from."""
    stages = cfg.pipeline.stages
    earlier = stages[:stages.index(stage)]
    owners = {stage_dir(cfg, s).resolve(): s for s in earlier}
    if "rm" in earlier:
        owners[(run_dir(cfg) / "rm_holdout").resolve()] = "rm"
    found = []
    for kind, where in start_points(cfg, stage).values():
        if kind != "ckpt":
            continue
        path = Path(where.split("@iter_")[0]).resolve()  # STAGE_DIR@iter_N
        owner = owners.get(path) or owners.get(path.parent)  # a stage or one of its iter_* directories
        if owner is not None and owner not in found:
            found.append(owner)
    return found


def replaced_name(path: Path, now: float | None = None) -> Path:
    """<path>.replaced-<local time>, unused."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    candidate, n = path.with_name(f"{path.name}{REPLACED}{stamp}"), 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}{REPLACED}{stamp}-{n}")
    return candidate


def _differences(cfg: Config, stage: str, summary: dict) -> list[str]:
    """Why a finished stage cannot be reused as is: changed inputs, or fewer steps asked for."""
    recorded = summary.get("inputs")
    if isinstance(recorded, dict):
        why = changes(recorded, stage_inputs(cfg, stage))
    else:  # unknown: reused (with a note) unless pipeline.rerun asks for it again
        why = ["its summary records no inputs (an older version)"] if stage in cfg.pipeline.rerun else []
    steps, done = getattr(cfg, stage).steps, summary.get("steps")
    if isinstance(done, int) and steps < done:
        why.append(f"{stage}.steps: finished with {done} steps, now {steps} (a stage is not shortened; "
                   f"{stage}.steps={done} reuses it)")
    return why


def _reuse(cfg: Config, stage: str, out: Path, summary: dict) -> StagePlan:
    """Skip a finished stage on its inputs, or continue it to more steps."""
    steps, done = getattr(cfg, stage).steps, summary.get("steps")
    notes = "" if isinstance(summary.get("inputs"), dict) else (
        f" (its summary records no inputs, from an older version: they cannot be checked; pipeline.rerun=[{stage}] "
        "trains it again)")
    if stage in cfg.pipeline.rerun:
        notes += f" (pipeline.rerun names {stage}, but its inputs are unchanged: nothing to train again)"
    if isinstance(done, int) and steps > done:
        return StagePlan("continue", f"{stage}: finished earlier at step {done}, continuing to "
                                     f"{stage}.steps={steps}{notes}")
    from megatron_rlhf.checkpoint.manager import resolve_checkpoint  # megatron-core: only when needed

    try:  # what later stages start from and the export reads: a damaged newest checkpoint is refused
        resolve_checkpoint(out)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; or delete {out}/summary.json: the pipeline then resumes {stage} from its newest "
                              "complete checkpoint and trains the steps after it again") from None
    return StagePlan("skip", f"{stage}: finished earlier, skipped ({out}/summary.json){notes}")


def _read_summary(out: Path) -> dict | None:
    """The stage's summary.json as the report reads it (None: none); damaged: a ConfigError."""
    return read_summary(out)


def _has_content(directory: Path) -> bool:
    return directory.is_dir() and any(directory.iterdir())


def _free_run_name(cfg: Config) -> str:
    base, n = cfg.checkpoint.run_name, 2
    while (Path(cfg.checkpoint.root) / f"{base}_{n}").exists():
        n += 1
    return f"{base}_{n}"


def _limited(lines: list[str]) -> str:
    shown = "; ".join(lines[:_SHOWN_CHANGES])
    more = len(lines) - _SHOWN_CHANGES
    return shown + (f"; and {more} more (summary.json's inputs has them all)" if more > 0 else "")


# ---------------------------------------------------------------------- the parts of a fingerprint
def _flat(tree: dict, prefix: str) -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, item in enumerate(value):
                flat.update(_flat(item, f"{prefix}{key}[{i}]."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _file_hash(path: str | Path) -> str:
    if Path(path).is_dir():  # a save_to_disk directory: its files, each by name and content
        files = sorted(f for f in Path(path).rglob("*") if f.is_file())
        joined = "".join(f"{f.relative_to(path)} {_file_hash(f)}\n" for f in files)
        return "sha256:" + hashlib.sha256(joined.encode()).hexdigest()
    try:
        with open(path, "rb") as f:
            return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
    except FileNotFoundError:
        return "missing"


def _split_fingerprint(cfg: Config, split: str, optional: bool) -> str | None:
    try:
        kind, where = split_source(cfg, split)
    except ConfigError:
        if optional:
            return None
        raise
    if kind == "file":
        return f"file {_file_hash(where)}"
    if kind == "held_out":
        part = "held out" if split.endswith("_eval") else "the rest after holding out"
        return f"{part} {cfg.data.eval_fraction} (seed {cfg.seed}) of file {_file_hash(where)}"
    size = getattr(cfg.data.task_sizes, _TASK_SIZE.get(split, split))
    return f"task {where} (seed {cfg.seed}, {size} records)"


def _reward_file_hash(spec: str, index: int) -> str:
    from megatron_rlhf.rewards.function import resolve_function_file

    path, _ = resolve_function_file(spec, f"rl.rewards[{index}].function")
    return _file_hash(path)


def _start_fingerprint(kind: str, where: str | None) -> str:
    if kind == "fresh":
        return "fresh initialisation"
    if kind == "hf":
        directory = Path(where)
        files = sorted(p for p in directory.iterdir() if p.is_file()) if directory.is_dir() else []
        sizes = "\n".join(f"{p.name} {p.stat().st_size}" for p in files)
        return (f"Hugging Face config.json {_file_hash(directory / 'config.json')}, "
                f"files sha256:{hashlib.sha256(sizes.encode()).hexdigest()} (names and sizes)")
    try:
        found, _ = find_checkpoint(where, allow_fallback=False)
    except FileNotFoundError:  # CheckpointError included: the stage itself says what is wrong
        return "no usable checkpoint"
    with open(found / "commit.json", "rb") as f:
        identity = f"{found.name}, commit.json sha256:{hashlib.file_digest(f, 'sha256').hexdigest()}"
    upstream = _read_summary_quietly(found.parent)
    if isinstance(upstream.get("inputs"), dict):  # a stage retrained alike can commit a byte-identical record
        identity += f", its stage's inputs sha256:{inputs_digest(upstream['inputs'])}"
    return identity


def _read_summary_quietly(directory: Path) -> dict:
    try:
        summary = json.loads((directory / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def _same_file_other_contents(was: Any, now: Any) -> bool:
    """Two values that name one file hash each and differ only in it."""
    return (isinstance(was, str) and isinstance(now, str) and len(_HASH.findall(was)) == 1
            and _HASH.sub("", was) == _HASH.sub("", now))


def _short(value: Any) -> str:
    """A value for a message: hashes cut to 12 hex digits."""
    text = json.dumps(value) if not isinstance(value, str) else value
    return " ".join(word[:19] + "…" if word.startswith("sha256:") and len(word) > 19 else word
                    for word in text.split(" "))
