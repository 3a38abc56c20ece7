"""The performance options' bookkeeping: when the score phase reuses the rollout's log-probs,
what the padding metrics count, and the recipes that reusing must refuse."""

import pytest
import torch

from megatron_rlhf.config import ConfigError, load_config, validate
from megatron_rlhf.trainers.batching import by_length, padding_sums
from megatron_rlhf.trainers.rl import recomputes_old_logprobs


def test_reused_log_probs_are_recomputed_on_the_interval():
    validate(load_config(None, ["rl.reuse_rollout_logprobs=true"]), world_size=1)  # the in-place engine: allowed
    rl = load_config(None, ["rl.reuse_rollout_logprobs=true", "rl.logprob_recompute_interval=3"]).rl
    assert [s for s in range(1, 11) if recomputes_old_logprobs(rl, "megatron", s)] == [1, 3, 6, 9]
    rl.logprob_recompute_interval = 0  # only the first iteration
    assert [s for s in range(1, 11) if recomputes_old_logprobs(rl, "megatron", s)] == [1]
    rl.reuse_rollout_logprobs = False  # the default: every iteration
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
    sums = padding_sums(lengths, width=12, micro_batch_size=2, trimmed=True)
    assert sums["real_tokens"] == 28 and sums["batch_slots"] == 60
    # sorted 10, 9 | 4, 3 | 2 (+ one filler row): 2 x 10 + 2 x 4 + 2 x 2
    assert sums["microbatch_slots"] == 32
    untrimmed = padding_sums(lengths, width=12, micro_batch_size=2, trimmed=False)
    assert untrimmed["microbatch_slots"] == 60
