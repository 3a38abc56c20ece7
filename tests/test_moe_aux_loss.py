"""The load-balancing loss of a mixture-of-experts actor keeps megatron's definition (per
microbatch, per layer) and its coefficient whatever the trainer's loss divides by: the gradient
it adds does not change with the micro batch size, data or expert parallelism, the loss
aggregation (response tokens or sequences) or the prompt/response ratio, and equals
coefficient x the gradient of megatron's loss by megatron's own path (tests/workers/moe_aux_loss.py)."""

import pytest
import torch

from distributed import TINY_MODEL, torchrun
from workers import layout_args

pytestmark = pytest.mark.slow

MOE = ["model.family=mixtral", "model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=96",
       "model.num_layers=2", "model.moe_aux_loss_coef=1.0", "seed=3"]
LAYOUTS = {"dp2": (1, 1), "ep2dp2": (1, 1, ["parallel.expert_parallel=2"])}
RTOL = 1e-5  # of the largest entry: float32 rounding of two gradients' difference


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_aux")
    worker = "tests/workers/moe_aux_loss.py"
    torchrun(1, worker, f"--root={root}", "--layout=init=1x1", "--layout=tp1pp1=1x1", *TINY_MODEL, *MOE)
    torchrun(2, worker, f"--root={root}", *layout_args(LAYOUTS), *TINY_MODEL, *MOE)
    return {name: torch.load(root / f"aux_{name}.pt") for name in ["tp1pp1", *LAYOUTS]}


def relative_difference(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    scale = max(v.abs().max().item() for v in want.values())
    assert scale > 0, "no auxiliary gradient: the comparison would prove nothing"
    return max((got[k] - want[k]).abs().max().item() for k in want) / scale


def test_the_auxiliary_gradient_is_coefficient_times_megatrons_loss_gradient(runs):
    base = runs["tp1pp1"]
    assert relative_difference(base["aux"][("token_mean", 8)], base["megatron"]) <= RTOL


@pytest.mark.parametrize("layout", ["tp1pp1", *LAYOUTS])
def test_the_auxiliary_gradient_does_not_depend_on_split_aggregation_or_prompt_length(runs, layout):
    want = runs["tp1pp1"]["aux"][("token_mean", 8)]
    for key, got in runs[layout]["aux"].items():
        assert relative_difference(got, want) <= RTOL, key
