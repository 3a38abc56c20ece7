"""torchrun worker for tests/test_role_semantics.py: what each role's outputs mean.

Computes the roles' outputs and, beside them, the same quantities from first principles
(full logits from the bare GPTModel, log_softmax, gathers), and writes both to --out.
"""

import argparse
from pathlib import Path

import torch

from megatron_rlhf import parallel
from megatron_rlhf.checkpoint.dist import save_role
from megatron_rlhf.config import load_config
from megatron_rlhf.models.roles import Actor, Critic, Reference, RewardModel, summed
from megatron_rlhf.trainers.runner import start_distributed
from workers import training_of

TEMPERATURE = 0.7


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(None, args.overrides)
    start_distributed(cfg)
    vocab = cfg.model.vocab_size
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (4, 12), generator=g)
    lengths = torch.tensor([12, 7, 3, 9])
    res = {"tokens": tokens, "lengths": lengths, "vocab": vocab}

    actor = Actor(cfg.model, temperature=TEMPERATURE, **training_of(cfg))
    out = actor.forward({"tokens": tokens}, micro_batch_size=2)
    res.update(logprobs=out["logprobs"], entropy=out["entropy"])
    with torch.no_grad():  # full logits [b, s, padded_vocab] straight from megatron's GPTModel
        position_ids = torch.arange(tokens.size(1)).expand_as(tokens)
        res["logits"] = actor.module(tokens, position_ids, None)

    reward_model = RewardModel(cfg.model)
    critic = Critic(cfg.model, **training_of(cfg))
    critic.module.load_state_dict(reward_model.module.state_dict())  # same network, same weights
    res["rewards"] = reward_model.forward({"tokens": tokens, "lengths": lengths}, 2)["rewards"]
    res["values"] = critic.forward({"tokens": tokens}, 2)["values"]
    head = reward_model.module.output_layer
    res["head_weight"], res["head_bias"] = head.weight.detach().clone(), head.bias.detach().clone()

    # Rows with `lengths` run each microbatch trimmed to its longest row (models/roles.py): the
    # same outputs at every real position as the untrimmed forward, zeros past the trim.
    widths = []  # the sequence width megatron's embedding actually sees, per microbatch
    hook = actor.module.embedding.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].size(1)), with_kwargs=True)
    trimmed = actor.forward({"tokens": tokens, "lengths": lengths}, micro_batch_size=2)
    hook.remove()
    res["trimmed_widths"] = widths
    res.update(trimmed_logprobs=trimmed["logprobs"], trimmed_entropy=trimmed["entropy"],
               trimmed_values=critic.forward({"tokens": tokens, "lengths": lengths}, 2)["values"])
    reference = Reference(cfg.model)
    res["reference_trainable_params"] = sum(p.requires_grad for p in reference.module.parameters())
    res["reference_training_mode"] = reference.module.training
    try:
        reference.train_step({"tokens": tokens}, 2, lambda o, mb: (*summed(o["logprobs"]), {}))
        res["reference_train_step_refused"] = False
    except AssertionError:
        res["reference_train_step_refused"] = True
    res["dropout"] = (actor.module.config.hidden_dropout, actor.module.config.attention_dropout)

    # Saving a never-stepped optimizer (its Adam state is materialised for megatron) must not
    # change the first step.
    twin = Actor(cfg.model, temperature=TEMPERATURE, **training_of(cfg))
    twin.module.load_state_dict(actor.module.state_dict())
    twin.optimizer.reload_model_params()
    save_role(twin, args.out.parent / "fresh_optimizer")
    loss_fn = lambda o, mb: (*summed(-o["logprobs"]), {})  # noqa: E731
    actor.train_step({"tokens": tokens}, 2, loss_fn)
    twin.train_step({"tokens": tokens}, 2, loss_fn)
    from megatron_rlhf.logging.memory import memory_account  # after a step: Adam's state exists

    res["memory_account"] = memory_account({"actor": actor, "critic": critic}, 0, 0)
    res["param_count"] = sum(p.numel() for p in actor.module.parameters())
    res["padded_vocab"] = cfg.model.padded_vocab_size
    res["fresh_save_step_diff"] = max(
        (p - q).abs().max().item() for p, q in zip(actor.module.parameters(), twin.module.parameters())
    )
    # Advantage whitening summed over data-parallel ranks equals the single-process formula.
    from megatron_rlhf.algorithms.stats import masked_whiten, whiten
    from megatron_rlhf.parallel.collectives import masked_moments

    x, m = torch.randn(4, 6, generator=g), (torch.rand(4, 6, generator=g) > 0.3).float()
    _, mean, var = masked_moments(x, m)
    res["whiten_diff"] = (masked_whiten(x, m) - whiten(x, m, mean, var)).abs().max().item()
    # DDP's gradient buffers and the optimizer come from the same (the stage's) optimizer
    # section, whatever the top-level `optimizer` section says.
    import dataclasses

    from megatron.core.optimizer import DistributedOptimizer

    res["optimizer_sections"] = {}
    for stage_says in (False, True):
        stage_optimizer = dataclasses.replace(cfg.optimizer, use_distributed_optimizer=stage_says)
        cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, use_distributed_optimizer=not stage_says))
        role = Actor(cfg.model, **training_of(cfg, optimizer=stage_optimizer))
        res["optimizer_sections"][stage_says] = (role.model.ddp_config.use_distributed_optimizer,
                                                 all(isinstance(o, DistributedOptimizer) for o in
                                                     getattr(role.optimizer, "chained_optimizers", [role.optimizer])))
    # The fused log-prob + entropy function against autograd through the textbook formulas.
    from megatron_rlhf.models.vocab_parallel import vocab_parallel_logprobs_and_entropy

    logits = torch.randn(5, 3, 11, dtype=torch.float64, generator=g).requires_grad_()
    targets = torch.randint(0, 11, (5, 3), generator=g)
    up_lp, up_h = torch.randn(5, 3, dtype=torch.float64, generator=g), torch.randn(5, 3, dtype=torch.float64, generator=g)
    fused = vocab_parallel_logprobs_and_entropy(logits, targets)
    fused_grad, = torch.autograd.grad(fused[0] * up_lp + fused[1] * up_h, logits, torch.ones_like(up_lp))
    log_p = torch.log_softmax(logits, -1)
    plain = (log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1))
    plain_grad, = torch.autograd.grad(plain[0] * up_lp + plain[1] * up_h, logits, torch.ones_like(up_lp))
    res["fused_logprob_entropy_diff"] = max((fused[0] - plain[0]).abs().max().item(), (fused[1] - plain[1]).abs().max().item())
    res["fused_grad_diff"] = (fused_grad - plain_grad).abs().max().item()
    res["fused_grad_scale"] = plain_grad.abs().max().item()
    # megatron's activation recomputation changes memory, never the gradient.
    res["recompute_grad_diff"] = {}
    full_loss = lambda o, mb: (*summed(-o["logprobs"] - 0.1 * o["entropy"]), {})  # noqa: E731
    grads = {}
    for granularity, extra in ((None, {}), ("selective", {}), ("full", {"recompute_method": "uniform", "recompute_num_layers": 1})):
        model_cfg = dataclasses.replace(cfg.model, recompute_granularity=granularity, **extra)
        role = Actor(model_cfg, temperature=TEMPERATURE, **training_of(cfg))
        role.module.load_state_dict(actor.module.state_dict())
        role.optimizer.reload_model_params()
        role.gradients({"tokens": tokens, "lengths": lengths}, 2, full_loss)
        grads[granularity] = torch.cat([p.main_grad.flatten() for p in role.module.parameters()])
        res["recompute_grad_diff"][granularity] = (grads[granularity] - grads[None]).abs().max().item()
        res.setdefault("recompute_activation_bytes", {})[granularity] = role.activation_bytes
    res["recompute_grad_scale"] = grads[None].abs().max().item()
    torch.save(res, args.out)
    parallel.destroy()


if __name__ == "__main__":
    main()
