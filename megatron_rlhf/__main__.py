"""`python -m megatron_rlhf <command> --config recipe.yaml [key=value ...]`

Launch with torchrun (or srun) for more than one process; every rank runs the same command.
"""

from __future__ import annotations

import argparse
import sys

from megatron_rlhf.config import ConfigError, load_config

COMMANDS = {
    "smoke": "the four roles at the configured TP x PP: forward + one optimizer step each",
    "sft": "supervised fine-tuning stage -> <run>/sft",
    "rm": "reward-model stage (starts from the SFT checkpoint) -> <run>/rm",
    "ppo": "PPO stage (actor/reference from SFT, reward model/critic from RM) -> <run>/ppo",
    "pipeline": "SFT -> RM -> PPO, skipping finished stages and resuming partial ones; report",
}


def run_command(command: str, cfg) -> None:
    if command == "smoke":
        from megatron_rlhf import smoke

        smoke.run(cfg)
    elif command == "sft":
        from megatron_rlhf.trainers import sft

        sft.train(cfg)
    elif command == "rm":
        from megatron_rlhf.trainers import rm

        rm.train(cfg)
    elif command == "ppo":
        from megatron_rlhf.trainers import ppo

        ppo.train(cfg)
    elif command == "pipeline":
        from megatron_rlhf import pipeline

        pipeline.run(cfg)


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
    from megatron_rlhf.checkpoint.validate import CheckpointError
    from megatron_rlhf.data.jsonl import DataError
    from megatron_rlhf.data.tokenizers import TokenizerError
    from megatron_rlhf.resilience.nonfinite import NonFiniteError

    try:
        run_command(args.command, cfg)
    except ConfigError as err:  # checks that need the launched world size or the data
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except (DataError, TokenizerError) as err:
        print(f"data error: {err}", file=sys.stderr)
        return 2
    except CheckpointError as err:  # damaged checkpoints: a person decides, not a requeue loop
        print(f"checkpoint error: {err}", file=sys.stderr)
        return 2
    except NonFiniteError as err:  # not requeued: resuming would diverge again
        print(f"training error: {err}", file=sys.stderr)
        return 3
    finally:
        from megatron_rlhf import parallel

        parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
