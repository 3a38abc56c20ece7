"""What a user sees on the console: a quiet start (megatron_rlhf/logging/quiet.py) and, through
our launcher (`python -m megatron_rlhf.torchrun`), errors as one line, printed last, with the
worker's exit code. The launcher runs as users run it, with the environment's warning settings
(no PYTHONWARNINGS=ignore, unlike tests/distributed.py)."""

import os
import subprocess
import sys

import pytest

from distributed import REPO

RECIPE = ["--config", "pipelines/tiny_cpu.yaml"]
TINY_SFT = ["sft.steps=3", "sft.optimizer.warmup_steps=1", "data.task_sizes.sft_train=64",
            "data.task_sizes.sft_eval=16"]
# Start-up noise that quiet.py hides (as printed without it), and the launcher's own noise.
NOISE = ("pynvml", "Transformer Engine and Apex", "Apex is not installed", "CUDA_HOME", "GPTModel IS DEPRECATED",
         "full_param_layout", "MimoModelConfig", "ShardedTensor", "Warning:")
LAUNCHER_NOISE = ("Traceback", "ChildFailedError", "elastic", "OMP_NUM_THREADS", "FAILED")


def launch(*args, fault: str | None = None, timeout: int = 300) -> tuple[int, str]:
    """Exit code and the launcher's stdout and stderr as one stream, in order."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "MEGATRON_RLHF_FAULT")}
    env["PYTHONUNBUFFERED"] = "1"
    if fault:
        env["MEGATRON_RLHF_FAULT"] = fault
    proc = subprocess.run([sys.executable, "-m", "megatron_rlhf.torchrun", *args], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return proc.returncode, proc.stdout


def assert_one_error_last(out: str, start: str, *words: str) -> None:
    lines = out.strip().splitlines()
    errors = [line for line in lines if line.startswith(start)]
    assert errors == [lines[-1]], out  # exactly one, and last
    assert all(w in lines[-1] for w in words), lines[-1]
    assert not [n for n in LAUNCHER_NOISE if n in out], out


def workers_started(log_dir) -> bool:
    return any(log_dir.rglob("attempt_*"))  # torch's launcher makes one per attempt of the workers


# ------------------------------------------------------------------ the filters (no torch)

FILTER_SCRIPT = """
import logging, sys, warnings
from megatron_rlhf.logging import quiet
quiet.install(sys.argv[1] == "verbose")
def warn(message, category, module):
    warnings.warn_explicit(message, category, module.replace(".", "/") + ".py", 1, module=module, registry={})
warn("The pynvml package is deprecated. Please install nvidia-ml-py instead.", FutureWarning, "torch.cuda")
warn("Apex is not installed. Falling back to Torch Norm", UserWarning, "megatron.core.models.backends")
warn("Apex is not installed. Falling back to Torch Norm", UserWarning, "megatron_rlhf.models.gpt")  # not theirs
warn("Apex is not installed. Falling back to Torch Norm", FutureWarning, "megatron.core.models.backends")
warn("a new warning", UserWarning, "megatron.core.models.backends")
logging.getLogger("megatron.core.models.gpt.gpt_model").warning("GPTModel IS DEPRECATED. GPTModel is ...")
logging.getLogger("megatron.core.models.gpt.gpt_model").warning("a new megatron log warning")
logging.getLogger("megatron_rlhf.checkpoint.manager").warning("GPTModel IS DEPRECATED (ours)")
"""


@pytest.mark.parametrize("mode", ["quiet", "verbose"])
def test_quiet_hides_only_listed_warnings(mode):
    out = subprocess.run([sys.executable, "-c", FILTER_SCRIPT, mode], cwd=REPO, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}, check=True).stderr
    shown = [line for line in out.splitlines() if not line.startswith("  ")]
    assert ("megatron_rlhf/models/gpt.py:1: UserWarning: Apex is not installed. Falling back to Torch Norm" in shown
            and "megatron/core/models/backends.py:1: FutureWarning: Apex is not installed. Falling back to Torch Norm"
            in shown and "megatron/core/models/backends.py:1: UserWarning: a new warning" in shown
            and "a new megatron log warning" in shown and "GPTModel IS DEPRECATED (ours)" in shown), out
    hidden = ["torch/cuda.py:1: FutureWarning: The pynvml package is deprecated. Please install nvidia-ml-py instead.",
              "megatron/core/models/backends.py:1: UserWarning: Apex is not installed. Falling back to Torch Norm",
              "GPTModel IS DEPRECATED. GPTModel is ..."]
    assert [h in shown for h in hidden] == [mode == "verbose"] * len(hidden), out
    assert len(shown) == (8 if mode == "verbose" else 5), out


def test_launcher_and_config_import_no_torch():
    """quiet.install must run before torch is imported: the CLI modules and config loading import none."""
    code = ("import sys, megatron_rlhf.torchrun, megatron_rlhf.__main__\n"
            "from megatron_rlhf.config import load_config\n"
            "load_config('pipelines/tiny_cpu.yaml', ['logging.verbose=true'])\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')], 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


# ------------------------------------------------------------------ errors before any worker


@pytest.mark.parametrize("override, field", [
    ("rl.mini_batch_size=7", "rl.mini_batch_size=7"),
    ("parallel.tensor_parallel=2", "parallel.tensor_parallel=2"),  # needs the launched world size (1)
])
def test_bad_config_stops_before_workers(tmp_path, override, field):
    code, out = launch("--nproc-per-node", "1", "--log-dir", str(tmp_path / "logs"), "pipeline", *RECIPE,
                       f"checkpoint.root={tmp_path}", override, timeout=60)
    assert code == 2, out
    assert len(out.strip().splitlines()) == 1, out  # nothing else printed
    assert_one_error_last(out, "config error: ", field)
    assert not workers_started(tmp_path / "logs")


def test_data_error_stops_before_workers(tmp_path):
    code, out = launch("--nproc-per-node", "1", "--log-dir", str(tmp_path / "logs"), "sft", *RECIPE,
                       f"checkpoint.root={tmp_path}", "data.sft_train=/nonexistent.jsonl", timeout=60)
    assert code == 2, out
    assert len(out.strip().splitlines()) == 1, out
    assert_one_error_last(out, "data error: ", "data.sft_train=/nonexistent.jsonl")
    assert not workers_started(tmp_path / "logs")


@pytest.mark.parametrize("command, recipe", [("sft", "pipelines/tiny_cpu.yaml"), ("dpo", "pipelines/tiny_cpu_dpo.yaml"),
                                             ("pipeline", "pipelines/tiny_cpu.yaml")])
def test_a_training_command_without_config_is_an_error_naming_a_recipe(command, recipe, capsys, monkeypatch):
    """The built-in defaults alone would train a toy run into checkpoints/default/."""
    from megatron_rlhf.__main__ import ERROR_DIR_ENV, main

    monkeypatch.delenv(ERROR_DIR_ENV, raising=False)
    assert main([command, "sft.steps=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: --config: `{command}` needs a recipe, e.g. --config {recipe} "), err
    assert (REPO / recipe).is_file()
    from megatron_rlhf.torchrun import main as launch  # the launcher: before its preflight and any worker

    assert launch(["--nproc-per-node=1", command, "sft.steps=3"]) == 2
    assert capsys.readouterr().err.startswith(f"config error: --config: `{command}` needs a recipe")


# ------------------------------------------------------------------ the console line


@pytest.mark.parametrize("stage, metrics, shown", [
    ("sft_lora", {"loss": 1.5, "grad_norm": 0.25}, "loss 1.5  grad norm 0.25"),
    ("dpo_lora", {"loss": 0.5, "reward_accuracy": 0.75}, "loss 0.5  acc 0.75"),
    ("ppo_lora", {"reward": 0.25, "kl_mean": 0.5}, "reward 0.25  kl 0.5"),
    ("rm_holdout", {"loss": 0.5, "accuracy": 0.75}, "loss 0.5  acc 0.75"),
])
def test_the_console_line_of_a_lora_stage_shows_its_kinds_numbers(tmp_path, stage, metrics, shown):
    from megatron_rlhf.logging.metrics import MetricsLogger

    line = MetricsLogger(tmp_path, stage, 3, tensorboard=False).console_line(1, metrics)
    assert line.startswith(f"[{stage}] 1/3  {shown}"), line


def test_the_combined_reward_is_called_reward_whatever_its_sources(tmp_path):
    """A rule-only run (no reward model) says `reward`, never rm, on the console line and at the end."""
    from megatron_rlhf.logging.metrics import MetricsLogger
    from megatron_rlhf.trainers.rl_metrics import done_message, format_scores
    from megatron_rlhf.trainers.rl_records import with_reward_names

    before = {"eval_reward": 0.21, "eval_gold_score": 0.0}
    after = {"eval_reward": 0.55, "eval_gold_score": 0.5, "eval_win_rate_gold": 0.75, "eval_win_rate_reward": 0.625}
    line = MetricsLogger(tmp_path, "grpo", 40, tensorboard=False).console_line(
        40, {"reward": 0.5, "reward_exact": 0.5, "kl_mean": 1.5, **after})
    assert line.startswith("[grpo] 40/40  reward 0.5  kl 1.5  eval reward 0.55  eval gold 0.5  win(gold) 0.75  "
                           "win(reward) 0.625"), line
    assert format_scores(before) == "reward 0.210, gold_score 0.000"
    assert done_message(before, after) == ("done: gold 0.000 -> 0.500, reward 0.210 -> 0.550; win rate against the "
                                           "SFT policy: gold 0.75, reward 0.62")
    # a run started by an earlier version resumes with the SFT policy's numbers under the new names
    old = {"eval": {"eval_rm_score": 0.21, "eval_win_rate_rm": 0.5}, "samples": ["a || b"], "per_prompt": {"rm": [0.5]}}
    assert with_reward_names(old) == {"eval": {"eval_reward": 0.21, "eval_win_rate_reward": 0.5},
                                      "samples": ["a || b"], "per_prompt": {"reward": [0.5]}}


# ------------------------------------------------------------------ a worker fails (real runs)


@pytest.fixture(scope="module")
def nonfinite_run(tmp_path_factory):
    """NaN losses from step 1 with no tolerance: the worker stops with a NonFiniteError (exit 3)."""
    root = tmp_path_factory.mktemp("nonfinite")
    return root, *launch("--nproc-per-node", "1", "--log-dir", str(root / "logs"), "sft", *RECIPE, *TINY_SFT,
                         f"checkpoint.root={root}", "resilience.max_consecutive_nonfinite=0", fault="nan@train:1+")


@pytest.fixture(scope="module")
def preempted_run(tmp_path_factory):
    """SIGUSR1 on rank 0 in step 2 of 3, two ranks, --verbose: both save and exit 42."""
    root = tmp_path_factory.mktemp("preempted")
    return root, *launch("--nproc-per-node", "2", "--verbose", "sft", *RECIPE, *TINY_SFT,
                         f"checkpoint.root={root}", fault="sigusr1@train:2:0")


@pytest.mark.slow
def test_worker_exit_code_nonfinite(nonfinite_run):
    root, code, out = nonfinite_run
    assert code == 3, out
    assert_one_error_last(out, "training error: ", "NaN/Inf", "resilience.max_consecutive_nonfinite=0")
    assert workers_started(root / "logs")  # what the tests above check the absence of


@pytest.mark.slow
def test_worker_exit_code_preempted(preempted_run):
    root, code, out = preempted_run
    assert code == 42, out.splitlines()[-5:]
    lines = out.strip().splitlines()
    assert lines[-1] == "preempted: checkpoint at step 2 saved; exit 42: rerun or requeue to resume", lines[-5:]
    assert lines.count(lines[-1]) == 1, out  # two ranks, one line
    assert not [n for n in ("Traceback", "ChildFailedError") if n in out], out
    assert (root / "tiny_cpu" / "sft" / "latest").read_text().strip() == "iter_0000002"


@pytest.mark.slow
def test_quiet_start(nonfinite_run):
    _, _, out = nonfinite_run
    assert "[sft] train data:" in out, out  # our own lines still show
    assert not [n for n in NOISE if n in out], out


@pytest.mark.slow
def test_verbose_shows_everything(preempted_run):
    _, _, out = preempted_run
    assert {n for n in NOISE if n in out} >= {"pynvml", "Transformer Engine and Apex", "GPTModel IS DEPRECATED",
                                             "full_param_layout", "Warning:"}, out


@pytest.mark.slow
def test_worker_killed_by_signal(tmp_path):
    """A worker that dies of SIGKILL leaves no message: the launcher says so, exit 128 + 9."""
    code, out = launch("--nproc-per-node", "1", "sft", *RECIPE, *TINY_SFT, f"checkpoint.root={tmp_path}",
                       fault="kill@train:2")
    assert code == 128 + 9, out
    assert_one_error_last(out, "rank 0 ", "killed by SIGKILL")
