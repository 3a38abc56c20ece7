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
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_rlhf.config import ConfigError, config_yaml, load_config, validate
from megatron_rlhf.logging import quiet

# Set by megatron_rlhf/torchrun.py: a handled error goes to <dir>/rank_<RANK>.json instead of
# the console, and the launcher prints it once for all ranks, last.
ERROR_DIR_ENV = "MEGATRON_RLHF_ERROR_DIR"
# Set by megatron_rlhf/torchrun.py to its own pid: its workers stop when it dies (follow_launcher).
LAUNCHER_PID_ENV = "MEGATRON_RLHF_LAUNCHER_PID"

@dataclass(frozen=True)
class Verb:
    summary: str  # one line, in `python -m megatron_rlhf --help`
    details: str = ""  # more, in the verb's own --help
    flags: tuple[str, ...] = ()  # its options besides --config and the overrides (FLAGS)
    sections: tuple[str, ...] = ()  # the config sections it reads (docs/config_reference.md)


# Every section of the root Config, in its order (pipeline and print-config read them all).
ALL_SECTIONS = ("seed", "model", "parallel", "optimizer", "data", "sft", "rm", "dpo", "rl", "sampling", "rollout",
                "lora", "pipeline", "checkpoint", "resilience", "logging")
# What every training stage reads besides its own section.
STAGE_SECTIONS = ("seed", "model", "parallel", "data", "checkpoint", "resilience", "logging")
VERBS = {
    "smoke": Verb("the four roles at the configured TP x PP: forward + one optimizer step each",
                  sections=("seed", "model", "parallel", "optimizer", "resilience")),
    "sft": Verb("supervised fine-tuning stage -> <run>/sft (with LoRA: <run>/sft_lora)",
                "Starts from sft.init_from, model.init_from_hf, or fresh weights.",
                sections=(*STAGE_SECTIONS, "sft", "lora")),
    "rm": Verb("reward-model stage (starts from the SFT checkpoint) -> <run>/rm", sections=(*STAGE_SECTIONS, "rm")),
    "dpo": Verb("DPO stage from preference pairs -> <run>/dpo (with LoRA: <run>/dpo_lora)",
                "The policy trains against a frozen reference; both start from SFT (dpo.init_from).",
                sections=(*STAGE_SECTIONS, "dpo", "sampling", "lora")),
    "rl": Verb("RL stage (rl.algorithm: ppo, grpo, rloo, ...) -> <run>/<algorithm>",
               "rl.algorithm = ppo (default) | grpo | rloo | reinforce_pp | reinforce_pp_baseline | batch_mean. "
               "The actor and reference start from SFT, the reward model and PPO's critic from RM.",
               sections=(*STAGE_SECTIONS, "rl", "rm", "sampling", "rollout", "lora")),
    "ppo": Verb("the rl stage (the name older scripts use)",
                sections=(*STAGE_SECTIONS, "rl", "rm", "sampling", "rollout", "lora")),
    "pipeline": Verb("the stages of pipeline.stages (sft -> rm -> rl), then the report",
                     "Skips finished stages and resumes partial ones; a stage whose inputs changed stops the run "
                     "unless pipeline.rerun lists it.", sections=ALL_SECTIONS),
    "stages": Verb("print pipeline.stages, one per line (what slurm/submit_pipeline.sh submits)",
                   sections=("pipeline",)),
    "print-config": Verb("the resolved config as YAML, each value with where it came from",
                         "After the base chain, the overrides and the HF config.json fill-in. Each value ends in "
                         "`# from: default | recipe | base <file> | override | config.json`; --no-sources prints "
                         "plain YAML that --config reads back (not checked: print-config shows also a config "
                         "that a stage would refuse).", ("--no-sources",), ALL_SECTIONS),
    "report": Verb("write <run>/report.md and its plots for a run directory; print the path",
                   "The run: --run DIR, or --config RECIPE (and overrides): checkpoint.root/checkpoint.run_name.",
                   ("--run",), ("checkpoint",)),
    "import-hf": Verb("--hf DIR --out DIR: a local Hugging Face checkpoint -> our checkpoint",
                      "Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3; the model fields from its config.json (model.* "
                      "overrides are checked against it); launch at any TP x PP.",
                      ("--hf", "--out"), ("seed", "model", "parallel")),
    "export-hf": Verb("--ckpt DIR --role R --out DIR: our checkpoint -> a Hugging Face directory",
                      "One process. The model config, tokenizer and sampling settings are those the checkpoint's "
                      "run recorded (--tokenizer DIR only for older checkpoints); a LoRA checkpoint is exported "
                      "merged (W + alpha/r B A on the base checkpoint it records, or --lora-base DIR).",
                      ("--ckpt", "--iter", "--role", "--out", "--tokenizer", "--lora-base", "--drop-score-bias"),
                      ("model", "data")),
    "export-peft": Verb("--ckpt DIR --role actor --out DIR: LoRA adapters -> a PEFT adapter directory",
                        "For the base model export-hf writes from the checkpoint they were trained on.",
                        ("--ckpt", "--iter", "--role", "--out", "--hf"), ("model",)),
    "serve-reward": Verb("--ckpt DIR: serve an RM checkpoint's reward model over HTTP (POST /score)",
                         "At TP x PP = world size, until SIGTERM/Ctrl-C (docs/reward_service.md).",
                         ("--ckpt", "--host", "--port", "--max-batch", "--max-wait-ms"),
                         ("seed", "model", "parallel", "rl")),
}
COMMANDS = {name: verb.summary for name, verb in VERBS.items()}  # megatron_rlhf/torchrun.py finds the verb by these

# Every verb's options: the recipe, the overrides, and --verbose (slurm/ passes the same extra
# arguments to `stages` as to the stages).
VERBOSE = dict(action="store_true", help="show every third-party warning (default: the known harmless ones are "
                                         "hidden, megatron_rlhf/logging/quiet.py) and every metric on the console; "
                                         "= logging.verbose=true")
# The options of some verbs (Verb.flags): argparse keywords.
FLAGS = {
    "--no-sources": dict(action="store_true", help="plain YAML, without the `# from:` comments"),
    "--run": dict(help="the run directory (<checkpoint.root>/<checkpoint.run_name>)"),
    "--hf": dict(help="import-hf: the local Hugging Face model directory; export-peft: the base model's export "
                      "(recorded in adapter_config.json as base_model_name_or_path)"),
    "--ckpt": dict(help="a stage or iter_* checkpoint directory"),
    "--iter": dict(type=int, help="the checkpoint of step N of the stage directory --ckpt (default: the one its "
                                  "`latest` names)"),
    "--role": dict(choices=("actor", "reward", "critic", "reference"), help="the role to export"),
    "--out": dict(help="the output directory"),
    "--lora-base": dict(help="a LoRA checkpoint's base checkpoint, where it is now (default: the path the "
                             "checkpoint recorded)"),
    "--tokenizer": dict(help="tokenizer directory to copy (default: the one the checkpoint's run recorded)"),
    "--drop-score-bias": dict(action="store_true",
                              help="reward/critic: drop the value head's constant offset (HF's score has no bias)"),
    "--host": dict(default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)"),
    "--port": dict(type=int, default=8000, help="port (0: a free one, printed)"),
    "--max-batch": dict(type=int, default=64, help="most samples per model forward"),
    "--max-wait-ms": dict(type=float, default=5.0, help="how long a request waits for others to share its forward"),
}
# Options that take no value (the rest do: `--out sft` names a directory, not the sft verb).
SWITCHES = ("-h", "--help", "--verbose", *(name for name, kw in FLAGS.items() if kw.get("action") == "store_true"))


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


def print_config(args, cfg) -> None:
    if args.no_sources:
        print(config_yaml(cfg), end="")
        return
    recipe = [] if args.config is None else ["--config", args.config]
    header = [" ".join(["python -m megatron_rlhf print-config", *map(shlex.quote, [*recipe, *args.overrides])]),
              *(f"note: {note}" for note in (*cfg.notes, *cfg.hf_notes)), ""]
    print(config_yaml(cfg, cfg.recipe.sources, header), end="")


def report_command(args, cfg) -> Path:
    """<run>/report.md of --run, or of the recipe's run directory (stage_data.run_dir, without its torch imports)."""
    if args.run is None and args.config is None:
        raise ConfigError("report: name the run: --run DIR (<checkpoint.root>/<checkpoint.run_name>) or "
                          "--config RECIPE [overrides] (its checkpoint.root/checkpoint.run_name)")
    run = Path(args.run) if args.run is not None else Path(cfg.checkpoint.root) / cfg.checkpoint.run_name
    if not run.is_dir():
        raise ConfigError(f"report: {run}: no such run directory (a run's stages write to "
                          "<checkpoint.root>/<checkpoint.run_name>/<stage>)")
    from megatron_rlhf.logging.report import write_report

    try:
        return write_report(run)
    except FileNotFoundError as err:  # a directory with no stage in it: not a run directory
        raise ConfigError(f"report: {err}") from None


def serve_reward_command(args, cfg) -> None:
    from megatron_rlhf.trainers.serve_reward import serve_reward

    typed = {o.split("=", 1)[0].strip() for o in args.overrides}  # checked against the checkpoint's model
    serve_reward(cfg, ckpt=args.ckpt, host=args.host, port=args.port, max_batch=args.max_batch,
                 max_wait_ms=args.max_wait_ms, typed_keys=typed)


class CommandParser(argparse.ArgumentParser):
    """`python -m megatron_rlhf <verb> [options] [key=value ...]`, one subparser per verb (its own
    --help). The verb may come after options (`--config X sft`), and options may follow the
    overrides, as before the verbs had their own parsers: argparse's subparsers allow neither
    (and parse_intermixed_args refuses them), so the verb is found here and the rest is parsed,
    intermixed, by its subparser."""

    def parse_intermixed_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        for i, word in enumerate(args):
            before = args[i - 1] if i else ""
            if word in self.verbs and not (before.startswith("-") and "=" not in before and before not in SWITCHES):
                parsed = self.verbs[word].parse_intermixed_args(args[:i] + args[i + 1:], namespace)
                parsed.command = word
                return parsed
        if "-h" in args or "--help" in args:
            self.exit(message=self.format_help())
        self.error(f"no command among {args}: choose one of {', '.join(self.verbs)}")

    parse_args = parse_intermixed_args
    verbs: dict[str, argparse.ArgumentParser]  # build_parser sets them: its subparsers, by verb


class VerbListFormatter(argparse.RawDescriptionHelpFormatter):
    """`python -m megatron_rlhf --help` lists one verb a line: the name column as wide as the
    longest verb (argparse measures subcommands narrower than it indents them, and wraps)."""

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=24, width=max(100, shutil.get_terminal_size().columns))

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        self._action_max_length = max(self._action_max_length, 6 + max(map(len, VERBS)))


def build_parser() -> CommandParser:
    parser = CommandParser(prog="python -m megatron_rlhf", description=__doc__,
                           formatter_class=VerbListFormatter,
                           epilog="`python -m megatron_rlhf <command> --help`: the command's options and the "
                                  "config sections it reads (docs/config_reference.md, docs/cli.md)")
    commands = parser.add_subparsers(title="commands", metavar="<command>", parser_class=argparse.ArgumentParser)
    parser.verbs = commands.choices
    for name, verb in VERBS.items():
        sub = commands.add_parser(
            name, help=verb.summary, description=f"{verb.summary}. {verb.details}".strip(),
            epilog=f"config sections read: {', '.join(verb.sections)} (docs/config_reference.md)")
        needs = " (required)" if name in RECIPE_FOR else ""
        sub.add_argument("--config", help=f"YAML recipe (pipelines/*.yaml){needs}")
        sub.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor_parallel=2")
        sub.add_argument("--verbose", **VERBOSE)
        for flag in verb.flags:
            sub.add_argument(flag, **FLAGS[flag])
    return parser


def follow_launcher() -> None:
    """A worker of our launcher gets SIGTERM when the launcher dies, however it dies (torch's
    launcher starts workers in their own session, so a kill of the launcher's process group
    misses them): it stops as preempted (resilience/preemption.py) instead of training on alone."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != int(launcher):  # the launcher died before the prctl: nobody will send it
        os.kill(os.getpid(), signal.SIGTERM)


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
        if args.command == "print-config":  # no torch either
            print_config(args, cfg)
            return 0
        if args.command == "report":
            print(report_command(args, cfg))
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
    from megatron_rlhf.resilience import preemption
    from megatron_rlhf.resilience.nonfinite import NonFiniteError
    from megatron_rlhf.resilience.preemption import Preempted, StageInterrupted
    from megatron_rlhf.rewards.base import RewardSourceError

    if cpu.needed():
        quiet.install_cpu(verbose)
    follow_launcher()

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
    except StageInterrupted as err:  # nothing saved: the last complete checkpoint stands (resilience/preemption.py)
        return report_error(f"preempted: {err} (abandoned, nothing saved); exit {err.code}: rerun or requeue to "
                            "resume from the last complete checkpoint", err.code)
    except Exception as err:
        if not preemption.signalled():
            raise
        # A signalled rank whose peer stopped mid-collective fails here; the job is being stopped anyway.
        return report_error(f"preempted: stopped by {preemption.install().last_signal}, then {type(err).__name__}: "
                            f"{str(err)[:200]}; exit {preemption.REQUEUE_EXIT_CODE}: rerun or requeue to resume from "
                            "the last complete checkpoint", preemption.REQUEUE_EXIT_CODE)
    finally:
        parallel = sys.modules.get("megatron_rlhf.parallel")  # not imported (e.g. `stages`): nothing to tear down
        if parallel is not None:
            parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
