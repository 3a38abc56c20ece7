"""torchrun workers launched by the multi-process tests."""

import argparse
from pathlib import Path


def training_of(cfg, **given) -> dict:
    """A trainable role's keyword arguments (models/roles.py: Role) from `cfg`, as the tests'
    roles have always trained: cfg.optimizer, the run's seed and resilience limit; `given`
    (e.g. optimizer=, lora=) replaces or adds to them."""
    return {"optimizer": cfg.optimizer, "seed": cfg.seed,
            "max_consecutive_nonfinite": cfg.resilience.max_consecutive_nonfinite, **given}


def start_layout_worker():
    """Parse `--root DIR --layout NAME [--init] key=value...`, start distributed + megatron.
    Returns (args, config)."""
    from megatron_rlhf.config import load_config
    from megatron_rlhf.trainers.runner import start_distributed

    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--layout", required=True)
    ap.add_argument("--init", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(None, args.overrides)
    start_distributed(cfg)
    return args, cfg


def layout_args(layouts: dict[str, tuple]) -> list[str]:
    """`--layout NAME=TPxPP[:key=value...]` flags for run_layouts, one per entry {name: (tp, pp)}
    or {name: (tp, pp, [overrides of that layout alone])}, in order."""
    return [f"--layout={name}={shape[0]}x{shape[1]}" + "".join(f":{o}" for o in (shape[2] if len(shape) > 2 else ()))
            for name, shape in layouts.items()]


def run_layouts(body, extra_args=(), config=None) -> None:
    """One launch, several layouts: parse `--root DIR --layout NAME=TPxPP[:key=value...] [--layout ...]
    [--init] key=value...`, then for each layout in turn start megatron's parallel_state at that
    TP x PP (DP: the rest of the world), seed as a fresh process would, run `body(args, cfg,
    name)`, and tear the model-parallel groups down again. A launch costs ~7 s of CPU in
    imports alone, so the tests check every layout of one world size in one launch.
    `extra_args`: (flag, argparse kwargs) pairs the body reads from args; `config(args, tp, pp)`:
    the config each layout starts with (default: the overrides at that TP x PP)."""
    from megatron.core import parallel_state

    from megatron_rlhf import parallel
    from megatron_rlhf.config import load_config
    from megatron_rlhf.trainers.runner import start_distributed

    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--layout", action="append", required=True, help="NAME=TPxPP[:key=value...], repeatable")
    ap.add_argument("--init", action="store_true")
    for flag, kwargs in extra_args:
        ap.add_argument(flag, **kwargs)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    for spec in args.layout:
        name, rest = spec.split("=", 1)
        shape, *layout_overrides = rest.split(":")
        tp, pp = (int(x) for x in shape.split("x"))
        cfg = (config(args, tp, pp) if config else
               load_config(None, [*args.overrides, f"parallel.tensor_parallel={tp}", f"parallel.pipeline_parallel={pp}",
                                  *layout_overrides]))
        start_distributed(cfg)  # the process group stays; megatron's groups are new for each layout
        body(args, cfg, name)
        parallel_state.destroy_model_parallel()
    parallel.destroy()
