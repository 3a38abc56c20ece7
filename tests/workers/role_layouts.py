"""torchrun worker for tests/test_role_layouts.py: the four roles at one TP x PP x DP layout.

Layouts are given as `--layout NAME=TPxPP[:key=value...]` (several per launch: workers.run_layouts).
"init" (one process, first) builds all roles from a seed and saves their weights, plus the PPO
inputs (old and reference log-probs, old values) computed from them; the other layouts load
both, so every layout starts from identical weights and identical loss inputs.
Every other layout:
  1. forward outputs of actor, reference, critic and reward model on a fixed batch, and with
     each microbatch's rows packed into one THD row (rl.packing);
  2. gradients of the trainers' own losses (SFT, PPO actor in two aggregation modes, PPO
     critic, Bradley-Terry, DPO sigmoid and IPO) on a batch of very unequal sequence lengths, for several micro
     batch sizes (one split packed): compared in-process (same layout), and saved for the rank's whole share
     (one microbatch) for the test to compare across layouts; data-parallel whitening and moments vs one process;
  3. one optimizer step of each trainable role (its batch split across DP ranks); the
     updated weights are saved for the test to compare across layouts;
  4. exact resume: actor save (with DistributedOptimizer state) -> load -> step equals the
     uninterrupted step; and the TP1-PP1 actor checkpoint, loaded here, steps like TP1-PP1.
Results go to --root (global rank 0).
"""

import sys
from functools import partial

import torch

from megatron_rlhf.algorithms.stats import masked_whiten, whiten
from megatron_rlhf.checkpoint.dist import load_role, save_role
from megatron_rlhf.config import DPOConfig, RLConfig
from megatron_rlhf.models.roles import Actor, Critic, Reference, RewardModel
from megatron_rlhf.parallel.collectives import masked_moments
from megatron_rlhf.trainers.dpo import pair_loss
from megatron_rlhf.trainers.rl import actor_loss, critic_loss
from megatron_rlhf.trainers.rm import bradley_terry_loss
from megatron_rlhf.trainers.sft import sft_loss
from workers import run_layouts, training_of
from workers.routing_checks import routing_checks

ROLES = {"actor": Actor, "reference": Reference, "critic": Critic, "reward": RewardModel}
TRAINABLE = ("actor", "critic", "reward")
BATCH, SEQ, MBS, VOCAB, PROMPT = 8, 16, 2, 100, 3
# The first half (data-parallel rank 0 at DP2) is long, the second short: microbatches and
# ranks hold very different token counts, which a per-microbatch mean would weigh equally.
LENGTHS = [16, 15, 16, 14, 4, 5, 6, 4]
TOKEN_BUDGET = 24  # one long row per microbatch, the four short ones together
PPO = partial(RLConfig, entropy_coef=0.01, kl_in_reward=False, kl_estimator="k2", clip_eps=0.2, value_clip=0.2)
# name -> (role, loss function). Rows alternate chosen/rejected for the reward model.
LOSSES = {
    "sft": ("actor", sft_loss),
    "ppo_actor": ("actor", partial(actor_loss, rl=PPO(), kl_coef=0.1)),
    "ppo_actor_seq_mean": ("actor", partial(actor_loss, rl=PPO(loss_aggregation="seq_mean_token_mean"), kl_coef=0.1)),
    # the critic-free policy-loss options: GSPO's sequence ratio, clip-higher, dual-clip, k3 in the loss
    "grpo_actor_options": ("actor", partial(actor_loss, kl_coef=0.1, rl=PPO(
        algorithm="grpo", n_samples_per_prompt=2, importance_ratio="sequence", clip_eps_high=0.28, dual_clip=3.0,
        kl_estimator="k3", loss_aggregation="seq_mean_token_mean"))),
    "critic": ("critic", partial(critic_loss, rl=PPO())),
    "reward": ("reward", bradley_terry_loss),
    # DPO on the same rows read as pairs (chosen, rejected): sigmoid with label smoothing and the
    # SFT term, and IPO (log-ratios averaged over each side's response tokens)
    "dpo_sigmoid": ("actor", partial(pair_loss, dpo=DPOConfig(beta=0.5, label_smoothing=0.1, sft_weight=0.2))),
    "dpo_ipo": ("actor", partial(pair_loss, dpo=DPOConfig(beta=0.5, loss="ipo"))),
}
PAIR_LOSSES = ("reward", "dpo_sigmoid", "dpo_ipo")  # microbatches of whole pairs
STEP_LOSSES = {"actor": "ppo_actor", "critic": "critic", "reward": "reward"}


def make_batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(LENGTHS)
    positions = torch.arange(SEQ)
    tokens = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g).masked_fill(positions >= lengths[:, None], 1)
    mask = ((positions >= PROMPT - 1) & (positions < lengths[:, None] - 1)).float()  # next token is a response token
    return {
        "tokens": tokens, "lengths": lengths, "prompt_lengths": torch.full((BATCH,), PROMPT),
        "loss_mask": mask, "mask": mask,
        "advantages": torch.randn(BATCH, SEQ, generator=g) * mask,
        "returns": torch.randn(BATCH, SEQ, generator=g) * mask,
    }


def ppo_inputs(roles, batch, seed: int = 5) -> dict[str, torch.Tensor]:
    """Old/reference log-probs near the actor's own (ratios around 1, some clipped) and old
    values near the critic's: what the score phase would hand to the train phase."""
    g = torch.Generator().manual_seed(seed)
    logprobs = roles["actor"].forward(batch, MBS)["logprobs"]
    values = roles["critic"].forward(batch, MBS)["values"]
    noise = lambda scale: scale * torch.randn(BATCH, SEQ, generator=g)  # noqa: E731
    mask = batch["mask"]
    ref_logprobs = (logprobs + noise(0.5)) * mask
    return {"old_logprobs": (logprobs + noise(0.2)) * mask, "ref_logprobs": ref_logprobs,
            "values": (values + noise(0.3)) * mask, "ref_logps": ref_logprobs.sum(-1)}


def dp_shard(batch):
    from megatron.core import parallel_state as ps

    n, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    size = BATCH // n
    return {k: v[r * size : (r + 1) * size] for k, v in batch.items()}


def params(role):
    return {n: p.detach().clone() for n, p in role.module.named_parameters()}


def flat_gradient(role) -> torch.Tensor:
    return torch.cat([p.main_grad.detach().flatten().clone() for p in role.module.parameters()])


def save_gradients(role, path) -> None:
    """The gradients as a model checkpoint (weights := main_grad), so that the test reads
    them back unsharded whatever the layout; the weights are restored afterwards."""
    weights = params(role)
    with torch.no_grad():
        for p in role.module.parameters():
            p.copy_(p.main_grad)
        save_role(role, path, with_optimizer=False)
        for name, p in role.module.named_parameters():
            p.copy_(weights[name])


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.item()


def gradient_checks(args, layout: str, roles, batch) -> dict:
    """Per loss: reported global mean loss and gradients for micro batch sizes 1, 2, the
    rank's whole share and a token budget; the in-layout relative gradient difference against the whole share."""
    shard = dp_shard(batch)
    rows = shard["tokens"].size(0)
    out = {}
    for name, (role_name, loss_fn) in LOSSES.items():
        if args.losses and name not in args.losses.split(","):
            continue
        role = roles[role_name]
        # Pairs stay whole at fixed sizes; the others also split by a token budget: microbatches
        # of 1 and 4 rows and of different widths (PP: megatron's variable_seq_lengths).
        # Packed (rl.packing): each microbatch's rows as one THD row, by the same token budget
        # (real tokens) or, for pairs, two rows per microbatch.
        splits = ([(2, 0, False), (2, 0, True), (rows, 0, False)] if name in PAIR_LOSSES else
                  [(1, 0, False), (2, 0, False), (1, TOKEN_BUDGET, False), (1, TOKEN_BUDGET, True), (rows, 0, False)])
        reported, grads = {}, {}
        if cfg_is_moe(role):  # rl.packing refuses MoE models (routing replay is not packed yet)
            splits = [split for split in splits if not split[2]]
        for mbs, budget, packed in splits:
            key = f"{budget} tokens" if budget else mbs
            key = f"packed {key}" if packed else key
            role.packing = packed
            reported[key] = role.gradients(shard, mbs, loss_fn, token_budget=budget)
            role.packing = False
            grads[key] = flat_gradient(role)
        # Last computed: the whole share. At DP2 the two ranks' shares hold very different token
        # counts, which a mean of per-rank means would weigh equally.
        save_gradients(role, args.root / "grads" / layout / name)
        ref = grads[rows]
        scale = ref.abs().max().item()
        out[name] = {
            "reported": reported,
            "grad_scale": scale,
            "rel_diff": {mbs: max_over_ranks((g - ref).abs().max().item() / scale) for mbs, g in grads.items()},
        }
    return out


def whitening_checks(batch) -> dict:
    """Moments and whitening over data-parallel shards vs the whole batch in one process."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(BATCH, SEQ, generator=g) * 3 + 1
    shard = dp_shard({"x": x, "mask": batch["mask"]})
    count, mean, var = masked_moments(shard["x"], shard["mask"])
    local = whiten(shard["x"], shard["mask"], mean, var)
    want = dp_shard({"w": masked_whiten(x, batch["mask"])})["w"]
    n = batch["mask"].sum()
    return {"count": count.item(), "count_want": n.item(), "mean": mean.item(),
            "mean_want": (x.double() * batch["mask"]).sum().item() / n.item(),
            "whiten_diff": max_over_ranks((local - want).abs().max().item())}


def precomputed_reference(reference, batch) -> torch.Tensor:
    """DPO's precomputed reference table ([pairs, 2], each data-parallel rank computing its share)
    for the batch's rows read as pairs (chosen, rejected): collated, they are the batch again."""
    from megatron_rlhf.data.encode import EncodedPair
    from megatron_rlhf.trainers.dpo import precompute

    rows = [batch["tokens"][i, : batch["lengths"][i]].tolist() for i in range(BATCH)]
    pairs = [EncodedPair(rows[i], rows[i + 1], PROMPT) for i in range(0, BATCH, 2)]
    return precompute(reference, pairs, pad_id=1, seq_len=SEQ, micro_pairs=1)


def cfg_is_moe(role) -> bool:
    return bool(role.model_config.num_experts)


def packed_outputs(roles, batch) -> dict:
    """Each role's outputs with its microbatches' rows packed into one THD row (rl.packing; dense
    models only: rl.packing refuses MoE)."""
    out = {}
    for name, role in roles.items():
        if cfg_is_moe(role):
            continue
        role.packing = True
        out[name] = role.forward(batch, MBS)
        role.packing = False
    return out


def check_layout(args, cfg, layout: str) -> None:
    from megatron_rlhf.models import gpt
    from workers.context_parallel_attention import ContextParallelSDPA

    rank = torch.distributed.get_rank()
    # context parallelism on CPU: the reference attention (megatron's local one has none)
    gpt.cpu_context_parallel_attention = ContextParallelSDPA if cfg.parallel.context_parallel > 1 else None
    if layout == "init":
        roles = {name: cls(cfg.model) if name == "reference" else cls(cfg.model, **training_of(cfg))
                 for name, cls in ROLES.items()}
        for name, role in roles.items():
            save_role(role, args.root / "init" / name, with_optimizer=False)
        torch.save(ppo_inputs(roles, make_batch(seed=1)), args.root / "init" / "ppo_inputs.pt")
        return

    roles = {name: cls(cfg.model) if name == "reference" else cls(cfg.model, trainable=True, **training_of(cfg))
             for name, cls in ROLES.items()}
    for name, role in roles.items():
        load_role(role, args.root / "init" / name, with_optimizer=False)

    batch = {**make_batch(seed=1), **torch.load(args.root / "init" / "ppo_inputs.pt")}
    results = {"outputs": {}, "losses": {}, "sequence_parallel": {n: r.module.config.sequence_parallel for n, r in roles.items()}}
    for name, role in roles.items():
        results["outputs"][name] = role.forward(batch, MBS)
    results["packed_outputs"] = packed_outputs(roles, batch)
    results["dpo_reference"] = precomputed_reference(roles["reference"], batch)
    results["gradients"] = gradient_checks(args, layout, roles, batch)
    results["whitening"] = whitening_checks(batch)
    for name in TRAINABLE:
        metrics = roles[name].train_step(dp_shard(batch), MBS, LOSSES[STEP_LOSSES[name]][1])
        results["losses"][name] = metrics["loss"]
        save_role(roles[name], args.root / "after_step" / layout / name, with_optimizer=False)

    # Exact resume of the actor through a DistributedOptimizer checkpoint.
    actor, actor_loss_fn = roles["actor"], LOSSES["sft"][1]
    resume_dir = args.root / "resume" / layout
    save_role(actor, resume_dir)
    batch2 = dp_shard(make_batch(seed=2))
    uninterrupted = actor.train_step(batch2, MBS, actor_loss_fn)
    save_role(actor, args.root / "after_two_steps" / layout / "actor", with_optimizer=False)
    resumed_actor = Actor(cfg.model, **training_of(cfg))
    load_role(resumed_actor, resume_dir)
    resumed = resumed_actor.train_step(batch2, MBS, actor_loss_fn)
    expected, got = params(actor), params(resumed_actor)
    results["resume"] = {
        "loss_uninterrupted": uninterrupted["loss"], "loss_resumed": resumed["loss"],
        "max_param_diff": max((expected[n] - got[n]).abs().max().item() for n in expected),
        "adam_steps": sorted({float(s["step"]) for inner in getattr(resumed_actor.optimizer, "chained_optimizers",
                                                                   [resumed_actor.optimizer])
                              for s in inner.optimizer.state.values()}),  # chained: dense + expert parameters
    }
    # The TP1-PP1 optimizer checkpoint, resharded to this layout, takes the same second step.
    from_tp1 = Actor(cfg.model, **training_of(cfg))
    load_role(from_tp1, args.root / "resume" / "tp1pp1dp1")
    from_tp1.train_step(batch2, MBS, actor_loss_fn)
    save_role(from_tp1, args.root / "resharded_step" / layout / "actor", with_optimizer=False)

    if args.routes:
        results["routing"] = routing_checks(args, cfg, layout)
    if rank == 0:
        torch.save(results, args.root / f"results_{layout}.pt")


if __name__ == "__main__":
    sys.exit(run_layouts(check_layout, extra_args=[
        ("--losses", {"default": "", "help": "names of LOSSES to check (comma-separated; default: all)"}),
        ("--routes", {"action": "store_true", "help": "an MoE actor's routing replay too (routing_checks.py)"})]))
