"""The SDPA core attention of the CPU layer spec (megatron_rlhf/models/attention.py) computes
what megatron-core's local DotProductAttention computes: the same outputs and q/k/v gradients
per mask case (causal, grouped-query, explicit padding mask, sliding window, a query chunk
after cached keys, one decode step), checked against megatron's module and against a
reference whose mask is written out element by element; the same SelfAttention layer and
GPTModel (logits and every gradient) at TP1, TP2 and PP2; the same greedy tokens through the
KV-cached in-place engine. All checks run in one 2-process launch
(tests/workers/sdpa_layouts.py); megatron's CPU adaptations patch the process, so none run
in pytest's own."""

import pytest
import torch

from distributed import TINY_MODEL, torchrun
from workers import layout_args
from workers.sdpa_layouts import CASES, NEW, PROMPTS

pytestmark = pytest.mark.slow
# TP2 without sequence parallelism: the comparison model is megatron's local spec, whose torch
# norm refuses it (the role layout tests check our spec under sequence parallelism)
LAYOUTS = {"tp1pp1": (1, 1), "tp2pp1": (2, 1, ["parallel.sequence_parallel=false"]), "tp1pp2": (1, 2)}
ATOL = 1e-5  # fp32; the two kernels differ by ~1e-6 on these O(1) tensors
GRAD_RTOL = 1e-6  # of the largest gradient entry (float32 rounding; role_layouts uses the same)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sdpa")
    torchrun(2, "tests/workers/sdpa_layouts.py", f"--root={root}", *layout_args(LAYOUTS), *TINY_MODEL)
    return {name: torch.load(root / f"sdpa_{name}.pt", weights_only=False) for name in LAYOUTS}


def assert_attention_close(got, want, rows, what: str):
    """(out, dq, dk, dv) pairs; outputs compared on query rows that see a key."""
    names = ("output", "dq", "dk", "dv")
    for name, g, w in zip(names, got, want):
        if name == "output":
            g, w = g[rows], w[rows]
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0, msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.parametrize("case", list(CASES))
def test_core_attention_matches_reference_and_megatron(runs, case):
    c = runs["tp1pp1"]["core"][case]
    assert_attention_close(c["sdpa"], c["reference"], c["rows"], "vs reference")
    if c["megatron"] is not None:
        assert_attention_close(c["sdpa"], c["megatron"], c["rows"], "vs megatron DotProductAttention")
    if "megatron_full_rows" in c:  # the chunk's rows of megatron's full square self-attention
        assert_attention_close(c["sdpa"], c["megatron_full_rows"], c["rows"], "vs full attention's last rows")


def test_query_rows_without_visible_keys_give_zeros(runs):
    c = runs["tp1pp1"]["core"]["padding"]
    hidden_rows = ~c["rows"]
    assert hidden_rows.any(), "the padding case must have a query that sees no key"
    assert torch.equal(c["sdpa"][0][hidden_rows], torch.zeros_like(c["sdpa"][0][hidden_rows]))
    assert all(torch.isfinite(g).all() for g in c["sdpa"][1:])


def test_masks_built_in_one_place_keep_megatrons_semantics(runs):
    r = runs["tp1pp1"]
    assert r["visible_keys_mismatches"] == []
    assert r["mask_builder_mismatches"] == []  # parallel/cpu.py's stand-ins == megatron's builders


@pytest.mark.parametrize("kind", ["causal", "padding"])
def test_self_attention_layer_same_with_either_core_attention(runs, kind):
    got, want = (runs["tp1pp1"]["self_attention"][kind][spec] for spec in ("sdpa", "local"))
    torch.testing.assert_close(got[0], want[0], atol=ATOL, rtol=0)  # output
    torch.testing.assert_close(got[1], want[1], atol=GRAD_RTOL * float(want[1].abs().max()), rtol=0)  # input gradient
    assert got[2].keys() == want[2].keys()
    largest = max(float(g.abs().max()) for g in want[2].values())
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, atol=GRAD_RTOL * largest, rtol=0, msg=lambda m: f"{name}: {m}")


def test_attention_dropout_follows_megatrons_rng_and_is_unbiased(runs):
    d = runs["tp1pp1"]["dropout"]
    assert torch.equal(d["first"], d["again"]), "the model-parallel RNG state does not decide the dropout mask"
    assert not torch.allclose(d["first"], d["plain"]), "no dropout in training"
    # the mean of 2000 draws is the dropout-free output (within ~5 standard errors)
    torch.testing.assert_close(d["mean"], d["plain"], atol=0.25, rtol=0)


def test_unsupported_inputs_are_refused_by_name(runs):
    refused = runs["tp1pp1"]["refusals"]
    for what, error in refused.items():
        assert error is not None, f"{what} was accepted"
        kind, message = error
        assert kind == "NotImplementedError", (what, error)
        assert what in message, (what, message)


def test_cpu_spec_differs_from_local_spec_only_in_core_attention_and_norm_class(runs):
    """The norms are torch's RMSNorm either way; ours also runs under sequence parallelism."""
    assert runs["tp1pp1"]["spec_differences"] == [
        "spec.submodules.input_layernorm", "spec.submodules.self_attention.submodules.core_attention",
        "spec.submodules.pre_mlp_layernorm"]


@pytest.mark.parametrize("kind", ["causal", "padding"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpt_model_same_logits_and_gradients_as_local_spec(runs, layout, kind):
    m = runs[layout]["model"][kind]
    assert m["grad_count"] > 0 and m["logits_max"] > 0.1
    assert m["logits_diff"] <= ATOL, m
    assert m["grad_diff"] <= GRAD_RTOL * m["grad_max"], m


def test_kv_cached_greedy_decode_equals_recomputation_and_local_spec(runs):
    d = runs["tp1pp1"]["decoding"]
    cached, local = d["sdpa_cached"], d["local_cached"]
    assert torch.equal(cached["tokens"], local["tokens"]) and torch.equal(cached["lengths"], local["lengths"])
    torch.testing.assert_close(cached["logprobs"], local["logprobs"], atol=ATOL, rtol=0)
    for row, want in enumerate(d["sdpa_recomputed"]):
        length = int(cached["lengths"][row])
        assert length == len(PROMPTS[row]) + NEW or int(cached["finished"][row])
        assert cached["tokens"][row, :length].tolist() == want[:length]


def test_query_chunk_after_cached_keys_equals_full_recomputation(runs):
    d = runs["tp1pp1"]["decoding"]
    torch.testing.assert_close(d["chunk_logits"], d["full_logits"], atol=ATOL, rtol=0)


def test_a_chunk_of_queries_after_cached_keys_gets_the_causal_mask_bottom_right_on_the_te_path():
    """models/attention.py inference_chunk_mask_type, which the GPU spec's TE core attention
    applies (make gpu-check's long-context part compares turns from the turn cache there):
    megatron's static inference passes no_mask after its first forward; a causal layer turns it
    into causal_bottom_right for a chunk of queries, and changes nothing else."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rlhf.models.attention import inference_chunk_mask_type

    causal, none, right = AttnMaskType.causal, AttnMaskType.no_mask, AttnMaskType.causal_bottom_right
    assert inference_chunk_mask_type(causal, none, queries=5) == right
    assert inference_chunk_mask_type(right, none, queries=2) == right
    assert inference_chunk_mask_type(causal, none, queries=1) == none      # one query sees every cached key
    assert inference_chunk_mask_type(causal, causal, queries=5) == causal  # the prompt's forward, training
    assert inference_chunk_mask_type(none, none, queries=5) == none        # a layer without causality
    assert inference_chunk_mask_type(AttnMaskType.padding_causal, AttnMaskType.padding_causal, 7) == \
        AttnMaskType.padding_causal                                        # packed THD
