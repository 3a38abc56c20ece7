"""A fix of megatron-core's MoE router, for every backend (NCCL and gloo alike).

megatron-core 0.19.2's `get_tokens_per_expert_and_token_count` (transformer/moe/moe_utils.py)
all-reduces the router's per-expert counts over the TP x CP group *in place*, and on the
padding-mask branch then reads the "local" token count from that buffer: every rank gets the
group's total. Under megatron's per-token loss path (every trained role of ours) the router
multiplies its load-balancing loss by that count (router.py, attach_and_log_load_balancing_loss),
so at TP > 1 with a padding mask (ours always pass one: models/role_experts.py) the balancing
gradient is TP x too large: the Qwen3-30B-A3B recipe (TP 2) trained with twice its
model.moe_aux_loss_coef. The logged loss is right; megatron's own loss gradient has the same bug,
so only a comparison with TP 1 shows it (tests/test_moe_aux_loss.py). Upstream:
NVIDIA/Megatron-LM PR #7481 (open).

What the router needs there is not each rank's own count either. Under sequence parallelism each
TP rank's loss is a partial sum over its slice of the micro batch, and the TP-replicated router
weight sums those partial gradients: the micro batch's loss gets the weight (count x group size)
on each slice. With the true local count, a slice with more padding (the last one, for
right-padded rows) would weigh its tokens less than the others. The group's mean share
(total / group size) gives every slice the micro batch's valid-token count: the gradient of
megatron's micro-batch loss times its tokens, however the padding falls on the slices.

`apply()` replaces the function where megatron's router looks it up (it imports the name), once
per process, before the first model is built (models/gpt.py: build_model). It does so only for
the megatron-core releases it was verified against: another release keeps its own function and
the run warns. tests/test_moe_aux_loss.py keeps a check that fails once a megatron-core release
fixes the bug, so the fix is then reviewed and removed.
"""

from __future__ import annotations

import warnings

import torch

# megatron-core releases whose get_tokens_per_expert_and_token_count has the bug this fixes
VERIFIED_MEGATRON_CORE = ("0.19.2",)

_applied = False
megatron_original = None  # megatron's own function (kept for the test that watches upstream)


def group_mean_token_count(routing_map: torch.Tensor, reduce_group, topk: int = None,
                           with_padding_mask: bool = False):
    """megatron's get_tokens_per_expert_and_token_count, with a padding mask returning as the
    local token count the group's mean share of the micro batch's valid tokens (see the module
    docstring). Returns (global tokens per expert, local count, total count) as megatron's."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    global_tokens_per_expert = reduce_from_tensor_model_parallel_region(routing_map.sum(dim=0), reduce_group)
    if with_padding_mask:
        total_num_tokens = global_tokens_per_expert.sum() / topk
        return global_tokens_per_expert, total_num_tokens / reduce_group.size(), total_num_tokens
    local_num_tokens = routing_map.shape[0]
    return global_tokens_per_expert, local_num_tokens, local_num_tokens * reduce_group.size()


def megatron_core_version() -> str:
    # the installed distribution's: megatron.core.package_info appends the git commit of the
    # working directory when it is a checkout (ours: "0.19.2+3199f28")
    from importlib import metadata

    return metadata.version("megatron-core")


def apply() -> bool:
    """Route megatron's MoE routers through group_mean_token_count (once per process). False
    where this megatron-core release was not verified (the router is left as it is, with a warning)."""
    global _applied, megatron_original
    if _applied:
        return True
    from megatron.core.transformer.moe import moe_utils, router

    version = megatron_core_version()
    if version not in VERIFIED_MEGATRON_CORE:
        warnings.warn(f"megatron-core {version}: models/moe_fixes.py fixes the MoE load-balancing token count of "
                      f"{', '.join(VERIFIED_MEGATRON_CORE)} only and leaves this release's router as it is; check "
                      "whether NVIDIA/Megatron-LM PR #7481 is in it (tests/test_moe_aux_loss.py compares TP 2 with TP 1)",
                      stacklevel=2)
        return False
    megatron_original = moe_utils.get_tokens_per_expert_and_token_count
    router.get_tokens_per_expert_and_token_count = group_mean_token_count
    moe_utils.get_tokens_per_expert_and_token_count = group_mean_token_count
    _applied = True
    return True
