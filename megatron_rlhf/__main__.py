"""`python -m megatron_rlhf <command> --config recipe.yaml [key=value ...]`

Launch with `python -m megatron_rlhf.torchrun` (our torchrun) or srun for more than one
process; every rank runs the same command. Exit codes: 0 done, 2 config/data/checkpoint
error, 3 non-finite training, 4 reward source failed: fix it and rerun to resume, 42 preempted
(checkpointed; rerun or requeue to resume).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from megatron_rlhf.config import ConfigError, load_config, validate
from megatron_rlhf.logging import quiet

# Set by megatron_rlhf/torchrun.py: a handled error goes to <dir>/rank_<RANK>.json instead of
# the console, and the launcher prints it once for all ranks, last.
ERROR_DIR_ENV = "MEGATRON_RLHF_ERROR_DIR"

COMMANDS = {
    "smoke": "the four roles at the configured TP x PP: forward + one optimizer step each",
    "sft": "supervised fine-tuning stage (from sft.init_from, model.init_from_hf or fresh) -> <run>/sft "
           "(with LoRA: <run>/sft_lora)",
    "rm": "reward-model stage (starts from the SFT checkpoint) -> <run>/rm",
    "dpo": "DPO stage: the policy from preference pairs against a frozen reference (both start from SFT) "
           "-> <run>/dpo (with LoRA: <run>/dpo_lora)",
    "rl": "RL stage, rl.algorithm = ppo (default) | grpo | rloo | reinforce_pp | reinforce_pp_baseline | "
          "batch_mean (actor/reference from SFT, reward model and PPO's critic from RM) -> <run>/<algorithm>",
    "ppo": "the rl stage (the name older scripts use)",
    "pipeline": "the stages of pipeline.stages (sft -> rm -> rl), skipping finished stages and resuming "
                "partial ones; report",
    "stages": "print pipeline.stages, one per line (what slurm/submit_pipeline.sh submits)",
    "import-hf": "--hf DIR --out DIR: a local Hugging Face checkpoint (Llama 2/3.x, Mistral, Qwen2/2.5, "
                 "Qwen3) -> our checkpoint (model fields from its config.json; launch at any TP x PP)",
    "export-hf": "--ckpt DIR [--iter N] --role actor|reward|critic --out DIR: our checkpoint -> a Hugging Face "
                 "directory (one process; the model config, tokenizer and sampling settings are those the "
                 "checkpoint's run recorded: --tokenizer DIR only for older checkpoints); "
                 "a LoRA checkpoint is exported merged (W + alpha/r B A on the base checkpoint it records, or "
                 "--lora-base DIR)",
    "export-peft": "--ckpt DIR --role actor --out DIR [--hf BASE_HF_DIR]: the adapters of a LoRA policy "
                   "checkpoint -> a PEFT LoRA adapter directory, for the base model export-hf writes from the "
                   "checkpoint they were trained on (--hf: that directory, recorded as base_model_name_or_path)",
    "serve-reward": "--ckpt DIR [--host H] [--port P] [--max-batch N] [--max-wait-ms MS]: serve the reward model "
                    "of an RM checkpoint over HTTP (POST /score, docs/reward_service.md) at TP x PP = world size, "
                    "until SIGTERM/Ctrl-C",
}


# Commands that train and write checkpoints: the built-in defaults alone would silently train a
# toy run into checkpoints/default/, so these need a recipe; the one to start from for each.
RECIPE_FOR = {"sft": "pipelines/tiny_cpu.yaml", "rm": "pipelines/tiny_cpu.yaml", "dpo": "pipelines/tiny_cpu_dpo.yaml",
              "rl": "pipelines/tiny_cpu.yaml", "ppo": "pipelines/tiny_cpu.yaml", "pipeline": "pipelines/tiny_cpu.yaml"}


def check_recipe_given(command: str, config: str | None) -> None:
    if config is None and command in RECIPE_FOR:
        raise ConfigError(f"--config: `{command}` needs a recipe, e.g. --config {RECIPE_FOR[command]} "
                          "(pipelines/ has one per model size and algorithm; key=value overrides go after it)")


def convert_command(args, cfg) -> None:
    from megatron_rlhf.convert import export_hf, import_hf
    from megatron_rlhf.convert.hf_io import checkpoint_model_config

    needed = {"import-hf": ("hf", "out"), "export-hf": ("ckpt", "role", "out"),
              "export-peft": ("ckpt", "role", "out")}[args.command]
    if missing := [f"--{name}" for name in needed if getattr(args, name) is None]:
        raise ConfigError(f"{args.command}: missing {', '.join(missing)}")
    if args.command in ("export-hf", "export-peft"):
        if args.iter is not None:  # an older checkpoint of the stage directory, named (validate.find_checkpoint)
            args.ckpt = f"{args.ckpt}@iter_{args.iter}"
        # The checkpoint's own model config (every stage records it); model.* overrides must agree.
        typed = {o.split("=", 1)[0].strip() for o in args.overrides}
        model_cfg = checkpoint_model_config(args.ckpt, args.role, cfg.model, typed)
        if model_cfg is None:  # an older checkpoint: the recipe and overrides describe it
            from megatron_rlhf.trainers.stage_data import resolve_vocab_size, tokenizer_for

            if cfg.model.vocab_size is None:  # the recipe's tokenizer's size, as in training
                cfg, _ = resolve_vocab_size(cfg, tokenizer_for(cfg))
            model_cfg = cfg.model
        if args.command == "export-peft":
            from megatron_rlhf.convert.lora_export import export_peft_adapter

            path = export_peft_adapter(args.ckpt, args.role, args.out, model_cfg=model_cfg, base_model=args.hf)
        else:
            path = export_hf(args.ckpt, args.role, args.out, model_cfg=model_cfg, tokenizer_dir=args.tokenizer,
                             drop_score_bias=args.drop_score_bias, lora_base=args.lora_base)
        print(f"[{args.command}] {args.role} of {args.ckpt} -> {path}", flush=True)
        return
    from megatron_rlhf.trainers.runner import start_distributed

    # config.json gives the architecture; model.* overrides are checked against it
    cfg = load_config(args.config, [*args.overrides, f"model.from_hf_config={args.hf}"])
    rank0 = start_distributed(cfg).rank == 0
    if rank0:
        print(f"[import-hf] model from {args.hf}/config.json: {cfg.model}", flush=True)
    path = import_hf(cfg, args.hf, args.out)
    if rank0:
        print(f"[import-hf] {args.hf} -> {path}", flush=True)


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
    elif command == "dpo":
        from megatron_rlhf.trainers import dpo

        dpo.train(cfg)
    elif command in ("rl", "ppo"):
        from megatron_rlhf.trainers import rl

        rl.train(cfg)

    elif command == "pipeline":
        from megatron_rlhf import pipeline

        pipeline.run(cfg)


def serve_reward_command(args, cfg) -> None:
    from megatron_rlhf.trainers.serve_reward import serve_reward

    typed = {o.split("=", 1)[0].strip() for o in args.overrides}  # checked against the checkpoint's model
    serve_reward(cfg, ckpt=args.ckpt, host=args.host, port=args.port, max_batch=args.max_batch,
                 max_wait_ms=args.max_wait_ms, typed_keys=typed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_rlhf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v}" for k, v in COMMANDS.items()))
    parser.add_argument("--config", help="YAML recipe (pipelines/*.yaml); required by " + ", ".join(RECIPE_FOR))
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor_parallel=2")
    parser.add_argument("--verbose", action="store_true",
                        help="show every third-party warning (default: the known harmless ones are hidden, "
                             "megatron_rlhf/logging/quiet.py) and every metric on the console; = logging.verbose=true")
    parser.add_argument("--hf", help="import-hf: local Hugging Face model directory; export-peft: the base model's "
                                     "export (recorded in adapter_config.json)")
    parser.add_argument("--ckpt", help="export-hf, export-peft, serve-reward: a stage or iter_* checkpoint directory")
    parser.add_argument("--iter", type=int, help="export-hf, export-peft: the checkpoint of step N of the stage "
                                                 "directory --ckpt (default: the one its `latest` names)")
    parser.add_argument("--role", choices=("actor", "reward", "critic", "reference"),
                        help="export-hf / export-peft: the role to export")
    parser.add_argument("--out", help="import-hf / export-hf / export-peft: output directory")
    parser.add_argument("--lora-base", help="export-hf of a LoRA checkpoint: where its base checkpoint is now "
                                            "(default: the path the checkpoint recorded)")
    parser.add_argument("--tokenizer", help="export-hf: tokenizer directory to copy (default: the one the "
                                            "checkpoint's run recorded)")
    parser.add_argument("--drop-score-bias", action="store_true",
                        help="export-hf of reward/critic: drop the value head's constant offset (HF's score has no bias)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="serve-reward: address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="serve-reward: port (0: a free one, printed)")
    parser.add_argument("--max-batch", type=int, default=64, help="serve-reward: most samples per model forward")
    parser.add_argument("--max-wait-ms", type=float, default=5.0,
                        help="serve-reward: how long a request waits for others to share its forward")
    return parser


def report_error(message: str, code: int) -> int:
    """Print a handled error; under our launcher, leave it for the launcher to print instead."""
    if directory := os.environ.get(ERROR_DIR_ENV):
        rank = int(os.environ.get("RANK", "0"))
        try:
            (Path(directory) / f"rank_{rank}.json").write_text(
                json.dumps({"rank": rank, "exit_code": code, "message": message}))
            return code
        except OSError:
            pass
    print(message, file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    try:  # cheap: no torch yet
        check_recipe_given(args.command, args.config)
        cfg = load_config(args.config, args.overrides)
        if args.command == "stages":  # before anything imports torch: Slurm submission scripts wait on it
            print("\n".join(validate(cfg).pipeline.stages))
            return 0
    except ConfigError as err:
        return report_error(f"config error: {err}", 2)
    if args.verbose and not cfg.logging.verbose:  # also: every metric on the console
        cfg = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, verbose=True))
    verbose = cfg.logging.verbose
    quiet.install(verbose)  # before torch and megatron-core are imported

    from megatron_rlhf.checkpoint.validate import CheckpointError
    from megatron_rlhf.convert import ConvertError
    from megatron_rlhf.data.jsonl import DataError
    from megatron_rlhf.data.tokenizers import TokenizerError
    from megatron_rlhf.parallel import cpu
    from megatron_rlhf.resilience.nonfinite import NonFiniteError
    from megatron_rlhf.resilience.preemption import Preempted
    from megatron_rlhf.rewards.base import RewardSourceError

    if cpu.needed():
        quiet.install_cpu(verbose)

    try:
        if args.command in ("import-hf", "export-hf", "export-peft"):
            convert_command(args, cfg)
        elif args.command == "serve-reward":
            serve_reward_command(args, cfg)
        else:
            run_command(args.command, cfg)
    except ConfigError as err:  # checks that need the launched world size or the data
        return report_error(f"config error: {err}", 2)
    except (DataError, TokenizerError) as err:
        return report_error(f"data error: {err}", 2)
    except ConvertError as err:
        return report_error(f"conversion error: {err}", 2)
    except CheckpointError as err:  # damaged checkpoints: a person decides, not a requeue loop
        return report_error(f"checkpoint error: {err}", 2)
    except NonFiniteError as err:  # not requeued: resuming would diverge again
        return report_error(f"training error: {err}", 3)
    except RewardSourceError as err:  # the last checkpoint is intact: fix the source, rerun to resume
        return report_error(f"reward error: {err}", 4)
    except Preempted as err:  # the runner logged it; the launcher's last line says it too
        if os.environ.get(ERROR_DIR_ENV):
            report_error(f"preempted: checkpoint at step {err.step} saved; exit {err.code}: rerun or requeue "
                         "to resume", err.code)
        raise
    finally:
        parallel = sys.modules.get("megatron_rlhf.parallel")  # not imported (e.g. `stages`): nothing to tear down
        if parallel is not None:
            parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
