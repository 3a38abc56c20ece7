"""DPO's losses (algorithms/dpo.py) against numbers worked out by hand, the trainer's LossFn
on interleaved chosen/rejected rows, the dpo config checks, and where each stage of a DPO
route starts from. Expected values are computed in the comments with `math`, never by
calling the code under test."""

import math

import pytest
import torch

from megatron_rlhf.algorithms.dpo import PairLogps, dpo_loss, pair_logps, sequence_logps
from megatron_rlhf.config import ConfigError, DPOConfig, load_config, policy_start, validate
from megatron_rlhf.trainers.dpo import pair_loss


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


# Two pairs. Policy summed log-probs: chosen -4, -10; rejected -6, -7 (response tokens 2, 5
# chosen; 3, 2 rejected). Reference: chosen -5, -9; rejected -5, -8.
POLICY = PairLogps(torch.tensor([-4.0, -10.0]), torch.tensor([-6.0, -7.0]),
                   torch.tensor([2.0, 5.0]), torch.tensor([3.0, 2.0]))
REFERENCE = PairLogps(torch.tensor([-5.0, -9.0]), torch.tensor([-5.0, -8.0]),
                      torch.tensor([2.0, 5.0]), torch.tensor([3.0, 2.0]))
# log-ratios, summed: chosen +1, -1; rejected -1, +1  ->  h = 2, -2
# log-ratios, averaged: chosen 1/2, -1/5; rejected -1/3, 1/2  ->  h = 5/6, -7/10


def test_sigmoid_loss_by_hand():
    losses, stats = dpo_loss(POLICY, REFERENCE, beta=0.5)
    # -log sigmoid(0.5 * 2) = -logsig(1); -log sigmoid(-1)
    assert losses.tolist() == pytest.approx([-logsig(1.0), -logsig(-1.0)], rel=1e-6)
    assert stats["chosen_reward"].tolist() == pytest.approx([0.5, -0.5])
    assert stats["rejected_reward"].tolist() == pytest.approx([-0.5, 0.5])
    assert stats["margin"].tolist() == pytest.approx([1.0, -1.0])
    assert stats["reward_accuracy"].tolist() == [1.0, 0.0]
    assert stats["logp_chosen"].tolist() == [-4.0, -10.0] and stats["logp_rejected"].tolist() == [-6.0, -7.0]


def test_a_tie_counts_half_in_the_reward_accuracy():
    """At step 0 the policy is the reference: every implicit reward is 0 and every pair ties,
    which is chance (0.5), not every pair ranked wrong."""
    _, stats = dpo_loss(REFERENCE, REFERENCE, beta=0.5)
    assert stats["reward_accuracy"].tolist() == [0.5, 0.5]
    # one pair won (h = 2), one lost (h = -2), one tie: the chosen and rejected log-ratios equal (0 and 0)
    policy = PairLogps(torch.tensor([-4.0, -10.0, -3.0]), torch.tensor([-6.0, -7.0, -2.0]),
                       torch.tensor([2.0, 5.0, 1.0]), torch.tensor([3.0, 2.0, 1.0]))
    reference = PairLogps(torch.tensor([-5.0, -9.0, -3.0]), torch.tensor([-5.0, -8.0, -2.0]),
                          torch.tensor([2.0, 5.0, 1.0]), torch.tensor([3.0, 2.0, 1.0]))
    for loss_type in ("sigmoid", "ipo"):
        _, stats = dpo_loss(policy, reference, beta=0.5, loss_type=loss_type)
        assert stats["reward_accuracy"].tolist() == [1.0, 0.0, 0.5], loss_type


def test_label_smoothing_by_hand():
    losses, _ = dpo_loss(POLICY, REFERENCE, beta=0.5, label_smoothing=0.2)
    # 0.8 * -logsig(1) + 0.2 * -logsig(-1), and the mirror for h = -2
    want = [-0.8 * logsig(1.0) - 0.2 * logsig(-1.0), -0.8 * logsig(-1.0) - 0.2 * logsig(1.0)]
    assert losses.tolist() == pytest.approx(want, rel=1e-6)


def test_ipo_averages_the_log_ratios_over_response_tokens():
    losses, stats = dpo_loss(POLICY, REFERENCE, beta=0.25, loss_type="ipo")
    # (h - 1/(2 * 0.25))^2 = (h - 2)^2 with h = 5/6, -7/10
    assert losses.tolist() == pytest.approx([(5 / 6 - 2) ** 2, (-7 / 10 - 2) ** 2], rel=1e-6)
    # implicit rewards use the same (averaged) log-ratios: 0.25 x (1/2, -1/5) and 0.25 x (-1/3, 1/2)
    assert stats["chosen_reward"].tolist() == pytest.approx([0.125, -0.05])
    assert stats["rejected_reward"].tolist() == pytest.approx([-1 / 12, 0.125])


def test_sft_term_adds_the_chosen_mean_token_nll():
    losses, stats = dpo_loss(POLICY, REFERENCE, beta=0.5, sft_weight=0.3)
    # chosen NLL per token: 4/2 = 2, 10/5 = 2
    assert stats["sft_nll"].tolist() == pytest.approx([2.0, 2.0])
    assert losses.tolist() == pytest.approx([-logsig(1.0) + 0.6, -logsig(-1.0) + 0.6], rel=1e-6)
    assert stats["preference_loss"].tolist() == pytest.approx([-logsig(1.0), -logsig(-1.0)], rel=1e-6)


def test_sequence_log_probs_sum_the_response_tokens_of_interleaved_rows():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-0.5, -0.5, -4.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    assert [x.tolist() for x in sequence_logps(logprobs, mask)] == [[-5.0, -4.0], [2.0, 1.0]]
    pairs = pair_logps(logprobs, mask)
    assert pairs.chosen.tolist() == [-5.0] and pairs.rejected.tolist() == [-4.0]
    assert pairs.chosen_tokens.tolist() == [2.0] and pairs.rejected_tokens.tolist() == [1.0]


def test_the_trainers_loss_sums_over_pairs_and_counts_pairs():
    # rows: chosen_0, rejected_0, chosen_1, rejected_1; one response token each
    logprobs = torch.tensor([[-1.0, 0.0], [-2.0, 0.0], [-3.0, 0.0], [-1.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0]] * 4)
    ref = torch.tensor([-1.5, -1.5, -2.0, -2.0])
    loss, units, stats = pair_loss({"logprobs": logprobs}, {"loss_mask": mask, "ref_logps": ref},
                                   DPOConfig(beta=1.0))
    # h = (0.5 - (-0.5)) = 1 and (-1 - 1) = -2
    assert units.item() == 2
    assert loss.item() == pytest.approx(-logsig(1.0) - logsig(-2.0), rel=1e-6)
    assert stats["reward_accuracy"].item() == 1.0
    loss.backward()
    # d/d logp_chosen_0 of -logsig(h) = -(1 - sigmoid(1)); the rejected side the opposite
    g = 1 - 1 / (1 + math.exp(-1.0))
    assert logprobs.grad[0, 0].item() == pytest.approx(-g) and logprobs.grad[1, 0].item() == pytest.approx(g)


@pytest.mark.parametrize("override, field", [
    ("dpo.loss=kto", "dpo.loss"), ("dpo.beta=0", "dpo.beta"), ("dpo.label_smoothing=0.5", "dpo.label_smoothing"),
    ("dpo.sft_weight=-1", "dpo.sft_weight"), ("dpo.seq_length=1000", "dpo.seq_length"),
    ("dpo.global_batch_size=30", "dpo.global_batch_size"),
])
def test_bad_dpo_settings_name_the_field(override, field):
    with pytest.raises(ConfigError, match=f"^{field}"):
        validate(load_config(None, [override]), world_size=1)


def test_label_smoothing_belongs_to_the_sigmoid_loss():
    with pytest.raises(ConfigError, match="dpo.label_smoothing=0.1 with dpo.loss=ipo"):
        validate(load_config(None, ["dpo.loss=ipo", "dpo.label_smoothing=0.1"]), world_size=1)


def test_dpo_stage_starts_from_sft_or_its_own_fields():
    with pytest.raises(ConfigError, match="dpo.init_from"):
        validate(load_config(None, ["pipeline.stages=[dpo]"]), world_size=1)
    validate(load_config(None, ["pipeline.stages=[dpo]", "dpo.init_from=/runs/x/sft"]), world_size=1)
    validate(load_config(None, ["pipeline.stages=[sft,dpo]"]), world_size=1)


def test_rl_after_dpo_starts_from_the_dpo_policy():
    assert policy_start(load_config(None, [])) == ("sft", None)
    assert policy_start(load_config(None, ["pipeline.stages=[sft,rm,dpo,rl]"])) == ("dpo", None)
    assert policy_start(load_config(None, ["pipeline.stages=[sft,rm,rl,dpo]"])) == ("sft", None)
    assert policy_start(load_config(None, ["pipeline.stages=[sft,rm,dpo,rl]", "rl.sft_from=/x"])) == ("dpo", "/x")
