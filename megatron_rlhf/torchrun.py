"""`python -m megatron_rlhf.torchrun [torchrun options] [--verbose] <command> --config X [key=value ...]`

torchrun for our commands. Before any worker starts it checks the config at the world size it
launches and the data the command reads (`config error: ...` / `data error: ...`, exit 2).
Then torch's own launcher (torch.distributed.run) starts the workers: --standalone when one
node and no rendezvous is given; OMP_NUM_THREADS=1 when unset and more than one process.
On a failure the worker's own error is printed once, last, and the exit code is the worker's:
2 config/data/checkpoint error, 3 non-finite training, 42 preempted (checkpointed: rerun or
requeue to resume), 128+N killed by signal N. --verbose (or logging.verbose=true) shows the
warnings and torchrun logs hidden otherwise (megatron_rlhf/logging/quiet.py).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from megatron_rlhf.__main__ import COMMANDS, ERROR_DIR_ENV, LAUNCHER_PID_ENV, build_parser, check_recipe_given
from megatron_rlhf.config import ConfigError, learning_rate_warnings, load_config, validate
from megatron_rlhf.logging import quiet

STAGE_COMMANDS = ("smoke", "sft", "rm", "dpo", "rl", "ppo", "pipeline")  # checked here before launch
FLAGS = ("--standalone", "--verbose", "-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path")


def split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(launcher options, the command and its arguments): the command is the first COMMANDS
    word that is not the value of an option (`--role rm`)."""
    for i, word in enumerate(argv):
        before = argv[i - 1] if i else ""
        takes_value = before.startswith("-") and "=" not in before and before not in FLAGS
        if word in COMMANDS and not takes_value:
            return argv[:i], argv[i:]
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        sys.exit(0)
    sys.exit(fail(f"{__doc__.splitlines()[0]}: no command ({', '.join(COMMANDS)}) among {argv}"))


def main(argv: list[str] | None = None) -> int:
    launcher_args, command_args = split(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_intermixed_args(command_args)
    try:
        check_recipe_given(args.command, args.config)  # before the preflight and any worker
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        return fail(f"config error: {err}")
    verbose = "--verbose" in launcher_args or args.verbose or cfg.logging.verbose
    quiet.install(verbose)  # before torch is imported

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import determine_local_world_size, parse_args, parse_min_max_nnodes, run

    if "--verbose" in launcher_args and not args.verbose:
        command_args = [*command_args, "--verbose"]
    targs = parse_args([*(a for a in launcher_args if a != "--verbose"), "--module", "megatron_rlhf", *command_args])
    min_nodes, max_nodes = parse_min_max_nnodes(targs.nnodes)
    if max_nodes == 1 and targs.rdzv_backend == "static" and not targs.rdzv_endpoint and targs.master_port is None:
        targs.standalone = True
    nproc = determine_local_world_size(targs.nproc_per_node)
    if args.command in STAGE_COMMANDS:
        if message := check(cfg, args.command, nproc * max_nodes if min_nodes == max_nodes else None):
            return fail(message)
    if nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun does, without its banner
    quiet.quiet_launcher(verbose)
    os.environ[ERROR_DIR_ENV] = error_dir = tempfile.mkdtemp(prefix="megatron_rlhf_errors.")
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # workers stop when this process dies (__main__.follow_launcher)
    try:
        run(targs)
        return 0
    except ChildFailedError as err:
        return report(error_dir, err.failures, err.get_first_failure()[0])
    except SignalException as err:  # the launcher was signalled and passed the signal on to the workers
        code = report(error_dir, {}, None)  # e.g. preempted: checkpointed, exit 42
        return fail(f"launcher: received {err.sigval.name}", 128 + err.sigval) if code is None else code
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)


def check(cfg, command: str, world_size: int | None) -> str | None:
    """The config at this world size and the data: an error message, or None (notes printed)."""
    from megatron_rlhf.checkpoint.validate import CheckpointError
    from megatron_rlhf.data.jsonl import DataError
    from megatron_rlhf.data.tokenizers import TokenizerError
    from megatron_rlhf.trainers.stage_data import architecture_from_start, preflight
    from megatron_rlhf.trainers.stage_inputs import plan

    try:
        stage = "rl" if command == "ppo" else command
        # a stage that starts from a checkpoint runs with its architecture (max_seq_length included)
        validate(architecture_from_start(cfg, stage, world_size)[0] if stage in ("sft", "rm", "dpo", "rl") else cfg,
                 world_size)
        for note in preflight(cfg, command):
            print(f"[preflight] {note}", flush=True)
        stages = cfg.pipeline.stages if command == "pipeline" else ["rl" if command == "ppo" else command]
        for warning in learning_rate_warnings(cfg, stages):
            print(f"[preflight] warning: {warning}", flush=True)
        if command == "pipeline":
            plan(cfg)  # a finished stage it may not reuse (changed inputs, damaged checkpoint) stops here
        if message := live_writer(cfg, command):
            return f"config error: {message}"
    except ConfigError as err:
        return f"config error: {err}"
    except (DataError, TokenizerError) as err:
        return f"data error: {err}"
    except CheckpointError as err:
        return f"checkpoint error: {err}"
    return None


def live_writer(cfg, command: str) -> str | None:
    """Another run writing a stage directory this command writes (resilience/run_lock.py): the
    error, before any worker starts (the workers' rank 0 takes the lock itself)."""
    from megatron_rlhf.resilience.run_lock import busy_error, stage_directory_holder
    from megatron_rlhf.trainers.stage_data import stage_dir

    stages = validate(cfg).pipeline.stages if command == "pipeline" else ["rl" if command == "ppo" else command]
    for stage in stages:
        if stage != "smoke" and (holder := stage_directory_holder(stage_dir(cfg, stage))) is not None:
            return str(busy_error(stage_dir(cfg, stage), cfg.checkpoint.run_name, holder))
    return None


def fail(message: str, code: int = 2) -> int:
    print(message, file=sys.stderr, flush=True)
    return code


def report(error_dir: str, failures: dict, first_rank: int | None) -> int | None:
    """Print the workers' errors once (with their ranks when they differ); returns the first
    failed worker's exit code (None: no worker reported or failed)."""
    reports = {}
    for path in Path(error_dir).glob("rank_*.json"):
        try:
            entry = json.loads(path.read_text())
            reports[entry["rank"]] = entry
        except (OSError, ValueError, KeyError):
            continue  # a worker killed while writing: its exit code still counts
    messages: dict[str, list[int]] = {}
    for rank in sorted(reports):
        messages.setdefault(reports[rank]["message"], []).append(rank)
    for message, ranks in messages.items():
        print(f"rank {','.join(map(str, ranks))}: {message}" if len(messages) > 1 else message, file=sys.stderr)
    if first_rank in reports:
        return reports[first_rank]["exit_code"]
    if first_rank is None:
        return next((reports[rank]["exit_code"] for rank in sorted(reports)), None)
    failure = failures[first_rank]  # no report: an unexpected error (its traceback is above) or a signal
    if failure.exitcode < 0:
        print(f"rank {first_rank} was killed by {failure.signal_name()}", file=sys.stderr)
        return 128 - failure.exitcode
    return failure.exitcode


if __name__ == "__main__":
    sys.exit(main())
