"""A mixture-of-experts model (4 experts, top-2, one dense layer, megatron's alltoall dispatcher)
as all four roles: expert parallelism EP2 (with DP2 for the dense weights), TP2 x EP2 with
expert-TP 1 (sequence parallel) and PP2 give the same outputs, gradients of every trainer loss
(micro batch 1, 2, whole, by token budget) and updated weights as one process, from one
checkpoint written at EP1 and resharded on load; DistributedOptimizer resume is exact at each.
The load-balancing loss is off here: it is a product of per-microbatch statistics, so it cannot
be split-invariant (tests/test_moe_aux_loss.py checks its gradient scale).

Rollout routing replay at every layout (tests/workers/routing_checks.py): the in-place engine's
recorded routes are what the trainer's full-sequence forward chooses at the same weights; after
the routers move, replay routes every token as the rollout did (hooks on megatron's routers), the
gradient reaches only the replayed experts, and activation recomputation replays in schedule order
(replay targets are held for it alone: none in the score forward or training without it)."""

import pytest
import torch

from distributed import TINY_MODEL, read_global_tensors, torchrun
from test_role_layouts import (
    BASE, GRAD_RTOL, LOOSER, assert_outputs_match_base, assert_resharded_step_matches_base, assert_resume_is_exact,
    assert_step_matches_base, relative_difference, run_role_layouts,
)
from workers import layout_args

pytestmark = pytest.mark.slow

MOE = ["model.family=mixtral", "model.num_experts=4", "model.moe_router_topk=2", "model.moe_dense_layers=[0]",
       "model.moe_ffn_hidden_size=96", "model.moe_aux_loss_coef=0.0"]
OVERRIDES = [*TINY_MODEL, *MOE, "optimizer.lr=0.01", "optimizer.adam_eps=1e-4", "seed=7"]
EP2 = ["parallel.expert_parallel=2"]
# The losses whose gradients the MoE layouts check: every trainer kind and both aggregations (DPO's
# are the policy's log-probs again, checked by the dense layouts).
MOE_LOSSES = ["sft", "ppo_actor", "grpo_actor_options", "critic", "reward"]
LAYOUTS = {"ep2dp2": (1, 1, 2, EP2), "tp1pp2": (1, 2, 2, []),
           "tp2ep2": (2, 1, 4, [*EP2, "parallel.expert_tensor_parallel=1"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_layouts")
    return root, run_role_layouts(root, LAYOUTS, f"--losses={','.join(MOE_LOSSES)}", "--routes", *OVERRIDES)


def test_the_roles_have_experts(runs):
    root, _ = runs
    names = read_global_tensors(root / "init" / "actor").keys()
    experts = {n for n in names if ".mlp.experts." in n}
    assert any("layers.1.mlp.router.weight" in n for n in names) and experts
    assert not any("layers.0.mlp.router" in n or "layers.0.mlp.experts" in n for n in names)  # the dense layer


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_outputs_match_one_process(runs, layout):
    assert_outputs_match_base(runs[1], layout)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_and_updated_weights_match_one_process(runs, layout):
    assert_step_matches_base(*runs, layout)


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
def test_distributed_optimizer_resume_is_exact_and_reshards(runs, layout):
    assert_resume_is_exact(runs[1], layout)
    assert_resharded_step_matches_base(runs[0], layout)


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
@pytest.mark.parametrize("loss", MOE_LOSSES)
def test_gradients_do_not_depend_on_the_split_or_the_layout(runs, layout, loss):
    root, results = runs
    checks = results[layout]["gradients"][loss]
    for mbs, diff in checks["rel_diff"].items():
        assert diff <= LOOSER.get(loss, GRAD_RTOL), f"micro batch {mbs}: gradients differ by {diff:.2e}"
    if layout != BASE:
        got, want = (read_global_tensors(root / "grads" / name / loss) for name in (layout, BASE))
        assert got.keys() == want.keys()
        assert relative_difference(got, want) <= LOOSER.get(loss, GRAD_RTOL)


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_rollout")
    worker = "tests/workers/moe_rollout.py"
    torchrun(1, worker, f"--root={root}", "--layout=init=1x1", *OVERRIDES)
    torchrun(2, worker, f"--root={root}", *layout_args({"ep2dp2": (1, 1, EP2)}), *OVERRIDES)
    return {name: torch.load(root / f"moe_rollout_{name}.pt") for name in ("init", "ep2dp2")}


def test_expert_parallel_decoding_of_unequal_shares_equals_one_process(rollouts):
    """Each rank decodes different prompts over a different span; the expert all-to-all pairs
    every step (no hang) and every row is what one process decodes."""
    assert rollouts["ep2dp2"]["rows"] == rollouts["init"]["rows"]
    assert len({len(row) for row in rollouts["init"]["rows"]}) > 1


def test_expert_parallel_turns_continue_from_the_turn_cache(rollouts):
    """A multi-turn continuation (rollout/megatron_engine.py TurnCache) with each rank's cache
    holding a different span: the ranks agree on where to start feeding, and every row is what
    generating from the whole row gives."""
    for name in ("init", "ep2dp2"):
        for cached, again in rollouts[name]["second_turn"]:
            assert cached == again and len(cached) > 7
        assert all(reused > 0 for reused in rollouts[name]["reused"])


# ----------------------------------------------------------------------------- routing replay
def routing(runs, layout) -> dict:
    return runs[1][layout]["routing"]


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
def test_the_rollout_records_each_tokens_experts(runs, layout):
    """Routes [B, S, this stage's MoE layers, top-k] uint8 on the tokens' device; every token fed
    to the model is routed, nothing past a row's end is; each layout samples the one-process rollout."""
    rollout = routing(runs, layout)["rollout"]
    assert rollout["routes_shape"] == (*rollout["tokens"].shape, rollout["stage_layers"], 2)
    assert (rollout["routes_dtype"], rollout["routes_device"]) == ("torch.uint8", "cpu")
    assert rollout["unrouted_past_end"] and rollout["routed_before_last"]
    assert torch.equal(rollout["tokens"], routing(runs, BASE)["rollout"]["tokens"])


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
def test_the_trainer_routes_as_the_rollout_at_the_same_weights(runs, layout):
    """Decoding with the KV cache (sequence parallelism off) and the full-sequence forward (on, at
    TP2) choose the same top-k set for every recorded token of every MoE layer (the counts are
    summed over data-parallel ranks, which here all hold the same rollout); replaying them there
    is the identity, which a replay in another token order would not be."""
    r = routing(runs, layout)
    assert r["same_weights"]["differing"] == 0
    torch.testing.assert_close(r["replayed_same_weights"], r["same_weights"]["logprobs"], atol=1e-6, rtol=0)
    assert r["same_weights"]["compared"] / r["rollout"]["data_parallel"] == routing(runs, BASE)["same_weights"]["compared"] > 0


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
def test_replay_routes_as_the_rollout_after_the_routers_moved(runs, layout):
    """Perturbed routers choose other experts for most tokens; replaying, megatron's routers use
    exactly the rollout's top-k sets (compared as sets), and the replayed log-probs are the same at
    every layout (the targets follow each layout's token order, sequence shard and stage)."""
    r, base = routing(runs, layout), routing(runs, BASE)
    assert r["perturbed"]["differing"] / r["perturbed"]["compared"] > 0.3
    step = r["train_step"]  # what replay overrode in a train step, as the routing metrics report it
    assert 0.3 < step["routing_replay_overridden_mean"] <= step["routing_replay_overridden_max"] <= 1
    assert r["replay_capture"]["mismatches"] == 0 and r["replay_capture"]["tokens"] > 0
    torch.testing.assert_close(r["replayed_logprobs"], base["replayed_logprobs"], atol=1e-5, rtol=0)
    assert (r["replayed_logprobs"] - r["perturbed"]["logprobs"]).abs().max() > 1e-3


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
def test_the_gradient_follows_the_replayed_routes(runs, layout):
    """Routes that send every token to experts 0 and 1: experts 2 and 3 get exactly no gradient,
    the routers still do (through the replayed experts' probabilities); routing freely, all four do."""
    r = routing(runs, layout)
    norms = r["two_experts"]["expert_norms"]
    assert (norms[:2] > 0).all() and (norms[2:] == 0).all()
    assert r["two_experts"]["router_norm"] > 0
    assert (r["free"]["expert_norms"] > 0).all()


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
def test_replay_under_activation_recomputation(runs, layout):
    """Full recomputation runs every router again inside backward, microbatches in schedule order
    (PP2's 1F1B runs two forwards before the first backward): the gradient is the one without."""
    r = routing(runs, layout)
    calls = r["recompute_router_calls"]
    assert calls["with"] == 2 * calls["without"] > 0
    assert r["recompute_max_grad_diff"] <= 1e-6


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
def test_replay_holds_targets_for_a_recomputation_only(runs, layout):
    """The routers keep a microbatch's replay targets past its forward only when activation
    recomputation will run the router again: the score forward and a training pass without
    recomputation hold none (megatron's RouterReplay held every microbatch's, as int64, until
    the pass ended). One process, no pipeline: one microbatch's uint8 targets at a time, the
    longest row's positions x this stage's MoE layers x top-k bytes."""
    r = routing(runs, layout)
    held = r["replay_queue_bytes"]
    assert held["score"] == 0 and held["train"] == 0
    assert held["train_recompute"] > 0
    if layout == BASE:
        rollout = r["rollout"]
        assert held["train_recompute"] == int(rollout["lengths"].max()) * rollout["stage_layers"] * 2
