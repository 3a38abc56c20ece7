"""TP2-PP1, TP1-PP2, TP2-PP2 and DP2 give the same role outputs, losses and updated weights
as TP1-PP1 from identical weights (loaded from one megatron dist checkpoint); and a
DistributedOptimizer save -> load -> step equals the uninterrupted step exactly."""

import pytest
import torch

from distributed import TINY_MODEL, read_global_tensors, torchrun

pytestmark = pytest.mark.slow

# lr large and adam_eps not tiny: the Adam update then depends smoothly on the gradient, so a
# wrong gradient (e.g. scaled by TP) moves weights by >> 1e-5 while float noise does not.
OVERRIDES = [*TINY_MODEL, "optimizer.lr=0.01", "optimizer.adam_eps=1e-4", "seed=7"]
BASE = "tp1pp1dp1"
LAYOUTS = {"tp2pp1dp1": (2, 1, 2), "tp1pp2dp1": (1, 2, 2), "tp2pp2dp1": (2, 2, 4), "tp1pp1dp2": (1, 1, 2)}
ATOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    worker = "tests/workers/role_layouts.py"
    torchrun(1, worker, f"--root={root}", "--layout=init", "--init", *OVERRIDES)
    torchrun(1, worker, f"--root={root}", f"--layout={BASE}", *OVERRIDES)
    for layout, (tp, pp, nproc) in LAYOUTS.items():
        torchrun(nproc, worker, f"--root={root}", f"--layout={layout}", *OVERRIDES,
                 f"parallel.tensor_parallel={tp}", f"parallel.pipeline_parallel={pp}")
    results = {name: torch.load(root / f"results_{name}.pt") for name in [BASE, *LAYOUTS]}
    return root, results


def assert_same_tensors(got: dict, want: dict, atol: float):
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=atol, rtol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_outputs_match_tp1pp1(runs, layout):
    _, results = runs
    for role, outputs in results[BASE]["outputs"].items():
        assert_same_tensors(results[layout]["outputs"][role], outputs, ATOL)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_and_updated_weights_match_tp1pp1(runs, layout):
    root, results = runs
    for role, loss in results[BASE]["losses"].items():
        assert results[layout]["losses"][role] == pytest.approx(loss, abs=ATOL), role
        want = read_global_tensors(root / "after_step" / BASE / role)
        initial = read_global_tensors(root / "init" / role)
        moved = max((want[k] - initial[k]).abs().max().item() for k in want)
        assert moved > 100 * ATOL, f"{role}: the optimizer step did not move the weights"
        assert_same_tensors(read_global_tensors(root / "after_step" / layout / role), want, ATOL)


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
def test_distributed_optimizer_resume_is_exact(runs, layout):
    _, results = runs
    resume = results[layout]["resume"]
    assert resume["loss_resumed"] == resume["loss_uninterrupted"]
    assert resume["max_param_diff"] == 0.0
    assert resume["adam_steps"] == [2.0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_optimizer_checkpoint_reshards_from_tp1pp1(runs, layout):
    root, _ = runs
    want = read_global_tensors(root / "after_two_steps" / BASE / "actor")
    assert_same_tensors(read_global_tensors(root / "resharded_step" / layout / "actor"), want, ATOL)


def test_roles_are_initialised_differently(runs):
    """Guards the comparisons above against trivially equal outputs."""
    _, results = runs
    out = results[BASE]["outputs"]
    assert not torch.allclose(out["actor"]["logprobs"], out["reference"]["logprobs"])
    assert out["reward"]["rewards"].std() > 0


def test_reported_loss_is_the_mean_microbatch_loss(runs):
    """train_step's loss is the caller's loss averaged over microbatches, recomputed here
    from the (pre-step) forward outputs of the same weights."""
    from workers.role_layouts import LOSSES, MBS, make_batch

    _, results = runs
    batch = make_batch(seed=1)
    for role, loss_fn in LOSSES.items():
        outputs = results[BASE]["outputs"][role]
        per_mb = [
            loss_fn({k: v[i : i + MBS] for k, v in outputs.items()}, {k: v[i : i + MBS] for k, v in batch.items()})
            for i in range(0, batch["tokens"].size(0), MBS)
        ]
        assert results[BASE]["losses"][role] == pytest.approx(torch.stack(per_mb).mean().item(), abs=1e-6)
