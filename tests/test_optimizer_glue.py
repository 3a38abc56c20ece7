"""The train step's glue around megatron: torch's fused AdamW inside megatron's optimizer (on at
build and after loading a checkpoint written without it; numerically the single-tensor AdamW),
the exact-but-cheap finiteness checks of the NaN guard, and no redundant train()/eval() walk that
leaves a module in the wrong mode. The fast tests run in this process; the slow ones read one
2-process run (DP2, DistributedOptimizer) of tests/workers/optimizer_glue.py."""

import pytest
import torch

from distributed import TINY_MODEL, torchrun
from megatron_rlhf.models.roles import set_training
from megatron_rlhf.resilience.nonfinite import NonFiniteGuard, all_finite, any_rank_nonfinite

LR = 0.01
BIG = 3e38  # finite in float32 and bfloat16; two of them overflow a sum


# --------------------------------------------------------------------- fast: finiteness checks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_elements_whose_sum_overflows_are_finite(dtype):
    t = torch.full((1000,), BIG, dtype=dtype)
    assert torch.isinf(t.sum(dtype=torch.float32))  # the premise: the cheap screen trips
    assert all_finite([t]) and not any_rank_nonfinite([t])
    assert not NonFiniteGuard("Actor", 0).should_skip([torch.tensor(1.0)], [t, -t])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_one_non_finite_element_anywhere_is_found(bad):
    for where in (0, 4321, 99_999):
        t = torch.randn(100_000)
        t[where] = bad
        assert not all_finite([torch.ones(3), t]) and any_rank_nonfinite([t, torch.ones(3)])


def test_opposite_infinities_and_mixed_tensors():
    both = torch.tensor([float("inf"), -float("inf")])  # sums to NaN, not to a finite value
    assert not all_finite([both]) and any_rank_nonfinite([both])
    assert all_finite([torch.arange(10), torch.ones(2, dtype=torch.float16), torch.zeros(0)])
    assert all_finite([]) and not any_rank_nonfinite([])


def test_guard_counts_a_non_finite_loss_or_gradient():
    guard = NonFiniteGuard("Actor", max_consecutive=5)
    good = [torch.randn(50_000)]
    assert not guard.should_skip([torch.tensor(2.0)], good)
    assert guard.should_skip([torch.tensor(float("nan"))], good)
    grads = torch.randn(50_000)
    grads[777] = float("inf")
    assert guard.should_skip([torch.tensor(2.0)], [grads])
    assert guard.state_dict() == {"consecutive": 2, "skipped": 2}


# --------------------------------------------------------------------- fast: train()/eval() walk
def test_set_training_fixes_a_submodule_left_in_the_other_mode():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(4, 4)))
    model.eval()
    model[1][0].train()  # e.g. a module added later, or switched by someone else
    set_training(model, False)
    assert not any(m.training for m in model.modules())
    model[1].eval()
    model.train()
    model[1][1].eval()
    set_training(model, True)
    assert all(m.training for m in model.modules())


# --------------------------------------------------------------------- slow: a real DP2 run
@pytest.fixture(scope="module")
def glue(tmp_path_factory):
    root = tmp_path_factory.mktemp("optimizer_glue")
    torchrun(2, "tests/workers/optimizer_glue.py", f"--root={root}", *TINY_MODEL, "seed=7", f"optimizer.lr={LR}")
    res = torch.load(root / "results.pt", weights_only=False)
    assert res["data_parallel"] == 2  # Adam state sharded by the DistributedOptimizer
    return res


FUSED = (True, False)  # (fused, foreach) of a torch AdamW param group


@pytest.mark.slow
def test_fused_adam_at_build(glue):
    for role in ("actor", "critic", "critic_after_step"):
        assert glue["fused"][role] and all(flags == FUSED for flags in glue["fused"][role]), role


@pytest.mark.slow
def test_fused_adam_after_loading_a_checkpoint_written_without_it(glue):
    old = glue["old_ckpt"]
    assert old["saved_flags"] and all(f == (None, None) for f in old["saved_flags"])  # the premise
    assert all(flags == FUSED for flags in old["loaded_flags"])
    assert old["loaded_equals_saved"] == 0.0  # weights, moments and steps
    # the loaded (fused) actor steps like the single-tensor one it was saved from, within float32
    # rounding (measured 7e-9; one step moves an element by up to lr = 1e-2)
    assert old["next_step_vs_single"] < 1e-6
    assert all(flags == FUSED for flags in glue["resume"]["flags"])
    assert glue["resume"]["vs_uninterrupted"] == 0.0  # fused save -> load -> step is exact


@pytest.mark.slow
def test_fused_step_matches_the_single_tensor_step(glue):
    n = glue["numerics"]
    assert all(f == (None, None) for f in n["single_flags"])  # the comparison's premise
    assert n["moved"] > LR  # 3 steps moved the weights by more than one step's size
    # within float32 rounding of weights of magnitude <= ~1 (measured 4e-7)
    assert n["weights_fused_vs_single"] < 1e-5
    assert n["fused_vs_single"] < 1e-4  # weights, Adam moments and steps, relative per tensor


@pytest.mark.slow
def test_every_module_is_in_the_mode_each_call_needs(glue):
    m = glue["modes"]
    assert m["forward"] == m["forward_after_a_submodule_trained"] == {False}
    assert m["eval_forwards_equal"]  # adapter dropout off in both forwards
    assert m["reference_forward"] == {False}
    for call in ("train_step", "train_step_again", "train_step_after_a_submodule_evaluated",
                 "train_step_after_the_engine", "train_step_after_the_reference"):
        assert m[call] == {True}, call


@pytest.mark.slow
def test_the_guard_answers_alike_on_every_rank(glue):
    # rank 1 alone: a finite tensor whose sum overflows is no skip; a NaN is a skip on both ranks
    assert glue["guard"] == [{"overflow": False, "nan": True}] * 2
