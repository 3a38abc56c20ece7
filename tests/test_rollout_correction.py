"""Train/rollout mismatch: the correction weights (TIS, sequence masking) by hand, their effect on
the actor loss's gradient, the refit receiver's checks, and the config rules of rollout.*.
No vLLM needed (the engine itself is tested in tests/test_vllm.py)."""

import math
from pathlib import Path

import pytest
import torch

from megatron_rlhf.algorithms.losses import rollout_correction
from megatron_rlhf.colocation import phases_for
from megatron_rlhf.config import ConfigError, RLConfig, check_vllm_cpu_model, load_config, validate
from megatron_rlhf.rollout.vllm_worker import checksums, verify_bucket
from megatron_rlhf.trainers.rl import actor_loss

LN = math.log
PIPELINES = Path(__file__).resolve().parent.parent / "pipelines"


def test_tis_weights_are_the_truncated_ratio_by_hand():
    old = torch.tensor([[LN(0.5), LN(0.2), LN(0.3), 0.0]])
    rollout = torch.tensor([[LN(0.25), LN(0.4), LN(0.3), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = rollout_correction(old, rollout, mask, tis_cap=1.5, mask_threshold=None)
    assert torch.allclose(w, torch.tensor([[1.5, 0.5, 1.0, 0.0]]), atol=1e-6)  # ratios 2 (capped), 0.5, 1
    assert torch.equal(rollout_correction(old, rollout, mask, None, None), mask)  # off: no change


def test_sequence_mask_uses_the_geometric_mean_ratio_by_hand():
    # row 0: ratios 2 and 0.5 -> geometric mean 1 (kept); row 1: ratios 4 and 4 -> 4 (masked at t=2);
    # row 2: ratio 1/3 on its only token -> outside [1/2, 2] (masked)
    old = torch.tensor([[LN(0.4), LN(0.1)], [LN(0.8), LN(0.4)], [LN(0.1), 0.0]])
    rollout = torch.tensor([[LN(0.2), LN(0.2)], [LN(0.2), LN(0.1)], [LN(0.3), 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    w = rollout_correction(old, rollout, mask, tis_cap=None, mask_threshold=2.0)
    assert torch.equal(w, torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]))
    both = rollout_correction(old, rollout, mask, tis_cap=3.0, mask_threshold=2.0)
    assert torch.allclose(both, torch.tensor([[2.0, 0.5], [0.0, 0.0], [0.0, 0.0]]), atol=1e-6)


def _actor_grad(rl: RLConfig, with_rollout: bool):
    torch.manual_seed(0)
    b, s = 3, 6
    logprobs = (torch.randn(b, s) * 0.1 - 1).requires_grad_()
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 0, 0, 0, 0]], dtype=torch.float)
    old = (logprobs.detach() + 0.05 * torch.randn(b, s)) * mask
    mb = {"tokens": torch.zeros(b, s, dtype=torch.long), "mask": mask, "old_logprobs": old,
          "ref_logprobs": old.clone(), "advantages": torch.randn(b, s) * mask,
          "rollout_logprobs": ((old + 0.3 * torch.randn(b, s)) * mask) if with_rollout else None}
    loss, units, stats = actor_loss({"logprobs": logprobs, "entropy": torch.zeros(b, s)}, mb, rl, kl_coef=0.0)
    (loss / units).backward()
    return logprobs.grad, mb, stats


def test_tis_scales_each_tokens_policy_gradient_by_its_weight():
    plain, _, _ = _actor_grad(RLConfig(), with_rollout=False)
    corrected, mb, stats = _actor_grad(RLConfig(tis_cap=1.2, mismatch_mask_threshold=1.15), with_rollout=True)
    weights = rollout_correction(mb["old_logprobs"], mb["rollout_logprobs"], mb["mask"], 1.2, 1.15)
    assert (weights == 0).any() and ((weights > 0) & (weights != 1)).any()  # both corrections act here
    assert torch.allclose(corrected, plain * weights, atol=1e-7)
    assert "tis_weight_mean" in stats and float(stats["mismatch_masked_fraction"]) > 0


def test_correction_is_off_by_default():
    rl = RLConfig()
    assert not rl.corrects_mismatch
    assert RLConfig(tis_cap=2.0).corrects_mismatch


def test_refit_receiver_rejects_wrong_shape_duplicate_and_corruption():
    expected = {"a": (2, 3), "b": (4,)}
    good = {"a": torch.ones(2, 3), "b": torch.arange(4.0)}
    verify_bucket(good, checksums(good), expected, seen=set())  # passes
    with pytest.raises(RuntimeError, match="shape"):
        verify_bucket({"a": torch.ones(3, 2)}, checksums({"a": torch.ones(3, 2)}), expected, set())
    with pytest.raises(RuntimeError, match="twice"):
        verify_bucket({"a": torch.ones(2, 3)}, checksums({"a": torch.ones(2, 3)}), expected, seen={"a"})
    with pytest.raises(RuntimeError, match="does not have"):
        verify_bucket({"c": torch.ones(1)}, checksums({"c": torch.ones(1)}), expected, set())
    flipped = {"a": good["a"].clone(), "b": good["b"]}
    flipped["a"][1, 2] = 1.5  # one value changed after the sender's checksum
    with pytest.raises(RuntimeError, match="corrupted"):
        verify_bucket(flipped, checksums(good), expected, set())
    with pytest.raises(RuntimeError, match="cut short"):
        verify_bucket({"a": good["a"]}, checksums(good), expected, set())


def test_rollout_config_rules():
    def cfg(*overrides):
        return validate(load_config(PIPELINES / "tiny_cpu.yaml", list(overrides)))

    with pytest.raises(ConfigError, match="rollout.engine"):
        cfg("rollout.engine=sglang")
    with pytest.raises(ConfigError, match="rl.tis_cap"):
        cfg("rl.tis_cap=0.5")
    with pytest.raises(ConfigError, match="rl.mismatch_mask_threshold"):
        cfg("rl.mismatch_mask_threshold=1.0")
    with pytest.raises(ConfigError, match="rollout.tensor_parallel=2"):
        cfg("rollout.engine=vllm", "rollout.tensor_parallel=2")
    # the default tiny model's head size (64 / 4 = 16) is below what vLLM's CPU backend takes
    with pytest.raises(ConfigError, match="head size is 16.*tiny_cpu_vllm.yaml"):
        check_vllm_cpu_model(cfg("rollout.engine=vllm").model)
    check_vllm_cpu_model(validate(load_config(PIPELINES / "tiny_cpu_vllm.yaml")).model)


def test_a_separate_engine_adds_a_sync_phase_and_frees_generate():
    roles = {"actor": 0, "reference": 0, "reward": 0, "critic": 0}
    inplace, separate = phases_for(roles), phases_for(roles, engine="vllm")
    assert "sync" not in inplace and inplace["generate"] == {"actor": "params"}
    assert separate["sync"] == {"actor": "params"} and separate["generate"] == {}
    assert "actor" not in separate["eval"] and "reward" in separate["eval"]


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_corrected_loss_gradient_does_not_depend_on_the_micro_batch_split(aggregation):
    """The weights are per token and per row, so the global-batch mean (sum of microbatch sums
    over all units) gives the same gradient for any split; rows of unequal lengths, one masked."""
    rl = RLConfig(tis_cap=1.2, mismatch_mask_threshold=1.15, loss_aggregation=aggregation)
    _, mb, _ = _actor_grad(rl, with_rollout=True)
    logprobs = (torch.randn(3, 6, generator=torch.Generator().manual_seed(1)) * 0.1 - 1).requires_grad_()

    def grad(splits):
        total, units = 0.0, 0
        for rows in splits:
            part = {k: v[rows] for k, v in mb.items() if v is not None}
            out = {"logprobs": logprobs[rows], "entropy": torch.zeros(len(rows), 6)}
            loss, n, _ = actor_loss(out, part, rl, kl_coef=0.0)
            total, units = total + loss, units + n
        logprobs.grad = None
        (total / units).backward()
        return logprobs.grad.clone()

    whole = grad([[0, 1, 2]])
    assert torch.allclose(whole, grad([[0], [1, 2]]), atol=1e-7)
    assert torch.allclose(whole, grad([[0], [1], [2]]), atol=1e-7)
