"""Asynchronous RL (rl.max_staleness >= 1) with the vLLM engine on CPU, end to end: the fixed
schedule's versions, and the fire drills. Each drill interrupts one run of the stage in a
different way, and the run resumed after all of them equals an uninterrupted run bit for bit
(actor and critic weights and optimizer state, trainer state with the rollout buffer, every
metric but wall-clock ones), and its audit (rollout_audit.jsonl) is the uninterrupted run's
line for line: every batch drawn once and trained once, no prompt lost or repeated.

N = 1 drills, one after the other on one run: SIGKILL of the trainer during training (its engine
is reaped), of the engine during a generation in flight (that batch is regenerated whole after
the resume), of the engine during a refit, of the trainer during a checkpoint save, SIGUSR1
preemption. N = 2: a hung engine at a refit stops the stage after rollout.engine_timeout_seconds
with an error naming it, and the run resumes exactly.
"""

import json
import time

import pytest

from megatron_rlhf.resilience.preemption import REQUEUE_EXIT_CODE
from distributed import still_running
from stages import assert_same_run, fault, latest, metrics, stage, summary

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VLLM_RECIPE = "pipelines/tiny_cpu_vllm.yaml"
SHORT = ["sft.steps=4", "sft.eval_interval=4", "sft.optimizer.warmup_steps=1", "rm.steps=4", "rm.eval_interval=4",
         "rm.optimizer.warmup_steps=1", "data.task_sizes.sft_train=256", "data.task_sizes.preference_train=256"]
RL = ["rl.save_interval=1", "rl.rollout_batch_size=16", "rl.mini_batch_size=16", "rl.tis_cap=2"]


def inputs(tmp_path):
    stage(1, "sft", tmp_path, "base", *SHORT, recipe=VLLM_RECIPE)
    stage(1, "rm", tmp_path, "base", *SHORT, recipe=VLLM_RECIPE)
    return [f"rl.sft_from={tmp_path / 'base' / 'sft'}", f"rl.rm_from={tmp_path / 'base' / 'rm'}", *RL]


def interrupted(tmp_path, run, overrides, spec):
    """One run of the stage that `spec` (resilience/faults.py) interrupts: its output."""
    proc = stage(1, "rl", tmp_path, run, *overrides, recipe=VLLM_RECIPE, **fault(spec))
    assert proc.returncode != 0, f"{spec}: the stage did not stop\n{proc.stdout[-3000:]}"
    return proc.stdout + proc.stderr


def assert_reaped(tmp_path, run):
    """The engine's processes are gone soon after their trainer was SIGKILLed (vllm_process.start_reaper)."""
    pids = json.loads((tmp_path / run / "ppo" / "vllm_model_rank0" / "engine_pids.json").read_text())
    assert not still_running(pids, within=15), f"engine processes {pids} outlived their SIGKILLed trainer"


def assert_same_as_uninterrupted(tmp_path, steps, n):
    assert_same_run(tmp_path, "full", "drilled", "ppo", steps, ["actor", "critic"])
    audit = [(tmp_path / run / "ppo" / "rollout_audit.jsonl").read_text() for run in ("full", "drilled")]
    assert audit[0] == audit[1]
    records = [json.loads(line) for line in audit[0].splitlines()]
    drawn = {r["batch"]: r for r in records if r["event"] == "drawn"}
    trained = [r for r in records if r["event"] == "trained"]
    assert sorted(drawn) == list(range(1, steps + 1)) and len(drawn) == sum(r["event"] == "drawn" for r in records)
    assert [(r["step"], r["batch"]) for r in trained] == [(s, s) for s in range(1, steps + 1)]  # each once, in order
    assert all(r["prompts"] == drawn[r["batch"]]["prompts"] and r["version"] == max(0, r["step"] - 1 - n)
               for r in trained)
    prompts = [p for r in trained for p in r["prompts"]]
    assert len(prompts) == len(set(prompts)) == steps * 16  # one epoch's worth: no prompt lost or repeated
    rows = [m for m in metrics(tmp_path, "full", "ppo") if m["step"] > 0]
    assert [m["policy_version"] for m in rows] == [max(0, m["step"] - 1 - n) for m in rows]
    assert all(m[f"staleness_lag_{m['step'] - 1 - int(m['policy_version'])}_samples"] == 16 for m in rows)
    assert all(0 <= m["trainer_idle_fraction"] <= 1 and 0 <= m["engine_busy_fraction"] <= 1 for m in rows)
    done = summary(tmp_path, "full", "ppo")
    assert done["max_staleness"] == n and done["engine_generate_seconds"] > 0


def test_one_step_ahead_survives_every_drill_and_resumes_bit_for_bit(tmp_path):
    steps, n = 6, 1
    overrides = [*inputs(tmp_path), f"rl.steps={steps}", f"rl.eval_interval={steps}", f"rl.max_staleness={n}"]
    stage(1, "rl", tmp_path, "full", *overrides, recipe=VLLM_RECIPE)

    interrupted(tmp_path, "drilled", overrides, "kill@train:2")  # the trainer dies while training step 2
    assert latest(tmp_path, "drilled", "ppo") == "iter_0000001"
    assert_reaped(tmp_path, "drilled")
    out = interrupted(tmp_path, "drilled", overrides, "kill_engine@generate:3")  # batch 4, in flight, is lost
    assert "vLLM engine's processes" in out and "died" in out
    assert latest(tmp_path, "drilled", "ppo") == "iter_0000002"  # step 3's save drains batch 4 first: it failed
    out = interrupted(tmp_path, "drilled", overrides, "kill_engine@refit:4")
    assert "weight refit of the vLLM engine failed" in out and "died" in out
    interrupted(tmp_path, "drilled", overrides, "kill@save:4")  # the trainer dies writing checkpoint 4
    assert latest(tmp_path, "drilled", "ppo") == "iter_0000003"
    proc = stage(1, "rl", tmp_path, "drilled", *overrides, recipe=VLLM_RECIPE, **fault("sigusr1@train:5"))
    assert f"exitcode  : {REQUEUE_EXIT_CODE}" in proc.stderr  # preempted: saved step 5, exits for requeue
    assert latest(tmp_path, "drilled", "ppo") == "iter_0000005"
    stage(1, "rl", tmp_path, "drilled", *overrides, recipe=VLLM_RECIPE)
    assert_same_as_uninterrupted(tmp_path, steps, n)


def test_two_steps_ahead_a_hung_engine_times_out_and_the_run_resumes_bit_for_bit(tmp_path):
    steps, n = 5, 2
    overrides = [*inputs(tmp_path), f"rl.steps={steps}", f"rl.eval_interval={steps}", f"rl.max_staleness={n}",
                 "rollout.engine_timeout_seconds=8"]
    stage(1, "rl", tmp_path, "full", *overrides, recipe=VLLM_RECIPE)
    start = time.perf_counter()
    out = interrupted(tmp_path, "drilled", overrides, "hang_engine@refit:3")
    assert "did not finish within rollout.engine_timeout_seconds=8" in out
    assert time.perf_counter() - start < 150  # bounded: the timeout, then the stage stops and its engine is killed
    assert latest(tmp_path, "drilled", "ppo") == "iter_0000002"
    stage(1, "rl", tmp_path, "drilled", *overrides, recipe=VLLM_RECIPE)
    assert_same_as_uninterrupted(tmp_path, steps, n)
