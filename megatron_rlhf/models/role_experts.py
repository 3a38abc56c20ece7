"""The mixture-of-experts part of a role (models/roles.py: Role): the routers' load-balancing
scale and padding mask, routing replay per microbatch (models/routing.py), and the router
losses and replay overrides a train step reports. Dense models pass through every method."""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

from megatron_rlhf.models.microbatches import Batch, loss_units, padding_positions, routed_tokens
from megatron_rlhf.models.routing import stage_summary
from megatron_rlhf.parallel import device
from megatron_rlhf.parallel.collectives import dp_sum


# the name megatron's MoE metrics tracker records each load-balancing type under (router.py)
BALANCING_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


class ExpertRouting:
    """Mixed into Role: reads its module, optimizer, output_shapes, routes (a RoutingReplay or
    None) and the per-call state Role keeps (_compare_routes, _microbatches, _replayed)."""

    def _begin_expert_step(self, batch: Batch, loss_fn: Callable) -> None:
        """Before a train step's forwards: the routers' load-balancing scale for this batch, and
        this step's own replay overrides and router losses (not the score phase's, not the last step's)."""
        if getattr(self.module.config, "moe_grad_scale_func", None) is not None:
            self._router_loss_scale = self._router_loss_scale_for({k: v.to(device()) for k, v in batch.items()}, loss_fn)
        self._replayed = self.routes is not None and "routes" in batch  # the same on every rank
        if self._replayed:
            self.routes.reset_overridden()
        if self._tracked_router_losses:
            get_moe_metrics_tracker().clear()  # the routers add each microbatch's losses to it

    @property
    def _has_experts(self) -> bool:
        return bool(self.module.config.num_moe_experts)

    def _router_loss_scale_for(self, batch: Batch, loss_fn: Callable) -> torch.Tensor:
        """The scale megatron's routers give their load-balancing and z-loss gradients
        (config.moe_grad_scale_func) so that the coefficient means what it says whatever the
        loss divides by. Under the per-token loss path a router attaches its per-microbatch loss
        times the microbatch's real tokens, assuming finalize_model_grads divides by the global
        count of real tokens T; ours divides by the loss's units U (response tokens, sequences,
        pairs). Scaling by U / T makes the auxiliary gradient the token-weighted mean of the
        microbatches' losses, times the coefficient, whatever the aggregation, the prompt/response
        ratio or the DP size. megatron defines the losses per microbatch, so they (not this scale)
        change with the split into microbatches. Both load-balancing types attach the micro batch's
        valid-token count (seq_aux_loss: its per-sequence mean times the sequences), and TP > 1
        attaches it only with models/moe_fixes.py's count: one scale for both types.
        U comes from the loss function itself on zero outputs: a LossFn's units depend on the
        batch alone (its masks), never on the outputs."""
        units = loss_units(loss_fn, batch, self.output_shapes(*batch["tokens"].shape))
        units, tokens = dp_sum(torch.stack([units, routed_tokens(batch)]).double())
        return self.optimizer.scale_loss((units / tokens.clamp(min=1)).float().reshape(1))

    def _sequence_shard(self) -> tuple[int, int] | None:
        """(TP rank, TP size) when the routers see only this rank's part of the sequence."""
        if not self.module.config.sequence_parallel:
            return None
        return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()

    def _route(self, mb: Batch) -> bool:
        """Before a microbatch's forward: replay its rollout routes (`routes` in the batch), or
        record the routers' own choices to compare with them (forward(compare_routes=True)).
        Whether there was anything to do."""
        if self.routes is None or "routes" not in mb:
            return False
        if self._compare_routes:
            self.routes.record()
        else:
            self.routes.replay(*self.routes.targets(mb["routes"], self._lengths(mb), self._sequence_shard()))
        return True

    @staticmethod
    def _lengths(mb: Batch) -> torch.Tensor:
        return mb["lengths"] if "lengths" in mb else torch.full_like(mb["tokens"][:, 0], mb["tokens"].size(1))

    def _padding_mask(self, mb: Batch, width: int) -> torch.Tensor | None:
        """MoE routers leave padding out of their load-balancing statistics (megatron's
        padding_mask, True = padding). megatron scatters it for sequence parallelism on the first
        pipeline stage only; later stages get their slice here."""
        if not self._has_experts or "lengths" not in mb:
            return None
        padding = padding_positions(mb["lengths"], width)
        if self.module.config.sequence_parallel and not parallel_state.is_pipeline_first_stage():
            padding = tensor_parallel.scatter_to_sequence_parallel_region(padding.t().contiguous()).t()
        return padding


    @property
    def _tracked_router_losses(self) -> list[str]:
        """The router losses megatron's MoE metrics tracker records in training (coefficient > 0)."""
        config = self.module.config
        if not config.num_moe_experts:
            return []
        balancing = BALANCING_LOSS_NAMES.get(config.moe_router_load_balancing_type, "load_balancing_loss")
        return [name for name, coef in ((balancing, config.moe_aux_loss_coeff),
                                         ("z_loss", config.moe_z_loss_coeff)) if coef]

    def _replay_overrides(self) -> dict[str, float]:
        """With routing replay: the fraction of replayed tokens whose router chose another top-k
        set in this step's forwards (mean and max over every MoE layer; collective). {} otherwise."""
        if self.routes is None or not self._replayed:
            return {}
        counts = self.routes.take_overridden(self.module.config.sequence_parallel)
        mean, top = stage_summary(counts["differing"] / counts["compared"].clamp(min=1))
        return {"routing_replay_overridden_mean": mean, "routing_replay_overridden_max": top}

    def _router_losses(self) -> dict[str, float]:
        """The step's load-balancing and z-losses without their coefficients: per microbatch,
        mean over MoE layers and microbatches, averaged over data-parallel ranks (megatron's
        tracker report; collective over the model's ranks)."""
        names = self._tracked_router_losses
        if not names:
            return {}
        config, losses = self.module.config, {}
        get_moe_metrics_tracker().report(
            loss_scale=1.0 / self._microbatches, iteration=0, force_initialize=True, track_names=names,
            num_layers=config.num_layers, moe_layer_freq=config.moe_layer_freq, total_loss_dict=losses)
        return {name: float(losses[name]) for name in names if name in losses}
