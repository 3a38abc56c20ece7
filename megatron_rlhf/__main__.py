"""`python -m megatron_rlhf <command> --config recipe.yaml [key=value ...]`

Launch with torchrun (or srun) for more than one process; every rank runs the same command.
"""

from __future__ import annotations

import argparse
import sys

from megatron_rlhf.config import ConfigError, load_config

COMMANDS = {
    "smoke": "the four roles at the configured TP x PP: forward + one optimizer step each",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_rlhf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v}" for k, v in COMMANDS.items()))
    parser.add_argument("--config", help="YAML recipe (pipelines/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor_parallel=2")
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if args.command == "smoke":
        from megatron_rlhf import smoke

        try:
            smoke.run(cfg)
        except ConfigError as err:  # layout checks against the launched world size
            print(f"config error: {err}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
