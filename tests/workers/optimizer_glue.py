"""torchrun worker for tests/test_optimizer_glue.py (2 processes, TP1 PP1, so DP2 with the
DistributedOptimizer sharding Adam over both ranks). Results go to <root>/results.pt (rank 0).

  fused      the flags of every torch AdamW param group of a fresh actor and critic;
  numerics   a fused actor and a single-tensor one (its groups' flags reset to what megatron
             builds: fused and foreach unset), from the same seed, 3 steps on the same batches:
             weights and Adam moments of both, and how far the weights moved;
  old_ckpt   the single-tensor actor's checkpoint (written "before the change": its param groups
             carry no fused flag, as the saved common state shows) loaded into a fresh actor:
             the loaded groups' flags, and one more step of each (loaded vs the single-tensor
             original);
  resume     the fused actor saved after step 3, loaded into a fresh actor; step 4 of both;
  modes      a LoRA actor with adapter dropout 0.5 (trained one step so its adapters matter):
             whether every module is in the mode each call needs, with a submodule left in the
             other mode before the call (as the rollout engine or megatron's inference
             wrappers may leave it) and after the LoRA reference's forward (the adapter-free
             actor module), and whether two eval forwards agree;
  guard      the NaN guard's collective answer on each rank when only rank 1's tensors
             overflow a float32 sum (finite) or hold a NaN.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rlhf import parallel  # before megatron.core: it adapts megatron-core to CPU
from megatron_rlhf.checkpoint.dist import load_role, save_role
from megatron_rlhf.config import LoRAConfig, load_config
from megatron_rlhf.models.optimizer import _inner_optimizers, _torch_adam
from megatron_rlhf.models.roles import Actor, AdapterFreeReference, Critic, summed
from megatron_rlhf.resilience.nonfinite import any_rank_nonfinite
from megatron_rlhf.trainers.runner import start_distributed
from megatron.core import dist_checkpointing, parallel_state  # noqa: E402  (after megatron_rlhf)

from workers.checkpoint_safety import MBS, batch  # noqa: E402  (the same batches and actor loss)
from workers.checkpoint_safety import loss as actor_loss  # noqa: E402
from workers import training_of  # noqa: E402


def critic_loss(out, mb):
    return (*summed((out["values"] - mb["advantages"]) ** 2), {})


def adam_groups(role) -> list[dict]:
    return [g for opt in _inner_optimizers(role.optimizer) for g in _torch_adam(opt).param_groups]


def group_flags(role) -> list[tuple]:
    return [(g["fused"], g["foreach"]) for g in adam_groups(role)]


def as_megatron_builds_it(role) -> None:
    for group in adam_groups(role):
        group["fused"] = group["foreach"] = None


def weights(role) -> dict[str, torch.Tensor]:
    return {f"w.{n}": p.detach().clone() for n, p in role.module.named_parameters()}


def state(role) -> dict[str, torch.Tensor]:
    """This rank's weights, its shard of the Adam moments and the steps, in a fixed order."""
    out = weights(role)
    for opt in _inner_optimizers(role.optimizer):
        adam = _torch_adam(opt)
        for gi, group in enumerate(adam.param_groups):
            for pi, p in enumerate(group["params"]):
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    out[f"{key}.{gi}.{pi}"] = adam.state[p][key].detach().clone()
    return out


def max_diff(a: dict, b: dict, relative: bool = False) -> float:
    """Over all ranks, the largest element difference; `relative`: per tensor, divided by the
    tensor's largest magnitude."""
    def diff(k):
        d = (a[k].double() - b[k].double()).abs().max().item()
        return d / max(a[k].double().abs().max().item(), 1e-30) if relative else d

    t = torch.tensor([max(diff(k) for k in a)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def train(role, steps) -> None:
    for step in steps:
        out = role.train_step(batch(step), MBS, actor_loss)
        assert not out["skipped"], step


def modes(role) -> set[bool]:
    return {m.training for m in role.model.modules()}


def check_modes(cfg) -> dict:
    actor = Actor(cfg.model, **training_of(cfg, lora=LoRAConfig(rank=4, alpha=8.0, dropout=0.5)))
    train(actor, [1])  # lora_B moves off zero: the adapters (and their dropout) now change outputs
    adapted = next(m for m in actor.model.modules() if getattr(m, "lora_dropout_p", 0))
    res = {}
    first = actor.forward(batch(9), MBS)["logprobs"]
    res["forward"] = modes(actor)
    adapted.train()  # one submodule left in training mode under an eval model
    second = actor.forward(batch(9), MBS)["logprobs"]
    res["forward_after_a_submodule_trained"] = modes(actor)
    res["eval_forwards_equal"] = torch.equal(first, second)
    train(actor, [2])
    res["train_step"] = modes(actor)
    train(actor, [3])
    res["train_step_again"] = modes(actor)
    adapted.eval()  # one submodule left in eval mode under a training model
    train(actor, [4])
    res["train_step_after_a_submodule_evaluated"] = modes(actor)
    actor.model.eval()  # the rollout engine's call
    train(actor, [5])
    res["train_step_after_the_engine"] = modes(actor)
    # A LoRA reference evaluates the actor's bare module: the DDP wrapper around it stays in training mode
    AdapterFreeReference(actor).forward(batch(9), MBS)
    res["reference_forward"] = {m.training for m in actor.module.modules()}
    train(actor, [6])
    res["train_step_after_the_reference"] = modes(actor)
    return res


def check_guard() -> list[dict]:
    """any_rank_nonfinite where only rank 1 holds a finite tensor whose sum overflows, or a NaN:
    every rank's answer."""
    def answer(odd: torch.Tensor) -> bool:
        return any_rank_nonfinite([torch.ones(10), odd if dist.get_rank() == 1 else torch.randn(100)])

    big = torch.full((100,), 3e38)
    nan = torch.randn(100)
    nan[17] = float("nan")
    mine = {"overflow": answer(big), "nan": answer(nan)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(None, args.overrides)
    start_distributed(cfg)
    res = {"data_parallel": parallel_state.get_data_parallel_world_size()}

    fused, critic = Actor(cfg.model, **training_of(cfg)), Critic(cfg.model, **training_of(cfg))
    res["fused"] = {"actor": group_flags(fused), "critic": group_flags(critic)}
    critic.train_step(batch(1), MBS, critic_loss)
    res["fused"]["critic_after_step"] = group_flags(critic)

    parallel.seed_everything(cfg.seed)
    fused = Actor(cfg.model, **training_of(cfg))
    parallel.seed_everything(cfg.seed)
    single = Actor(cfg.model, **training_of(cfg))
    as_megatron_builds_it(single)
    start = weights(fused)
    train(fused, [1, 2, 3])
    train(single, [1, 2, 3])
    res["numerics"] = {"fused_vs_single": max_diff(state(fused), state(single), relative=True),
                       "weights_fused_vs_single": max_diff(weights(fused), weights(single)),
                       "moved": max_diff(weights(fused), start), "single_flags": group_flags(single)}

    save_role(single, args.root / "single_tensor")
    save_role(fused, args.root / "fused")
    saved = dist_checkpointing.load_common_state_dict(str(args.root / "single_tensor"))
    res["old_ckpt"] = {"saved_flags": [(g.get("fused"), g.get("foreach"))
                                       for g in saved["optimizer"]["optimizer"]["param_groups"]]}
    loaded = Actor(cfg.model, **training_of(cfg))
    load_role(loaded, args.root / "single_tensor")
    res["old_ckpt"]["loaded_flags"] = group_flags(loaded)
    res["old_ckpt"]["loaded_equals_saved"] = max_diff(state(loaded), state(single))
    train(loaded, [4])
    train(single, [4])
    res["old_ckpt"]["next_step_vs_single"] = max_diff(state(loaded), state(single))

    resumed = Actor(cfg.model, **training_of(cfg))
    load_role(resumed, args.root / "fused")
    train(resumed, [4])
    train(fused, [4])
    res["resume"] = {"flags": group_flags(resumed), "vs_uninterrupted": max_diff(state(resumed), state(fused))}

    res["modes"] = check_modes(cfg)
    res["guard"] = check_guard()
    if dist.get_rank() == 0:
        torch.save(res, args.root / "results.pt")
    parallel.destroy()


if __name__ == "__main__":
    sys.exit(main())
