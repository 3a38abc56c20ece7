"""Packed sequences (rl.packing): a microbatch's rows back to back in one THD row. The
bookkeeping is checked here in-process (packing, unpacking, next-token targets that never
cross a row boundary, the real-token budget, the padding metrics, the block-diagonal causal
mask and the config rule); the models' packed == unpacked outputs and gradients at TP1, TP2
(sequence parallel), PP2 and DP2 run in the role layout launch (tests/test_role_layouts.py:
test_packed_outputs_match_unpacked, and a packed split in its gradient checks)."""

import pytest
import torch
import torch.nn.functional as F

from megatron_rlhf.config import ConfigError, load_config, validate
from megatron_rlhf.models.batching import padding_sums
from megatron_rlhf.models.microbatches import (
    last_tokens, max_sequence_length, microbatch_rows, next_token_targets, pack_rows, per_row, unpack_rows,
)

LENGTHS = [5, 2, 4]
WIDTH = 6  # the microbatch's width (its longest row, or more)


def microbatch() -> dict[str, torch.Tensor]:
    lengths = torch.tensor(LENGTHS)
    tokens = (torch.arange(len(LENGTHS))[:, None] + 1) * 10 + torch.arange(WIDTH)  # row r, column c: 10(r+1) + c
    tokens = tokens.masked_fill(torch.arange(WIDTH) >= lengths[:, None], 0)
    return {"tokens": tokens, "lengths": lengths}


def test_rows_pack_back_to_back_with_positions_restarting_and_the_padding_as_a_sequence():
    packed = pack_rows(microbatch(), multiple=4)  # 11 real tokens -> 12 under TP4 sequence parallelism
    assert packed["packed_tokens"].tolist() == [[10, 11, 12, 13, 14, 20, 21, 30, 31, 32, 33, 0]]
    assert packed["packed_positions"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3, 0]]
    assert packed["packed_has_next"].int().tolist() == [[1, 1, 1, 1, 0, 1, 0, 1, 1, 1, 0, 0]]
    assert packed["cu_seqlens"].tolist() == [0, 5, 7, 11, 12] and packed["cu_seqlens"].dtype == torch.int32
    assert max_sequence_length(packed) == 5
    assert torch.equal(packed["tokens"], microbatch()["tokens"])  # the rows stay for the loss functions
    assert pack_rows(microbatch())["cu_seqlens"].tolist() == [0, 5, 7, 11]  # no padding: no empty sequence after it


def test_unpacking_puts_each_token_back_in_its_row_and_zeros_past_its_length():
    mb = microbatch()
    packed = pack_rows(mb, multiple=4)
    values = packed["packed_tokens"].float() * 2 + 1  # any per-token output, padding included
    want = (mb["tokens"].float() * 2 + 1) * (torch.arange(WIDTH) < mb["lengths"][:, None])
    assert torch.equal(unpack_rows(values, packed), want)
    assert torch.equal(unpack_rows(values[0], packed), want)
    assert last_tokens(values, packed).tolist() == [29.0, 43.0, 67.0]  # 2 * (14, 21, 33) + 1
    unpadded = pack_rows(mb)
    assert torch.equal(unpack_rows(unpadded["packed_tokens"].float() * 2 + 1, unpadded), want)
    assert last_tokens(unpadded["packed_tokens"], unpadded).tolist() == [14, 21, 33]


def test_next_token_targets_never_cross_into_the_next_row():
    """Packed, then unpacked: the same targets and valid mask as the rows run apart."""
    mb = microbatch()
    packed = pack_rows(mb, multiple=4)
    targets, valid = next_token_targets(packed)  # [T, 1]
    row_targets, row_valid = next_token_targets(mb)  # [WIDTH, rows]
    got = per_row(packed, {"targets": targets * valid, "valid": valid})
    assert torch.equal(got["valid"], row_valid.t())
    assert torch.equal(got["targets"], (row_targets * row_valid).t())
    assert targets[4].item() == 20 and valid[4].item() == 0  # row 0's last token: row 1's first is no target


def test_a_packed_token_budget_counts_real_tokens_and_nothing_is_padding():
    lengths = [16, 15, 16, 14, 4, 5, 6, 4]
    assert microbatch_rows(lengths, 1, 24) == [1, 1, 1, 1, 4]  # rows x longest
    assert microbatch_rows(lengths, 1, 32, packed=True) == [2, 2, 4]  # 31, 30, 19 real tokens
    sums = padding_sums(torch.tensor(sorted(lengths)), 16, 2, 32, packed=True)
    assert sums["microbatch_slots"] == sums["real_tokens"] == sum(lengths)  # padding_fraction_computed = 0
    unpacked = padding_sums(torch.tensor(lengths), 16, 2)
    assert unpacked["microbatch_slots"] > unpacked["real_tokens"]


def test_block_diagonal_causal_attention_equals_each_sequence_alone():
    from megatron_rlhf.models.attention import packed_visible_keys

    cu_seqlens = torch.tensor([0, 3, 4, 7, 8], dtype=torch.int32)  # three sequences and one padding token
    visible = packed_visible_keys(cu_seqlens, 9)  # and a token past cu_seqlens[-1]
    sequence = [0, 0, 0, 1, 2, 2, 2, 3, 4]
    want = torch.tensor([[sequence[i] == sequence[j] and j <= i for j in range(9)] for i in range(9)])
    assert torch.equal(visible, want)
    q, k, v = torch.randn(3, 1, 2, 8, 4, generator=torch.Generator().manual_seed(0)).unbind(0)
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:8, :8])
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        alone = F.scaled_dot_product_attention(*(t[:, :, start:end] for t in (q, k, v)), is_causal=True)
        torch.testing.assert_close(got[:, :, start:end], alone, atol=1e-6, rtol=0)


def test_packing_refuses_an_expert_model():
    cfg = load_config(None, ["rl.packing=true", "model.family=mixtral", "model.num_experts=4",
                             "model.moe_router_topk=2", "model.vocab_size=100"])
    with pytest.raises(ConfigError, match=r"rl.packing=true with an MoE model"):
        validate(cfg, world_size=1)
    validate(load_config(None, ["rl.packing=true"]), world_size=1)
