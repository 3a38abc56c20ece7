"""Context parallelism's bookkeeping (parallel/context.py) as pure functions, its device
discipline under FakeTensorMode, and its refusals. The end-to-end checks (CP2 alone, with TP2 and
sequence parallelism, with PP2: outputs, packed outputs, gradients of every loss, optimizer
steps, resume, equal to TP1-PP1) are layouts of tests/test_role_layouts.py; vLLM with CP is in
tests/test_vllm.py."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_rlhf.config import ConfigError, load_config, validate
from megatron_rlhf.models.microbatches import last_tokens, next_token_targets, pack_rows, unpack_rows
from megatron_rlhf.parallel.context import (
    SHARE_KEY, column_multiple, partitioned_index, share_of, split_microbatch, units_share,
)

CUDA = torch.device("cuda", 0)


def chunks_by_definition(cu_seqlens: list[int], cp: int, rank: int) -> list[int]:
    """Each sequence in 2 x cp equal chunks; rank r's are chunk r and chunk 2cp-1-r, sequence by sequence."""
    out = []
    for start, end in zip(cu_seqlens, cu_seqlens[1:]):
        size = (end - start) // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            out += range(start + chunk * size, start + (chunk + 1) * size)
    return out


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("cu_seqlens", [[0, 32], [0, 8, 24, 32], [0, 16, 24, 48, 64]])
def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r_of_every_sequence(cu_seqlens, cp):
    if any((b - a) % (2 * cp) for a, b in zip(cu_seqlens, cu_seqlens[1:])):
        pytest.skip("a sequence not divisible into 2 x cp chunks")
    total, cu = cu_seqlens[-1], torch.tensor(cu_seqlens, dtype=torch.int32)
    shares = [partitioned_index(cu, total, cp, r) for r in range(cp)]
    for rank, index in enumerate(shares):
        assert index.tolist() == chunks_by_definition(cu_seqlens, cp, rank)
    share = share_of(cu, total, cp, 1)
    assert torch.equal(share.index, shares[1])
    assert sorted(share.order.tolist()) == list(range(total))  # every column once, over the ranks


def test_rows_are_padded_to_2cp_chunks_times_tp_under_sequence_parallelism():
    assert column_multiple(1, 2, True) == 2
    assert column_multiple(2, 1, False) == 4
    assert column_multiple(2, 2, True) == 8
    assert column_multiple(2, 2, False) == 4


def packed_microbatch():
    lengths = torch.tensor([5, 3, 6])
    tokens = torch.arange(1, 19).view(3, 6) * (torch.arange(6) < lengths[:, None])
    return {"tokens": tokens, "lengths": lengths}


def test_packed_rows_get_rooms_of_2cp_and_still_unpack_to_their_rows():
    mb = packed_microbatch()
    packed = pack_rows(mb, multiple=8, sequence_multiple=4)  # CP2 with TP2 + SP
    # rooms 8, 4, 8 = 20, then 4 of padding to a multiple of 8: a sequence of its own
    assert packed["cu_seqlens"].tolist() == [0, 8, 12, 20, 24]
    assert packed["cu_seqlens_real"].tolist() == [0, 5, 8, 14, 18]
    row = packed["packed_tokens"][0]
    assert row[:5].tolist() == mb["tokens"][0, :5].tolist() and row[5:8].tolist() == [0, 0, 0]
    assert row[8:11].tolist() == mb["tokens"][1, :3].tolist()
    assert packed["packed_positions"][0, 8:12].tolist() == [0, 1, 2, 3]
    assert packed["packed_has_next"][0].nonzero().flatten().tolist() == [0, 1, 2, 3, 8, 9, 12, 13, 14, 15, 16]
    assert torch.equal(unpack_rows(packed["packed_tokens"], packed), mb["tokens"])
    assert last_tokens(packed["packed_tokens"], packed).tolist() == [mb["tokens"][i, n - 1].item()
                                                                     for i, n in enumerate(mb["lengths"].tolist())]


def test_without_rooms_packing_is_as_before():
    mb = packed_microbatch()
    packed = pack_rows(mb, multiple=4)
    assert packed["cu_seqlens"].tolist() == [0, 5, 8, 14, 16] and "cu_seqlens_real" not in packed
    assert packed["packed_tokens"][0, :14].tolist() == mb["tokens"][mb["tokens"] > 0].tolist()


def test_the_split_keeps_targets_computed_on_the_whole_row():
    """A rank's last token of chunk r has its next token on another rank: the targets are split,
    not recomputed from the share."""
    tokens = torch.arange(10, 26).view(1, 16)
    mb = {"tokens": tokens, "lengths": torch.tensor([16])}
    targets, valid = next_token_targets(mb)
    cu = torch.tensor([0, 16])
    whole = {"cp_tokens": tokens, "cp_targets": targets.t(), "cp_valid": valid.t()}
    for rank in range(2):
        share = split_microbatch({**mb, **whole}, {k: k for k in whole}, cu, cp=2, rank=rank, use_megatron=False)
        index = share[SHARE_KEY].index
        assert torch.equal(share["cp_tokens"][0], tokens[0, index])
        got_targets, got_valid = next_token_targets(share)
        assert torch.equal(got_targets[:, 0], targets[index, 0])
        assert got_targets[3, 0].item() == tokens[0, index[3] + 1].item()  # across the chunk boundary
        assert torch.equal(got_valid[:, 0], valid[index, 0])


def test_a_row_that_does_not_split_into_2cp_chunks_is_refused():
    mb = {"cp_tokens": torch.zeros(1, 6, dtype=torch.long)}
    with pytest.raises(ValueError, match="2 x context_parallel=4"):
        split_microbatch(mb, {"cp_tokens": "cp_tokens"}, torch.tensor([0, 6]), cp=2, rank=0, use_megatron=False)


def test_loss_units_reach_megatron_from_cp_rank_0_only():
    units = torch.tensor(17, dtype=torch.int32)
    assert units_share(units, 0).item() == 17 and units_share(units, 1).item() == 0
    assert units_share(units, 1).dtype == torch.int32


def test_the_split_stays_on_the_device_of_the_batch():
    """Under FakeTensorMode: every index and share is a "cuda" tensor when the batch is (a CPU
    index would raise there), and no host read is needed (fake tensors have no values)."""
    with FakeTensorMode():
        tokens = torch.randint(0, 50, (2, 16), device=CUDA)
        mb = {"tokens": tokens, "lengths": torch.tensor([16, 11], device=CUDA)}
        targets, valid = next_token_targets(mb)
        cu = torch.tensor([0, 16], dtype=torch.int32, device=CUDA)
        whole = {"cp_tokens": tokens, "cp_targets": targets.t(), "cp_valid": valid.t()}
        share = split_microbatch({**mb, **whole}, {k: k for k in whole}, cu, cp=2, rank=1, use_megatron=False)
        for key in whole:
            assert share[key].device == CUDA and share[key].shape == (2, 8), key
        assert share[SHARE_KEY].index.device == CUDA and share[SHARE_KEY].order.device == CUDA
        packed_cu = torch.tensor([0, 8, 12, 24], dtype=torch.int32, device=CUDA)
        assert partitioned_index(packed_cu, 24, 2, 0).device == CUDA


def test_a_cpu_run_refuses_context_parallelism_naming_the_field():
    from megatron.core.transformer import TransformerConfig

    from megatron_rlhf.models.gpt import layer_spec

    cfg = load_config("pipelines/tiny_cpu.yaml", [])
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, context_parallel_size=2,
                               use_cpu_initialization=True)
    with pytest.raises(ConfigError, match="parallel.context_parallel=2: context parallelism runs in Transformer "
                                          "Engine's attention"):
        layer_spec(cfg.model, config)


@pytest.mark.parametrize("overrides,world,message", [
    (["parallel.context_parallel=2", "parallel.tensor_parallel=2"], 6, "does not divide the world size 6"),
    (["parallel.context_parallel=0"], None, "parallel.context_parallel=0: must be >= 1"),
    (["parallel.context_parallel=2"], 2, "with rollout.engine=megatron"),
])
def test_context_parallel_config_rules(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config("pipelines/tiny_cpu.yaml", overrides), world_size=world)


def test_context_parallelism_with_expert_layers_is_refused():
    with pytest.raises(ConfigError, match="parallel.context_parallel=2 with model.num_experts"):
        validate(load_config("pipelines/tiny_cpu_moe.yaml", ["parallel.context_parallel=2", "rollout.engine=vllm"]),
                 world_size=2)


def test_a_context_parallel_layout_validates_with_the_vllm_engine():
    cfg = validate(load_config("pipelines/tiny_cpu.yaml", ["parallel.context_parallel=2", "parallel.tensor_parallel=2",
                                                          "rollout.engine=vllm"]), world_size=8)
    assert cfg.parallel.check(cfg.model, 8) == 2  # DP = 8 / (TP2 x CP2)
