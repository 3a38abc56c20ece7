"""The RL stage with multi-turn episodes (rl.environment: the calculator environment on the
built-in calculator task), run as users run it: SFT on the task's tool-use demonstrations, then
GRPO at DP2 whose episodes call the tool; the episode metrics are logged; a rank killed in the
middle of an iteration resumes bitwise (an interrupted iteration's episodes are restarted from
the last checkpoint with the same seeds: a deterministic environment replays them exactly)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from distributed import REPO
from stages import SIZES as BASE_SIZES
from stages import assert_same_run, fault, latest, metrics, stage, summary

RECIPE = "pipelines/tiny_cpu_agent.yaml"
SIZES = ["data.task_sizes.sft_train=256", "data.task_sizes.sft_eval=32", "data.task_sizes.ppo_prompts=64",
         "data.task_sizes.eval_prompts=8"]
STEPS = 3
# dynamic sampling on: groups whose episodes all scored alike are redrawn (episodes again)
RL = [f"rl.steps={STEPS}", "rl.save_interval=1", "rl.eval_interval=3", "rl.rollout_batch_size=4",
      "rl.mini_batch_size=16", "rl.micro_batch_size=8", "rl.epochs=1", "rl.dynamic_sampling=true",
      "rl.max_sampling_rounds=2"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent")
    stage(1, "sft", root, "agent", "sft.steps=30", "sft.eval_interval=30", *SIZES, recipe=RECIPE)
    inputs = [f"rl.sft_from={root}/agent/sft", *SIZES, *RL]
    stage(2, "rl", root, "agent", *inputs, recipe=RECIPE)
    return root, inputs


def test_the_agent_stage_logs_its_episodes(root):
    root, _ = root
    s = summary(root, "agent", "grpo")
    assert s["steps"] == STEPS and s["reward_sources"][0]["type"] == "environment"
    lines = metrics(root, "agent", "grpo")
    assert [x["step"] for x in lines] == list(range(STEPS + 1))
    for line in lines[1:]:
        assert line["env_turns_per_episode"] >= 1 and 0 <= line["env_tool_call_rate"] <= 1
        assert line["env_failed_fraction"] == 0 and line["env_episode_length"] > 5
        assert line["logprob_mismatch"] < 1e-5  # the engine's log-probs of the policy's tokens are the actor's
    assert any(line["env_tool_call_rate"] > 0 for line in lines[1:])  # the tool was called: multi-turn episodes


def test_ppo_trains_its_critic_on_the_policys_tokens_of_episodes(root):
    """PPO with episodes: the critic (from the SFT actor) is fitted on the policy's tokens only."""
    root, inputs = root
    stage(1, "rl", root, "agent", *inputs, "rl.algorithm=ppo", "rl.steps=2", "rl.dynamic_sampling=false",
          "rl.critic_optimizer.lr=1e-3", recipe=RECIPE)
    lines = metrics(root, "agent", "ppo")
    assert [x["step"] for x in lines] == [0, 1, 2]
    for line in lines[1:]:
        assert line["env_turns_per_episode"] >= 1 and "value_loss" in line and "explained_variance" in line
    assert summary(root, "agent", "ppo")["roles"] == ["actor", "critic", "reference"]


def test_a_rank_killed_mid_iteration_resumes_the_episodes_bitwise(root):
    root, inputs = root
    proc = stage(2, "rl", root, "agent_killed", f"rl.sft_from={root}/agent/sft", *inputs[1:], recipe=RECIPE,
                 **fault("kill@train:2:1"))
    assert proc.returncode != 0 and "kill at train of step 2" in proc.stdout
    assert latest(root, "agent_killed", "grpo") == "iter_0000001"
    stage(2, "rl", root, "agent_killed", f"rl.sft_from={root}/agent/sft", *inputs[1:], recipe=RECIPE)
    assert_same_run(root, "agent", "agent_killed", "grpo", STEPS, ["actor"])


def test_an_environment_service_that_is_down_stops_the_stage_cleanly(root):
    """rl.environment.type=http at a port nobody serves: every rank stops with exit code 4 (a
    failed reward source's), naming the service, before anything trains."""
    root, inputs = root
    proc = stage(2, "rl", root, "agent_down", *inputs, "rl.environment.type=http",
                 "rl.environment.class_path=null", "rl.environment.url=http://127.0.0.1:9",
                 "rl.environment.max_retries=0", recipe=RECIPE, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and out.count("failed (exitcode: 4)") + out.count("exited with code 4") >= 1, out[-3000:]
    assert "reward error: environment service POST http://127.0.0.1:9/reset" in out
    assert not (root / "agent_down" / "grpo" / "latest").exists()


def our_launcher(root, run, *overrides, env=None) -> list[str]:
    """`python -m megatron_rlhf.torchrun` at DP2 (as users launch), with the stage helper's arguments."""
    return [sys.executable, "-m", "megatron_rlhf.torchrun", "--nproc-per-node=2", "rl", "--config", RECIPE,
            *BASE_SIZES, f"checkpoint.root={root}", f"checkpoint.run_name={run}", *overrides]


def launcher_env(**extra) -> dict:
    pythonpath = os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))
    inherited = {k: v for k, v in os.environ.items() if k != "MEGATRON_RLHF_FAULT"}
    return {**inherited, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": pythonpath, **extra}


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.1)


SIGTERM_BOUND_S = 10  # SIGTERM to exit 42, in interruptible work (resilience/preemption.py)


def test_sigterm_ends_a_hung_environment_step_and_an_eval_and_the_rerun_resumes_exactly(root, tmp_path):
    """A preemption (SIGTERM, as Slurm sends) while an environment step hangs, then while an eval
    runs: each time the stage exits 42 within SIGTERM_BOUND_S, abandoning the step with nothing
    saved; the reruns resume from the last complete checkpoint and end equal to the
    uninterrupted run. Before: SIGTERM only set a flag read at the step's end, which a hung step
    never reaches (the launcher SIGKILLed the workers 30 s later: no exit 42)."""
    from hanging_calculator import ARM

    root, inputs = root
    run, arm = "agent_sigterm", tmp_path / "arm"
    args = [*inputs, "rl.environment.class_path=tests/hanging_calculator.py:HangingCalculatorEnv",
            "rl.environment.step_timeout_s=600"]
    stage_dir = root / run / "grpo"
    log = tmp_path / "hung.log"
    with log.open("w") as out:
        proc = subprocess.Popen(our_launcher(root, run, *args), cwd=REPO, env=launcher_env(**{ARM: str(arm)}),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until(lambda: (stage_dir / "latest").exists(), 300, "checkpoint 1")
            arm.touch()  # the next environment step hangs
            wait_until(lambda: (tmp_path / "arm.hanging").exists(), 120, "a hung environment step")
            time.sleep(0.5)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)  # as srun passes Slurm's SIGTERM to the launcher
            rc = proc.wait(timeout=60)
            took = time.monotonic() - signalled
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    print(f"SIGTERM during a hung environment step -> exit {rc} in {took:.2f} s")  # for the record (pytest -s)
    assert rc == 42 and took < SIGTERM_BOUND_S, (rc, took, text[-3000:])
    assert "SIGTERM during the generate phase" in text, text[-3000:]
    saved = int(latest(root, run, "grpo").split("_")[1])
    assert saved in (1, 2) and not (stage_dir / f"iter_{saved + 1:07d}").exists()
    assert max(x["step"] for x in metrics(root, run, "grpo")) <= saved  # the abandoned step logged nothing

    # SIGTERM to every rank as step 3's eval starts: abandoned too, checkpoint 2 stands
    proc = stage(2, "rl", root, run, *args, recipe=RECIPE, **fault("sigterm@eval:3"))
    assert proc.returncode != 0 and "SIGTERM during the eval phase" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert "exitcode  : 42" in proc.stderr, proc.stderr[-3000:]
    assert latest(root, run, "grpo") == "iter_0000002" and not (stage_dir / "iter_0000003").exists()

    stage(2, "rl", root, run, *args, recipe=RECIPE)
    assert_same_run(root, "agent", run, "grpo", STEPS, ["actor"])
