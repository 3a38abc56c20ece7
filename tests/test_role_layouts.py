"""TP2-PP1, TP1-PP2, TP2-PP2 (sequence parallel), TP2-PP1 without it and DP2 give the same role outputs, losses, gradients and updated
weights as TP1-PP1 from identical weights (loaded from one megatron dist checkpoint); the
gradient of every trainer loss does not depend on the micro batch size or the data-parallel
size (true global-batch means, on very unequal sequence lengths); and a DistributedOptimizer
save -> load -> step equals the uninterrupted step exactly."""

import pytest
import torch

from distributed import TINY_MODEL, read_global_tensors, torchrun
from workers import layout_args
from workers.role_layouts import LOSSES

pytestmark = pytest.mark.slow

# lr large and adam_eps not tiny: the Adam update then depends smoothly on the gradient, so a
# wrong gradient (e.g. scaled by TP) moves weights by >> 1e-5 while float noise does not.
OVERRIDES = [*TINY_MODEL, "optimizer.lr=0.01", "optimizer.adam_eps=1e-4", "seed=7"]
BASE = "tp1pp1dp1"
# (TP, PP, processes[, overrides]). TP > 1 runs with sequence parallelism (parallel.sequence_parallel:
# auto); one TP2 layout without it keeps the replicated-activation path checked too.
NO_SP = ["parallel.sequence_parallel=false"]
# Context parallelism (CP2) through the tests' reference CP attention (tests/workers/
# context_parallel_attention.py; CPU runs refuse CP otherwise): alone, with TP2 + sequence
# parallelism and with PP2. rollout.engine=vllm: CP refuses the in-place engine.
CP2 = ["parallel.context_parallel=2", "rollout.engine=vllm"]
LAYOUTS = {"tp2pp1dp1": (2, 1, 2), "tp1pp2dp1": (1, 2, 2), "tp2pp2dp1": (2, 2, 4), "tp1pp1dp2": (1, 1, 2),
           "tp2pp1dp1_nosp": (2, 1, 2, NO_SP), "tp1pp1cp2": (1, 1, 2, CP2), "tp2pp1cp2": (2, 1, 4, CP2),
           "tp1pp2cp2": (1, 2, 4, CP2)}
ATOL = 1e-5
GRAD_RTOL = 1e-6  # of the largest gradient entry: float32 rounding, while a split-dependent
#                   weighting of tokens moves gradients by percents
# DPO's gradient is the difference of the chosen and rejected sides' (sigmoid-weighted):
# cancellation leaves float32 rounding at ~1.4e-6 of the largest entry (measured, DP2); the
# issue's 1e-5 bound is still far below what a split-dependent weighting does.
LOOSER = {"dpo_sigmoid": 1e-5, "dpo_ipo": 1e-5}


def run_role_layouts(root, layouts: dict, *args: str) -> dict:
    """tests/workers/role_layouts.py at `layouts` {name: (TP, PP, processes[, overrides])}, after
    "init" and the TP1-PP1 base in one process: one launch per world size, each checking all of its
    layouts (workers.run_layouts). `args`: the worker's flags and config overrides. Results by name."""
    by_world = {1: {"init": (1, 1), BASE: (1, 1)}}
    for layout, (tp, pp, nproc, *overrides) in layouts.items():
        by_world.setdefault(nproc, {})[layout] = (tp, pp, *overrides)
    for nproc, group in sorted(by_world.items()):
        torchrun(nproc, "tests/workers/role_layouts.py", f"--root={root}", *layout_args(group), *args)
    return {name: torch.load(root / f"results_{name}.pt") for name in [BASE, *layouts]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return root, run_role_layouts(root, LAYOUTS, *OVERRIDES)


def assert_same_tensors(got: dict, want: dict, atol: float):
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=atol, rtol=0, msg=lambda m: f"{key}: {m}")


def assert_outputs_match_base(results: dict, layout: str) -> None:
    for role, outputs in results[BASE]["outputs"].items():
        assert_same_tensors(results[layout]["outputs"][role], outputs, ATOL)


def assert_step_matches_base(root, results: dict, layout: str) -> None:
    """Each trained role's loss and updated weights at `layout` equal the base's (which moved)."""
    for role, loss in results[BASE]["losses"].items():
        assert results[layout]["losses"][role] == pytest.approx(loss, abs=ATOL), role
        want = read_global_tensors(root / "after_step" / BASE / role)
        initial = read_global_tensors(root / "init" / role)
        moved = max((want[k] - initial[k]).abs().max().item() for k in want)
        assert moved > 100 * ATOL, f"{role}: the optimizer step did not move the weights"
        assert_same_tensors(read_global_tensors(root / "after_step" / layout / role), want, ATOL)


def assert_resume_is_exact(results: dict, layout: str) -> None:
    resume = results[layout]["resume"]
    assert resume["loss_resumed"] == resume["loss_uninterrupted"]
    assert resume["max_param_diff"] == 0.0
    assert resume["adam_steps"] == [2.0]


def assert_resharded_step_matches_base(root, layout: str) -> None:
    """The base's optimizer checkpoint, loaded at `layout`, takes the base's second step."""
    want = read_global_tensors(root / "after_two_steps" / BASE / "actor")
    assert_same_tensors(read_global_tensors(root / "resharded_step" / layout / "actor"), want, ATOL)


def test_tensor_parallel_layouts_run_with_sequence_parallelism_unless_switched_off(runs):
    """The layouts below compare what they claim: auto turns sequence parallelism on at TP > 1."""
    _, results = runs
    for layout, (tp, _, _, *overrides) in LAYOUTS.items():
        want = tp > 1 and not (overrides and NO_SP[0] in overrides[0])
        assert set(results[layout]["sequence_parallel"].values()) == {want}, layout


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_outputs_match_tp1pp1(runs, layout):
    assert_outputs_match_base(runs[1], layout)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_and_updated_weights_match_tp1pp1(runs, layout):
    assert_step_matches_base(*runs, layout)


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
def test_distributed_optimizer_resume_is_exact(runs, layout):
    assert_resume_is_exact(runs[1], layout)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_optimizer_checkpoint_reshards_from_tp1pp1(runs, layout):
    assert_resharded_step_matches_base(runs[0], layout)


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
def test_dpo_precomputed_reference_equals_the_reference_forward(runs, layout):
    """The table DPO precomputes (pairs sharded over DP ranks, then summed) holds each side's
    summed response log-probs: the TP1-PP1 reference forward's, within 1e-6 relative (a sum of ~60
    nats: float32 rounding moves it by ~4e-6), at every layout."""
    from workers.role_layouts import make_batch

    _, results = runs
    batch = make_batch(seed=1)
    sums = (results[BASE]["outputs"]["reference"]["logprobs"] * batch["mask"]).sum(-1)
    torch.testing.assert_close(results[layout]["dpo_reference"], sums.view(-1, 2), atol=0, rtol=1e-6)


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
def test_packed_outputs_match_unpacked(runs, layout):
    """rl.packing: each microbatch's rows (unequal lengths) packed into one THD row through the
    SDPA core attention's block-diagonal causal mask, positions restarting per row (padded to a
    multiple of TP under sequence parallelism), give every role's outputs of the rows run apart."""
    results = runs[1][layout]
    for role, outputs in results["outputs"].items():
        assert_same_tensors(results["packed_outputs"][role], outputs, ATOL)


def test_roles_are_initialised_differently(runs):
    """Guards the comparisons above against trivially equal outputs."""
    _, results = runs
    out = results[BASE]["outputs"]
    assert not torch.allclose(out["actor"]["logprobs"], out["reference"]["logprobs"])
    assert out["reward"]["rewards"].std() > 0


def relative_difference(got: dict, want: dict) -> float:
    scale = max(v.abs().max().item() for v in want.values())
    assert scale > 0, "gradients are all zero: the comparison would prove nothing"
    return max((got[k] - want[k]).abs().max().item() for k in want) / scale


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_gradients_do_not_depend_on_the_micro_batch_size(runs, layout, loss):
    _, results = runs
    checks = results[layout]["gradients"][loss]
    assert checks["grad_scale"] > 0
    for mbs, diff in checks["rel_diff"].items():
        assert diff <= LOOSER.get(loss, GRAD_RTOL), f"micro batch {mbs}: gradients differ by {diff:.2e} of their largest entry"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("loss", list(LOSSES))
def test_gradients_match_tp1pp1(runs, layout, loss):
    """DP2 against DP1 is the split-invariance claim (each rank's share as one microbatch:
    a long-row half and a short-row half); TP2 and PP2 guard the layouts."""
    root, _ = runs
    want = read_global_tensors(root / "grads" / BASE / loss)
    got = read_global_tensors(root / "grads" / layout / loss)
    assert got.keys() == want.keys()
    assert relative_difference(got, want) <= LOOSER.get(loss, GRAD_RTOL)


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
def test_reported_loss_is_the_global_batch_mean(runs, layout):
    """Whatever the split, train_step and gradients report the loss of the whole batch: the
    loss function applied to all of it at once (one microbatch), from the TP1-PP1 outputs."""
    from workers.role_layouts import make_batch

    _, results = runs
    outputs = results[BASE]["outputs"]
    batch = {**make_batch(seed=1), **torch.load(runs[0] / "init" / "ppo_inputs.pt")}
    for name, (role, loss_fn) in LOSSES.items():
        loss, units, _ = loss_fn(outputs[role], batch)
        want = (loss / units).item()
        for mbs, reported in results[layout]["gradients"][name]["reported"].items():
            assert reported["loss"] == pytest.approx(want, rel=1e-5), (name, mbs)


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
def test_data_parallel_moments_and_whitening(runs, layout):
    w = runs[1][layout]["whitening"]
    assert w["count"] == w["count_want"]
    assert w["mean"] == pytest.approx(w["mean_want"], rel=1e-12)
    assert w["whiten_diff"] < 1e-6
