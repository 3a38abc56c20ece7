"""torchrun worker for tests/test_hf_convert.py: our side of the HF conversion checks.

The test writes tiny random HF models under --root/hf/<variant> (policies: Llama untied,
tied, with Llama-3.1 RoPE scaling; Qwen2 with q/k/v biases; Qwen3 with q/k norms and a
head_dim of its own; reward models of Llama, Qwen2 and Qwen3) and a token batch to
--root/batch.pt. At each TP x PP layout of the launch (`--layout NAME=TPxPP`, repeatable: workers.run_layouts)
the worker
  1. loads every variant with load_hf_weights and records our full logits and log-probs
     (policies) or rewards and per-token values (the reward model);
  2. at the --import-train layout: import_hf of every variant (also a bfloat16 one) into
     --root/import/<variant>; trains an actor loaded from HF (2 steps) and a reward model
     and a critic loaded from the imported reward model (1 step each), saves them with
     CheckpointManager under --root/trained and records their outputs (the reward model
     with reward_std = 2, which the export folds in), and a bfloat16 actor (1 step);
  3. at the --reload layout: loads the checkpoints import_hf wrote (at another layout), records outputs
     and saves the tied policy again at this layout (--root/resaved_tied).
Results go to --root/results_<layout>.pt (global rank 0).
"""

import sys

import torch
import torch.nn.functional as F

from megatron_rlhf.checkpoint.dist import load_model_weights, load_role
from megatron_rlhf.checkpoint.manager import CheckpointManager
from megatron_rlhf.config import load_config
from megatron_rlhf.convert import ConvertError, hf_overrides, import_hf, load_hf_weights
from megatron_rlhf.models.roles import Actor, Critic, RewardModel, summed
from workers import run_layouts, training_of

POLICIES = ("untied", "tied", "llama31", "qwen2", "qwen3")
REWARD_MODELS = ("rm", "qwen2_rm", "qwen3_rm")
MBS = 2


class LogitsActor(Actor):
    """Actor that also returns the full (TP-gathered, unpadded) logits."""

    def outputs(self, *, hidden_states, output_layer, output_weight, context, **kw):
        out = super().outputs(hidden_states=hidden_states, output_layer=output_layer,
                              output_weight=output_weight, context=context, **kw)
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        logits, _ = output_layer(hidden_states, weight=output_weight)
        full = gather_from_tensor_model_parallel_region(logits.float())
        out["logits"] = full.transpose(0, 1)[..., : self.model_config.vocab_size].contiguous()
        return out

    def output_shapes(self, batch_size, seq_len):
        return {**super().output_shapes(batch_size, seq_len),
                "logits": torch.Size([batch_size, seq_len, self.model_config.vocab_size])}


class ValuesRewardModel(RewardModel):
    """RewardModel that also returns the normalised per-token values."""

    def outputs(self, *, hidden_states, output_layer, context, **_):
        values = output_layer(hidden_states)
        last = (context["lengths"] - 1).clamp(min=0).unsqueeze(1)
        norm = lambda x: (x - self.reward_mean) / self.reward_std  # noqa: E731
        return {"rewards": norm(values.gather(1, last).squeeze(1)), "values": norm(values)}

    def output_shapes(self, batch_size, seq_len):
        return {"rewards": torch.Size([batch_size]), "values": torch.Size([batch_size, seq_len])}


def variant_cfg(args, variant, tp, pp):
    overrides = hf_overrides(args.root / "hf" / variant) + ["model.max_seq_length=64", "optimizer.lr=0.001",
                                                            "optimizer.adam_eps=1e-4"]
    if variant == "bf16":
        overrides.append("model.params_dtype=bfloat16")
    return load_config(None, overrides + args.overrides + [f"parallel.tensor_parallel={tp}",
                                                           f"parallel.pipeline_parallel={pp}"])


def outputs(role, batch):
    return {k: v.detach().cpu() for k, v in role.forward(batch, MBS).items()}


def check_layout(args, cfg, layout: str) -> None:
    tp, pp = cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel
    cfgs = {v: variant_cfg(args, v, tp, pp) for v in (*POLICIES, *REWARD_MODELS, "bf16")}
    batch = torch.load(args.root / "batch.pt")
    results = {"loaded": {}, "reloaded": {}, "trained": {}}

    for variant in POLICIES:
        actor = LogitsActor(cfgs[variant].model, trainable=False)
        load_hf_weights(actor, args.root / "hf" / variant)
        results["loaded"][variant] = outputs(actor, {"tokens": batch["tokens"]})
    for variant in REWARD_MODELS:
        rm = ValuesRewardModel(cfgs[variant].model)
        load_hf_weights(rm, args.root / "hf" / variant)
        results["loaded"][variant] = outputs(rm, batch)
    try:  # a reward model's directory into a policy: refused on every rank
        load_hf_weights(Actor(cfgs["rm"].model, trainable=False), args.root / "hf" / "rm")
    except ConvertError as e:
        results["refused"] = str(e)

    if layout == args.import_train:
        for variant in (*POLICIES, *REWARD_MODELS, "bf16"):
            import_hf(cfgs[variant], args.root / "hf" / variant, args.root / "import" / variant)
        cfg = cfgs["untied"]
        actor = LogitsActor(cfg.model, trainable=True, **training_of(cfg))  # straight from HF: the optimizer must follow
        load_hf_weights(actor, args.root / "hf" / "untied")
        adv = torch.randn(batch["tokens"].shape, generator=torch.Generator().manual_seed(3))
        for _ in range(2):
            actor.train_step({"tokens": batch["tokens"], "adv": adv}, MBS,
                             lambda o, mb: (*summed(-o["logprobs"] * mb["adv"]), {}))
        rm_dir = args.root / "import" / "rm" / "iter_0000000" / "reward"
        reward = ValuesRewardModel(cfgs["rm"].model, trainable=True, **training_of(cfgs["rm"]))
        load_model_weights(reward, rm_dir)
        reward.train_step(batch, MBS, lambda o, mb: (*summed(-F.logsigmoid(o["rewards"][0::2] - o["rewards"][1::2])), {}))
        reward.reward_mean, reward.reward_std = 0.0, 2.0
        critic = Critic(cfgs["rm"].model, trainable=True, **training_of(cfgs["rm"]))
        load_model_weights(critic, rm_dir)
        returns = torch.randn(batch["tokens"].shape, generator=torch.Generator().manual_seed(4))
        critic.train_step({**batch, "returns": returns}, MBS, lambda o, mb: (*summed((o["values"] - mb["returns"]) ** 2), {}))
        trained = {"actor": actor, "reward": reward, "critic": critic}
        CheckpointManager(args.root / "trained").save(2, trained, {"step": 2})
        # bfloat16 parameters: the optimizer's float32 main params must be reloaded from HF
        bf16 = Actor(cfgs["bf16"].model, trainable=True, **training_of(cfgs["bf16"]))
        load_hf_weights(bf16, args.root / "hf" / "bf16")
        bf16.train_step({"tokens": batch["tokens"], "adv": adv}, MBS, lambda o, mb: (*summed(-o["logprobs"] * mb["adv"]), {}))
        CheckpointManager(args.root / "trained_bf16").save(1, {"actor": bf16}, {"step": 1})
        results["trained"] = {"actor": outputs(actor, {"tokens": batch["tokens"]}), "reward": outputs(reward, batch),
                              "critic": outputs(critic, {"tokens": batch["tokens"]})}

    if layout == args.reload:
        for variant in POLICIES:
            actor = LogitsActor(cfgs[variant].model, trainable=False)
            load_role(actor, args.root / "import" / variant / "iter_0000000" / "actor", with_optimizer=False)
            results["reloaded"][variant] = outputs(actor, {"tokens": batch["tokens"]})
            if variant == "tied":  # saved at this layout for the export test
                CheckpointManager(args.root / "resaved_tied").save(0, {"actor": actor}, {"step": 0})
        for variant in REWARD_MODELS:
            rm = ValuesRewardModel(cfgs[variant].model)
            load_role(rm, args.root / "import" / variant / "iter_0000000" / "reward", with_optimizer=False)
            results["reloaded"][variant] = outputs(rm, batch)

    if torch.distributed.get_rank() == 0:
        torch.save(results, args.root / f"results_{layout}.pt")


if __name__ == "__main__":
    sys.exit(run_layouts(check_layout, config=lambda args, tp, pp: variant_cfg(args, "untied", tp, pp), extra_args=[
        ("--import-train", {"metavar": "LAYOUT", "help": "the layout that imports every variant and trains"}),
        ("--reload", {"metavar": "LAYOUT", "help": "the layout that reloads the imports (after --import-train's)"})]))
