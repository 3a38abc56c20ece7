"""The phase table decides what is resident; every phase's time and memory is recorded."""

import time
from types import SimpleNamespace

import pytest

from megatron_rlhf.colocation import PHASES, ColocationScheduler, phases_for


def roles():
    # Only the attribute the scheduler reads; on CPU no tensor moves are made.
    return {"actor": SimpleNamespace(trainable=True), "critic": SimpleNamespace(trainable=True),
            "reference": SimpleNamespace(trainable=False), "reward": SimpleNamespace(trainable=False)}


@pytest.mark.parametrize("engine", ["megatron", "vllm"])
def test_residency_follows_the_phase_table(engine):
    sched = ColocationScheduler(roles(), phases_for(roles(), engine=engine))
    assert set(sched.phases) == set(PHASES) - ({"sync"} if engine == "megatron" else set())
    for phase, needs in sched.phases.items():
        sched.enter(phase)
        for name in sched.roles:
            assert sched.on_device[name] == needs.get(name, "host"), (phase, name)
    sched.exit()
    assert sched.on_device["reference"] == "host" and sched.on_device["actor"] == "params"


def test_a_lora_reference_is_never_moved_apart_from_the_actor():
    # It runs the actor's module: offloading it in train would take the actor's weights along.
    shared = {**roles(), "reference": SimpleNamespace(trainable=False, shares_weights_of="actor")}
    sched = ColocationScheduler(shared)
    for phase in sched.phases:
        sched.enter(phase)
        assert sched.on_device["reference"] == "params", phase
    sched.exit()


def test_time_memory_and_tokens_are_recorded_per_phase():
    sched = ColocationScheduler(roles())
    sched.enter("generate")
    time.sleep(0.02)
    sched.enter("train")  # entering a phase closes the previous one
    time.sleep(0.01)
    sched.exit(tokens=100)
    summary = sched.summary()
    assert summary["generate"]["seconds"] >= 0.02 and summary["generate"]["calls"] == 1
    assert summary["train"]["tokens_per_s"] == pytest.approx(100 / summary["train"]["seconds"])
    assert summary["train"]["peak_memory_bytes"] > 0


def test_step_metrics_report_only_the_phases_a_step_ran():
    sched = ColocationScheduler(roles())
    for phase in ("generate", "train", "eval"):
        with sched.phase(phase) as p:
            time.sleep(0.01)
            p.tokens = 10
    first = sched.step_metrics()
    assert {"generate_seconds", "train_seconds", "eval_seconds"} <= first.keys()
    with sched.phase("generate") as p:
        time.sleep(0.03)
        p.tokens = 30
    second = sched.step_metrics()  # no eval in this step: no stale eval_seconds
    assert set(second) == {"generate_seconds", "generate_tokens_per_s", "generate_peak_memory_bytes"}
    assert second["generate_seconds"] >= 0.03 and second["generate_tokens_per_s"] == pytest.approx(
        30 / second["generate_seconds"])
    assert sched.summary()["generate"]["calls"] == 2


def test_unknown_role_in_the_table_is_an_error():
    with pytest.raises(ValueError, match="critic"):
        ColocationScheduler({"actor": SimpleNamespace(trainable=True)}, phases={"train": {"critic": "params"}})
