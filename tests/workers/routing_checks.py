"""Rollout routing replay at one layout, for tests/test_moe_layouts.py (run by role_layouts.py with
--routes, on the MoE actor that "init" saved). Every data-parallel rank samples the same prompts,
so each layout's rollout is the one-process rollout and results compare across layouts.

1. the in-place engine records each token's experts (routes on the device, unrouted past each row);
2. the actor's full-sequence forward at the same weights routes every recorded token the same, and
   replaying the routes there changes nothing;
3. with the routers perturbed, its own routing differs for many tokens, and replay routes them as
   the rollout did (the top-k sets megatron's routers use, captured by forward hooks);
4. replaying routes that use experts 0 and 1 only: the other experts get no gradient, the routers do;
5. replay under full activation recomputation gives the gradient it gives without; the routers
   hold replay targets for the recomputation then only: the score forward and a training pass
   without recomputation queue none (the most bytes each pass queued, over every rank);
6. a replayed train step reports how many tokens replay overrode (the perturbed routers' own choice).
"""

import torch
from megatron.core import parallel_state as ps

from megatron_rlhf.checkpoint.dist import load_role
from megatron_rlhf.models.microbatches import real_positions
from megatron_rlhf.models.roles import Actor
from megatron_rlhf.rollout import MegatronRolloutEngine, SamplingParams
from workers import training_of

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [17, 18, 19, 20, 21]]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=6)
ROUTER_NOISE = 0.5


def logprob_sum(outputs, mb):
    """A loss over every real position (units from the batch alone, as a LossFn's must be)."""
    real = real_positions(mb["lengths"], mb["tokens"].size(1))
    return (outputs["logprobs"] * real).sum(), real.sum().to(torch.int32), {}


def routers(actor):
    return [m for m in actor.module.modules() if getattr(m, "router_replay", None) is not None]


def perturb_routers(actor) -> None:
    """The same noise on every rank (the router weights are replicated): a generator per layer."""
    with torch.no_grad():
        for router in routers(actor):
            g = torch.Generator().manual_seed(1000 + router.layer_number)
            router.weight.add_(ROUTER_NOISE * torch.randn(router.weight.shape, generator=g).to(router.weight))


def expert_gradient_norms(actor, num_experts: int) -> torch.Tensor:
    """[experts] the norm of each expert's weight gradient over every layer, from whichever rank holds it."""
    local = num_experts // ps.get_expert_model_parallel_world_size()
    first = ps.get_expert_model_parallel_rank() * local
    norms = torch.zeros(num_experts, dtype=torch.float64)
    for name, p in actor.module.named_parameters():
        if ".local_experts." in name:
            expert = first + int(name.split(".local_experts.")[1].split(".")[0])
            norms[expert] += p.main_grad.double().pow(2).sum()
    torch.distributed.all_reduce(norms, op=torch.distributed.ReduceOp.MAX)
    return norms.sqrt()


def router_gradient_norm(actor) -> float:
    norm = torch.tensor([sum(float(r.weight.main_grad.double().pow(2).sum()) for r in routers(actor))])
    torch.distributed.all_reduce(norm, op=torch.distributed.ReduceOp.MAX)
    return norm.sqrt().item()


class CapturedRouting:
    """Forward hooks on the actor's routers: the top-k set each one used per token, as rows of a
    sorted [tokens, k] tensor, beside the replay target it was given (sorted too)."""

    def __init__(self, actor):
        self.mismatches, self.tokens, self.calls = 0, 0, 0
        self.handles = [r.register_forward_hook(self.hook) for r in routers(actor)]

    def hook(self, router, _inputs, output):
        self.calls += 1
        routing_map = output[1]  # [tokens, experts] bool
        target = router.router_replay.target_topk_idx
        used = routing_map.nonzero()[:, 1].view(routing_map.size(0), -1)  # each row's experts, ascending
        self.mismatches += int((used != target.sort(-1).values).any(-1).sum())
        self.tokens += routing_map.size(0)

    def remove(self):
        for h in self.handles:
            h.remove()


def over_stages(values: list[float]) -> list[float]:
    """Sums over the pipeline stages (each holds its own layers' counts)."""
    t = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(t, group=ps.get_pipeline_model_parallel_group())
    return t.tolist()


class RouterCalls:
    """How many times the actor's routers run (activation recomputation runs them again in backward)."""

    def __init__(self, actor):
        self.count = 0
        self.handles = [r.register_forward_hook(self.hook) for r in routers(actor)]

    def hook(self, *_):
        self.count += 1

    def remove(self):
        for h in self.handles:
            h.remove()


def queued_bytes(actor) -> int:
    """The most bytes of replay targets the actor's routers held for a recomputation since the
    last call, summed over every rank (each holds its own stage's layers)."""
    held = torch.tensor([actor.routes.take_queue_peak_bytes()], dtype=torch.float64)
    torch.distributed.all_reduce(held)
    return int(held.item())


def disagreement(actor, batch, mbs: int) -> dict:
    out = actor.forward(batch, mbs, compare_routes=True)
    counts = actor.routes.take_disagreement(actor.module.config.sequence_parallel)
    differing, compared = over_stages([counts["differing"].sum().item(), counts["compared"].sum().item()])
    return {"logprobs": out["logprobs"], "differing": differing, "compared": compared}


def routing_checks(args, cfg, layout: str) -> dict:
    actor = Actor(cfg.model, trainable=True, **training_of(cfg))
    load_role(actor, args.root / "init" / "actor", with_optimizer=False)
    results = {}
    rollout = MegatronRolloutEngine(cfg.model, actor, eos_id=3, pad_id=0).generate(PROMPTS, SAMPLING, seed=11)
    routes = rollout.routes
    positions = torch.arange(routes.size(1))
    past_end = positions[None, :] >= rollout.lengths[:, None]
    unrouted = routes == actor.routes.unrouted
    results["rollout"] = {
        "tokens": rollout.tokens, "lengths": rollout.lengths, "routes_shape": tuple(routes.shape),
        "routes_dtype": str(routes.dtype), "routes_device": str(routes.device),
        "unrouted_past_end": bool(unrouted[past_end].all()),
        "routed_before_last": bool(~unrouted[positions[None, :] < rollout.lengths[:, None] - 1].any()),
        "stage_layers": actor.routes.layers, "data_parallel": ps.get_data_parallel_world_size(),
    }
    batch = {"tokens": rollout.tokens, "lengths": rollout.lengths, "routes": routes}
    results["same_weights"] = disagreement(actor, batch, mbs=2)
    queued_bytes(actor)
    results["replayed_same_weights"] = actor.forward(batch, 2)["logprobs"]
    queued = {"score": queued_bytes(actor)}  # the score phase's forward: no backward follows

    perturb_routers(actor)
    results["perturbed"] = disagreement(actor, batch, mbs=2)
    capture = CapturedRouting(actor)
    results["replayed_logprobs"] = actor.forward(batch, 2)["logprobs"]
    capture.calls = 0  # the training forward's alone, against recomputation's below
    queued_bytes(actor)
    actor.gradients(batch, 1, logprob_sum)
    queued["train"] = queued_bytes(actor)
    capture.remove()
    totals = torch.tensor([capture.mismatches, capture.tokens], dtype=torch.float64)
    torch.distributed.all_reduce(totals)
    results["replay_capture"] = {"mismatches": totals[0].item(), "tokens": totals[1].item()}
    replay_grad = [p.main_grad.clone() for p in actor.module.parameters()]

    config = actor.module.config  # read by megatron's block at every forward
    config.recompute_granularity, config.recompute_method, config.recompute_num_layers = "full", "uniform", 1
    calls = RouterCalls(actor)
    actor.gradients(batch, 1, logprob_sum)
    queued["train_recompute"] = queued_bytes(actor)
    calls.remove()
    config.recompute_granularity = config.recompute_method = config.recompute_num_layers = None
    results["replay_queue_bytes"] = queued
    results["recompute_router_calls"] = {"with": calls.count, "without": capture.calls}
    results["recompute_max_grad_diff"] = max(float((p.main_grad - g).abs().max())
                                             for p, g in zip(actor.module.parameters(), replay_grad))

    two_experts = routes.clone()
    two_experts[~unrouted] = 0
    two_experts[..., 1].masked_fill_(~unrouted[..., 1], 1)
    actor.gradients({**batch, "routes": two_experts}, 1, logprob_sum)
    results["two_experts"] = {"expert_norms": expert_gradient_norms(actor, cfg.model.num_experts),
                              "router_norm": router_gradient_norm(actor)}
    actor.gradients({k: v for k, v in batch.items() if k != "routes"}, 1, logprob_sum)
    results["free"] = {"expert_norms": expert_gradient_norms(actor, cfg.model.num_experts)}
    results["train_step"] = actor.train_step(batch, 2, logprob_sum)  # replaying, the routers still perturbed
    return results
