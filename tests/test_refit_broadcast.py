"""rollout.refit_transport=broadcast through a real vLLM engine on CPU (gloo; the NCCL path on GPU:
benchmarks/gpu_check.py --vllm-separate): refits by broadcast and by shared memory leave the
engine generating the same tokens for the same weights, and what the in-place Megatron engine
generates; a corrupted or short bucket fails the refit with an error naming the transport, the
engine then refuses to generate until a good refit. Worker: tests/workers/refit_broadcast.py.
"""

import pytest
import torch

from distributed import torchrun
from test_vllm import MODEL

pytestmark = [pytest.mark.vllm]

SEPARATE = ["rollout.engine=vllm", "rollout.placement=separate", "rollout.sleep_level=0", "model.num_layers=2"]


def test_broadcast_refit_generates_as_shm_refit_and_fails_loudly(tmp_path):
    torchrun(1, "tests/workers/refit_broadcast.py", "--root", str(tmp_path), "--layout", "tp1", *MODEL, *SEPARATE)
    res = torch.load(tmp_path / "results.pt", weights_only=False)
    rounds = res["rounds"]
    assert [(r["weights"], r["transport"]) for r in rounds] == [("w0", "shm"), ("w1", "broadcast"),
                                                                ("w0", "broadcast"), ("w1", "shm")]
    for r in rounds:
        assert r["vllm"] == r["megatron"], r
        assert r["refit"]["refit_bytes"] > 0
    assert rounds[0]["vllm"] == rounds[2]["vllm"] and rounds[1]["vllm"] == rounds[3]["vllm"]
    assert rounds[0]["vllm"] != rounds[1]["vllm"]  # the weights changed what it generates
    assert rounds[1]["refit"]["refit_bytes"] == rounds[3]["refit"]["refit_bytes"]  # every tensor, either way
    failures = res["failures"]
    for label, words in (("corrupted", "arrived corrupted"), ("short", "shape")):
        assert "refit_transport=broadcast" in failures[label] and words in failures[label], failures[label]
        assert "stale" in failures[f"{label}_generate"], failures
    assert failures["recovered"] is True
