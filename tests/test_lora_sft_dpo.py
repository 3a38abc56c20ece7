"""SFT and DPO with LoRA end to end, chained as users run them (`pipeline`, stages sft -> dpo,
lora.stages [sft, dpo]), on the shared SFT checkpoint (conftest.sft_rm_root):

- LoRA SFT continues the fixture's mid-run SFT checkpoint (sft.init_from) and lowers the eval
  loss, training and saving adapters only; its base is that checkpoint, referenced;
- LoRA DPO starts from the LoRA SFT checkpoint (its adapters merged into its base), against
  the reference = the actor with its adapters off (reward accuracy 0.5 before training: policy
  and reference agree, every pair ties), and learns the task;
- the pipeline's merged export of the DPO adapters (merged onto the SFT adapters merged onto
  the fixture's checkpoint) gives the log-probs of the DPO policy in transformers;
- a DPO run killed mid-step resumes bit for bit (adapters from its checkpoint, the base
  re-merged from the SFT LoRA checkpoint).
"""

import pytest
import torch

from distributed import read_global_tensors
from stages import assert_same_run, fault, iter_dir, stage, summary

pytestmark = pytest.mark.slow

LORA = ["lora.rank=8", "lora.alpha=16", "lora.stages=[sft,dpo]", "lora.targets=[qkv,proj,fc1,fc2,output]"]
SFT = ["sft.steps=10", "sft.eval_interval=10", "sft.optimizer.lr=2e-3", "sft.optimizer.min_lr=2e-3"]
DPO_STEPS = 12
DPO = [f"dpo.steps={DPO_STEPS}", "dpo.global_batch_size=32", "dpo.micro_batch_size=8", "dpo.seq_length=32",
       "dpo.beta=0.5", "dpo.optimizer.lr=5e-3", "dpo.optimizer.min_lr=5e-4", "dpo.optimizer.warmup_steps=2",
       "dpo.optimizer.lr_decay_style=cosine", f"dpo.eval_interval={DPO_STEPS}", "dpo.log_interval=1",
       "dpo.save_interval=4", "checkpoint.keep_last=5"]
ATOL = 1e-5


@pytest.fixture(scope="module")
def root(sft_rm_root):
    start = [f"sft.init_from={sft_rm_root}/main/sft/iter_0000030"]
    stage(1, "pipeline", sft_rm_root, "lora_chain", "pipeline.stages=[sft,dpo]", *LORA, *SFT, *DPO, *start)
    start.append(f"dpo.init_from={sft_rm_root}/lora_chain/sft_lora")  # where the pipeline's dpo started
    killed = stage(1, "dpo", sft_rm_root, "lora_killed", *LORA, *DPO, *start, **fault("kill@train:7"))
    assert killed.returncode != 0 and "kill at train of step 7" in killed.stdout
    stage(1, "dpo", sft_rm_root, "lora_killed", *LORA, *DPO, *start)
    return sft_rm_root


def test_lora_sft_trains_adapters_on_its_start(root):
    s = summary(root, "lora_chain", "sft_lora")
    print(f"\nLoRA SFT eval loss {s['eval_loss_start']:.4f} -> {s['eval_loss']:.4f}")
    assert s["eval_loss"] < s["eval_loss_start"] - 0.01, s  # measured 2.507 -> 2.473
    assert s["lora"]["actor"]["base"] == str(root / "main" / "sft" / "iter_0000030" / "actor")
    held = read_global_tensors(iter_dir(root, "lora_chain", "sft_lora", 10) / "actor")
    weights = {k for k in held if not k.startswith("optimizer.")}
    assert weights and all(k.endswith((".lora_A", ".lora_B")) for k in weights), sorted(weights)


def test_lora_dpo_starts_from_the_merged_sft_and_learns(root):
    s = summary(root, "lora_chain", "dpo_lora")
    print(f"\nLoRA DPO: reward accuracy {s['eval_reward_accuracy_before']} -> {s['eval_reward_accuracy']:.3f}, "
          f"gold {s['gold_score_eval_before']:.3f} -> {s['gold_score_eval_after']:.3f}")
    assert s["started_from"] == str(root / "lora_chain" / "sft_lora" / "iter_0000010")
    assert s["lora"]["actor"]["base"] == s["started_from"] + "/actor"
    assert s["reference"] == "on the fly"
    assert s["eval_reward_accuracy_before"] == 0.5  # the reference is the starting policy exactly: all ties
    assert s["eval_reward_accuracy"] >= 0.85, s  # measured 0.97
    assert s["gold_score_eval_after"] - s["gold_score_eval_before"] >= 0.3, s  # measured -0.10 -> 0.41


def test_merged_export_gives_the_dpo_policy(root):
    """export/dpo_lora_actor_hf in transformers against a frozen role loaded from the DPO
    adapter checkpoint (checkpoint.dist's merge on load): two merges, one answer."""
    from transformers import AutoModelForCausalLM

    export = root / "lora_chain" / "export" / "dpo_lora_actor_hf"
    model = AutoModelForCausalLM.from_pretrained(export, local_files_only=True).eval()
    want = torch.load(_merged_logprobs(root), weights_only=False)
    with torch.no_grad():
        logits = model(want["tokens"]).logits.float()
    got = torch.log_softmax(logits, -1)[:, :-1].gather(-1, want["tokens"][:, 1:, None])[..., 0]
    assert (got - want["logprobs"][:, :-1]).abs().max().item() < ATOL


def _merged_logprobs(root):
    """Log-probs of the DPO policy from our Reference role loaded from its LoRA checkpoint."""
    from distributed import torchrun

    out = root / "lora_chain" / "merged_logprobs.pt"
    if not out.exists():
        torchrun(1, "tests/workers/lora_merged_logprobs.py", f"--ckpt={iter_dir(root, 'lora_chain', 'dpo_lora', DPO_STEPS)}",
                 f"--out={out}")
    return out


def test_killed_lora_dpo_resumes_bit_for_bit(root):
    assert_same_run(root, "lora_chain", "lora_killed", "dpo_lora", DPO_STEPS, ["actor"])
