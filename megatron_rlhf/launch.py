"""nemo-run launcher (optional extra `nemo`): the recipe's pipeline.stages (default
sft -> rm -> rl) as one nemo-run Experiment.

    pip install -e '.[nemo]'
    python -m megatron_rlhf.launch --config pipelines/tiny_cpu.yaml --executor local --nproc 1
    python -m megatron_rlhf.launch --config pipelines/llama3_70b.yaml --executor slurm \\
        --nodes 8 --tasks-per-node 8 --gpus-per-node 8 --partition batch --account acct \\
        --job-dir /lustre/nemo_run [--dryrun] [key=value ...]
    # in a container (pyxis/enroot on the cluster), its interpreter, data mounted read-only:
    python -m megatron_rlhf.launch --config pipelines/llama3_70b.yaml --executor slurm ... \
        --container-image nvcr.io#nvidia/pytorch:25.04-py3 --container-mounts /lustre/data:/data:ro

The stages are the recipe's pipeline.stages after the overrides (loaded and validated, as
`python -m megatron_rlhf stages` prints them); `--stages sft rm` picks others. Each stage is
the same command the Slurm scripts run (`python -m megatron_rlhf <stage>`; rl runs the recipe's
rl.algorithm), as a nemo-run Script; stages depend on each other (afterok on Slurm, sequential
locally).
Local runs use torchrun; Slurm runs one srun task per device, as slurm/stage.sh does, with
--label (each output line prefixed with its rank), --run-root as checkpoint.root (default as
slurm/stage.sh: $RUN_ROOT, else ${SCRATCH:-$HOME}/megatron_rlhf_runs, outside the checkout
nemo-run copies into its job directory; a checkpoint.root=... override wins), and in
--container-image when given (REPO-independent: nemo-run mounts its code copy; the run root is
mounted at its own path, --container-mounts adds more).
Before anything is submitted the recipe goes through the same pre-flight as
slurm/submit_pipeline.sh (megatron_rlhf.preflight): placeholders and missing input paths are
refused with exit 2.
Requeue-on-USR1 is the Slurm scripts' job: under nemo-run a signalled stage checkpoints and
exits 42 and the next submission resumes from the checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys

import os

from megatron_rlhf.config import STAGES, ConfigError, load_config, validate
from megatron_rlhf.preflight import preflight_paths


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
        container_image=args.container_image, container_mounts=container_mounts(args),
        srun_args=["--label", *args.srun_args.split()],
    )


def default_run_root() -> str:
    """slurm/stage.sh's rule (slurm/common.sh): RUN_ROOT, else ${SCRATCH:-$HOME}/megatron_rlhf_runs."""
    return os.environ.get("RUN_ROOT") or os.path.join(
        os.environ.get("SCRATCH") or os.path.expanduser("~"), "megatron_rlhf_runs")


def container_mounts(args) -> list[str]:
    """pyxis mounts for a container run: the run root at its own path, then --container-mounts."""
    if not args.container_image:
        return []
    return [f"{args.run_root}:{args.run_root}", *filter(None, args.container_mounts.split(","))]


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
    ap.add_argument("--python", help="interpreter that has megatron_rlhf (default: this one; in a container: python)")
    ap.add_argument("--nproc", type=int, default=1, help="local: processes (torchrun)")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--tasks-per-node", type=int, default=8)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--partition", default="")
    ap.add_argument("--account", default="")
    ap.add_argument("--time", default="24:00:00")
    ap.add_argument("--job-dir", default="nemo_run_jobs")
    ap.add_argument("--run-root", default=default_run_root(),
                    help="slurm: checkpoint.root of the stages (default: $RUN_ROOT, else ${SCRATCH:-$HOME}/megatron_rlhf_runs)")
    ap.add_argument("--container-image", help="slurm: run the stages in this image (pyxis/enroot)")
    ap.add_argument("--container-mounts", default="", help="slurm: more pyxis mounts, SRC:DST[:FLAGS],...")
    ap.add_argument("--srun-args", default="", help="slurm: more srun arguments, one string: --srun-args='--cpu-bind=none --mpi=pmix'")
    ap.add_argument("--no-exists-check", action="store_true",
                    help="pre-flight: skip the input path checks (this host cannot see the jobs' filesystems)")
    ap.add_argument("--dryrun", action="store_true", help="print what would be submitted")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    args.python = args.python or ("python" if args.container_image else sys.executable)
    if args.executor == "slurm" and not any(o.startswith("checkpoint.root=") for o in args.overrides):
        args.overrides = [*args.overrides, f"checkpoint.root={args.run_root}"]
    args.stages = args.stages or recipe_stages(args.config, args.overrides)
    return args


def preflight(args: argparse.Namespace) -> list[str]:
    """What slurm/submit_pipeline.sh's pre-flight refuses, for these stages and mounts."""
    cfg = validate(load_config(args.config, args.overrides))
    mounts = ",".join(container_mounts(args)) if args.executor == "slurm" else ""
    return preflight_paths(cfg, args.stages, mounts, check_exists=not args.no_exists_check)


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
        problems = preflight(args)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if problems:
        print(f"preflight: {args.config} cannot run {', '.join(args.stages)}; nothing was submitted. "
              "Fix these settings:", *problems, sep="\n  ", file=sys.stderr)
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
