"""The vLLM refit (rollout/refit.py) of mixture-of-experts actors, without an engine: one launch
of 4 processes streams tiny random Qwen3-MoE (4 layers, layer 2 dense) and Mixtral models, loaded
from Hugging Face directories, at EP2 (TP1, 4 replicas), TP2 x EP2 (expert-TP 2), TP2 x EP2 with
expert-TP 1 and PP2 x EP2. Every engine rank (one per data-parallel replica) receives exactly the
tensors of the HF directory, bit for bit, under its names (per expert: experts.<e>.gate_proj /
up_proj / down_proj; Mixtral's w1 / w3 / w2) and in HF file order, which are exactly the names
and shapes the engine checks a refit against (expected_hf_shapes); buckets stay within the bound.
Streaming an expert layer holds at most one expert beyond the model and the bucket while its
experts stream (measured at EP2). The engine's checks (vllm_worker.py) know every expert tensor: a wrong-shaped expert, a fused
expert tensor and a missing expert are refused. The engine itself: tests/test_vllm.py (marked vllm).
"""

import pytest
import torch

from megatron_rlhf.config import load_config
from megatron_rlhf.convert import hf_overrides
from megatron_rlhf.rollout.refit import expected_hf_shapes
from megatron_rlhf.rollout.vllm_worker import RefitWorker, checksums, verify_bucket
from test_hf_moe import POLICIES, hf_tensors, model_cfg_of, random_hf_model

EP2 = "parallel.expert_parallel=2"
# layout -> (TP, PP, overrides, engine ranks: TP rank 0 of stage 0 of each replica); 4 processes
LAYOUTS = {
    "ep2": (1, 1, [EP2], [0, 1, 2, 3]),
    "tp2_ep2": (2, 1, [EP2], [0, 2]),  # expert tensor parallel = TP = 2
    "tp2_etp1_ep2": (2, 1, [EP2, "parallel.expert_tensor_parallel=1"], [0, 2]),
    "pp2_ep2": (1, 2, [EP2], [0, 1]),
}
BUCKET_BYTES = 40_000  # an expert matrix is 8 KiB, the embedding 40 KiB: several buckets, one oversized


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from distributed import torchrun
    from workers import layout_args

    root = tmp_path_factory.mktemp("refit_moe")
    for seed, variant in enumerate(POLICIES):
        random_hf_model(variant, seed).save_pretrained(root / "hf" / variant)
    model_args = hf_overrides(root / "hf" / POLICIES[0]) + ["model.max_seq_length=64", "rl.micro_batch_size=2"]  # DP4
    torchrun(4, "tests/workers/moe_refit.py", f"--root={root}", f"--bucket-bytes={BUCKET_BYTES}", "--measure-at=ep2",
             *layout_args({name: spec[:3] for name, spec in LAYOUTS.items()}), *model_args)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("variant", POLICIES)
def test_every_engine_rank_receives_the_hf_tensors(runs, layout, variant):
    root = runs
    hf = hf_tensors(root / "hf" / variant)
    expected = expected_hf_shapes(model_cfg_of(root / "hf" / variant))
    assert list(expected) == [n for n in expected if n in hf] and expected.keys() == hf.keys()
    experts = [n for n in expected if ".experts." in n]
    assert len(experts) == 3 * 4 * (3 if variant == "qwen3_moe" else 2)  # 3 matrices x 4 experts x expert layers
    for rank in LAYOUTS[layout][3]:
        buckets = torch.load(root / f"refit_{layout}_{variant}_rank{rank}.pt")
        got = [(name, t) for bucket in buckets for name, t in bucket.items()]
        names = [name for name, _ in got]
        assert names == list(expected), f"rank {rank}: missing {sorted(expected.keys() - set(names))[:4]}, " \
                                        f"extra {sorted(set(names) - expected.keys())[:4]} (or out of order)"
        for name, t in got:
            assert tuple(t.shape) == expected[name] and t.dtype == hf[name].dtype, (rank, name)
            assert torch.equal(t, hf[name]), (rank, name)
        assert len(buckets) > 3
        for bucket in buckets:
            assert len(bucket) == 1 or sum(t.numel() * t.element_size() for t in bucket.values()) <= BUCKET_BYTES


@pytest.mark.slow
def test_an_expert_layer_streams_one_expert_at_a_time(runs):
    """Beyond the model and the bucket: while experts stream, at most one expert (the next one,
    gathered before the bucket with the last tensor of the previous one goes out); overall, less
    than an expert layer's group."""
    root = runs
    expected = expected_hf_shapes(model_cfg_of(root / "hf" / "qwen3_moe"))
    layer = {n: torch.Size(s).numel() * 4 for n, s in expected.items() if n.startswith("model.layers.1.")}
    expert = sum(b for n, b in layer.items() if ".experts.0." in n)
    held = torch.load(root / "held_bytes.pt")
    assert held.keys() == expected.keys()
    while_experts = max(b for n, b in held.items() if ".experts." in n)
    assert while_experts <= expert and 0 < max(held.values()) < sum(layer.values()), (while_experts, expert, held)


def test_the_engine_checks_every_expert_tensor():
    m = load_config(None, ["model.family=qwen3_moe", "model.qk_layernorm=true", "model.num_experts=4",
                           "model.moe_ffn_hidden_size=32", "model.moe_dense_layers=[0]", "model.num_layers=2",
                           "model.vocab_size=100"]).model
    expected = expected_hf_shapes(m)
    expert = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert expected[expert] == (m.hidden_size, 32) and expected["model.layers.1.mlp.gate.weight"] == (4, m.hidden_size)
    assert "model.layers.0.mlp.down_proj.weight" in expected and len([n for n in expected if ".experts." in n]) == 12
    for bucket, error in [({expert: torch.zeros(32, m.hidden_size)}, "with shape"),
                          ({"model.layers.1.mlp.experts.gate_up_proj": torch.zeros(4, 64, m.hidden_size)},
                           "does not have")]:
        with pytest.raises(RuntimeError, match=error):
            verify_bucket(bucket, checksums(bucket), expected, seen=set())
    worker = RefitWorker()
    worker._refit_expected, worker._refit_seen = expected, set(expected) - {expert}
    with pytest.raises(RuntimeError, match=f"ended without 1 tensors, e.g. \\['{expert}'\\]"):
        worker.refit_end()
