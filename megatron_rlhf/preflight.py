"""Submit-time checks: what a cluster job would only find out once it has its nodes.

slurm/submit_pipeline.sh and the nemo-run launcher (megatron_rlhf.launch) run them before
anything is queued, so a recipe with a `/path/to/...` placeholder or a missing data file is
refused in a second instead of failing three 8-node jobs at start-up:

    python -m megatron_rlhf.preflight --config pipelines/llama3_70b.yaml [--container-mounts M] [key=value ...]

prints the stages to submit (pipeline.stages, one per line, as `python -m megatron_rlhf stages`)
and exits 0, or lists every unusable setting on stderr and exits 2. Loads only the config
(no torch): it runs on a login node in well under a second.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Iterator

from megatron_rlhf.config import STAGES, ConfigError, load_config, validate

# What the GPU recipes ship for the settings a user must fill in (pipelines/llama3_*.yaml).
PLACEHOLDER = "/path/to/"

# The data files each stage reads. A stage that is not submitted does not need its files, so
# their placeholders are left alone (an SFT -> DPO recipe never reads prompts_*).
STAGE_DATA = {
    "sft": ("data.sft_train", "data.sft_eval"),
    "rm": ("data.preference_train", "data.preference_eval"),
    "dpo": ("data.preference_train", "data.preference_eval"),
    "rl": ("data.prompts_train", "data.prompts_eval"),
}
# Local files or directories every stage reads when they are set.
SHARED_INPUTS = ("data.tokenizer", "data.chat_template", "model.init_from_hf", "model.from_hf_config")
# data.tokenizer's value for the built-in tasks' tokenizer (not a path).
# Values of data.tokenizer / data.chat_template that name no file.
NOT_PATHS = {"data.tokenizer": ("builtin", "auto"), "data.chat_template": ("auto", "none")}


def flat_settings(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) for every leaf of a config dict; list items as key[i]."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from flat_settings(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from flat_settings(value, f"{prefix}[{i}]")
    else:
        yield prefix, tree


def parse_mounts(mounts: str) -> list[tuple[str, str]]:
    """pyxis --container-mounts (SRC:DST[:FLAGS],... ; a bare SRC mounts at SRC) as
    (host SRC, container DST) pairs."""
    pairs = []
    for entry in filter(None, mounts.split(",")):
        parts = entry.split(":")
        pairs.append((parts[0], parts[1] if len(parts) > 1 else parts[0]))
    return pairs


def host_path(path: str, mounts: list[tuple[str, str]]) -> Path:
    """Where `path`, as the job's tasks see it (inside the container when there are mounts),
    lies on this host: the longest mount destination it is under is replaced by its source."""
    best = None
    for src, dst in mounts:
        dst = dst.rstrip("/") or "/"
        under = path == dst or path.startswith(dst.rstrip("/") + "/")
        if under and (best is None or len(dst) > len(best[1])):
            best = (src, dst)
    if best is None:
        return Path(path)
    return Path(best[0]) / Path(path).relative_to(best[1])


def preflight_paths(cfg, stages: list[str] | None = None, mounts: str = "", check_exists: bool = True) -> list[str]:
    """Every setting of the (validated) config `cfg` a job running `stages` (default: its
    pipeline.stages) could not start with, one line each, naming the field and its value:
    `/path/to/...` placeholders anywhere in the config (except the data files of stages not
    run), and input files or directories that do not exist (relative paths: from the current
    directory, the checkout the jobs run in). `mounts`: the container's --container-mounts, so a
    path inside the container is looked up at its source on this host. Empty: nothing to fix."""
    stages = list(cfg.pipeline.stages) if stages is None else stages
    needed = {key for stage in stages for key in STAGE_DATA[stage]}
    not_read = {key for keys in STAGE_DATA.values() for key in keys} - needed
    settings = dict(flat_settings(cfg.to_dict()))
    problems = [f"{key}={value}: a placeholder; give the real path ({key}=... in the recipe or as an override"
                + (", or null to hold out data.eval_fraction of the train file)" if key.endswith("_eval") else ")")
                for key, value in settings.items()
                if isinstance(value, str) and PLACEHOLDER in value and key not in not_read]
    if not check_exists:
        return problems
    pairs = parse_mounts(mounts)
    for key in (*SHARED_INPUTS, *sorted(needed)):
        value = settings[key]
        if value is None or PLACEHOLDER in value or value in NOT_PATHS.get(key, ()):
            continue
        where = host_path(value, pairs)
        if not where.exists():
            seen_at = f" (on this host: {where})" if str(where) != value else ""
            problems.append(f"{key}={value}: no such file or directory{seen_at}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_rlhf.preflight", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--stages", nargs="+", choices=STAGES, help="default: the recipe's pipeline.stages")
    ap.add_argument("--container-mounts", default="", help="pyxis SRC:DST[:FLAGS],... the jobs will use")
    ap.add_argument("--no-exists-check", action="store_true",
                    help="skip the file checks (this host cannot see the jobs' filesystems); placeholders are still refused")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    try:
        cfg = validate(load_config(args.config, args.overrides))
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    stages = args.stages or list(cfg.pipeline.stages)
    problems = preflight_paths(cfg, stages, args.container_mounts, check_exists=not args.no_exists_check)
    if problems:
        print(f"preflight: {args.config} ({' '.join(args.overrides) or 'no overrides'}) cannot run "
              f"{', '.join(stages)}; nothing was submitted. Fix these settings:", file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        return 2
    print("\n".join(stages))
    return 0


if __name__ == "__main__":
    sys.exit(main())
