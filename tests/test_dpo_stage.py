"""The DPO stage as users run it, on the shared SFT and RM checkpoints (conftest.sft_rm_root):

- the sft -> rm -> dpo -> rl route through `pipeline` (finished sft and rm skipped): DPO
  learns the task (gold score, held-out reward accuracy) with the reference on the fly, and
  the RL stage starts from the DPO policy (its eval of the starting policy is DPO's last eval);
- the precomputed reference gives the loss of the on-the-fly one (eval before training, the
  first step) within 1e-6;
- a run killed in the middle of a step and resumed equals the uninterrupted run bit for bit
  (weights, optimizer, trainer state with the precomputed table, metrics), and the same
  checkpoint resumed at TP2 reads the table from the checkpoint and trains on to the same
  numbers within float tolerance.
"""

import shutil

import pytest
import torch

from distributed import REPO, read_global_tensors
from stages import RM_STEPS, SFT_STEPS, assert_same_run, fault, iter_dir, linked_run, metrics, stage, summary

pytestmark = pytest.mark.slow

LEARN = ["dpo.steps=40", "dpo.global_batch_size=32", "dpo.micro_batch_size=8", "dpo.seq_length=32",
         "dpo.beta=0.5", "dpo.optimizer.lr=5e-4", "dpo.optimizer.min_lr=5e-5", "dpo.optimizer.warmup_steps=2",
         "dpo.optimizer.lr_decay_style=cosine", "dpo.eval_interval=40", "dpo.log_interval=1", "dpo.save_interval=0"]
SHORT = [*LEARN, "dpo.steps=6", "dpo.eval_interval=3", "dpo.save_interval=2", "checkpoint.keep_last=5",
         "dpo.precompute_reference=true"]
ROUTE = ["pipeline.stages=[sft,rm,dpo,rl]", "rl.steps=1", "rl.eval_interval=1", "rl.rollout_batch_size=16"]
ATOL_REFERENCE = 1e-6


@pytest.fixture(scope="module")
def runs(sft_rm_root):
    root = sft_rm_root
    linked_run(root, "dpo_route", "sft", "rm")
    # the linked stages' steps: with the recipe's (more) the pipeline would continue them, inside main/
    route = stage(1, "pipeline", root, "dpo_route", *ROUTE, *LEARN, f"sft.steps={SFT_STEPS}", f"rm.steps={RM_STEPS}")
    init = [f"dpo.init_from={root}/main/sft"]
    stage(1, "dpo", root, "dpo_short", *SHORT, *init)
    killed = stage(1, "dpo", root, "dpo_killed", *SHORT, *init, **fault("kill@train:5"))
    assert killed.returncode != 0
    shutil.copytree(root / "dpo_killed", root / "dpo_tp2")
    resumed = stage(1, "dpo", root, "dpo_killed", *SHORT, *init)
    tp2 = stage(2, "dpo", root, "dpo_tp2", *SHORT, *init, "parallel.tensor_parallel=2")
    return root, {"route": route, "resumed": resumed, "tp2": tp2}


def test_dpo_learns_the_task(runs):
    root, _ = runs
    s = summary(root, "dpo_route", "dpo")
    assert s["reference"] == "on the fly" and s["steps"] == 40
    assert s["eval_reward_accuracy_before"] == 0.5  # policy == reference: every pair ties, a tie counts half
    assert s["eval_reward_accuracy"] >= 0.85, s
    assert s["gold_score_eval_after"] - s["gold_score_eval_before"] >= 0.3, s
    assert s["win_rate_gold_final"] > 0.6
    rows = metrics(root, "dpo_route", "dpo")
    assert rows[0]["step"] == 0 and rows[0]["eval_loss"] == pytest.approx(0.6931472, abs=1e-6)  # log 2
    assert rows[-1]["eval_loss"] < 0.5


def test_rl_after_dpo_starts_from_the_dpo_policy(runs):
    root, out = runs
    assert f"actor/reference from {root}/dpo_route/dpo/iter_0000040" in out["route"].stdout
    rl, dpo = summary(root, "dpo_route", "ppo"), summary(root, "dpo_route", "dpo")
    # same prompts, seed and sampling: the RL stage's first eval samples exactly what DPO's last did
    assert rl["gold_score_eval_before"] == pytest.approx(dpo["gold_score_eval_after"], abs=1e-9)
    assert (root / "dpo_route" / "export" / "actor_hf" / "config.json").is_file()
    assert "## dpo" in (root / "dpo_route" / "report.md").read_text()


def test_pipeline_exports_the_dpo_policy_when_dpo_is_the_last_policy_stage(runs):
    from megatron_rlhf.config import load_config
    from megatron_rlhf.convert.safetensors_io import HFWeights
    from megatron_rlhf.pipeline import export_actor

    root, _ = runs
    cfg = load_config(REPO / "pipelines" / "tiny_cpu_dpo.yaml", [f"checkpoint.root={root}", "checkpoint.run_name=dpo_route"])
    out = export_actor(cfg, "dpo")
    assert out == root / "dpo_route" / "export" / "dpo_actor_hf"
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    exported = HFWeights(out).read("model.embed_tokens.weight")  # the DPO weights, not the SFT ones it started from
    trained = read_global_tensors(iter_dir(root, "dpo_route", "dpo", 40) / "actor")["embedding.word_embeddings.weight"]
    started = read_global_tensors(root / "main" / "sft" / "iter_0000060" / "actor")["embedding.word_embeddings.weight"]
    assert torch.equal(exported, trained[: exported.shape[0]]) and not torch.equal(exported, started[: exported.shape[0]])


def test_precomputed_reference_gives_the_on_the_fly_loss(runs):
    root, _ = runs
    fly, pre = metrics(root, "dpo_route", "dpo"), metrics(root, "dpo_short", "dpo")
    assert summary(root, "dpo_short", "dpo")["reference"] == "precomputed"
    for step in (0, 1):  # the starting policy's eval, then the first step's train metrics
        want, got = fly[step], pre[step]
        assert want["step"] == got["step"] == step
        keys = [k for k in want if k.endswith(("loss", "reward", "margin", "accuracy")) and "gold" not in k]
        assert len(keys) >= 5, keys
        for key in keys:
            assert got[key] == pytest.approx(want[key], abs=ATOL_REFERENCE), (step, key)


def test_killed_run_resumes_bit_for_bit(runs):
    root, out = runs
    assert "reference log-probs: precomputed, read from the checkpoint" in out["resumed"].stdout
    assert_same_run(root, "dpo_short", "dpo_killed", "dpo", 6, ["actor"])
    state = torch.load(iter_dir(root, "dpo_short", "dpo", 6) / "trainer_state" / "rank_00000.pt", weights_only=False)
    assert state["reference"]["tables"]["train"].shape == (1024, 2)


def test_checkpoint_resumes_at_tp2_with_the_stored_reference(runs):
    root, out = runs
    assert "reference log-probs: precomputed, read from the checkpoint" in out["tp2"].stdout
    want, got = metrics(root, "dpo_short", "dpo"), metrics(root, "dpo_tp2", "dpo")
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for w, g in zip(want[5:], got[5:]):  # steps 5, 6 (the TP2 part)
        for key in ("loss", "reward_accuracy", "margin", "eval_loss", "eval_margin"):
            if key in w:
                assert g[key] == pytest.approx(w[key], abs=1e-4), (w["step"], key)
