"""GPU path (NCCL, TE spec when installed, bf16): run on a machine with CUDA; skipped on CPU."""

import pytest
import torch

from distributed import torchrun

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_smoke_roles_bf16_on_one_gpu():
    proc = torchrun(1, "-m", "megatron_rlhf", "smoke", "--config", "pipelines/tiny_cpu.yaml",
                    "model.params_dtype=bfloat16")
    for role in ("Actor", "Reference", "Critic", "RewardModel"):
        assert role in proc.stdout
    assert "nan" not in proc.stdout.lower()
