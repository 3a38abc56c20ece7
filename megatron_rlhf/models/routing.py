"""Rollout routing replay (R3) for mixture-of-experts actors: the experts the rollout chose for
each token are recorded and the training forwards route through the same ones.

Without it the trainer's routers pick other experts than the sampler's for some tokens (other
kernels, bf16 ties, the weights moving between minibatches), and the policy gradient then
belongs to another network than the one that sampled: on Qwen3-30B-A3B GRPO this is ~10 % of
router decisions and collapses runs (Megatron-LM issue 4168). With replay a router keeps its
probabilities (so its gradient and the load-balancing loss stay) but takes the recorded top-k.

Built on megatron-core's per-router RouterReplay (`moe_enable_routing_replay`), driven per role:
megatron's class-level list holds every router of every model in the process, so with colocated
MoE roles its static setters would hand the actor's routes to the reference and critic too. Each
role's routers here are its own (RoleRouterReplay leaves that list), in layer order.

Routes tensor: [B, S, layers, k], per token position the k experts each MoE layer of this
pipeline stage chose for that token (unsorted, as recorded), dtype `route_dtype`; positions no
forward routed (padding, a response's last token when decoding stopped before feeding it)
hold the dtype's largest value, which is no expert (`unrouted_mark`). Token order inside megatron's router is
sequence-major: [s, b, h] viewed as [s*b, h], index = position * batch + row.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megatron_rlhf.models.microbatches import padding_positions
from megatron_rlhf.parallel import device
from megatron_rlhf.parallel.collectives import all_reduce, dp_sum


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type that holds every expert index below its largest value (the
    unrouted mark): a routes tensor is B x S x layers x k of them (Qwen3-235B: 94 x 8 a token)."""
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if num_experts < torch.iinfo(dtype).max:
            return dtype
    raise ValueError(f"{num_experts} experts")


def unrouted_mark(dtype: torch.dtype) -> int:
    """The value a routes tensor of `dtype` holds where no forward routed the token."""
    return torch.iinfo(dtype).max


def _in_backward() -> bool:
    """Whether autograd is running a backward pass now (activation recomputation runs layers
    again there); the check torch's own checkpointing uses."""
    return torch._C._current_graph_task_id() != -1


class RoleRouterReplay(RouterReplay):
    """megatron's record/replay for one router, owned by one role: it leaves the process-wide
    list, and a replayed layer that activation recomputation runs again inside backward takes
    its targets from the backward queue (filled in schedule order) instead of the last
    microbatch's.

    Only a recomputation reads the queue, so only a forward that will be recomputed fills it.
    megatron's `set_target_indices` queues every microbatch's targets until the pass ends: the
    score phase (no backward at all) and training without recomputation held them all for
    nothing. Which forward will be recomputed is known exactly when the router runs: every
    megatron-core 0.19.2 checkpoint around a router (full recomputation, recompute.py; selective
    "moe", moe_layer.py) is tensor_parallel.checkpoint's CheckpointFunction, or Transformer
    Engine's reentrant checkpoint under FP8/FP4: both run the checkpointed forward under no_grad
    and the recomputation inside backward with grad on. So a router that finds grad disabled in
    a forward whose targets were set with grad enabled (a training forward) is inside a
    checkpoint, and queues them; nothing else does. (A non-reentrant checkpoint, which keeps
    grad on, would find the queue empty in backward: refused, never replayed out of order.)

    Targets stay in the routes' dtype (uint8 below 255 experts) until the router gathers with
    them: 8x fewer bytes held than int64. `queue_peak_bytes`: the most the queue held since
    `RoutingReplay.take_queue_peak_bytes` (plain int arithmetic at each append: no device work).

    A replayed forward also counts the tokens whose own top-k set (from the same scores) differs
    from the replayed one: what replay overrode. `routed` ([tokens] bool, set with the targets)
    leaves out the positions the rollout did not route."""

    def __init__(self, layer_number: int | None):
        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)
        self.layer_number = layer_number
        self.routed: torch.Tensor | None = None
        self.overridden: torch.Tensor | None = None  # [2] float64: overridden, replayed tokens
        self.training_forward = False  # the targets were set with grad enabled: a backward follows
        self.queued_bytes = 0
        self.queue_peak_bytes = 0

    def set_target_indices(self, topk_indices: torch.Tensor) -> None:
        """The next forward's targets, [tokens, k] of any integer dtype; unlike megatron's, not
        queued here (get_replay_topk queues them if that forward is checkpointed)."""
        self.target_topk_idx = topk_indices
        self.training_forward = torch.is_grad_enabled()

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        action = self.router_replay_action
        if action not in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)  # record, free
        if action == RouterReplayAction.REPLAY_BACKWARD or _in_backward():  # a recomputation
            return self._gather(scores, self._dequeue())  # counted in the forward already
        if self.training_forward and not torch.is_grad_enabled():  # inside a checkpoint: recomputed in backward
            self._enqueue(self.target_topk_idx)
        probs, indices = self._gather(scores, self.target_topk_idx)
        if self.routed is not None:
            self._count_overridden(scores, topk, num_groups, group_topk, default_compute_topk, indices)
        return probs, indices

    @staticmethod
    def _gather(scores: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The probabilities at the targets, and the targets as the int64 indices megatron's
        dispatch and gather need (made here, per use, from the compact routes' dtype)."""
        indices = targets.to(device=scores.device, dtype=torch.long)
        return scores.gather(1, indices), indices

    def _enqueue(self, targets: torch.Tensor) -> None:
        self.replay_backward_list.append(targets)
        self.queued_bytes += targets.numel() * targets.element_size()
        self.queue_peak_bytes = max(self.queue_peak_bytes, self.queued_bytes)

    def _dequeue(self) -> torch.Tensor:
        if not self.replay_backward_list:
            raise RuntimeError(
                f"routing replay: layer {self.layer_number} is recomputed in backward, but none of its forwards "
                "ran under an activation checkpoint that disables grad (megatron's and Transformer Engine's "
                "reentrant checkpoints do); a non-reentrant checkpoint would need its forwards' targets queued")
        targets = self.replay_backward_list.pop(0)
        self.queued_bytes -= targets.numel() * targets.element_size()
        return targets

    def _count_overridden(self, scores, topk, num_groups, group_topk, compute_topk, replayed) -> None:
        with torch.no_grad():
            own = compute_topk(scores.detach(), topk, num_groups=num_groups, group_topk=group_topk)[1]
            differ = (own.sort(-1).values != replayed.sort(-1).values).any(-1) & self.routed
            counts = torch.stack([differ.sum(), self.routed.sum()]).double()
        self.overridden = counts if self.overridden is None else self.overridden + counts

    def clear_indices(self):
        """Targets, recordings and the queue dropped; the queue's peak is kept for
        `RoutingReplay.take_queue_peak_bytes` (the pass that made it has just released)."""
        super().clear_indices()
        self.routed, self.training_forward, self.queued_bytes = None, False, 0


class RoutingReplay:
    """The routers of one role's model chunk (this pipeline stage's MoE layers, in order):
    record their choices, replay given ones, or route freely (the default)."""

    def __init__(self, routers: list[RoleRouterReplay], num_experts: int, topk: int):
        self.routers, self.num_experts, self.topk = routers, num_experts, topk
        # compare mode: per layer, [tokens whose top-k set differed from the given routes, tokens compared]
        self.differing = None

    @classmethod
    def attach(cls, module: torch.nn.Module) -> RoutingReplay | None:
        """Give every router of `module` built with megatron's routing replay its own
        RoleRouterReplay; None for a model built without replay (dense, or a role that routes
        freely). A pipeline stage of an MoE model whose layers are all dense gets one without
        routers: every stage then records, replays and reduces the same way (collectives)."""
        routers = []
        for sub in module.modules():
            original = getattr(sub, "router_replay", None)
            if original is not None:
                if original in RouterReplay.global_router_replay_instances:  # megatron's, made at build: not kept
                    RouterReplay.global_router_replay_instances.remove(original)
                sub.router_replay = RoleRouterReplay(original.layer_number)
                routers.append(sub.router_replay)
        config = module.config
        if not config.moe_enable_routing_replay:
            return None
        return cls(routers, config.num_moe_experts, config.moe_router_topk)

    @property
    def layers(self) -> int:
        return len(self.routers)

    @property
    def unrouted(self) -> int:
        return unrouted_mark(route_dtype(self.num_experts))

    # --- modes
    def record(self) -> None:
        for r in self.routers:
            r.set_router_replay_action(RouterReplayAction.RECORD)

    def replay(self, targets: list[torch.Tensor], routed: torch.Tensor | None = None) -> None:
        """Route the next forward through `targets` (per layer [tokens, k], sequence-major, any
        integer dtype: `targets` gives the routes'); `routed` ([tokens, layers] bool): the tokens
        the rollout routed, whose overrides are counted. Call it right before the forward: whether
        grad is enabled now tells the routers if a backward (and so a recomputation) may follow."""
        for i, (r, t) in enumerate(zip(self.routers, targets, strict=True)):
            r.set_target_indices(t)
            r.routed = routed[:, i] if routed is not None else None
            r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def release(self) -> None:
        """Free routing again; recorded and queued targets dropped."""
        for r in self.routers:
            r.clear_router_replay_action()
            r.clear_indices()

    def take_queue_peak_bytes(self) -> int:
        """The sum over this stage's routers of the most bytes of replay targets each held for
        recomputation since the last call (what activation checkpointing costs replay), reset."""
        peak = sum(r.queue_peak_bytes for r in self.routers)
        for r in self.routers:
            r.queue_peak_bytes = r.queued_bytes
        return peak

    def recorded(self) -> torch.Tensor:
        """The last forward's choices, [tokens, layers, k] (sequence-major tokens)."""
        return torch.stack([r.get_recorded_indices() for r in self.routers], dim=1)

    # --- the rollout: record per decoding step
    def new_routes(self, batch: int, width: int, device) -> torch.Tensor:
        """A routes tensor [batch, width, layers, k] with nothing routed yet."""
        return torch.full((batch, width, self.layers, self.topk), self.unrouted,
                          dtype=route_dtype(self.num_experts), device=device)

    def write_step(self, routes: torch.Tensor, start: int, end: int) -> None:
        """The last forward's choices for positions [start, end) of every row, into `routes`
        (one indexed copy; no host sync)."""
        if not self.routers:
            return
        length, batch = end - start, routes.size(0)
        step = self.recorded().view(length, batch, self.layers, self.topk).transpose(0, 1)
        routes[:, start:end].copy_(step)

    # --- training forwards
    def targets(self, routes: torch.Tensor, lengths: torch.Tensor,
                sequence_shard: tuple[int, int] | None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Replay targets for a microbatch's routes [b, w, layers, k] as megatron's routers see
        the microbatch: per layer [w' * b, k] in the routes' dtype (the router makes the int64
        indices when it gathers), sequence-major, w' = this rank's part of the sequence
        (`sequence_shard` = (rank, size) under sequence parallelism); and [w' * b, layers] bool,
        the tokens the rollout routed. Each layer's targets are a tensor of their own, so the ones
        queued for a recomputation keep no other layer's alive. Positions the rollout did not
        route (padding past `lengths`, an unfed last token) go to experts spread round-robin:
        their outputs are masked, and spread they load no expert more than another."""
        positions = torch.arange(routes.size(1), device=routes.device)
        unrouted = self._unrouted(routes, lengths)
        if sequence_shard is not None:
            rank, size = sequence_shard
            part = routes.size(1) // size
            shard = slice(rank * part, (rank + 1) * part)
            routes, unrouted, positions = routes[:, shard], unrouted[:, shard], positions[shard]
        spread = (positions[:, None] * self.topk + torch.arange(self.topk, device=routes.device)) % self.num_experts
        filled = torch.where(unrouted[..., None], spread.to(routes.dtype)[None, :, None, :], routes)
        by_token = filled.transpose(0, 1)  # [w', b, layers, k]
        targets = [by_token[:, :, layer].flatten(0, 1).contiguous() for layer in range(filled.size(2))]
        return targets, ~unrouted.transpose(0, 1).flatten(0, 1)

    def _unrouted(self, routes: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[b, w, layers] True where the rollout routed nothing: marked so, or past the row's end
        (where the microbatch may have been padded for sequence parallelism)."""
        return (routes == self.unrouted).any(-1) | padding_positions(lengths, routes.size(1))[:, :, None]

    def compare(self, routes: torch.Tensor, lengths: torch.Tensor, sequence_shard: tuple[int, int] | None) -> None:
        """After a recorded forward of a microbatch with rollout routes [b, w, layers, k]: count,
        per layer, the tokens the rollout routed whose top-k set differs (sets: top-k comes
        unsorted without grad). Accumulates on the device until `take_disagreement`."""
        w = routes.size(1)
        routed = ~self._unrouted(routes, lengths)
        if sequence_shard is not None:
            rank, size = sequence_shard
            routes, routed = (x[:, rank * (w // size):(rank + 1) * (w // size)] for x in (routes, routed))
        given = routes.transpose(0, 1).flatten(0, 1).long()
        routed = routed.transpose(0, 1).flatten(0, 1)  # [tokens, layers]
        seen = self.recorded().long() if self.routers else given
        differ = (given.sort(-1).values != seen.sort(-1).values).any(-1) & routed
        counts = torch.stack([differ.sum(0), routed.sum(0)]).double()
        if self.differing is None:
            self.differing = counts
        else:
            self.differing += counts

    def reset_overridden(self) -> None:
        for r in self.routers:
            r.overridden = None

    def take_overridden(self, sequence_parallel: bool) -> dict[str, torch.Tensor]:
        """Per layer (this stage's), the replayed tokens whose router would have chosen another
        top-k set, summed over the replayed forwards since the last call, every data-parallel
        rank (and the TP ranks' sequence parts): {"differing": [layers], "compared": [layers]}."""
        counts = torch.zeros(2, self.layers, dtype=torch.float64, device=device())
        for i, r in enumerate(self.routers):
            if r.overridden is not None:
                counts[:, i] = r.overridden
            r.overridden = None
        return self._reduce(counts, sequence_parallel)

    def _reduce(self, counts: torch.Tensor, sequence_parallel: bool) -> dict[str, torch.Tensor]:
        if sequence_parallel:
            counts = all_reduce(counts, group=parallel_state.get_tensor_model_parallel_group())
        counts = dp_sum(counts)
        return {"differing": counts[0], "compared": counts[1]}

    def take_disagreement(self, sequence_parallel: bool) -> dict[str, torch.Tensor]:
        """Per layer (this stage's), the fraction of routed tokens whose top-k set differed in the
        compared forwards, over every data-parallel rank (and the TP ranks' sequence parts):
        {"differing": [layers], "compared": [layers]} sums; reset afterwards."""
        counts = self.differing if self.differing is not None else \
            torch.zeros(2, self.layers, dtype=torch.float64, device=device())
        self.differing = None
        return self._reduce(counts, sequence_parallel)


def expert_load(routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[layers, experts] tokens each expert received in `routes` [B, S, layers, k] (unrouted
    positions not counted), on the routes' device."""
    layers = routes.size(2)
    flat = routes.long().permute(2, 0, 1, 3).flatten(1)  # [layers, B*S*k]
    flat = flat.masked_fill(flat == unrouted_mark(routes.dtype), num_experts)  # a column dropped below
    counts = torch.zeros(layers, num_experts + 1, dtype=torch.float64, device=routes.device)
    counts.scatter_add_(1, flat, torch.ones_like(flat, dtype=torch.float64))
    return counts[:, :num_experts]


def stage_summary(per_layer: torch.Tensor) -> tuple[float, float]:
    """(mean, max) over every MoE layer of the model of a per-layer quantity that each pipeline
    stage holds for its own layers: summed and maxed over the pipeline group."""
    local = torch.stack([per_layer.sum(), torch.tensor(float(per_layer.numel()), dtype=per_layer.dtype,
                                                       device=per_layer.device)])
    top = per_layer.max().reshape(1) if per_layer.numel() else torch.zeros(1, dtype=per_layer.dtype, device=per_layer.device)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        local = all_reduce(local, group=group)
        top = all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
    total, layers = local.tolist()
    return total / max(layers, 1.0), float(top)
