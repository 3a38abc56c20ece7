"""torchrun worker for tests/test_moe_aux_loss.py: the gradient of megatron's load-balancing
loss in our trainers, at each layout of the launch (`--layout NAME=TPxPP[:key=value...]`).

Every row of the batch is the same sequence, so every microbatch and every data-parallel share
has the routing statistics of the whole batch and megatron's per-microbatch load-balancing loss
is the same number however the batch is split. The auxiliary gradient (the actor's gradient
with the coefficient on minus with it off, the policy loss held fixed) must then be the same for
micro batch 1, 2 and the whole share, for token-mean and sequence-mean loss aggregation, for a
short and a long prompt (other response-token counts), and at DP2 / EP2; and it must equal
coefficient x the gradient of megatron's loss itself (its own path without per-token loss: one
microbatch, loss scale 1). Results go to --root (global rank 0).
"""

from functools import partial

import torch

from megatron_rlhf.checkpoint.dist import load_role, save_role
from megatron_rlhf.config import RLConfig
from megatron_rlhf.models.roles import Actor
from megatron_rlhf.trainers.rl import actor_loss
from workers import run_layouts, training_of

ROWS, SEQ = 8, 16
COEF = 1.0  # large: the auxiliary gradient is a difference of two gradients that the policy loss dominates otherwise
LOSSES = {  # name -> (loss aggregation, prompt length)
    "token_mean": ("token_mean", 3),
    "seq_mean": ("seq_mean_token_mean", 3),
    "token_mean_long_prompt": ("token_mean", 11),
}


def make_batch(prompt: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    row = torch.randint(2, 100, (SEQ,), generator=g)
    positions = torch.arange(SEQ)
    mask = ((positions >= prompt - 1) & (positions < SEQ - 1)).float().expand(ROWS, -1)
    return {"tokens": row.expand(ROWS, -1).clone(), "lengths": torch.full((ROWS,), SEQ),
            "prompt_lengths": torch.full((ROWS,), prompt), "mask": mask.clone(),
            "advantages": (torch.randn(SEQ, generator=g) * mask[0]).expand(ROWS, -1).clone(),
            "old_logprobs": torch.full((ROWS, SEQ), -4.0) * mask, "ref_logprobs": torch.full((ROWS, SEQ), -4.0) * mask}


def dp_share(batch):
    from megatron.core import parallel_state as ps

    n, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    return {k: v[r * ROWS // n:(r + 1) * ROWS // n] for k, v in batch.items()}


def shared_gradients(actor) -> dict[str, torch.Tensor]:
    """main_grad of every parameter but the experts' (which the load-balancing loss does not
    reach): the same tensors at every expert-parallel layout."""
    return {n: p.main_grad.detach().clone() for n, p in actor.module.named_parameters() if ".experts." not in n}


def auxiliary_gradient(actor, batch, micro_batch_size: int, loss_fn) -> dict[str, torch.Tensor]:
    config = actor.module.config
    grads = {}
    for coef in (COEF, 0.0):
        config.moe_aux_loss_coeff = coef
        actor.gradients(batch, micro_batch_size, loss_fn)
        grads[coef] = shared_gradients(actor)
    config.moe_aux_loss_coeff = COEF
    return {n: grads[COEF][n] - grads[0.0][n] for n in grads[COEF]}


def megatron_reference(actor, batch) -> dict[str, torch.Tensor]:
    """COEF x the gradient of megatron's load-balancing loss over the whole batch as one
    microbatch, by megatron's own path: no per-token loss, loss scale 1, a zero main loss."""
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    routers = [m for m in actor.module.modules() if hasattr(m, "calculate_per_token_loss")]
    actor.model.zero_grad_buffer()
    actor.model.train()
    for router in routers:
        router.calculate_per_token_loss = False
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    tokens = batch["tokens"]
    logits = actor.model(tokens, torch.arange(SEQ).expand_as(tokens), None)
    (logits.sum() * 0.0).backward()
    for router in routers:
        router.calculate_per_token_loss = True
    return shared_gradients(actor)


def check_layout(args, cfg, layout: str) -> None:
    actor = Actor(cfg.model, **training_of(cfg))
    if layout == "init":
        save_role(actor, args.root / "init", with_optimizer=False)
        return
    load_role(actor, args.root / "init", with_optimizer=False)
    results = {"aux": {}}
    for name, (aggregation, prompt) in LOSSES.items():
        batch = dp_share(make_batch(prompt))
        loss_fn = partial(actor_loss, rl=RLConfig(loss_aggregation=aggregation, kl_in_reward=False), kl_coef=0.1)
        for mbs in (1, 2, batch["tokens"].size(0)):
            results["aux"][(name, mbs)] = auxiliary_gradient(actor, batch, mbs, loss_fn)
    if layout == "tp1pp1":
        results["megatron"] = megatron_reference(actor, make_batch(3))
    if torch.distributed.get_rank() == 0:
        torch.save(results, args.root / f"aux_{layout}.pt")


if __name__ == "__main__":
    run_layouts(check_layout)
