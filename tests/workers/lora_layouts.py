"""torchrun worker for tests/test_lora.py: LoRA actor and critic at each layout of the launch
(`--layout NAME=TPxPP`, repeatable: workers.run_layouts).

--init (one process, TP1 PP1, before its own checks): base actor and critic checkpoints from a
seed; LoRA roles on them whose outputs must equal the base's while B = 0; then every B set to
seeded random values and the adapters saved (adapter-only checkpoints, with optimizer state).
Every layout loads base + adapters from those checkpoints, then:
  1. outputs of the LoRA actor, of the adapter-free reference and of the plain base model
     (reference == base bitwise); the same model with merged weights W + (alpha/r) B A; the
     HF tensors a rollout engine's refit receives (merged, gathered over TP and PP);
  2. what is trainable: the parameter names, the optimizer's and DDP's parameter counts;
  3. one optimizer step of each LoRA role on very unequal sequence lengths (adapter-only
     checkpoint saved for the test to compare across layouts, base weights unchanged);
  4. exact resume: save -> a fresh role loads base + adapters -> its step equals the
     uninterrupted second step bit for bit;
  5. the adapter checkpoints loaded as a later stage's start (merged into the base): frozen, and
     as the base of new adapters.
Results go to --root (global rank 0).
"""

from functools import partial

import torch

from megatron_rlhf.checkpoint.dist import load_model_weights, load_role, save_role
from megatron_rlhf.checkpoint.validate import CheckpointError
from megatron_rlhf.config import LoRAConfig, RLConfig
from megatron_rlhf.models.lora import is_adapter, lora_layers, merged_parameters
from megatron_rlhf.models.roles import Actor, AdapterFreeReference, Critic, Reference
from megatron_rlhf.rollout.refit import RefitPlan, stream_hf_weights
from megatron_rlhf.trainers.rl import critic_loss
from megatron_rlhf.trainers.sft import sft_loss
from workers import run_layouts, training_of
from workers.role_layouts import make_batch

LORA = LoRAConfig(rank=4, alpha=8.0, targets=["qkv", "proj", "fc1", "fc2", "output"])
MBS = 2
LOSSES = {"actor": sft_loss, "critic": partial(critic_loss, rl=RLConfig(value_clip=0.2))}


def build(cfg, name: str):
    return (Actor if name == "actor" else Critic)(cfg.model, trainable=True, **training_of(cfg, lora=LORA))


def load(cfg, root, name: str):
    role = build(cfg, name)
    load_model_weights(role, root / "init" / f"{name}_base")
    load_role(role, root / "init" / f"{name}_adapters")
    return role


def outputs(role, batch):
    return role.forward(batch, MBS)


def init(args, cfg, batch) -> None:
    for name, cls in (("actor", Reference), ("critic", Critic)):
        base = cls(cfg.model) if cls is Reference else cls(cfg.model, trainable=False)
        save_role(base, args.root / "init" / f"{name}_base", with_optimizer=False)
        role = build(cfg, name)
        load_model_weights(role, args.root / "init" / f"{name}_base")
        fresh = {"b_zero_equal": all(torch.equal(a, b) for a, b in zip(outputs(base, batch).values(),
                                                                          outputs(role, batch).values()))}
        torch.save(fresh, args.root / f"fresh_{name}.pt")
        g = torch.Generator().manual_seed(11 if name == "actor" else 12)
        with torch.no_grad():
            for layer in lora_layers(role.module):
                layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * 0.1)
        role.optimizer.reload_model_params()
        save_role(role, args.root / "init" / f"{name}_adapters")


def step(role, batch, name):
    return role.train_step(batch, MBS, LOSSES[name])["loss"]


def check_layout(args, cfg, layout: str) -> None:
    batch = make_batch(seed=1)
    batch["returns"] = batch["returns"] * batch["mask"]
    batch["old_values"] = batch["values"] = torch.zeros_like(batch["returns"])
    if args.init:
        init(args, cfg, batch)
    rank = torch.distributed.get_rank()
    res = {"outputs": {}, "losses": {}, "resume": {}, "trainable": {}, "base_recorded": {}}

    actor = load(cfg, args.root, "actor")
    base = Reference(cfg.model)
    load_role(base, args.root / "init" / "actor_base", with_optimizer=False)
    reference = AdapterFreeReference(actor)
    res["outputs"]["actor"] = outputs(actor, batch)
    res["outputs"]["reference"] = outputs(reference, batch)
    res["outputs"]["base"] = outputs(base, batch)
    res["adapters_on_after_reference"] = all(layer.lora_enabled for layer in lora_layers(actor.module))
    # what a rollout engine's refit receives (on its rank): HF tensors with the adapters merged
    plan = RefitPlan.build(actor.module, cfg.model)
    refit = {k: v.clone() for bucket in stream_hf_weights(actor.module, cfg.model, plan, 1 << 20) for k, v in bucket.items()}
    with torch.no_grad():
        merged = merged_parameters(actor.module)
        for n, p in base.module.named_parameters():
            p.copy_(merged[n])
    res["outputs"]["merged"] = outputs(base, batch)

    # A LoRA checkpoint as a later stage's start: frozen, its base with the adapters merged; under
    # a new LoRA actor (fresh adapters, B = 0, on top of the merged model) and its reference.
    frozen = Reference(cfg.model)
    load_role(frozen, args.root / "init" / "actor_adapters", with_optimizer=False)
    res["outputs"]["loaded_merged"] = outputs(frozen, batch)
    stacked = build(cfg, "actor")
    load_model_weights(stacked, args.root / "init" / "actor_adapters")
    res["outputs"]["stacked"] = outputs(stacked, batch)
    res["outputs"]["stacked_reference"] = outputs(AdapterFreeReference(stacked), batch)
    res["stacked_own_adapters_fresh"] = all(not layer.lora_B.any() for layer in lora_layers(stacked.module))
    step(stacked, batch, "actor")  # its own adapters (DDP's buffers view them) are what trains
    res["stacked_own_adapters_trained"] = all(layer.lora_B.any() for layer in lora_layers(stacked.module))
    del frozen, stacked
    if layout == "tp1pp1":  # resuming across a LoRA change is refused, naming the settings
        res["refusals"] = {}
        for case, role, path in (
                ("rank", lambda: Actor(cfg.model, **training_of(cfg, lora=LoRAConfig(rank=2, alpha=8.0,
                                                                                   targets=LORA.targets))),
                 "actor_adapters"),
                ("adapters_into_full", lambda: Actor(cfg.model, **training_of(cfg)), "actor_adapters"),
                ("full_into_lora", lambda: build(cfg, "actor"), "actor_base")):
            try:
                load_role(role(), args.root / "init" / path)
            except CheckpointError as e:
                res["refusals"][case] = str(e)

    critic = load(cfg, args.root, "critic")
    res["outputs"]["critic"] = outputs(critic, batch)
    frozen_critic = Critic(cfg.model, trainable=False)  # base + adapters merged + the LoRA run's own value head
    load_role(frozen_critic, args.root / "init" / "critic_adapters", with_optimizer=False)
    res["outputs"]["critic_loaded_merged"] = outputs(frozen_critic, batch)
    del frozen_critic
    for name, role in (("actor", actor), ("critic", critic)):
        named = dict(role.module.named_parameters())
        trainable = [n for n, p in named.items() if p.requires_grad]
        in_optimizer = sum(p.numel() for g in role.optimizer.param_groups for p in g["params"])
        in_buffers = sum(p.numel() for b in role.grad_buffers for p in b.params)
        before = {n: p.detach().clone() for n, p in named.items()}
        res["losses"][name] = step(role, batch, name)
        moved = {n for n, p in named.items() if not torch.equal(p, before[n])}
        res["trainable"][name] = {
            "names": trainable, "non_adapters": [n for n in trainable if not is_adapter(n)],
            "numel": sum(named[n].numel() for n in trainable), "in_buffers": in_buffers,
            "in_optimizer_main_params": in_optimizer, "moved": sorted(moved),
        }
        save_role(role, args.root / "after_step" / layout / name)
        second = step(role, batch, name)
        after_two = {n: p.detach().clone() for n, p in role.module.named_parameters()}
        resumed = build(cfg, name)
        load_model_weights(resumed, args.root / "init" / f"{name}_base")
        load_role(resumed, args.root / "after_step" / layout / name)
        recorded = str((args.root / "init" / f"{name}_base").resolve())
        res["base_recorded"][name] = resumed.resumed_lora_base == recorded == resumed.lora_base
        second_resumed = step(resumed, batch, name)
        diff = max((p - after_two[n]).abs().max().item() for n, p in resumed.module.named_parameters())
        res["resume"][name] = {"loss": second, "loss_resumed": second_resumed, "max_param_diff": diff}
    if rank == 0:
        res["refit"] = refit
        torch.save(res, args.root / f"results_{layout}.pt")


if __name__ == "__main__":
    run_layouts(check_layout)
