"""Failure injection (what the resilience tests rely on) and the NaN/Inf guard's counting,
in one process: the multi-process behaviour is tested in test_resilience.py."""

import math

import pytest
import torch

from megatron_rlhf.resilience.faults import Fault, FaultInjector, parse
from megatron_rlhf.resilience.nonfinite import NonFiniteError, NonFiniteGuard


def test_parse_reads_kind_point_step_onwards_and_rank():
    assert parse("kill@train:5:1, nan@train:3+") == [
        Fault("kill", "train", 5, False, 1), Fault("nan", "train", 3, True, None)]
    assert parse("") == []


@pytest.mark.parametrize("spec", ["kill", "kill@train", "kill@train:x", "explode@train:1", "kill@nowhere:1"])
def test_a_bad_spec_is_an_error_naming_the_variable(spec):
    with pytest.raises(ValueError, match="MEGATRON_RLHF_FAULT"):
        parse(spec)


def test_faults_fire_only_in_the_first_attempt(monkeypatch):
    monkeypatch.setenv("MEGATRON_RLHF_FAULT", "nan@train:1")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert FaultInjector.from_env().faults
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not FaultInjector.from_env().faults
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")  # a requeued Slurm job
    assert not FaultInjector.from_env().faults


def test_nan_fault_hits_only_its_steps_and_rank(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    injector = FaultInjector(parse("nan@train:2:1,nan@train:4+"))
    hit = []
    for step in range(1, 7):
        injector.begin_step(step)
        hit.append(math.isnan(injector.corrupt_loss(torch.tensor(1.0)).item()))
    assert hit == [False, True, False, True, True, True]
    monkeypatch.setenv("RANK", "0")
    injector.begin_step(2)
    assert injector.corrupt_loss(torch.tensor(1.0)).item() == 1.0


def test_guard_skips_counts_resets_and_stops_after_too_many_in_a_row():
    guard = NonFiniteGuard("Actor", max_consecutive=2)
    good, bad = [torch.ones(3)], [torch.tensor([1.0, float("inf")])]
    assert not guard.should_skip(good, good)
    assert guard.should_skip([torch.tensor(float("nan"))], good)  # loss
    assert guard.should_skip(good, bad)  # gradients
    assert not guard.should_skip(good, good)  # a good step resets the streak, not the count
    assert guard.state_dict() == {"consecutive": 0, "skipped": 2}
    guard.should_skip(bad, good)
    guard.should_skip(bad, good)
    with pytest.raises(NonFiniteError, match=r"Actor: .* 3 optimizer steps in a row .*max_consecutive_nonfinite=2"):
        guard.should_skip(bad, good)
    restored = NonFiniteGuard("Actor", max_consecutive=2)
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == {"consecutive": 3, "skipped": 5}
