"""nemo-run launcher (optional extra `nemo`): the recipe's pipeline.stages (default
sft -> rm -> rl) as one nemo-run Experiment.

    pip install -e '.[nemo]'
    python -m megatron_rlhf.launch --config pipelines/tiny_cpu.yaml --executor local --nproc 1
    python -m megatron_rlhf.launch --config pipelines/llama3_70b.yaml --executor slurm \\
        --nodes 8 --tasks-per-node 8 --gpus-per-node 8 --partition batch --account acct \\
        --job-dir /lustre/nemo_run [--dryrun] [key=value ...]

The stages are the recipe's pipeline.stages after the overrides (loaded and validated, as
`python -m megatron_rlhf stages` prints them); `--stages sft rm` picks others. Each stage is
the same command the Slurm scripts run (`python -m megatron_rlhf <stage>`; rl runs the recipe's
rl.algorithm), as a nemo-run Script; stages depend on each other (afterok on Slurm, sequential
locally).
Local runs use torchrun; Slurm runs one srun task per device, as slurm/stage.sh does.
Requeue-on-USR1 is the Slurm scripts' job: under nemo-run a signalled stage checkpoints and
exits 42 and the next submission resumes from the checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys

from megatron_rlhf.config import STAGES, ConfigError, load_config, validate


def recipe_stages(config: str, overrides: list[str]) -> list[str]:
    """The recipe's pipeline.stages with the overrides applied (validated)."""
    return list(validate(load_config(config, overrides)).pipeline.stages)


def stage_script(stage: str, config: str, overrides: list[str], python: str):
    import nemo_run as run

    return run.Script(path="megatron_rlhf", m=True, entrypoint=python,
                      args=[stage, "--config", config, *overrides])


def make_executor(args):
    import nemo_run as run

    if args.executor == "local":
        return run.LocalExecutor(ntasks_per_node=args.nproc, launcher="torchrun")
    return run.SlurmExecutor(
        account=args.account, partition=args.partition, nodes=args.nodes,
        ntasks_per_node=args.tasks_per_node, gpus_per_node=args.gpus_per_node or None,
        time=args.time, tunnel=run.LocalTunnel(job_dir=args.job_dir),
    )


def add_stages(experiment, args) -> list[str]:
    """Add the stages in order, each depending on the one before; returns their task ids."""
    ids: list[str] = []
    for stage in args.stages:
        task = stage_script(stage, args.config, args.overrides, args.python)
        ids.append(experiment.add(task, name=stage, dependencies=ids[-1:] or None))
    return ids


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with args.stages resolved from the recipe when --stages is not given
    (raises ConfigError if the recipe or the overrides are invalid)."""
    ap = argparse.ArgumentParser(prog="python -m megatron_rlhf.launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--executor", choices=("local", "slurm"), default="local")
    ap.add_argument("--name", default="rlhf-pipeline")
    ap.add_argument("--stages", nargs="+", choices=STAGES,
                    help="stages to run, in order (default: the recipe's pipeline.stages)")
    ap.add_argument("--python", default=sys.executable, help="interpreter that has megatron_rlhf")
    ap.add_argument("--nproc", type=int, default=1, help="local: processes (torchrun)")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--tasks-per-node", type=int, default=8)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--partition", default="")
    ap.add_argument("--account", default="")
    ap.add_argument("--time", default="24:00:00")
    ap.add_argument("--job-dir", default="nemo_run_jobs")
    ap.add_argument("--dryrun", action="store_true", help="print what would be submitted")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    args.stages = args.stages or recipe_stages(args.config, args.overrides)
    return args


@contextlib.contextmanager
def build_experiment(args: argparse.Namespace):
    """The nemo-run Experiment of args.stages on args' executor, with the stages added and its
    context entered (nemo-run adds and runs tasks only inside it); nothing is submitted until
    the caller runs it (`experiment.run()`) or dry-runs it (`experiment.dryrun()`)."""
    import nemo_run as run

    with run.Experiment(args.name, executor=make_executor(args)) as experiment:
        add_stages(experiment, args)
        yield experiment


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    try:
        importlib.import_module("nemo_run")
    except ImportError as err:
        print(f"nemo-run is not installed ({err}): pip install -e '.[nemo]'", file=sys.stderr)
        return 2

    with build_experiment(args) as experiment:
        if args.dryrun:
            experiment.dryrun()
        else:
            experiment.run()  # the stage dependencies order the jobs
    return 0


if __name__ == "__main__":
    sys.exit(main())
