"""torchrun worker for tests/test_role_layouts.py: the four roles at one TP x PP x DP layout.

--init: (one process) build all roles from a seed and save their weights; the other layouts
load them, so every layout starts from identical weights through megatron dist checkpoints.
Otherwise, at this launch's layout:
  1. forward outputs of actor, reference, critic and reward model on a fixed batch;
  2. one optimizer step of each trainable role (its batch split across DP ranks); the
     updated weights are saved for the test to compare across layouts;
  3. exact resume: actor save (with DistributedOptimizer state) -> load -> step equals the
     uninterrupted step; and the TP1-PP1 actor checkpoint, loaded here, steps like TP1-PP1.
Results go to --out (global rank 0).
"""

import sys

import torch
import torch.nn.functional as F

from megatron_rlhf import parallel
from megatron_rlhf.checkpoint.dist import load_role, save_role
from megatron_rlhf.models.roles import Actor, Critic, Reference, RewardModel
from workers import start_layout_worker

ROLES = {"actor": Actor, "reference": Reference, "critic": Critic, "reward": RewardModel}
TRAINABLE = ("actor", "critic", "reward")
BATCH, SEQ, MBS, VOCAB = 8, 16, 2, 100


def make_batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
    lengths = torch.randint(4, SEQ + 1, (BATCH,), generator=g)
    valid = torch.arange(SEQ) < lengths[:, None]
    tokens = tokens.masked_fill(~valid, 1)  # right padding with a pad id
    return {
        "tokens": tokens,
        "lengths": lengths,
        "mask": (torch.arange(SEQ) < (lengths[:, None] - 1)).float(),  # positions with a next token
        "advantages": torch.randn(BATCH, SEQ, generator=g),
        "returns": torch.randn(BATCH, SEQ, generator=g),
    }


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp(min=1)


LOSSES = {
    "actor": lambda o, mb: -masked_mean(o["logprobs"] * mb["advantages"], mb["mask"])
    - 0.01 * masked_mean(o["entropy"], mb["mask"]),
    "critic": lambda o, mb: masked_mean((o["values"] - mb["returns"]) ** 2, mb["mask"]),
    # rows come in (chosen, rejected) pairs; a microbatch of 2 holds one pair
    "reward": lambda o, mb: -F.logsigmoid(o["rewards"][0::2] - o["rewards"][1::2]).mean(),
}


def dp_shard(batch):
    from megatron.core import parallel_state as ps

    n, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    size = BATCH // n
    return {k: v[r * size : (r + 1) * size] for k, v in batch.items()}


def dp_mean(value: float) -> float:
    from megatron.core import parallel_state as ps

    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t, group=ps.get_data_parallel_group())
    return t.item() / ps.get_data_parallel_world_size()


def params(role):
    return {n: p.detach().clone() for n, p in role.module.named_parameters()}


def main() -> None:
    args, cfg = start_layout_worker()
    rank = torch.distributed.get_rank()

    if args.init:
        for name, cls in ROLES.items():
            save_role(cls(cfg), args.root / "init" / name, with_optimizer=False)
        parallel.destroy()
        return

    roles = {name: cls(cfg) if name == "reference" else cls(cfg, trainable=True) for name, cls in ROLES.items()}
    for name, role in roles.items():
        load_role(role, args.root / "init" / name, with_optimizer=False)

    batch = make_batch(seed=1)
    results = {"outputs": {}, "losses": {}}
    for name, role in roles.items():
        results["outputs"][name] = role.forward(batch, MBS)
    for name in TRAINABLE:
        metrics = roles[name].train_step(dp_shard(batch), MBS, LOSSES[name])
        results["losses"][name] = dp_mean(metrics["loss"])
        save_role(roles[name], args.root / "after_step" / args.layout / name, with_optimizer=False)

    # Exact resume of the actor through a DistributedOptimizer checkpoint.
    actor = roles["actor"]
    resume_dir = args.root / "resume" / args.layout
    save_role(actor, resume_dir)
    batch2 = dp_shard(make_batch(seed=2))
    uninterrupted = actor.train_step(batch2, MBS, LOSSES["actor"])
    save_role(actor, args.root / "after_two_steps" / args.layout / "actor", with_optimizer=False)
    resumed_actor = Actor(cfg)
    load_role(resumed_actor, resume_dir)
    resumed = resumed_actor.train_step(batch2, MBS, LOSSES["actor"])
    expected, got = params(actor), params(resumed_actor)
    results["resume"] = {
        "loss_uninterrupted": uninterrupted["loss"], "loss_resumed": resumed["loss"],
        "max_param_diff": max((expected[n] - got[n]).abs().max().item() for n in expected),
        "adam_steps": sorted({float(s["step"]) for s in resumed_actor.optimizer.optimizer.state.values()}),
    }
    # The TP1-PP1 optimizer checkpoint, resharded to this layout, takes the same second step.
    from_tp1 = Actor(cfg)
    load_role(from_tp1, args.root / "resume" / "tp1pp1dp1")
    from_tp1.train_step(batch2, MBS, LOSSES["actor"])
    save_role(from_tp1, args.root / "resharded_step" / args.layout / "actor", with_optimizer=False)

    if rank == 0:
        torch.save(results, args.root / f"results_{args.layout}.pt")
    parallel.destroy()


if __name__ == "__main__":
    sys.exit(main())
