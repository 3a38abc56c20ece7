"""PPO math checked against numbers worked out by hand (megatron_rlhf/algorithms/ppo.py)."""

import math

import pytest
import torch

from megatron_rlhf.algorithms import ppo


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
    close(ppo.kl_estimate(lp, ref, "k1"), [[0.4, -0.5]])
    close(ppo.kl_estimate(lp, ref, "k2"), [[0.08, 0.125]])
    close(ppo.kl_estimate(lp, ref, "k3"), [[0.0703200460, 0.1487212707]])
    # k3 is zero where the policies agree and never negative.
    close(ppo.kl_estimate(t([[-1.0]]), t([[-1.0]]), "k3"), [[0.0]])
    assert (ppo.kl_estimate(torch.randn(4, 8), torch.randn(4, 8), "k3") >= 0).all()


def test_unknown_kl_estimator_names_config_field():
    with pytest.raises(ValueError, match=r"ppo\.kl_estimator.*k1.*k2.*k3"):
        ppo.kl_estimate(t([[0.0]]), t([[0.0]]), "k4")


# ----------------------------------------------------------------------------- token rewards


def test_checklist_kl_penalty_examples():
    # actor -1.2, reference -1.6, beta 0.05: k1 = 0.4, reward = -0.05 * 0.4 = -0.02
    kl = ppo.kl_estimate(t([[-1.2]]), t([[-1.6]]), "k1")
    close(kl, [[0.4]])
    close(ppo.token_rewards(kl, t([0.0]), t([[1.0]]), kl_coef=0.05), [[-0.02]])
    # actor -2.0, reference -2.4, beta 0.1: k1 = 0.4, reward = -0.1 * 0.4 = -0.04
    kl = ppo.kl_estimate(t([[-2.0]]), t([[-2.4]]), "k1")
    close(ppo.token_rewards(kl, t([0.0]), t([[1.0]]), kl_coef=0.1), [[-0.04]])


def test_token_rewards_score_at_last_valid_token_with_right_padding():
    # kl = 0.1 on real tokens (9.0 junk on pads), kl_coef 0.5 -> -0.05 per real token.
    kl = t([[0.1, 0.1, 0.1, 9.0], [0.1, 0.1, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    r = ppo.token_rewards(kl, t([1.0, 2.0, 5.0]), mask, kl_coef=0.5)
    close(r, [[-0.05, -0.05, 0.95, 0.0], [-0.05, 1.95, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


# ----------------------------------------------------------------------------- GAE


def test_gae_gamma1_lam095_hand_computed():
    # r = [0, 0, 1], V = [0.5, 0.6, 0.7], V after the last token = 0.
    # t=2: delta = 1 + 0 - 0.7 = 0.3;              A2 = 0.3
    # t=1: delta = 0 + 0.7 - 0.6 = 0.1;            A1 = 0.1 + 0.95 * 0.3   = 0.385
    # t=0: delta = 0 + 0.6 - 0.5 = 0.1;            A0 = 0.1 + 0.95 * 0.385 = 0.46575
    # returns = A + V = [0.96575, 0.985, 1.0]
    adv, ret = ppo.gae(t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]]), gamma=1.0, lam=0.95)
    close(adv, [[0.46575, 0.385, 0.3]])
    close(ret, [[0.96575, 0.985, 1.0]])


def test_gae_gamma09_lam05_hand_computed():
    # gamma * lam = 0.45
    # t=2: delta = 1 - 0.7 = 0.3;                  A2 = 0.3
    # t=1: delta = 0.9 * 0.7 - 0.6 = 0.03;         A1 = 0.03 + 0.45 * 0.3   = 0.165
    # t=0: delta = 0.9 * 0.6 - 0.5 = 0.04;         A0 = 0.04 + 0.45 * 0.165 = 0.11425
    adv, ret = ppo.gae(t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]]), gamma=0.9, lam=0.5)
    close(adv, [[0.11425, 0.165, 0.3]])
    close(ret, [[0.61425, 0.765, 1.0]])


def test_gae_padding_does_not_leak():
    # Same 3-token row, then 2 pads holding junk rewards and values; batched with a full row.
    rewards = t([[0, 0, 1, 3.0, -7.0], [0.1, 0.2, 0.3, 0.4, 0.5]])
    values = t([[0.5, 0.6, 0.7, 5.0, 11.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    mask = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    adv, ret = ppo.gae(rewards, values, mask, gamma=1.0, lam=0.95)
    ref_adv, ref_ret = ppo.gae(t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]]), 1.0, 0.95)
    close(adv[0, :3], ref_adv[0])
    close(ret[0, :3], ref_ret[0])
    close(adv[0, 3:], [0.0, 0.0])
    close(ret[0, 3:], [0.0, 0.0])
    # The full row is unaffected by its batch neighbour's padding.
    solo_adv, _ = ppo.gae(rewards[1:], values[1:], mask[1:], 1.0, 0.95)
    close(adv[1:], solo_adv)


# ----------------------------------------------------------------------------- whitening


def test_masked_whiten():
    x = t([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -50.0, 7.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    w = ppo.masked_whiten(x, mask)
    close(ppo.masked_mean(w, mask), 0.0)
    close(ppo.masked_var(w, mask), 1.0, tol=1e-4)
    close(w * (1 - mask), torch.zeros_like(w))
    # The pads' 100 / -50 / 7 did not enter: mean of [1..5] is 3, so x=3 whitens to 0.
    close(w[0, 2], 0.0)
    kept = ppo.masked_whiten(x, mask, shift_mean=False)
    close(ppo.masked_mean(kept, mask), 3.0)
    close(ppo.masked_var(kept, mask), 1.0, tol=1e-4)
    close(kept * (1 - mask), torch.zeros_like(kept))


@pytest.mark.parametrize("value", [0.7, 0.1, -3.3])
def test_whitening_constant_advantages_is_zero_not_nan(value):
    # 64 x 48 tokens of one value: E[x^2] - mean^2 in float32 gave a negative variance (NaN)
    # for 0.7 and an 11,000x spurious scale for 0.1.
    x, mask = torch.full((64, 48), value), torch.ones(64, 48)
    assert ppo.masked_var(x, mask) == 0.0
    w = ppo.masked_whiten(x, mask)
    assert torch.isfinite(w).all() and w.abs().max() == 0.0


def test_whitening_near_constant_matches_float64_formula():
    g = torch.Generator().manual_seed(1)
    x = (0.7 + 1e-4 * torch.randn(64, 48, generator=g, dtype=torch.float64)).float()
    mask = (torch.rand(64, 48, generator=g) > 0.2).float()
    x64, valid = x.double()[mask.bool()], mask.bool()
    want = (x.double() - x64.mean()) / torch.sqrt(x64.var() + 1e-8) * mask
    torch.testing.assert_close(ppo.masked_whiten(x, mask).double(), want, rtol=1e-5, atol=1e-6)
    from megatron_rlhf.parallel.collectives import masked_moments

    count, mean, var = masked_moments(x, mask)  # the trainer's path (one process here)
    assert count.item() == valid.sum().item()
    torch.testing.assert_close(var, x64.var(), rtol=1e-9, atol=0)
    torch.testing.assert_close(ppo.whiten(x, mask, mean, var).double(), want, rtol=1e-5, atol=1e-6)


def test_masked_var_hand_values():
    # [1, 2, 3, 4, 5]: mean 3, sum of squares 10 -> biased 2.0, unbiased 2.5.
    x, mask = t([[1, 2, 3, 9.0], [4, 5, 9.0, 9.0]]), t([[1, 1, 1, 0], [1, 1, 0, 0]])
    close(ppo.masked_mean(x, mask), 3.0)
    close(ppo.masked_var(x, mask), 2.5)
    close(ppo.masked_var(x, mask, unbiased=False), 2.0)
    assert ppo.masked_var(x, mask).dtype == torch.float64


# ----------------------------------------------------------------------------- policy loss


def token_mean(per_token, mask):
    total, units = ppo.aggregate(per_token, mask, "token_mean")
    return total / units


def test_checklist_policy_clip_positive_advantage():
    # old prob 0.10, new 0.13 -> rho = 1.3; eps 0.2, A = 2: rho*A = 2.6, clip(rho)*A = 1.2*2 = 2.4,
    # min = 2.4 -> loss = -2.4, and the clipped term was the active one.
    lp, old = t([[math.log(0.13)]]), t([[math.log(0.10)]])
    loss, clipped = ppo.policy_loss(lp, old, t([[2.0]]), clip_eps=0.2)
    close(loss, [[-2.4]])
    assert clipped.tolist() == [[True]] and not clipped.requires_grad


def test_policy_clip_negative_advantage():
    # rho = 0.5 < 1 - eps, A = -1: -A*rho = 0.5, -A*clip = 0.8 -> loss 0.8 (clipped active).
    loss, clipped = ppo.policy_loss(t([[math.log(0.5)]]), t([[0.0]]), t([[-1.0]]), 0.2)
    close(loss, [[0.8]])
    assert clipped.tolist() == [[True]]
    # rho = 1.5, A = -1: -A*rho = 1.5 > -A*clip = 1.2 -> unclipped is pessimistic, not clipped.
    loss, clipped = ppo.policy_loss(t([[math.log(1.5)]]), t([[0.0]]), t([[-1.0]]), 0.2)
    close(loss, [[1.5]])
    assert clipped.tolist() == [[False]]


def test_policy_loss_gradient_zero_on_clipped_tokens():
    # tokens: (A=2, rho=1.3) clipped; (A=2, rho=1.1) free; (A=-1, rho=1.3) free; (A=-1, rho=0.5)
    # clipped; a 5th padded token. d loss / d logprob_i = -A_i * rho_i / 4 on free tokens.
    ratios = [1.3, 1.1, 1.3, 0.5, 2.0]
    lp = torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)
    adv, mask = t([[2.0, 2.0, -1.0, -1.0, 5.0]]), t([[1, 1, 1, 1, 0]])
    per_token, clipped = ppo.policy_loss(lp, torch.zeros(1, 5), adv, clip_eps=0.2)
    loss = token_mean(per_token, mask)
    loss.backward()
    close(lp.grad, [[0.0, -2.0 * 1.1 / 4, 1.3 / 4, 0.0, 0.0]])
    close(token_mean(clipped.float(), mask), 0.5)
    # loss = mean(-2.4, -2.2, 1.3, 0.8) = -2.5 / 4
    close(loss, -2.5 / 4)


# ----------------------------------------------------------------------------- value loss


def test_value_loss_takes_larger_error():
    # c = 0.2, V_old = 1.0.
    # row 0: V = 1.5 -> V_clip = 1.2; R = 2.0: (1.5-2)^2 = 0.25 < (1.2-2)^2 = 0.64 -> clipped worse
    # row 1: V = 0.5 -> V_clip = 0.8; R = 2.0: (0.5-2)^2 = 2.25 > (0.8-2)^2 = 1.44 -> unclipped worse
    loss, clipped = ppo.value_loss(t([[1.5]]), t([[1.0]]), t([[2.0]]), clip_range=0.2)
    close(loss, [[0.5 * 0.64]])
    assert clipped.tolist() == [[True]]
    loss, clipped = ppo.value_loss(t([[0.5]]), t([[1.0]]), t([[2.0]]), clip_range=0.2)
    close(loss, [[0.5 * 2.25]])
    assert clipped.tolist() == [[False]]
    # Both together plus a junk pad: 0.5 * (0.64 + 2.25) / 2.
    loss, clipped = ppo.value_loss(t([[1.5, 0.5, 50.0]]), t([[1.0, 1.0, 0.0]]), t([[2.0, 2.0, -9.0]]), 0.2)
    mask = t([[1, 1, 0]])
    close(token_mean(loss, mask), 0.5 * (0.64 + 2.25) / 2)
    close(token_mean(clipped.float(), mask), 0.5)


# ----------------------------------------------------------------------------- aggregation


def test_loss_aggregation_modes_by_hand():
    # row 0: tokens [1, 2, 3]; row 1: [10]; row 2: no token (a pad holding NaN must not leak).
    x = t([[1.0, 2.0, 3.0], [10.0, 99.0, 99.0], [float("nan"), 5.0, 5.0]])
    mask = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    total, units = ppo.aggregate(x, mask, "token_mean")
    close(total, 16.0)  # token mean 16 / 4 = 4
    assert units.item() == 4 and units.dtype == torch.int32
    total, units = ppo.aggregate(x, mask, "seq_mean_token_mean")
    close(total, 2.0 + 10.0)  # sequence means 2 and 10 -> 6
    assert units.item() == 2
    total, units = ppo.aggregate(x, mask, "seq_mean_token_sum")
    close(total, 6.0 + 10.0)  # sequence sums 6 and 10 -> 8
    assert units.item() == 2
    with pytest.raises(ValueError, match=r"ppo\.loss_aggregation"):
        ppo.aggregate(x, mask, "mean")


@pytest.mark.parametrize("mode", ppo.LOSS_AGGREGATIONS)
def test_aggregation_is_a_global_mean_over_any_split(mode):
    """Summed (total, units) of any row split give the loss of the whole batch, and so its
    gradient: what megatron's per-token loss path computes across microbatches and ranks."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([9, 1, 7, 2, 8, 1])
    mask = (torch.arange(9) < lengths[:, None]).float()
    x = torch.randn(6, 9, generator=g, requires_grad=True)
    total, units = ppo.aggregate(x, mask, mode)
    whole = torch.autograd.grad(total / units, x)[0]
    for split in ([1] * 6, [2, 2, 2], [4, 2]):
        parts = [ppo.aggregate(xs, ms, mode) for xs, ms in zip(x.split(split), mask.split(split))]
        loss = sum(p[0] for p in parts) / sum(p[1] for p in parts)
        close(loss, (total / units).item())
        torch.testing.assert_close(torch.autograd.grad(loss, x)[0], whole, rtol=1e-6, atol=1e-7)
    # a mean of per-microbatch means (the old way) weighs the short rows more
    if mode == "token_mean":
        naive = sum(p[0] / p[1] for p in (ppo.aggregate(xs, ms, mode) for xs, ms in zip(x.split(2), mask.split(2)))) / 3
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
    estimate = (sampled_from * ppo.kl_estimate(logp, ref, estimator)).sum()
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
    close(ppo.kl_estimate(lp, ref, "k1", clip=10.0), [[10.0, -10.0, 0.1]])
    close(ppo.kl_estimate(lp, ref, "k3", clip=10.0)[0, 2], math.exp(-0.1) - 1 + 0.1)
    assert ppo.kl_estimate(lp, ref, "k3", clip=10.0).max() == 10.0
    assert ppo.kl_estimate(lp, ref, "k3").max() > 1e8  # unbounded without the clip


# ----------------------------------------------------------------------------- diagnostics


def test_explained_variance():
    returns, mask = t([[1.0, 2.0, 3.0, 0.0]]), t([[1, 1, 1, 0]])

    def ev(values):
        return ppo.explained_variance(ppo.masked_var(returns - values, mask), ppo.masked_var(returns, mask)).item()

    assert ev(returns.clone()) == pytest.approx(1.0)
    assert ev(t([[2.0, 2.0, 2.0, 9.0]])) == pytest.approx(0.0, abs=1e-6)
    # residual [0, 0, 1]: var 1/3 (unbiased); var(returns) = 1 -> 1 - 1/3 = 2/3
    assert ev(t([[1.0, 2.0, 2.0, 0.0]])) == pytest.approx(2 / 3, abs=1e-6)
    constant = ppo.masked_var(t([[4.0, 4.0]]), t([[1, 1]]))
    assert math.isnan(ppo.explained_variance(constant, constant).item())


def test_response_repetition_rate():
    # [1,2,1,2]: bigrams (1,2),(2,1),(1,2) -> 1 - 2/3 = 1/3;  [5,5,5]: (5,5),(5,5) -> 1 - 1/2 = 1/2
    # [1,2,3]: 0;  [7]: fewer than 2 tokens -> 0.   mean = (1/3 + 1/2) / 4 = 5/24
    rate = ppo.response_repetition_rate([[1, 2, 1, 2], [5, 5, 5], [1, 2, 3], [7]])
    assert rate == pytest.approx(5 / 24)
    assert ppo.response_repetition_rate([]) == 0.0


# ----------------------------------------------------------------------------- KL controllers


def test_adaptive_kl_controller_update_numbers():
    ctl = ppo.make_kl_controller("adaptive", init_kl_coef=0.1, target=6.0, horizon=10000)
    # kl 12: 12/6 - 1 = 1 -> clipped to 0.2; mult = 1 + 0.2 * 256 / 10000 = 1.00512
    ctl.update(12.0, n_steps=256)
    assert ctl.value == pytest.approx(0.1 * 1.00512)
    # kl 3 (below target): 3/6 - 1 = -0.5 -> -0.2; mult = 1 - 0.2 * 256 / 10000 = 0.99488
    ctl = ppo.AdaptiveKLController(0.1, 6.0, 10000)
    ctl.update(3.0, n_steps=256)
    assert ctl.value == pytest.approx(0.1 * 0.99488)
    assert ctl.value < 0.1
    # kl 6.6 (inside the clip): 0.1 -> mult = 1 + 0.1 * 256 / 10000 = 1.00256
    ctl = ppo.AdaptiveKLController(0.1, 6.0, 10000)
    ctl.update(6.6, n_steps=256)
    assert ctl.value == pytest.approx(0.1 * 1.00256)


def test_kl_controllers_state_dict_round_trip():
    ctl = ppo.AdaptiveKLController(0.1, 6.0, 10000)
    for kl in (12.0, 9.0, 1.0):
        ctl.update(kl, 64)
    fresh = ppo.AdaptiveKLController(0.1, 6.0, 10000)
    fresh.load_state_dict(ctl.state_dict())
    assert fresh.value == ctl.value
    fresh.update(7.0, 64)
    ctl.update(7.0, 64)
    assert fresh.value == ctl.value

    fixed = ppo.make_kl_controller("fixed", 0.05, target=6.0, horizon=10000)
    assert isinstance(fixed, ppo.FixedKLController)
    fixed.update(100.0, 256)
    assert fixed.value == 0.05
    other = ppo.FixedKLController(0.2)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.05


def test_unknown_kl_controller_names_config_field():
    with pytest.raises(ValueError, match=r"ppo\.kl_controller.*fixed.*adaptive"):
        ppo.make_kl_controller("pid", 0.1, 6.0, 10000)
