"""The performance options' bookkeeping: when the score phase reuses the rollout's log-probs,
what the padding metrics count, how a token budget splits microbatches, and the recipes
that reusing must refuse."""

import dataclasses

import pytest
import torch

from megatron_rlhf.config import ConfigError, load_config, validate
from megatron_rlhf.models.batching import by_length, padding_sums
from megatron_rlhf.models.microbatches import microbatch_rows, split_microbatches
from megatron_rlhf.trainers.rl import recomputes_old_logprobs


def test_reused_log_probs_are_recomputed_on_the_interval():
    validate(load_config(None, ["rl.reuse_rollout_logprobs=true"]), world_size=1)  # the in-place engine: allowed
    rl = load_config(None, ["rl.reuse_rollout_logprobs=true", "rl.logprob_recompute_interval=3"]).rl
    assert [s for s in range(1, 11) if recomputes_old_logprobs(rl, "megatron", s)] == [1, 3, 6, 9]
    rl = dataclasses.replace(rl, logprob_recompute_interval=0)  # only the first iteration
    assert [s for s in range(1, 11) if recomputes_old_logprobs(rl, "megatron", s)] == [1]
    rl = dataclasses.replace(rl, reuse_rollout_logprobs=False)  # the default: every iteration
    assert all(recomputes_old_logprobs(rl, "megatron", s) for s in range(1, 11))


@pytest.mark.parametrize("overrides, field", [
    (["rl.reuse_rollout_logprobs=true", "rollout.engine=vllm", "model.hidden_size=128",
      "model.num_attention_heads=2"], "rollout.engine=vllm"),
    (["rl.reuse_rollout_logprobs=true", "rl.tis_cap=2"], "rl.tis_cap"),
    (["rl.logprob_recompute_interval=-1"], "rl.logprob_recompute_interval=-1"),
])
def test_reuse_is_refused_where_rollout_log_probs_are_not_pi_old(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(load_config(None, overrides), world_size=1)


def test_padding_counts_batch_and_trimmed_microbatch_slots():
    lengths = torch.tensor([10, 3, 9, 4, 2])
    assert by_length(lengths).tolist() == [0, 2, 3, 1, 4]
    sums = padding_sums(lengths, width=12, micro_batch_size=2)
    assert sums["real_tokens"] == 28 and sums["batch_slots"] == 60
    # sorted 10, 9 | 4, 3 | 2 (+ one filler row): 2 x 10 + 2 x 4 + 2 x 2
    assert sums["microbatch_slots"] == 32
    # a budget of 12 token slots: 10 | 9 | 4, 3, 2 -> 10 + 9 + 3 x 4, no filler rows
    assert padding_sums(lengths, width=12, micro_batch_size=2, token_budget=12)["microbatch_slots"] == 31


def test_token_budget_packs_as_many_rows_as_fit():
    assert microbatch_rows([16, 15, 16, 14, 4, 5, 6, 4], 2) == [2, 2, 2, 2]
    assert microbatch_rows([16, 15, 16, 14, 4, 5, 6, 4], 2, token_budget=24) == [1, 1, 1, 1, 4]
    # unsorted rows: the running longest row counts (4, 4 then 9 would need 27 > 24)
    assert microbatch_rows([4, 4, 9, 2], 1, token_budget=24) == [2, 2]
    assert microbatch_rows([30, 2], 1, token_budget=24) == [1, 1]  # a row over budget runs alone
    batch = {"tokens": torch.arange(40).view(8, 5), "lengths": torch.tensor([5, 5, 4, 3, 3, 2, 2, 1])}
    parts = split_microbatches(batch, 2, token_budget=10)
    assert [p["tokens"].size(0) for p in parts] == [2, 2, 3, 1]  # 5,5 | 4,3 | 3,2,2 | 1
    assert torch.equal(torch.cat([p["tokens"] for p in parts]), batch["tokens"])


@pytest.mark.parametrize("budget, ok", [(0, True), (64, True), (63, False)])
def test_token_budget_must_hold_the_longest_sequence(budget, ok):
    cfg = load_config(None, ["model.max_seq_length=64", f"rl.micro_batch_tokens={budget}"])
    if ok:
        validate(cfg, world_size=1)
    else:
        with pytest.raises(ConfigError, match=r"rl\.micro_batch_tokens=63.*>= 64"):
            validate(cfg, world_size=1)
