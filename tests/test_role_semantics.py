"""Role outputs mean what the trainers assume: shifted next-token log-probs of
temperature-scaled logits with padded vocabulary excluded, entropy of the same
distribution, reward at the last non-pad token, a frozen reference, dropout off."""

import math

import pytest
import torch

from distributed import TINY_MODEL, torchrun
from workers.role_semantics import TEMPERATURE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    out = tmp_path_factory.mktemp("semantics") / "res.pt"
    torchrun(1, "tests/workers/role_semantics.py", f"--out={out}", *TINY_MODEL)
    return torch.load(out, weights_only=False)


def test_logprobs_are_next_token_logprobs_of_scaled_logits(res):
    logits, tokens, vocab = res["logits"], res["tokens"], res["vocab"]
    assert logits.size(-1) > vocab  # padded vocabulary: the test must see padding excluded
    logp = torch.log_softmax(logits[..., :vocab] / TEMPERATURE, dim=-1)
    want = logp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(res["logprobs"][:, :-1], want, atol=1e-5, rtol=0)
    assert torch.all(res["logprobs"][:, -1] == 0)


def test_entropy_of_the_same_distribution(res):
    logp = torch.log_softmax(res["logits"][..., : res["vocab"]] / TEMPERATURE, dim=-1)
    want = -(logp.exp() * logp).sum(-1)[:, :-1]
    torch.testing.assert_close(res["entropy"][:, :-1], want, atol=1e-5, rtol=0)


def test_reward_is_the_value_at_the_last_non_pad_token(res):
    last = res["lengths"] - 1
    want = res["values"][torch.arange(len(last)), last]
    torch.testing.assert_close(res["rewards"], want, atol=1e-6, rtol=0)
    assert len(set(res["rewards"].tolist())) == len(last)


def test_value_head_init(res):
    weight = res["head_weight"]
    assert weight.shape == (1, 64)
    assert torch.all(res["head_bias"] == 0)
    # N(0, 1/sqrt(d_model + 1)): sample std within sampling error for 64 draws
    assert weight.std().item() == pytest.approx(1 / math.sqrt(65), rel=0.3)


def test_reference_is_frozen_and_dropout_is_off(res):
    assert res["reference_trainable_params"] == 0
    assert res["reference_training_mode"] is False
    assert res["reference_train_step_refused"]
    assert res["dropout"] == (0.0, 0.0)


def test_saving_a_fresh_optimizer_leaves_the_first_step_unchanged(res):
    assert res["fresh_save_step_diff"] == 0.0


def test_data_parallel_whitening_matches_the_pure_formula(res):
    assert res["whiten_diff"] < 1e-6


def test_ddp_and_optimizer_follow_the_stage_optimizer_section(res):
    """wrap_ddp once read the top-level `optimizer` section and the optimizer the stage's:
    a DistributedOptimizer over all-reduced buffers, or the reverse."""
    assert res["optimizer_sections"] == {False: (False, False), True: (True, True)}


def test_trimmed_microbatches_match_at_every_real_position(res):
    """Microbatches (rows 0-1: lengths 12, 7; rows 2-3: 3, 9) cut to their longest row give the
    untrimmed outputs at every real position, and 0 from where a row has no next token
    (log-probs, entropy: lengths - 1) or no token (values: lengths) to the batch's width."""
    lengths = res["lengths"]
    assert res["trimmed_widths"] == [12, 9]  # each microbatch ran at its longest row's width
    for key, full, first_zero in (("logprobs", res["logprobs"], -1), ("entropy", res["entropy"], -1),
                                  ("values", res["values"], 0)):
        trimmed = res[f"trimmed_{key}"]
        assert trimmed.shape == full.shape
        for row, n in enumerate(lengths.tolist()):
            torch.testing.assert_close(trimmed[row, : n - 1], full[row, : n - 1], atol=1e-6, rtol=1e-6)
            assert torch.all(trimmed[row, n + first_zero :] == 0), (key, row)
            assert not torch.all(full[row, n + first_zero :] == 0) or n == 12  # without lengths: computed


def test_memory_account_counts_weights_gradients_and_adam_state(res):
    """fp32 weights, one fp32 gradient buffer (DDP) and two Adam moments of the trained roles;
    the distributed optimizer's main parameters are views of the fp32 weights, no extra bytes."""
    actor = res["memory_account"]["roles"]["actor"]
    n = res["param_count"]
    assert actor["weights"] == 4 * n
    assert actor["gradient_buffers"] >= 4 * n  # buffers are padded to bucket boundaries
    assert 2 * 4 * n <= actor["optimizer_state"] <= 2 * 4 * n + 1024  # + Adam's step counters
    assert res["memory_account"]["model_state_bytes"] == sum(
        r["weights"] + r["gradient_buffers"] + r["optimizer_state"] for r in res["memory_account"]["roles"].values())


def test_memory_account_measures_the_activations_kept_for_backward(res):
    """The actor's first step measured what its microbatch [2, 12] kept for backward: at least
    the fp32 logits the log-softmax saves; the never-trained critic has none; recomputing whole
    layers keeps less (only each layer's input)."""
    account = res["memory_account"]
    logits_bytes = 2 * 12 * res["padded_vocab"] * 4
    assert account["roles"]["actor"]["activations"] >= logits_bytes
    assert account["roles"]["critic"]["activations"] == 0
    assert account["activation_bytes"] == account["roles"]["actor"]["activations"]
    assert account["account_bytes"] == account["model_state_bytes"] + account["activation_bytes"]
    kept = res["recompute_activation_bytes"]
    assert kept["full"] < kept[None], kept


def test_activation_recomputation_leaves_gradients_unchanged(res):
    assert res["recompute_grad_scale"] > 0
    for granularity in ("selective", "full"):
        assert res["recompute_grad_diff"][granularity] <= 1e-6 * res["recompute_grad_scale"], granularity


def test_fused_logprobs_and_entropy_match_autograd_of_the_formulas(res):
    """One softmax, one saved tensor, a hand-written backward: the values and the gradient equal
    autograd through log_softmax and -sum p log p (float64)."""
    assert res["fused_logprob_entropy_diff"] < 1e-12
    assert res["fused_grad_scale"] > 0.1
    assert res["fused_grad_diff"] < 1e-12
