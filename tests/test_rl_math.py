"""RL math checked against numbers worked out by hand: megatron_rlhf/algorithms/stats.py
(masked moments, whitening, diagnostics), kl.py (KL estimators and controllers),
advantages.py (token rewards, GAE, the advantage estimators of every rl.algorithm) and
losses.py (importance ratios incl. GSPO, clipped policy loss with clip-higher and dual-clip,
value loss, aggregation), and the RL trainer's loss functions (trainers/rl.py: actor_loss,
critic_loss) with the means the roles report (models/roles.py: stat_means). Expected values are
worked out in the comments, never by calling the code under test."""

import math
from functools import partial
from pathlib import Path

import pytest
import torch

from megatron_rlhf.algorithms.advantages import (
    ESTIMATORS,
    Settings,
    batch_mean,
    discounted_returns,
    gae,
    grpo,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
    sequence_returns,
    token_rewards,
)
from megatron_rlhf.algorithms.kl import (
    AdaptiveKLController, FixedKLController, kl_estimate, kl_loss_estimate, make_kl_controller,
)
from megatron_rlhf.algorithms.losses import aggregate, log_importance_ratio, policy_loss, value_loss
from megatron_rlhf.algorithms.stats import (
    explained_variance,
    masked_mean,
    masked_var,
    masked_whiten,
    response_repetition_rate,
    whiten,
)
from megatron_rlhf.config import (
    KL_ESTIMATORS, LOSS_AGGREGATIONS, RL_ALGORITHMS, ConfigError, RLConfig, load_config, validate,
)
from megatron_rlhf.models.roles import stat_means
from megatron_rlhf.trainers.rl import actor_loss, critic_loss, step_means


PIPELINES = Path(__file__).resolve().parent.parent / "pipelines"


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(x, expected, tol=1e-5):
    expected = torch.as_tensor(expected, dtype=torch.float32)
    assert torch.allclose(torch.as_tensor(x, dtype=torch.float32), expected, atol=tol), (x, expected)


# ----------------------------------------------------------------------------- KL estimators


def test_kl_estimators_hand_values():
    # log_ratio = 0.4:  k1 = 0.4;  k2 = 0.5 * 0.16 = 0.08;
    #                   k3 = exp(-0.4) - 1 + 0.4 = 0.6703200460 - 0.6 = 0.0703200460
    # log_ratio = -0.5: k1 = -0.5; k2 = 0.5 * 0.25 = 0.125;
    #                   k3 = exp(0.5) - 1 - 0.5 = 1.6487212707 - 1.5 = 0.1487212707
    lp, ref = t([[-1.2, -2.0]]), t([[-1.6, -1.5]])
    close(kl_estimate(lp, ref, "k1"), [[0.4, -0.5]])
    close(kl_estimate(lp, ref, "k2"), [[0.08, 0.125]])
    close(kl_estimate(lp, ref, "k3"), [[0.0703200460, 0.1487212707]])
    # k3 is zero where the policies agree and never negative.
    close(kl_estimate(t([[-1.0]]), t([[-1.0]]), "k3"), [[0.0]])
    assert (kl_estimate(torch.randn(4, 8), torch.randn(4, 8), "k3") >= 0).all()


def test_unknown_kl_estimator_names_config_field():
    with pytest.raises(ValueError, match=r"rl\.kl_estimator.*k1.*k2.*k3"):
        kl_estimate(t([[0.0]]), t([[0.0]]), "k4")


# ----------------------------------------------------------------------------- token rewards


def test_checklist_kl_penalty_examples():
    # actor -1.2, reference -1.6, beta 0.05: k1 = 0.4, reward = -0.05 * 0.4 = -0.02
    kl = kl_estimate(t([[-1.2]]), t([[-1.6]]), "k1")
    close(kl, [[0.4]])
    close(token_rewards(-0.05 * kl, t([0.0]), t([[1.0]])), [[-0.02]])
    # actor -2.0, reference -2.4, beta 0.1: k1 = 0.4, reward = -0.1 * 0.4 = -0.04
    kl = kl_estimate(t([[-2.0]]), t([[-2.4]]), "k1")
    close(token_rewards(-0.1 * kl, t([0.0]), t([[1.0]])), [[-0.04]])


def test_token_rewards_score_at_last_valid_token_with_right_padding():
    # kl = 0.1 on real tokens (9.0 junk on pads), kl_coef 0.5: kl_penalty = -0.5 * kl = -0.05
    # per real token (-4.5 junk on pads, which must not leak).
    kl = t([[0.1, 0.1, 0.1, 9.0], [0.1, 0.1, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    r = token_rewards(-0.5 * kl, t([1.0, 2.0, 5.0]), mask)
    close(r, [[-0.05, -0.05, 0.95, 0.0], [-0.05, 1.95, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


# ----------------------------------------------------------------------------- GAE


def test_gae_gamma1_lam095_hand_computed():
    # r = [0, 0, 1], V = [0.5, 0.6, 0.7], V after the last token = 0.
    # t=2: delta = 1 + 0 - 0.7 = 0.3;              A2 = 0.3
    # t=1: delta = 0 + 0.7 - 0.6 = 0.1;            A1 = 0.1 + 0.95 * 0.3   = 0.385
    # t=0: delta = 0 + 0.6 - 0.5 = 0.1;            A0 = 0.1 + 0.95 * 0.385 = 0.46575
    # returns = A + V = [0.96575, 0.985, 1.0]
    adv, ret = gae(t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]]), gamma=1.0, lam=0.95)
    close(adv, [[0.46575, 0.385, 0.3]])
    close(ret, [[0.96575, 0.985, 1.0]])


def test_gae_gamma09_lam05_hand_computed():
    # gamma * lam = 0.45
    # t=2: delta = 1 - 0.7 = 0.3;                  A2 = 0.3
    # t=1: delta = 0.9 * 0.7 - 0.6 = 0.03;         A1 = 0.03 + 0.45 * 0.3   = 0.165
    # t=0: delta = 0.9 * 0.6 - 0.5 = 0.04;         A0 = 0.04 + 0.45 * 0.165 = 0.11425
    adv, ret = gae(t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]]), gamma=0.9, lam=0.5)
    close(adv, [[0.11425, 0.165, 0.3]])
    close(ret, [[0.61425, 0.765, 1.0]])


def test_gae_padding_does_not_leak():
    # Same 3-token row, then 2 pads holding junk rewards and values; batched with a full row.
    rewards = t([[0, 0, 1, 3.0, -7.0], [0.1, 0.2, 0.3, 0.4, 0.5]])
    values = t([[0.5, 0.6, 0.7, 5.0, 11.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    mask = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    ref_adv, ref_ret = gae(t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]]), 1.0, 0.95)
    close(adv[0, :3], ref_adv[0])
    close(ret[0, :3], ref_ret[0])
    close(adv[0, 3:], [0.0, 0.0])
    close(ret[0, 3:], [0.0, 0.0])
    # The full row is unaffected by its batch neighbour's padding.
    solo_adv, _ = gae(rewards[1:], values[1:], mask[1:], 1.0, 0.95)
    close(adv[1:], solo_adv)


# ----------------------------------------------------------------------------- advantage estimators

# Two prompts x 3 samples (group i = rows 3i .. 3i+2); response lengths 4, 2, 3 | 1, 4, 2.
GROUP_MASK = t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
GROUP_SCORES = t([1, 2, 3, 0, 0, 4])


def junk_on_pads(mask, penalty=0.0, junk=100.0):
    """A kl_penalty of `penalty` on every real token and `junk` on every pad (must not enter R)."""
    return penalty * mask + junk * (1 - mask)


def on_valid(row_values, mask):
    """The hand-computed per-row values on every valid token of their row, 0 at padding."""
    return torch.tensor(row_values, dtype=torch.float32)[:, None] * mask


def assert_zero_on_pads(adv, mask):
    assert (adv[mask == 0] == 0).all(), adv


def test_estimators_are_the_config_algorithms():
    assert set(ESTIMATORS) == set(RL_ALGORITHMS) and len(ESTIMATORS) == len(RL_ALGORITHMS) == 6
    assert ESTIMATORS["grpo"] is grpo and ESTIMATORS["rloo"] is rloo and ESTIMATORS["batch_mean"] is batch_mean
    assert ESTIMATORS["reinforce_pp"] is reinforce_pp
    assert ESTIMATORS["reinforce_pp_baseline"] is reinforce_pp_baseline


def test_sequence_returns_include_kl_penalty_on_valid_tokens_only():
    # row 0: 1 + (-0.1 - 0.2 - 0.3) = 0.4;  row 1: 2 + (-0.5) = 1.5 (the NaN and 7 are pads)
    kl_penalty = t([[-0.1, -0.2, -0.3], [-0.5, float("nan"), 7.0]])
    r = sequence_returns(t([1.0, 2.0]), kl_penalty, t([[1, 1, 1], [1, 0, 0]]))
    close(r, [0.4, 1.5])
    assert r.dtype == torch.float32 and r.shape == (2,)


def test_ppo_estimator_gae_then_whiten_by_hand():
    # row 0: the GAE example above: score 1 on the last token, no KL, V = [0.5, 0.6, 0.7]
    #   A = [0.46575, 0.385, 0.3], returns = A + V = [0.96575, 0.985, 1.0]
    # row 1 (2 tokens): kl_penalty -0.1 per token, score 0.5, V = [0.2, 0.3] (9 is a pad)
    #   r = [-0.1, -0.1 + 0.5] = [-0.1, 0.4]
    #   t=1: delta = 0.4 - 0.3 = 0.1;             A1 = 0.1
    #   t=0: delta = -0.1 + 0.3 - 0.2 = 0.0;      A0 = 0.0 + 0.95 * 0.1 = 0.095
    #   returns = [0.295, 0.4]
    scores, mask = t([1.0, 0.5]), t([[1, 1, 1], [1, 1, 0]])
    kl_penalty, values = t([[0.0, 0.0, 0.0], [-0.1, -0.1, 50.0]]), t([[0.5, 0.6, 0.7], [0.2, 0.3, 9.0]])
    adv, ret = ESTIMATORS["ppo"](scores, kl_penalty, mask, values, Settings(gamma=1.0, lam=0.95, whiten=False))
    close(adv, [[0.46575, 0.385, 0.3], [0.095, 0.1, 0.0]])
    close(ret, [[0.96575, 0.985, 1.0], [0.295, 0.4, 0.0]])
    # Whitened over the 5 valid tokens: sum = 1.34575, mean = 0.26915,
    # deviations [0.1966, 0.11585, 0.03085, -0.17415, -0.16915],
    # squares 0.03865156 + 0.0134212225 + 0.0009517225 + 0.0303282225 + 0.0286117225 = 0.11196445,
    # unbiased var = 0.11196445 / 4 = 0.0279911125; the returns stay the unwhitened A + V.
    adv, ret = ESTIMATORS["ppo"](scores, kl_penalty, mask, values, Settings(gamma=1.0, lam=0.95, whiten=True))
    sd = math.sqrt(0.0279911125 + 1e-8)
    close(adv, [[0.1966 / sd, 0.11585 / sd, 0.03085 / sd], [-0.17415 / sd, -0.16915 / sd, 0.0]])
    close(ret, [[0.96575, 0.985, 1.0], [0.295, 0.4, 0.0]])
    assert_zero_on_pads(adv, mask)


def test_grpo_group_std_unbiased_by_hand():
    # group 1, R = [1, 2, 3]: mean 2, deviations [-1, 0, 1], unbiased var (1 + 0 + 1) / 2 = 1,
    #   std 1 -> [-1, 0, 1] / (1 + 1e-6)   (biased std sqrt(2/3) would give [-1.2247, 0, 1.2247])
    # group 2, R = [0, 0, 4]: mean 4/3, deviations [-4/3, -4/3, 8/3],
    #   unbiased var (16/9 + 16/9 + 64/9) / 2 = 16/3, std 4/sqrt(3) = 2.3094011
    #   -> [-4/3, -4/3, 8/3] / (2.3094011 + 1e-6) = [-0.5773501, -0.5773501, 1.1547003]
    #   (biased std sqrt(32/9) = 1.8856 would give [-0.7071, -0.7071, 1.4142])
    adv, ret = grpo(GROUP_SCORES, junk_on_pads(GROUP_MASK), GROUP_MASK, None,
                    Settings(group_size=3, group_std=True, eps=1e-6))
    sd2 = 4 / math.sqrt(3) + 1e-6
    close(adv, on_valid([-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6), -4 / 3 / sd2, -4 / 3 / sd2, 8 / 3 / sd2], GROUP_MASK))
    close(adv[4], [-0.5773501] * 4)  # row 4: R = 0, 4 tokens
    close(adv[5], [1.1547003, 1.1547003, 0.0, 0.0])  # row 5: R = 4, 2 tokens
    assert ret is None
    assert_zero_on_pads(adv, GROUP_MASK)


def test_dr_grpo_no_std_division_by_hand():
    # group_std=False (Dr.GRPO): R - group mean only.
    # [1, 2, 3] - 2 = [-1, 0, 1];  [0, 0, 4] - 4/3 = [-4/3, -4/3, 8/3]
    adv, ret = grpo(GROUP_SCORES, junk_on_pads(GROUP_MASK), GROUP_MASK, None,
                    Settings(group_size=3, group_std=False))
    close(adv, on_valid([-1.0, 0.0, 1.0, -4 / 3, -4 / 3, 8 / 3], GROUP_MASK))
    assert ret is None
    assert_zero_on_pads(adv, GROUP_MASK)


def test_rloo_leave_one_out_by_hand():
    # R_i - mean of the other two:
    #   [1, 2, 3]: 1 - (2+3)/2 = -1.5;  2 - (1+3)/2 = 0;  3 - (1+2)/2 = 1.5
    #   [0, 0, 4]: 0 - (0+4)/2 = -2;    0 - (0+4)/2 = -2; 4 - (0+0)/2 = 4
    # (the full-group mean would give [-1, 0, 1] and [-4/3, -4/3, 8/3])
    adv, ret = rloo(GROUP_SCORES, junk_on_pads(GROUP_MASK), GROUP_MASK, None, Settings(group_size=3))
    close(adv, on_valid([-1.5, 0.0, 1.5, -2.0, -2.0, 4.0], GROUP_MASK))
    assert ret is None
    assert_zero_on_pads(adv, GROUP_MASK)


def test_kl_penalty_enters_grpo_and_rloo_through_the_return():
    # One group of 3; scores [1, 2, 3]; summed kl_penalty per row -1, -1, 0 -> R = [0, 1, 3].
    #   row 0 (2 tokens): -0.5 - 0.5 = -1;  row 1 (3 tokens): -0.25 - 0.25 - 0.5 = -1;  row 2: 0
    # mean R = 4/3, deviations [-4/3, -1/3, 5/3];
    # unbiased var (16/9 + 1/9 + 25/9) / 2 = 42/18 = 7/3, std sqrt(7/3) = 1.5275252
    # grpo:    [-4/3, -1/3, 5/3] / (sqrt(7/3) + 1e-6) = [-0.8728716, -0.2182179, 1.0910894]
    # Dr.GRPO: [-4/3, -1/3, 5/3]
    # rloo:    0 - (1+3)/2 = -2;  1 - (0+3)/2 = -0.5;  3 - (0+1)/2 = 2.5
    # (without the penalty: grpo [-1, 0, 1], rloo [-1.5, 0, 1.5])
    mask = t([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    kl_penalty = t([[-0.5, -0.5, 5.0], [-0.25, -0.25, -0.5], [0.0, 5.0, 5.0]])
    scores = t([1, 2, 3])
    adv, _ = grpo(scores, kl_penalty, mask, None, Settings(group_size=3))
    sd = math.sqrt(7 / 3) + 1e-6
    close(adv, on_valid([-4 / 3 / sd, -1 / 3 / sd, 5 / 3 / sd], mask))
    close(adv[:, 0], [-0.8728716, -0.2182179, 1.0910894])
    adv, _ = grpo(scores, kl_penalty, mask, None, Settings(group_size=3, group_std=False))
    close(adv, on_valid([-4 / 3, -1 / 3, 5 / 3], mask))
    adv, _ = rloo(scores, kl_penalty, mask, None, Settings(group_size=3))
    close(adv, on_valid([-2.0, -0.5, 2.5], mask))


def test_equal_rewards_give_exactly_zero_advantages_not_nan():
    # group 1 all R = 2 (std 0: 0 / (0 + eps) = 0, not 0/0); group 2 R = [1, 2, 3] as above.
    scores = t([2, 2, 2, 1, 2, 3])
    kl_penalty = junk_on_pads(GROUP_MASK)
    for estimator, s in ((grpo, Settings(group_size=3, group_std=True)),
                         (grpo, Settings(group_size=3, group_std=False)),
                         (rloo, Settings(group_size=3))):
        adv, _ = estimator(scores, kl_penalty, GROUP_MASK, None, s)
        assert torch.isfinite(adv).all(), (estimator.__name__, adv)
        assert (adv[:3] == 0).all(), (estimator.__name__, s, adv)
        assert (adv[3:] != 0).any()  # the other group still learns
    # reinforce_pp_baseline: two equal groups at different levels (2 and 5): the group means
    # remove both levels (a batch mean, 3.5, would not), so every token return is 0, and
    # whitening 0 with var 0 gives (0 - 0) / sqrt(0 + 1e-8) = 0.
    scores = t([2, 2, 2, 5, 5, 5])
    adv, _ = reinforce_pp_baseline(scores, torch.zeros(6, 4), GROUP_MASK, None, Settings(group_size=3))
    assert torch.isfinite(adv).all() and (adv == 0).all(), adv
    # Without the baseline the two levels are whitened apart.
    adv, _ = reinforce_pp(scores, torch.zeros(6, 4), GROUP_MASK, None, Settings(group_size=3))
    assert adv.abs().max() > 0.5


def test_rloo_equal_non_dyadic_rewards_near_zero():
    # 0.7 is not exactly representable: (3 * 0.7 - 0.7) / 2 rounds to one float32 ulp off 0.7.
    adv, _ = rloo(torch.full((3,), 0.7), torch.zeros(3, 2), torch.ones(3, 2), None, Settings(group_size=3))
    assert torch.isfinite(adv).all() and adv.abs().max() < 1e-6


# ----------------------------------------------------------------------------- failed episodes
# A failed multi-turn episode keeps its row with no policy token (mask row all 0) and a score of
# 0 (or rl.missing_eos_penalty): it is no sample of its group (advantages.py's docstring).
GROUP_ESTIMATORS = [(grpo, {"group_std": True}), (grpo, {"group_std": False}), (rloo, {}),
                    (reinforce_pp_baseline, {})]


@pytest.mark.parametrize("failed_score", [0.0, -1.0])
@pytest.mark.parametrize("estimator, settings", GROUP_ESTIMATORS)
def test_a_failed_row_does_not_move_its_siblings_advantages(estimator, settings, failed_score):
    # Group 0: three siblings all scored 1 and a failed row (row 2): its valid rewards are equal,
    # so every advantage is 0. Counting the failed row (score 0) would give the siblings
    # grpo: mean 0.75, deviations 0.25, unbiased std sqrt((3 * 0.0625 + 0.5625) / 3) = 0.5 -> +0.5;
    # Dr.GRPO +0.25; rloo 1 - (1 + 0 + 1) / 3 = +0.33; REINFORCE++-baseline a baselined +0.25.
    # Group 1 (scores [0, 2, 0, 2], two tokens each: its returns average 0) keeps REINFORCE++'s
    # whitening from hiding that shift, which it would in a batch of group 0 alone.
    mask = t([[1, 1, 1], [1, 1, 0], [0, 0, 0], [1, 0, 0]] + [[1, 1, 0]] * 4)
    scores = t([1.0, 1.0, failed_score, 1.0, 0.0, 2.0, 0.0, 2.0])
    adv, _ = estimator(scores, junk_on_pads(mask), mask, None, Settings(group_size=4, **settings))
    assert torch.isfinite(adv).all() and (adv[:4] == 0).all(), adv
    assert (adv[4:] != 0).any()


# Group 0: row 1 failed (score 9, kl junk everywhere), the other three are the group: with a -0.25
# penalty per token, R = [3 - 0.75, 1 - 0.5, 2 - 0.25] = [2.25, 0.5, 1.75]. Group 1: all valid.
MIXED_MASK = t([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0]] + [[1, 1, 0, 0]] * 4)
MIXED_SCORES = t([3.0, 9.0, 1.0, 2.0, 0.0, 2.0, 0.0, 2.0])
MIXED_KL = junk_on_pads(MIXED_MASK, penalty=-0.25)


@pytest.mark.parametrize("estimator, settings", GROUP_ESTIMATORS[:3])
def test_a_group_with_a_failed_row_is_the_group_of_its_valid_rows(estimator, settings):
    adv, _ = estimator(MIXED_SCORES, MIXED_KL, MIXED_MASK, None, Settings(group_size=4, **settings))
    for rows in ([0, 2, 3], [4, 5, 6, 7]):  # each group's valid rows, as a group of their own
        alone, _ = estimator(MIXED_SCORES[rows], MIXED_KL[rows], MIXED_MASK[rows], None,
                             Settings(group_size=len(rows), **settings))
        close(adv[rows], alone, tol=1e-6)
    assert (adv[1] == 0).all() and (adv[[0, 2, 3]] != 0).any()
    if estimator is rloo:  # R_i - mean of the two other valid rows, by hand
        # 2.25 - (0.5 + 1.75) / 2 = 1.125;  0.5 - (2.25 + 1.75) / 2 = -1.5;  1.75 - (2.25 + 0.5) / 2 = 0.375
        close(adv[:4], on_valid([1.125, 0.0, -1.5, 0.375], MIXED_MASK[:4]))


def test_reinforce_pp_baseline_subtracts_the_mean_of_the_valid_rows():
    # group 0's valid scores [3, 1, 2]: mean 2 -> [1, -1, 0] (with the failed row's 9 the mean would
    # be 3.75); group 1 [0, 2, 0, 2]: mean 1 -> [-1, 1, -1, 1]; then exactly reinforce_pp of those.
    adv, _ = reinforce_pp_baseline(MIXED_SCORES, MIXED_KL, MIXED_MASK, None, Settings(group_size=4))
    expected, _ = reinforce_pp(t([1, 0, -1, 0, -1, 1, -1, 1]), MIXED_KL, MIXED_MASK, None, Settings(group_size=4))
    close(adv, expected)
    assert (adv[1] == 0).all()


@pytest.mark.parametrize("estimator, settings", GROUP_ESTIMATORS)
def test_groups_of_fewer_than_two_valid_rows_get_zero_advantages_not_nan(estimator, settings):
    # group 0: one valid row (score 5) and two failed ones; group 1: every row failed;
    # group 2: valid, R = [1, 2, 3] (it still learns).
    mask = t([[1, 1, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    scores = t([5.0, 0.0, -1.0, 0.0, 2.0, -1.0, 1.0, 2.0, 3.0])
    s = Settings(group_size=3, **settings)
    adv, _ = estimator(scores, junk_on_pads(mask), mask, None, s)
    assert torch.isfinite(adv).all(), adv
    if estimator is reinforce_pp_baseline:  # whitening over the batch shifts every row: compare
        # with reinforce_pp of the baselined scores by hand: groups 0 and 1 have no baseline (0),
        # group 2: [1, 2, 3] - 2 = [-1, 0, 1]
        expected, _ = reinforce_pp(t([0, 0, 0, 0, 0, 0, -1, 0, 1]), junk_on_pads(mask), mask, None, s)
        close(adv, expected)
        alone, _ = estimator(scores[:3], junk_on_pads(mask[:3]), mask[:3], None, s)  # group 0 alone
        assert torch.isfinite(alone).all() and (alone == 0).all(), alone
    else:
        assert (adv[:6] == 0).all(), adv
    assert (adv[6:] != 0).any()


# reinforce_pp hand case: 2 rows, T = 3, lengths 3 and 2, gamma 0.5.
RPP_MASK = t([[1, 1, 1], [1, 1, 0]])
RPP_KL_PENALTY = t([[-0.1, -0.1, -0.1], [-0.2, -0.2, 9.0]])
# token rewards: row 0 (score 1):  [-0.1, -0.1, -0.1 + 1]  = [-0.1, -0.1, 0.9]
#                row 1 (score -1): [-0.2, -0.2 - 1, pad]   = [-0.2, -1.2, 0]
# discounted returns, gamma 0.5:
#   row 0: G2 = 0.9;  G1 = -0.1 + 0.5 * 0.9 = 0.35;  G0 = -0.1 + 0.5 * 0.35 = 0.075
#   row 1: G1 = -1.2; G0 = -0.2 + 0.5 * -1.2 = -0.8
RPP_RETURNS = [[0.075, 0.35, 0.9], [-0.8, -1.2, 0.0]]
# whitening over the 5 valid tokens: sum 1.325 - 2.0 = -0.675, mean -0.135,
# deviations [0.21, 0.485, 1.035, -0.665, -1.065],
# squares 0.0441 + 0.235225 + 1.071225 + 0.442225 + 1.134225 = 2.927,
# unbiased var 2.927 / 4 = 0.73175 (biased would be 2.927 / 5 = 0.5854)
RPP_SD = math.sqrt(0.73175 + 1e-8)
RPP_WHITENED = [[0.21 / RPP_SD, 0.485 / RPP_SD, 1.035 / RPP_SD], [-0.665 / RPP_SD, -1.065 / RPP_SD, 0.0]]


def test_reinforce_pp_discounted_then_whitened_by_hand():
    scores = t([1.0, -1.0])
    rewards = token_rewards(RPP_KL_PENALTY, scores, RPP_MASK)
    close(rewards, [[-0.1, -0.1, 0.9], [-0.2, -1.2, 0.0]])
    close(discounted_returns(rewards, RPP_MASK, 0.5), RPP_RETURNS)
    adv, ret = reinforce_pp(scores, RPP_KL_PENALTY, RPP_MASK, None, Settings(gamma=0.5))
    close(adv, RPP_WHITENED)
    assert ret is None
    assert_zero_on_pads(adv, RPP_MASK)
    valid = adv[RPP_MASK.bool()].double()
    assert abs(valid.mean().item()) < 1e-6 and abs(valid.var().item() - 1.0) < 1e-5  # unbiased var


def test_reinforce_pp_baseline_subtracts_group_mean_first():
    # one group of 2, scores [3, 1]: group mean 2 -> baselined [1, -1], then exactly the
    # reinforce_pp hand case above (scores [1, -1]).
    adv, ret = reinforce_pp_baseline(t([3.0, 1.0]), RPP_KL_PENALTY, RPP_MASK, None,
                                     Settings(gamma=0.5, group_size=2))
    close(adv, RPP_WHITENED)
    assert ret is None
    assert_zero_on_pads(adv, RPP_MASK)


# batch_mean hand case: R = score + summed kl_penalty over valid tokens (50 is a pad)
#   row 0: 1   + (-0.5 - 0.5)          = 0
#   row 1: 2.5 + (-0.5)                = 2
#   row 2: 8   + (-0.5 - 0.25 - 0.25)  = 7
BM_SCORES = t([1.0, 2.5, 8.0])
BM_KL_PENALTY = t([[-0.5, -0.5, 50.0], [-0.5, 50.0, 50.0], [-0.5, -0.25, -0.25]])
BM_MASK = t([[1, 1, 0], [1, 0, 0], [1, 1, 1]])


def test_batch_mean_by_hand():
    # mean over sequences (0 + 2 + 7) / 3 = 3 -> [-3, -1, 4]
    # (a token-weighted mean (0*2 + 2*1 + 7*3) / 6 = 23/6 or ignoring the KL would differ)
    adv, ret = batch_mean(BM_SCORES, BM_KL_PENALTY, BM_MASK, None, Settings())
    close(adv, on_valid([-3.0, -1.0, 4.0], BM_MASK))
    assert ret is None
    assert_zero_on_pads(adv, BM_MASK)


def other_rank(count, total, squared_deviations):
    """A Settings.reduce that adds a simulated second data-parallel rank's sums (worked out by
    hand): (count, sum) to the first-pass [count, sum] and its squared deviations from the
    global mean to the second pass of masked_moments."""
    calls = []

    def reduce(x):
        calls.append(x.shape)
        extra = [count, total] if x.dim() == 1 else squared_deviations
        return x + torch.tensor(extra, dtype=x.dtype)

    return reduce, calls


def test_batch_mean_global_over_ranks():
    # The other rank holds R = [5, 11]: count 2, sum 16, squared deviations from the global
    # mean (0 + 36) = 36. Global mean (0 + 2 + 7 + 5 + 11) / 5 = 25 / 5 = 5 -> [-5, -3, 2].
    reduce, calls = other_rank(2.0, 16.0, 36.0)
    adv, _ = batch_mean(BM_SCORES, BM_KL_PENALTY, BM_MASK, None, Settings(reduce=reduce))
    close(adv, on_valid([-5.0, -3.0, 2.0], BM_MASK))
    assert calls  # the hook was used


def test_reinforce_pp_whitens_over_the_global_batch():
    # The other rank holds the negated returns [-0.075, -0.35, -0.9, 0.8, 1.2]:
    #   count 5, sum +0.675 -> global count 10, sum 0, mean 0;
    #   its squared deviations from 0: 0.005625 + 0.1225 + 0.81 + 0.64 + 1.44 = 3.018125,
    #   the same as ours -> global unbiased var (2 * 3.018125) / 9 = 6.03625 / 9 = 0.6706944
    # so ours whiten to G / sqrt(0.6706944) (this batch alone: (G + 0.135) / sqrt(0.73175)).
    reduce, calls = other_rank(5.0, 0.675, 3.018125)
    adv, _ = reinforce_pp(t([1.0, -1.0]), RPP_KL_PENALTY, RPP_MASK, None, Settings(gamma=0.5, reduce=reduce))
    sd = math.sqrt(6.03625 / 9 + 1e-8)
    close(adv, [[0.075 / sd, 0.35 / sd, 0.9 / sd], [-0.8 / sd, -1.2 / sd, 0.0]])
    assert len(calls) == 2


# ----------------------------------------------------------------------------- whitening


def test_masked_whiten():
    x = t([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -50.0, 7.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    w = masked_whiten(x, mask)
    close(masked_mean(w, mask), 0.0)
    close(masked_var(w, mask), 1.0, tol=1e-4)
    close(w * (1 - mask), torch.zeros_like(w))
    # The pads' 100 / -50 / 7 did not enter: mean of [1..5] is 3, so x=3 whitens to 0.
    close(w[0, 2], 0.0)
    kept = masked_whiten(x, mask, shift_mean=False)
    close(masked_mean(kept, mask), 3.0)
    close(masked_var(kept, mask), 1.0, tol=1e-4)
    close(kept * (1 - mask), torch.zeros_like(kept))


@pytest.mark.parametrize("value", [0.7, 0.1, -3.3])
def test_whitening_constant_advantages_is_zero_not_nan(value):
    # 64 x 48 tokens of one value: E[x^2] - mean^2 in float32 gave a negative variance (NaN)
    # for 0.7 and an 11,000x spurious scale for 0.1.
    x, mask = torch.full((64, 48), value), torch.ones(64, 48)
    assert masked_var(x, mask) == 0.0
    w = masked_whiten(x, mask)
    assert torch.isfinite(w).all() and w.abs().max() == 0.0


def test_whitening_near_constant_matches_float64_formula():
    g = torch.Generator().manual_seed(1)
    x = (0.7 + 1e-4 * torch.randn(64, 48, generator=g, dtype=torch.float64)).float()
    mask = (torch.rand(64, 48, generator=g) > 0.2).float()
    x64, valid = x.double()[mask.bool()], mask.bool()
    want = (x.double() - x64.mean()) / torch.sqrt(x64.var() + 1e-8) * mask
    torch.testing.assert_close(masked_whiten(x, mask).double(), want, rtol=1e-5, atol=1e-6)
    from megatron_rlhf.parallel.collectives import masked_moments

    count, mean, var = masked_moments(x, mask)  # the trainer's path (one process here)
    assert count.item() == valid.sum().item()
    torch.testing.assert_close(var, x64.var(), rtol=1e-9, atol=0)
    torch.testing.assert_close(whiten(x, mask, mean, var).double(), want, rtol=1e-5, atol=1e-6)


def test_masked_var_hand_values():
    # [1, 2, 3, 4, 5]: mean 3, sum of squares 10 -> biased 2.0, unbiased 2.5.
    x, mask = t([[1, 2, 3, 9.0], [4, 5, 9.0, 9.0]]), t([[1, 1, 1, 0], [1, 1, 0, 0]])
    close(masked_mean(x, mask), 3.0)
    close(masked_var(x, mask), 2.5)
    close(masked_var(x, mask, unbiased=False), 2.0)
    assert masked_var(x, mask).dtype == torch.float64


# ----------------------------------------------------------------------------- policy loss


def token_mean(per_token, mask):
    total, units = aggregate(per_token, mask, "token_mean")
    return total / units


def test_checklist_policy_clip_positive_advantage():
    # old prob 0.10, new 0.13 -> rho = 1.3; eps 0.2, A = 2: rho*A = 2.6, clip(rho)*A = 1.2*2 = 2.4,
    # min = 2.4 -> loss = -2.4, and the clipped term was the active one.
    lp, old = t([[math.log(0.13)]]), t([[math.log(0.10)]])
    loss, clipped = policy_loss(lp - old, t([[2.0]]), 0.2)
    close(loss, [[-2.4]])
    assert clipped.tolist() == [[True]] and not clipped.requires_grad


def test_policy_clip_negative_advantage():
    # rho = 0.5 < 1 - eps, A = -1: -A*rho = 0.5, -A*clip = 0.8 -> loss 0.8 (clipped active).
    loss, clipped = policy_loss(t([[math.log(0.5)]]), t([[-1.0]]), 0.2)
    close(loss, [[0.8]])
    assert clipped.tolist() == [[True]]
    # rho = 1.5, A = -1: -A*rho = 1.5 > -A*clip = 1.2 -> unclipped is pessimistic, not clipped.
    loss, clipped = policy_loss(t([[math.log(1.5)]]), t([[-1.0]]), 0.2)
    close(loss, [[1.5]])
    assert clipped.tolist() == [[False]]


def test_policy_loss_gradient_zero_on_clipped_tokens():
    # tokens: (A=2, rho=1.3) clipped; (A=2, rho=1.1) free; (A=-1, rho=1.3) free; (A=-1, rho=0.5)
    # clipped; a 5th padded token. d loss / d logprob_i = -A_i * rho_i / 4 on free tokens.
    ratios = [1.3, 1.1, 1.3, 0.5, 2.0]
    lp = torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)
    adv, mask = t([[2.0, 2.0, -1.0, -1.0, 5.0]]), t([[1, 1, 1, 1, 0]])
    per_token, clipped = policy_loss(lp - torch.zeros(1, 5), adv, clip_low=0.2)
    loss = token_mean(per_token, mask)
    loss.backward()
    close(lp.grad, [[0.0, -2.0 * 1.1 / 4, 1.3 / 4, 0.0, 0.0]])
    close(token_mean(clipped.float(), mask), 0.5)
    # loss = mean(-2.4, -2.2, 1.3, 0.8) = -2.5 / 4
    close(loss, -2.5 / 4)


def test_policy_loss_clip_higher():
    # clip_low 0.2, clip_high 0.28: clip range [0.8, 1.28].
    # A = +1, rho = 1.25: -rho A = -1.25, -clip(rho) A = -1.25 -> loss -1.25, NOT clipped
    #   (a symmetric 0.2 would clip it at 1.2: loss -1.2); gradient -A rho = -1.25
    # A = +1, rho = 1.3:  -1.3 vs -clip(1.3) = -1.28 -> max = -1.28, clipped, gradient 0
    # A = -1, rho = 0.75: 0.75 vs clip(0.75) = 0.8  -> max = 0.8, clipped, gradient 0
    # A = -1, rho = 1.3:  1.3 vs 1.28 -> 1.3 (the unclipped is pessimistic), gradient -A rho = 1.3
    ratios = [1.25, 1.3, 0.75, 1.3]
    log_ratio = torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    loss, clipped = policy_loss(log_ratio, adv, 0.2, clip_high=0.28)
    close(loss, [[-1.25, -1.28, 0.8, 1.3]])
    assert clipped.tolist() == [[False, True, True, False]]
    loss.sum().backward()
    close(log_ratio.grad, [[-1.25, 0.0, 0.0, 1.3]])
    # clip_high=None is the symmetric clip: 1.25 is clipped at 1.2 then.
    loss, clipped = policy_loss(log_ratio.detach(), adv, 0.2)
    close(loss[0, 0], -1.2)
    assert clipped[0, 0]


def test_policy_loss_dual_clip():
    # clip 0.2, dual_clip 3:
    # A = -1, rho = 5: max(5, clip(5) = 1.2) = 5 > -c A = 3 -> bounded at 3.0, clipped, gradient 0
    # A = -1, rho = 2: max(2, 1.2) = 2 <= 3 -> 2.0, not clipped, gradient -A rho = 2
    # A = +1, rho = 5: max(-5, -1.2) = -1.2 (the usual clip; dual-clip only bounds A < 0)
    # A = +1, rho = 0.5: max(-0.5, -0.8) = -0.5, not clipped, gradient -A rho = -0.5
    #   (a bound of -c A = -3 applied to A > 0 would turn these into -3)
    ratios = [5.0, 2.0, 5.0, 0.5]
    log_ratio = torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)
    adv = t([[-1.0, -1.0, 1.0, 1.0]])
    loss, clipped = policy_loss(log_ratio, adv, 0.2, dual_clip=3.0)
    close(loss, [[3.0, 2.0, -1.2, -0.5]])
    assert clipped.tolist() == [[True, False, True, False]] and not clipped.requires_grad
    loss.sum().backward()
    close(log_ratio.grad, [[0.0, 2.0, 0.0, -0.5]])
    # without dual-clip the rho = 5, A = -1 token costs 5
    loss, clipped = policy_loss(log_ratio.detach(), adv, 0.2)
    close(loss, [[5.0, 2.0, -1.2, -0.5]])
    assert clipped.tolist() == [[False, False, True, False]]


def test_gspo_sequence_ratio_value_and_gradient():
    # log pi - log pi_old: row 0 [0.1, 0.3, -0.1] (3 tokens) -> mean 0.3 / 3 = 0.1
    #                      row 1 [0.6, -0.2, pad 5.0] (2 tokens) -> mean 0.4 / 2 = 0.2
    #                      (the pad counted: 5.4 / 3 = 1.8; the mean over T: 0.4 / 3)
    old = t([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]])
    diff = t([[0.1, 0.3, -0.1], [0.6, -0.2, 5.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    lp = (old + diff).requires_grad_(True)
    log_ratio = log_importance_ratio(lp, old, mask, "sequence")
    close(log_ratio[0], [0.1, 0.1, 0.1])
    close(log_ratio[1, :2], [0.2, 0.2])
    close(log_importance_ratio(lp, old, mask, "token"), diff)  # token level: unchanged

    # GSPO: J = sum_i s_i A_i with s_i = exp(mean_t log(pi_t / pi_old_t)):
    #   s_0 = e^0.1 = 1.1051709, s_1 = e^0.2 = 1.2214028; A = [2, -1] (the pad's -1 is junk)
    #   dJ / d log pi_{i,t} = s_i A_i / |y_i|: row 0 2 e^0.1 / 3 = 0.7367806 per token,
    #   row 1 -e^0.2 / 2 = -0.6107014 per valid token, 0 on the pad.
    #   J = 3 * (2 e^0.1) / 3 + 2 * (-e^0.2) / 2 = 2 e^0.1 - e^0.2 = 0.9889390
    adv = t([[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]])
    want_grad = [[2 * math.exp(0.1) / 3] * 3, [-math.exp(0.2) / 2] * 2 + [0.0]]
    total, units = aggregate(torch.exp(log_ratio) * adv, mask, "seq_mean_token_mean")
    close(total, 2 * math.exp(0.1) - math.exp(0.2))
    assert units.item() == 2
    (grad,) = torch.autograd.grad(total, lp)
    close(grad, want_grad)
    assert grad[1, 2] == 0.0
    # Through the clipped loss (both ratios inside the range where it binds: row 0 A > 0 with
    # 1.105 < 1.2; row 1 A < 0 with 1.221 > 1.2 takes the unclipped term): loss = -J.
    per_token, clipped = policy_loss(log_importance_ratio(lp, old, mask, "sequence"), adv, 0.2)
    assert not clipped[mask.bool()].any()
    total, _ = aggregate(per_token, mask, "seq_mean_token_mean")
    (grad,) = torch.autograd.grad(total, lp)
    close(grad, [[-g for g in row] for row in want_grad])
    assert grad[1, 2] == 0.0


# ----------------------------------------------------------------------------- value loss


def test_value_loss_takes_larger_error():
    # c = 0.2, V_old = 1.0.
    # row 0: V = 1.5 -> V_clip = 1.2; R = 2.0: (1.5-2)^2 = 0.25 < (1.2-2)^2 = 0.64 -> clipped worse
    # row 1: V = 0.5 -> V_clip = 0.8; R = 2.0: (0.5-2)^2 = 2.25 > (0.8-2)^2 = 1.44 -> unclipped worse
    loss, clipped = value_loss(t([[1.5]]), t([[1.0]]), t([[2.0]]), clip_range=0.2)
    close(loss, [[0.5 * 0.64]])
    assert clipped.tolist() == [[True]]
    loss, clipped = value_loss(t([[0.5]]), t([[1.0]]), t([[2.0]]), clip_range=0.2)
    close(loss, [[0.5 * 2.25]])
    assert clipped.tolist() == [[False]]
    # Both together plus a junk pad: 0.5 * (0.64 + 2.25) / 2.
    loss, clipped = value_loss(t([[1.5, 0.5, 50.0]]), t([[1.0, 1.0, 0.0]]), t([[2.0, 2.0, -9.0]]), 0.2)
    mask = t([[1, 1, 0]])
    close(token_mean(loss, mask), 0.5 * (0.64 + 2.25) / 2)
    close(token_mean(clipped.float(), mask), 0.5)


# ----------------------------------------------------------------------------- aggregation


def test_loss_aggregation_modes_by_hand():
    # row 0: tokens [1, 2, 3]; row 1: [10]; row 2: no token (a pad holding NaN must not leak).
    x = t([[1.0, 2.0, 3.0], [10.0, 99.0, 99.0], [float("nan"), 5.0, 5.0]])
    mask = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    total, units = aggregate(x, mask, "token_mean")
    close(total, 16.0)  # token mean 16 / 4 = 4
    assert units.item() == 4 and units.dtype == torch.int32
    total, units = aggregate(x, mask, "seq_mean_token_mean")
    close(total, 2.0 + 10.0)  # sequence means 2 and 10 -> 6
    assert units.item() == 2
    total, units = aggregate(x, mask, "seq_mean_token_sum")
    close(total, 6.0 + 10.0)  # sequence sums 6 and 10 -> 8
    assert units.item() == 2
    with pytest.raises(ValueError, match=r"rl\.loss_aggregation"):
        aggregate(x, mask, "mean")


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_aggregation_is_a_global_mean_over_any_split(mode):
    """Summed (total, units) of any row split give the loss of the whole batch, and so its
    gradient: what megatron's per-token loss path computes across microbatches and ranks."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([9, 1, 7, 2, 8, 1])
    mask = (torch.arange(9) < lengths[:, None]).float()
    x = torch.randn(6, 9, generator=g, requires_grad=True)
    total, units = aggregate(x, mask, mode)
    whole = torch.autograd.grad(total / units, x)[0]
    for split in ([1] * 6, [2, 2, 2], [4, 2]):
        parts = [aggregate(xs, ms, mode) for xs, ms in zip(x.split(split), mask.split(split))]
        loss = sum(p[0] for p in parts) / sum(p[1] for p in parts)
        close(loss, (total / units).item())
        torch.testing.assert_close(torch.autograd.grad(loss, x)[0], whole, rtol=1e-6, atol=1e-7)
    # a mean of per-microbatch means (the old way) weighs the short rows more
    if mode == "token_mean":
        naive = sum(p[0] / p[1] for p in (aggregate(xs, ms, mode) for xs, ms in zip(x.split(2), mask.split(2)))) / 3
        assert abs(naive.item() - (total / units).item()) > 1e-3


# ----------------------------------------------------------------------------- KL in the loss


def expected_kl_loss_gradient(estimator: str):
    """Exact E_{a ~ pi_old}[grad k(a)] at pi = pi_old on a 6-way categorical (what the KL term
    of the loss contributes in expectation on the first PPO step), and the two true KLs' gradients."""
    g = torch.Generator().manual_seed(3)
    theta = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    logp = torch.log_softmax(theta, 0)
    sampled_from = logp.exp().detach()
    estimate = (sampled_from * kl_estimate(logp, ref, estimator)).sum()
    forward_kl = (logp.exp() * (logp - ref)).sum()   # KL(pi || ref)
    reverse_kl = (ref.exp() * (ref - logp)).sum()    # KL(ref || pi)
    grads = [torch.autograd.grad(v, theta, retain_graph=True)[0] for v in (estimate, forward_kl, reverse_kl)]
    return grads


def test_kl_estimator_gradients_in_the_loss():
    # k1: zero expected gradient (E_pi[grad log pi] = 0): no regularisation, refused by config.
    k1, forward, _ = expected_kl_loss_gradient("k1")
    assert forward.abs().max() > 1e-2
    torch.testing.assert_close(k1, torch.zeros_like(k1), atol=1e-12, rtol=0)
    # k2: exactly the gradient of KL(pi || ref).
    k2, forward, reverse = expected_kl_loss_gradient("k2")
    torch.testing.assert_close(k2, forward, atol=1e-12, rtol=1e-10)
    assert (k2 - reverse).abs().max() > 1e-2
    # k3: the gradient of the reverse KL(ref || pi): GRPO's convention.
    k3, forward, reverse = expected_kl_loss_gradient("k3")
    torch.testing.assert_close(k3, reverse, atol=1e-12, rtol=1e-10)
    assert (k3 - forward).abs().max() > 1e-2


def test_kl_clip_bounds_each_token():
    lp, ref = t([[0.0, 0.0, 0.0]]), t([[-20.0, 20.0, -0.1]])
    close(kl_estimate(lp, ref, "k1", clip=10.0), [[10.0, -10.0, 0.1]])
    close(kl_estimate(lp, ref, "k3", clip=10.0)[0, 2], math.exp(-0.1) - 1 + 0.1)
    assert kl_estimate(lp, ref, "k3", clip=10.0).max() == 10.0
    assert kl_estimate(lp, ref, "k3").max() > 1e8  # unbounded without the clip


def estimators_accepted(kl_in_reward: bool) -> list[str]:
    """The KL estimators the config accepts with the KL in the reward or in the loss."""
    accepted = []
    for estimator in KL_ESTIMATORS:
        overrides = [f"rl.kl_in_reward={str(kl_in_reward).lower()}", f"rl.kl_estimator={estimator}"]
        try:
            validate(load_config(PIPELINES / "tiny_cpu.yaml", overrides))
        except ConfigError:
            continue
        accepted.append(estimator)
    return accepted


def policy_batch():
    """Two rows of unequal lengths, their first positions prompt tokens (mask 0): the actor's
    log-prob of -100 at (0, 0) is a prompt token's, while the reference's is 0 there (masked)."""
    g = torch.Generator().manual_seed(5)
    mask = t([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]])
    logprobs = -1.0 + 0.3 * torch.randn(2, 6, generator=g)
    logprobs[0, 0] = -100.0
    batch = {"tokens": torch.zeros(2, 6, dtype=torch.long), "mask": mask,
             "old_logprobs": (logprobs + 0.1 * torch.randn(2, 6, generator=g)) * mask,
             "ref_logprobs": (logprobs + 0.5 * torch.randn(2, 6, generator=g)) * mask,
             "advantages": torch.randn(2, 6, generator=g) * mask}
    return logprobs, batch


@pytest.mark.parametrize("clip", [10.0, None])
@pytest.mark.parametrize("site", ["loss", "reward"])
def test_kl_of_a_masked_prompt_token_leaves_gradients_finite(site, clip):
    """k3 at a prompt token with log p = -100 was exp(100) = inf in fp32: masked away in the
    forward, but 0 * inf = NaN in the backward (and the clamp's zero gradient does not help). The
    gradients must be finite and those of the same batch with that (masked) position removed."""
    estimators = estimators_accepted(kl_in_reward=site == "reward")
    assert "k3" in estimators and (site == "reward") == ("k1" in estimators)  # k1 is refused in the loss
    for estimator in estimators:
        rl = RLConfig(kl_in_reward=site == "reward", kl_estimator=estimator, kl_clip=clip)

        def gradient(columns):
            logprobs, batch = policy_batch()
            logprobs = logprobs[:, columns].clone().requires_grad_()
            batch = {k: v[:, columns] for k, v in batch.items()}
            if site == "loss":
                loss, units, _ = actor_loss({"logprobs": logprobs, "entropy": torch.zeros_like(logprobs)}, batch,
                                            rl, kl_coef=0.1)
                value = loss / units
            else:  # the estimate the reward uses (add_advantages), differentiated to see what it would pass on
                value = kl_estimate(logprobs, batch["ref_logprobs"], estimator, clip, batch["mask"]).sum()
            value.backward()
            return value.detach(), logprobs.grad

        value, grad = gradient(slice(None))
        assert torch.isfinite(value) and torch.isfinite(grad).all(), (estimator, grad)
        removed_value, removed_grad = gradient(slice(1, None))  # column 0 is masked in both rows
        torch.testing.assert_close(value, removed_value)
        torch.testing.assert_close(grad[:, 1:], removed_grad)
        assert (grad[:, 0] == 0).all()


def k3_bound_below(clip: float) -> float:
    """-y where k3(-y) = exp(y) - 1 - y = clip: y = log(clip + 1 + y), a contraction (slope
    1 / (clip + 1 + y) < 1/11 for clip 10) iterated to convergence."""
    y = 1.0
    for _ in range(60):
        y = math.log(clip + 1.0 + y)
    return -y


def test_kl_clip_in_the_loss_bounds_the_gradient_instead_of_zeroing_it():
    # clip 10, log ratio below the bound (-6, -60, -1000: log pi far below log pi_ref):
    #   k2: bound -sqrt(2 * 10) = -4.4721; value 10, gradient k2'(bound) = bound = -4.4721;
    #   k3: bound -y with exp(y) = 11 + y (y = 2.6109); value 10, gradient
    #       k3'(bound) = 1 - exp(y) = 1 - (11 + y) = -(10 + y) = -12.6109.
    # The reward-side estimate keeps the clamp: value 10, gradient 0 (no gradient flows there).
    y = -k3_bound_below(10.0)
    slope = {"k2": -math.sqrt(20.0), "k3": -(10.0 + y)}
    for estimator in ("k2", "k3"):
        lp = t([[-6.0, -60.0, -1000.0]]).requires_grad_()
        kl = kl_loss_estimate(lp, torch.zeros(1, 3), estimator, clip=10.0)
        (grad,) = torch.autograd.grad(kl.sum(), lp)
        close(kl, [[10.0, 10.0, 10.0]], tol=1e-4)
        close(grad, [[slope[estimator]] * 3], tol=1e-4)
        lp = t([[-6.0]]).requires_grad_()
        reward_side = kl_estimate(lp, torch.zeros(1, 1), estimator, clip=10.0)
        assert reward_side.item() == 10.0 and torch.autograd.grad(reward_side.sum(), lp)[0].item() == 0.0
    # k2 above the bound: gradient +4.4721; k3 above (log ratio > 11.0): 1 - exp(-11) = 0.99998.
    lp = t([[6.0]]).requires_grad_()
    close(torch.autograd.grad(kl_loss_estimate(lp, t([[0.0]]), "k2", 10.0).sum(), lp)[0], [[math.sqrt(20.0)]])
    lp = t([[12.0]]).requires_grad_()
    close(torch.autograd.grad(kl_loss_estimate(lp, t([[0.0]]), "k3", 10.0).sum(), lp)[0], [[1 - math.exp(-11.0)]],
          tol=1e-4)
    # Inside the bounds it is the plain estimator: log ratio -1, k3 = e - 1 - 1 = 0.71828, slope 1 - e = -1.71828.
    lp = t([[-1.0]]).requires_grad_()
    kl = kl_loss_estimate(lp, t([[0.0]]), "k3", 10.0)
    close(kl, [[math.e - 2.0]])
    close(torch.autograd.grad(kl.sum(), lp)[0], [[1.0 - math.e]])


# ----------------------------------------------------------------------------- diagnostics


def test_explained_variance():
    returns, mask = t([[1.0, 2.0, 3.0, 0.0]]), t([[1, 1, 1, 0]])

    def ev(values):
        return explained_variance(masked_var(returns - values, mask), masked_var(returns, mask)).item()

    assert ev(returns.clone()) == pytest.approx(1.0)
    assert ev(t([[2.0, 2.0, 2.0, 9.0]])) == pytest.approx(0.0, abs=1e-6)
    # residual [0, 0, 1]: var 1/3 (unbiased); var(returns) = 1 -> 1 - 1/3 = 2/3
    assert ev(t([[1.0, 2.0, 2.0, 0.0]])) == pytest.approx(2 / 3, abs=1e-6)
    constant = masked_var(t([[4.0, 4.0]]), t([[1, 1]]))
    assert math.isnan(explained_variance(constant, constant).item())


def test_response_repetition_rate():
    # [1,2,1,2]: bigrams (1,2),(2,1),(1,2) -> 1 - 2/3 = 1/3;  [5,5,5]: (5,5),(5,5) -> 1 - 1/2 = 1/2
    # [1,2,3]: 0;  [7]: fewer than 2 tokens -> 0.   mean = (1/3 + 1/2) / 4 = 5/24
    rate = response_repetition_rate([[1, 2, 1, 2], [5, 5, 5], [1, 2, 3], [7]])
    assert rate == pytest.approx(5 / 24)
    assert response_repetition_rate([]) == 0.0


def reported_means(loss_fn, outputs: dict, batch: dict, splits: list[list[int]]) -> dict[str, float]:
    """What a role's train_step reports: each microbatch's loss, units and stats summed over the
    split (megatron's schedule and the data-parallel sum), then stat_means."""
    totals: dict[str, float] = {}
    for rows in splits:
        loss, units, stats = loss_fn({k: v[rows] for k, v in outputs.items()}, {k: v[rows] for k, v in batch.items()})
        for name, value in {"loss": loss, "units": units, **stats}.items():
            totals[name] = totals.get(name, 0.0) + float(value)
    return stat_means(totals)


def test_diagnostics_are_token_means_whatever_the_loss_aggregation():
    # Row 0: 10 tokens, ratio 1.5 on the first 4 (clipped: A = 1 > 0, 1.5 > 1 + 0.2), 1 on the rest;
    # row 1: 2 tokens, both ratio 1.5 (clipped). Entropy 0.7 on row 0, 0.1 on row 1.
    # Diagnostics: clip_fraction 6 / 12 = 0.5, entropy (7 + 0.2) / 12 = 0.6, ratio_mean
    # (6 * 1.5 + 6) / 12 = 1.25, policy_loss (-1.2 * 6 - 1 * 6) / 12 = -1.1,
    # old_logprob_mismatch 6 * log(1.5) / 12 = 0.2027, in every mode.
    # The loss keeps its aggregation: per-token policy loss -1.2 (clipped) or -1;
    # row sums -10.8 and -2.4, row means -1.08 and -1.2:
    #   token_mean -13.2 / 12 = -1.1; seq_mean_token_mean -2.28 / 2 = -1.14; seq_mean_token_sum -13.2 / 2 = -6.6.
    # Critic: V - V_old = 0.5 on the 6 tokens of ratio 1.5 (clipped at 0.2, returns 2 away), 0 elsewhere:
    # value_clip_fraction 0.5.
    mask = torch.zeros(2, 11)
    mask[0, 1:11], mask[1, 1:3] = 1.0, 1.0
    drifted = torch.zeros(2, 11, dtype=torch.bool)
    drifted[0, 1:5], drifted[1, 1:3] = True, True
    old = -torch.ones(2, 11) * mask
    outputs = {"logprobs": old + math.log(1.5) * drifted, "entropy": t([[0.7] * 11, [0.1] * 11]),
               "values": 0.5 * drifted.float()}
    batch = {"tokens": torch.zeros(2, 11, dtype=torch.long), "mask": mask, "old_logprobs": old,
             "ref_logprobs": old, "advantages": mask.clone(), "values": torch.zeros(2, 11),
             "returns": 2.0 * mask}
    expected_loss = {"token_mean": -1.1, "seq_mean_token_mean": -1.14, "seq_mean_token_sum": -6.6}
    for mode in LOSS_AGGREGATIONS:
        rl = RLConfig(loss_aggregation=mode)
        for splits in ([[0, 1]], [[0], [1]]):
            actor = reported_means(partial(actor_loss, rl=rl, kl_coef=0.0), outputs, batch, splits)
            assert actor["clip_fraction"] <= 1.0
            close(actor["clip_fraction"], 0.5)
            close(actor["entropy"], 0.6)
            close(actor["ratio_mean"], 1.25)
            close(actor["policy_loss"], -1.1)
            close(actor["old_logprob_mismatch"], 0.5 * math.log(1.5))
            close(actor["loss"], expected_loss[mode])
            critic = reported_means(partial(critic_loss, rl=rl), outputs, batch, splits)
            close(critic["value_clip_fraction"], 0.5)


def test_old_logprob_mismatch_is_the_first_train_steps():
    # Steps 2 and 3 run after updates: their |log pi - log pi_old| is the policy's drift, not the
    # old log-probs' error; the other statistics are means over the steps that report them.
    steps = [{"old_logprob_mismatch": 1e-3, "approx_kl": 0.1, "actor_loss": 1.0}, {"value_loss": 2.0},
             {"old_logprob_mismatch": 5e-2, "approx_kl": 0.3, "actor_loss": 3.0}]
    assert step_means(steps) == pytest.approx({"old_logprob_mismatch": 1e-3, "approx_kl": 0.2, "actor_loss": 2.0,
                                               "value_loss": 2.0})


# ----------------------------------------------------------------------------- KL controllers


def test_adaptive_kl_controller_update_numbers():
    ctl = make_kl_controller("adaptive", init_kl_coef=0.1, target=6.0, horizon=10000)
    # kl 12: 12/6 - 1 = 1 -> clipped to 0.2; mult = 1 + 0.2 * 256 / 10000 = 1.00512
    ctl.update(12.0, n_steps=256)
    assert ctl.value == pytest.approx(0.1 * 1.00512)
    # kl 3 (below target): 3/6 - 1 = -0.5 -> -0.2; mult = 1 - 0.2 * 256 / 10000 = 0.99488
    ctl = AdaptiveKLController(0.1, 6.0, 10000)
    ctl.update(3.0, n_steps=256)
    assert ctl.value == pytest.approx(0.1 * 0.99488)
    assert ctl.value < 0.1
    # kl 6.6 (inside the clip): 0.1 -> mult = 1 + 0.1 * 256 / 10000 = 1.00256
    ctl = AdaptiveKLController(0.1, 6.0, 10000)
    ctl.update(6.6, n_steps=256)
    assert ctl.value == pytest.approx(0.1 * 1.00256)


def test_kl_controllers_state_dict_round_trip():
    ctl = AdaptiveKLController(0.1, 6.0, 10000)
    for kl in (12.0, 9.0, 1.0):
        ctl.update(kl, 64)
    fresh = AdaptiveKLController(0.1, 6.0, 10000)
    fresh.load_state_dict(ctl.state_dict())
    assert fresh.value == ctl.value
    fresh.update(7.0, 64)
    ctl.update(7.0, 64)
    assert fresh.value == ctl.value

    fixed = make_kl_controller("fixed", 0.05, target=6.0, horizon=10000)
    assert isinstance(fixed, FixedKLController)
    fixed.update(100.0, 256)
    assert fixed.value == 0.05
    other = FixedKLController(0.2)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.05


def test_unknown_kl_controller_names_config_field():
    with pytest.raises(ValueError, match=r"rl\.kl_controller.*fixed.*adaptive"):
        make_kl_controller("pid", 0.1, 6.0, 10000)
