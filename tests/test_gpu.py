"""GPU path (NCCL, TE spec when installed, bf16): the GPU tests run on a machine with CUDA and
are skipped on CPU. The `test_gpu_check_*_cpu` tests are not: they exercise the report,
pre-flight and run-orchestration code of benchmarks/gpu_check.py (make gpu-check) on run
directories written here in the stages' output format, in CI."""

import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed import REPO, torchrun

needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def gpu_test(fn):
    for mark in reversed(needs_gpu):
        fn = mark(fn)
    return fn


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The model features of the HF families (tests/test_hf_convert.py checks their parity on CPU
# with the local spec); on a GPU the TE spec builds them (fused q/k norms, qkv bias).
FAMILY_FEATURES = {
    "llama": [],
    "llama31_rope": ["model.rope_scaling.type=llama3", "model.rope_scaling.factor=8.0",
                     "model.rope_scaling.original_max_position_embeddings=32"],
    "qwen2": ["model.family=qwen2", "model.qkv_bias=true"],
    "qwen3": ["model.family=qwen3", "model.qk_layernorm=true", "model.head_dim=32"],
}


@gpu_test
@pytest.mark.parametrize("family", list(FAMILY_FEATURES))
def test_smoke_roles_bf16_on_one_gpu(family):
    proc = torchrun(1, "-m", "megatron_rlhf", "smoke", "--config", "pipelines/tiny_cpu.yaml",
                    "model.params_dtype=bfloat16", *FAMILY_FEATURES[family])
    for role in ("Actor", "Reference", "Critic", "RewardModel"):
        assert role in proc.stdout
    assert "nan" not in proc.stdout.lower()


@gpu_test
@pytest.mark.slow
def test_gpu_check_pipeline_bf16_on_one_gpu(tmp_path):
    """make gpu-check's run (this interpreter as it is, no venv): SFT -> RM -> PPO in bf16 with
    offload, then GRPO and PPO with LoRA, then the MoE pipeline on one process, then sane numbers
    in the table's JSON."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--no-install",
                           "--python", sys.executable, "--out", str(tmp_path), "--timeout", "600"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "peak GPU memory" in (tmp_path / "gpu_check.txt").read_text()
    assert res["complete"] and res["environment"]["params_dtype"] == "bfloat16"
    for name, phase in res["ppo_phases"].items():
        assert phase["seconds"] is not None and phase["seconds"] > 0, name
        assert phase["peak_memory_bytes"] is not None and phase["peak_memory_bytes"] > 0, name
    for stage in ("sft", "rm", "ppo"):
        assert res["stages"][stage]["seconds"] > 0
    gold = res["gold_score"]
    assert all(math.isfinite(gold[k]) for k in ("before", "after")), gold
    assert gold["after"] > gold["before"] - 0.1, gold
    mismatch = res["logprob_mismatch"]
    assert mismatch["first"]["value"] is not None and mismatch["last"]["value"] is not None, mismatch
    assert 0 <= mismatch["first"]["value"] < 1 and 0 <= mismatch["last"]["value"] < 1, mismatch
    # then GRPO on the same SFT/RM: three roles, no critic, so less memory where PPO holds the critic
    grpo = res["grpo"]
    assert grpo["complete"] and grpo["run"]["exit_code"] == 0, grpo
    assert grpo["algorithm"] == "grpo" and grpo["roles"] == ["actor", "reference", "reward"], grpo
    assert res["ppo"]["roles"] == ["actor", "critic", "reference", "reward"], res["ppo"]
    for name, phase in grpo["phases"].items():
        assert phase["seconds"] > 0 and phase["peak_memory_bytes"] > 0, name
    saving = res["memory_saving_bytes"]
    assert saving["train"] > 0 and saving["score"] > 0 and saving["stage"] > 0, saving
    assert all(math.isfinite(grpo["gold_score"][k]) for k in ("before", "after")), grpo["gold_score"]
    # then PPO with LoRA on the same SFT/RM: the same four roles, adapters trained on the actor and the critic
    lora, full = res["ppo_lora"], res["ppo"]
    assert lora["complete"] and lora["run"]["exit_code"] == 0, lora
    assert lora["roles"] == full["roles"] and sorted(lora["lora"] or {}) == ["actor", "critic"], lora
    for name, phase in lora["phases"].items():
        assert phase["seconds"] > 0 and phase["peak_memory_bytes"] > 0, name
    assert sorted(lora["trained"]["roles"]) == sorted(full["trained"]["roles"]) == ["actor", "critic"], lora
    for key in ("trainable_parameters", "optimizer_state"):
        assert 0 < lora["trained"][key] < full["trained"][key] / 2, (key, lora["trained"], full["trained"])
    assert res["lora_memory_saving_bytes"]["stage"] is not None, res["lora_memory_saving_bytes"]
    assert all(math.isfinite(lora["gold_score"][k]) for k in ("before", "after")), lora["gold_score"]
    # then the MoE pipeline (its own SFT -> RM -> GRPO, expert parallel 1): TE's grouped MLP where TE imports
    moe = res["moe"]
    assert moe["complete"] and moe["run"]["exit_code"] == 0, moe
    assert moe["grouped_gemm"] is res["environment"]["transformer_engine"], moe["expert_modules"]
    if not res["environment"]["transformer_engine"]:
        assert moe["expert_module"] == "SequentialMLP", moe["expert_modules"]
    assert sorted(moe["expert_modules"]) == ["grpo", "rm", "sft"], moe["expert_modules"]
    for stage, v in moe["stages"].items():
        assert v["seconds"] > 0 and v["peak_memory_bytes"] > 0, (stage, v)
    assert all(math.isfinite(moe["gold_score"][k]) for k in ("before", "after")), moe["gold_score"]


# --- on every machine (CPU included): the report and pre-flight code of make gpu-check ---

PPO_ROLES, GRPO_ROLES = ["actor", "critic", "reference", "reward"], ["actor", "reference", "reward"]


def account(trained, frozen_weights):
    """A summary's memory_account (logging/memory.py's format): trained = {role: (trainable
    parameters, optimizer-state bytes)}, frozen_weights = {role: weight bytes} of the others."""
    roles = {name: {"weights": 4 * n, "gradient_buffers": 4 * n, "optimizer_state": opt, "activations": 2**20,
                    "trainable_parameters": n} for name, (n, opt) in trained.items()}
    roles.update({name: {"weights": w, "gradient_buffers": 0, "optimizer_state": 0, "activations": 0,
                         "trainable_parameters": 0} for name, w in frozen_weights.items()})
    state = sum(r["weights"] + r["gradient_buffers"] + r["optimizer_state"] for r in roles.values())
    return {"roles": roles, "model_state_bytes": state, "activation_bytes": 2**20, "account_bytes": state + 2**20,
            "baseline_bytes": 2**20, "peak_above_baseline_bytes": 3 * state, "other_bytes": 2 * state - 2**20,
            "peak_over_account": 3 * state / (state + 2**20)}


# PPO trains every weight of the actor and the critic (fp32 main params + 2 Adam moments: 12 B per
# parameter); with LoRA only the adapters (the critic's value head too) and the reference holds no weights
FULL_TRAINED, LORA_TRAINED = {"actor": (2**18, 3 * 2**20), "critic": (2**18, 3 * 2**20)}, \
    {"actor": (8192, 12 * 8192), "critic": (8257, 12 * 8257)}
LORA_SUMMARY = {"actor": {"rank": 8, "alpha": 16.0, "targets": ["qkv", "proj", "fc1", "fc2"], "base": "<run>/sft"},
                "critic": {"rank": 8, "alpha": 16.0, "targets": ["qkv", "proj", "fc1", "fc2"], "base": "<run>/rm"}}


# The MoE run (<root>/gpu_check_moe): what a GPU with Transformer Engine builds, per stage and role
MOE_MODULES = {"sft": {"actor": "TEGroupedMLP"}, "rm": {"reward": "TEGroupedMLP"},
               "grpo": dict.fromkeys(GRPO_ROLES, "TEGroupedMLP")}


def write_moe_run(run, modules=MOE_MODULES):
    """The MoE run's directory as its stages write it: SFT, RM and GRPO summaries naming their
    expert modules (`modules`; None: a summary without the field), GRPO's metrics with routing
    metrics (a list-valued one too) beside others, SFT's with one."""
    phases = ("eval", "generate", "score", "train")
    summaries = {"sft": {"stage": "sft", "steps": 120, "wall_seconds": 20.5, "peak_memory_bytes": 40 * 2**20},
                 "rm": {"stage": "rm", "steps": 120, "wall_seconds": 15.0, "peak_memory_bytes": 48 * 2**20},
                 "grpo": {"stage": "rl", "algorithm": "grpo", "roles": GRPO_ROLES, "steps": 40,
                          "gold_score_eval_before": 0.02, "gold_score_eval_after": 0.45,
                          "reward_eval_before": 0.125, "reward_eval_after": 1.0, "kl_mean_final": 0.25,
                          "phase_seconds": dict(zip(phases, (1.0, 6.0, 2.0, 9.0))),
                          "phase_peak_memory_bytes": dict(zip(phases, (60 * 2**20, 70 * 2**20, 80 * 2**20,
                                                                       90 * 2**20))),
                          "peak_memory_bytes": 96 * 2**20, "wall_seconds": 35.0}}
    for stage, summary in summaries.items():
        (run / stage).mkdir(parents=True)
        if modules is not None:
            summary["expert_modules"] = modules[stage]
        (run / stage / "summary.json").write_text(json.dumps(summary))
    rows = [{"step": s, "logprob_mismatch": 1e-3, "kl_mean": 0.1,
             "routing_agreement": 0.875 if s == 1 else 0.96875 if s == 40 else 0.9,
             "expert_load": [0.25] * 4 if s == 1 else [0.5, 0.125, 0.125, 0.25]} for s in range(1, 41)]
    (run / "grpo" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = [{"step": 10, "loss": 3.0, "expert_load_max": 0.375}, {"step": 20, "loss": 2.0, "expert_load_max": 0.3125}]
    (run / "sft" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_run(run, with_stage_memory=True, grpo=True, lora=True, moe=True):
    """A run directory in the format the stages write (summary.json, <algorithm>/metrics.jsonl):
    SFT, RM, PPO, (grpo=True) GRPO and (lora=True) PPO with LoRA (<run>/ppo_lora) on the same SFT/RM;
    (moe=True) the MoE run beside it (write_moe_run)."""
    if moe:
        write_moe_run(run.parent / "gpu_check_moe")
    for stage, wall, mem in (("sft", 11.5, 3 * 2**20), ("rm", 9.25, 5 * 2**20)):
        (run / stage).mkdir(parents=True)
        summary = {"stage": stage, "steps": 120, "wall_seconds": wall}
        if with_stage_memory:
            summary["peak_memory_bytes"] = mem
        (run / stage / "summary.json").write_text(json.dumps(summary))
    (run / "ppo").mkdir()
    phases = ("eval", "generate", "score", "train")
    (run / "ppo" / "summary.json").write_text(json.dumps({  # no stage peak: the largest phase peak
        "stage": "rl", "algorithm": "ppo", "roles": PPO_ROLES, "steps": 40,
        "gold_score_eval_before": 0.01, "gold_score_eval_after": 0.655,
        "reward_eval_before": 0.08, "reward_eval_after": 1.5, "kl_mean_final": 3.25,
        "phase_seconds": dict(zip(phases, (2.0, 10.0, 4.0, 20.0))),
        "phase_peak_memory_bytes": dict(zip(phases, (100 * 2**20, 200 * 2**20, 300 * 2**20, 400 * 2**20))),
        "wall_seconds": 40.5, "lora": {},
        "memory_account": account(FULL_TRAINED, {"reference": 2**20, "reward": 2**20}),
    }))
    rows = [{"step": 0, "eval_gold_score": 0.01}]
    rows += [{"step": s, "gold_score": 0.1 * s, "logprob_mismatch": 1e-3 * s} for s in range(1, 41)]
    rows.append({"step": 40, "logprob_mismatch": 0.0625, "eval_gold_score": 0.655})  # a resumed run re-logs
    (run / "ppo" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if lora:
        (run / "ppo_lora").mkdir()
        (run / "ppo_lora" / "summary.json").write_text(json.dumps({
            "stage": "rl", "algorithm": "ppo", "roles": PPO_ROLES, "steps": 40, "lora": LORA_SUMMARY,
            "gold_score_eval_before": 0.01, "gold_score_eval_after": 0.6,
            "reward_eval_before": 0.08, "reward_eval_after": 1.375, "kl_mean_final": 0.5,
            "phase_seconds": dict(zip(phases, (1.0, 9.0, 3.5, 15.0))),
            "phase_peak_memory_bytes": dict(zip(phases, (90 * 2**20, 120 * 2**20, 180 * 2**20, 220 * 2**20))),
            "peak_memory_bytes": 232 * 2**20, "wall_seconds": 33.0,
            "memory_account": account(LORA_TRAINED, {"reference": 0, "reward": 2**20}),
        }))
        rows = [{"step": s, "logprob_mismatch": 2e-4 * s} for s in range(1, 41)]
        (run / "ppo_lora" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if not grpo:
        return
    (run / "grpo").mkdir()
    (run / "grpo" / "summary.json").write_text(json.dumps({
        "stage": "rl", "algorithm": "grpo", "roles": GRPO_ROLES, "steps": 40,
        "gold_score_eval_before": 0.01, "gold_score_eval_after": 0.5,
        "rm_score_eval_before": 0.08, "rm_score_eval_after": 1.25, "kl_mean_final": 0.125,  # an older run's names
        "phase_seconds": dict(zip(phases, (1.5, 8.0, 3.0, 12.0))),
        "phase_peak_memory_bytes": dict(zip(phases, (100 * 2**20, 150 * 2**20, 200 * 2**20, 250 * 2**20))),
        "peak_memory_bytes": 260 * 2**20, "wall_seconds": 30.0,
    }))
    rows = [{"step": s, "logprob_mismatch": 5e-4 * s} for s in range(1, 41)]
    (run / "grpo" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def table_rows(table, block=None):
    """The table's rows by their first cell (the text before two spaces; the first row of that
    name); with block, only the rows of the block whose header starts with it (up to the next
    empty line)."""
    lines = table.splitlines()
    if block is not None:
        start = next(i for i, line in enumerate(lines) if line.startswith(block))
        end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
        lines = lines[start:end]
    rows = {}
    for line in lines:
        rows.setdefault(line.split("  ")[0].strip(), line)
    return rows


def test_gpu_check_report_table_and_json_cpu(tmp_path):
    gc = load_gpu_check()
    run = tmp_path / "runs" / "gpu_check"
    write_run(run)
    out = tmp_path / "out"
    assert gc.main(["--report-only", str(run), "--out", str(out)]) == 0
    res = json.loads((out / "gpu_check.json").read_text())
    # the PPO keys of the PPO-only check
    assert res["complete"] and res["missing"] == []
    assert res["stages"]["sft"] == {"seconds": 11.5, "peak_memory_bytes": 3 * 2**20}
    assert res["stages"]["rm"] == {"seconds": 9.25, "peak_memory_bytes": 5 * 2**20}
    assert res["stages"]["ppo"] == {"seconds": 40.5, "peak_memory_bytes": 400 * 2**20}
    assert list(res["ppo_phases"]) == ["generate", "score", "train", "eval"]
    assert res["ppo_phases"]["train"] == {"seconds": 20.0, "peak_memory_bytes": 400 * 2**20}
    assert res["ppo_steps"] == 40 and res["kl_mean_final"] == 3.25
    assert res["gold_score"] == {"before": 0.01, "after": 0.655}
    assert res["logprob_mismatch"] == {"first": {"step": 1, "value": 1e-3}, "last": {"step": 40, "value": 0.0625}}
    # per algorithm
    ppo, grpo = res["ppo"], res["grpo"]
    assert ppo["phases"] == res["ppo_phases"] and ppo["stage"] == res["stages"]["ppo"]
    assert ppo["roles"] == PPO_ROLES and grpo["roles"] == GRPO_ROLES
    assert grpo["complete"] and grpo["missing"] == [] and grpo["algorithm"] == "grpo"
    assert grpo["stage_dir"] == str(run / "grpo") and grpo["steps"] == 40
    assert res["stages"]["grpo"] == grpo["stage"] == {"seconds": 30.0, "peak_memory_bytes": 260 * 2**20}
    assert grpo["phases"]["train"] == {"seconds": 12.0, "peak_memory_bytes": 250 * 2**20}
    assert grpo["gold_score"] == {"before": 0.01, "after": 0.5} and grpo["kl_mean_final"] == 0.125
    assert grpo["reward"] == {"before": 0.08, "after": 1.25}
    assert grpo["logprob_mismatch"] == {"first": {"step": 1, "value": 5e-4}, "last": {"step": 40, "value": 0.02}}
    # the memory GRPO saves: PPO minus GRPO per phase and for the stage peak
    assert res["memory_saving_bytes"] == {"generate": 50 * 2**20, "score": 100 * 2**20, "train": 150 * 2**20,
                                          "eval": 0, "stage": 140 * 2**20}
    # PPO with LoRA on the same SFT/RM (<run>/ppo_lora): its numbers and what training adapters saves
    lora = res["ppo_lora"]
    assert lora["complete"] and lora["missing"] == [] and lora["algorithm"] == "ppo" and lora["steps"] == 40
    assert lora["stage_dir"] == str(run / "ppo_lora") and lora["roles"] == PPO_ROLES and lora["lora"] == LORA_SUMMARY
    assert res["stages"]["ppo_lora"] == lora["stage"] == {"seconds": 33.0, "peak_memory_bytes": 232 * 2**20}
    assert lora["phases"]["train"] == {"seconds": 15.0, "peak_memory_bytes": 220 * 2**20}
    assert lora["gold_score"] == {"before": 0.01, "after": 0.6} and lora["kl_mean_final"] == 0.5
    assert lora["reward"] == {"before": 0.08, "after": 1.375}
    assert lora["logprob_mismatch"] == {"first": {"step": 1, "value": 2e-4}, "last": {"step": 40, "value": 8e-3}}
    assert res["lora_memory_saving_bytes"] == {"generate": 80 * 2**20, "score": 120 * 2**20, "train": 180 * 2**20,
                                               "eval": 10 * 2**20, "stage": 168 * 2**20}
    # the trained roles of each memory account (not the frozen reference and reward model)
    assert ppo["trained"] == {"roles": {r: {"trainable_parameters": 2**18, "optimizer_state": 3 * 2**20}
                                        for r in ("actor", "critic")},
                              "trainable_parameters": 2**19, "optimizer_state": 6 * 2**20}
    assert lora["trained"] == {"roles": {"actor": {"trainable_parameters": 8192, "optimizer_state": 98304},
                                         "critic": {"trainable_parameters": 8257, "optimizer_state": 99084}},
                               "trainable_parameters": 16449, "optimizer_state": 197388}
    assert grpo["trained"] == {"roles": {}, "trainable_parameters": None, "optimizer_state": None}  # no account
    # an account written before trainable_parameters existed: the roles with optimizer state
    assert gc.trained_roles({"roles": {"actor": {"optimizer_state": 96}, "reward": {"optimizer_state": 0}}}) == \
        {"roles": {"actor": {"trainable_parameters": None, "optimizer_state": 96}}, "trainable_parameters": None,
         "optimizer_state": 96}

    table = (out / "gpu_check.txt").read_text()
    rows = table_rows(table)
    assert rows["SFT stage"].split()[-3:] == ["11.5", "3.0", "MiB"]
    assert rows["RM stage"].split()[-3:] == ["9.2", "5.0", "MiB"]
    assert rows["RL phase"].split() == ["RL", "phase", "PPO", "s", "GRPO", "s", "PPO", "peak", "GRPO", "peak",
                                        "saving", "(PPO", "-", "GRPO)"]
    # phase, PPO s, GRPO s, PPO peak, GRPO peak, saving (share of PPO's peak)
    assert rows["generate"].split() == ["generate", "10.0", "8.0", "200.0", "MiB", "150.0", "MiB",
                                        "50.0", "MiB", "(25%)"]
    assert rows["score"].split()[1:] == ["4.0", "3.0", "300.0", "MiB", "200.0", "MiB", "100.0", "MiB", "(33%)"]
    assert rows["train"].split()[1:] == ["20.0", "12.0", "400.0", "MiB", "250.0", "MiB", "150.0", "MiB", "(38%)"]
    assert rows["eval"].split()[1:] == ["2.0", "1.5", "100.0", "MiB", "100.0", "MiB", "0.0", "MiB", "(0%)"]
    assert rows["RL stage (wall)"].split()[3:] == ["40.5", "30.0", "400.0", "MiB", "260.0", "MiB",
                                                   "140.0", "MiB", "(35%)"]
    assert rows["roles"].split(None, 1)[1] == ("PPO: actor, critic, reference, reward (4)   "
                                               "GRPO: actor, reference, reward (3)")
    # gold before, after, change, reward before, after, KL final, logprob_mismatch first -> last
    assert rows["PPO"].split() == ["PPO", "0.010", "0.655", "+0.645", "0.080", "1.500", "3.250",
                                   "1.000e-03", "(step", "1)", "->", "6.250e-02", "(step", "40)"]
    assert rows["GRPO"].split() == ["GRPO", "0.010", "0.500", "+0.490", "0.080", "1.250", "0.125",
                                    "5.000e-04", "(step", "1)", "->", "2.000e-02", "(step", "40)"]
    assert rows["PPO+LoRA"].split() == ["PPO+LoRA", "0.010", "0.600", "+0.590", "0.080", "1.375", "0.500",
                                        "2.000e-04", "(step", "1)", "->", "8.000e-03", "(step", "40)"]
    # PPO and PPO with LoRA side by side: phase, PPO s, PPO+LoRA s, PPO peak, PPO+LoRA peak, saving
    lrows = table_rows(table, block="PPO vs PPO+LoRA")
    assert lrows["PPO vs PPO+LoRA"].split() == ["PPO", "vs", "PPO+LoRA", "PPO", "s", "PPO+LoRA", "s", "PPO", "peak",
                                                "PPO+LoRA", "peak", "saving", "(PPO", "-", "PPO+LoRA)"]
    assert lrows["generate"].split() == ["generate", "10.0", "9.0", "200.0", "MiB", "120.0", "MiB",
                                         "80.0", "MiB", "(40%)"]
    assert lrows["score"].split()[1:] == ["4.0", "3.5", "300.0", "MiB", "180.0", "MiB", "120.0", "MiB", "(40%)"]
    assert lrows["train"].split()[1:] == ["20.0", "15.0", "400.0", "MiB", "220.0", "MiB", "180.0", "MiB", "(45%)"]
    assert lrows["eval"].split()[1:] == ["2.0", "1.0", "100.0", "MiB", "90.0", "MiB", "10.0", "MiB", "(10%)"]
    assert lrows["RL stage (wall)"].split()[3:] == ["40.5", "33.0", "400.0", "MiB", "232.0", "MiB",
                                                    "168.0", "MiB", "(42%)"]
    assert lrows["trained"].split(None, 1)[1] == ("parameters PPO 524,288, PPO+LoRA 16,449 (3.1%); optimizer state "
                                                  "PPO 6.0 MiB, PPO+LoRA 0.2 MiB (3.1%); roles: actor, critic")
    assert not [line for line in table.splitlines()
                if line.startswith(("missing", "GRPO:", "GRPO      missing", "PPO+LoRA:", "PPO+LoRA  missing"))]
    assert "peak memory" in table and "peak GPU memory" not in table  # no environment: CPU wording


def test_gpu_check_report_missing_numbers_cpu(tmp_path):
    """No peak_memory_bytes in the SFT/RM summaries (older runs) -> n/a; a run stopped before
    PPO -> n/a rows, the missing files listed, exit code 1."""
    gc = load_gpu_check()
    run = tmp_path / "gpu_check"
    write_run(run, with_stage_memory=False)
    res = gc.collect(run)
    assert res["stages"]["sft"]["peak_memory_bytes"] is None
    assert "n/a" in next(line for line in gc.format_table(res).splitlines() if line.startswith("RM stage"))
    (run / "ppo" / "summary.json").unlink()
    (run / "ppo" / "metrics.jsonl").write_text('{"step": 1, "logprob_mismatch": NaN}\n')
    assert gc.main(["--report-only", str(run), "--out", str(tmp_path / "out")]) == 1
    res = json.loads((tmp_path / "out" / "gpu_check.json").read_text())  # strict JSON: NaN -> null
    assert not res["complete"] and res["missing"] == [str(run / "ppo" / "summary.json")]
    assert res["gold_score"] == {"before": None, "after": None}
    assert res["logprob_mismatch"]["first"] == {"step": 1, "value": None}
    assert res["grpo"]["complete"]  # GRPO's numbers stand; the savings it cannot be compared with are null
    assert res["memory_saving_bytes"] == dict.fromkeys(("generate", "score", "train", "eval", "stage"))
    assert res["ppo_lora"]["complete"] and res["ppo_lora"]["stage"]["peak_memory_bytes"] == 232 * 2**20
    assert res["lora_memory_saving_bytes"] == dict.fromkeys(("generate", "score", "train", "eval", "stage"))
    assert res["ppo"]["trained"]["trainable_parameters"] is None
    rows = table_rows((tmp_path / "out" / "gpu_check.txt").read_text())
    assert rows["train"].split()[1:] == ["n/a", "12.0", "n/a", "250.0", "MiB", "n/a"]
    assert rows["PPO"].split()[1:4] == ["n/a", "n/a", "n/a"]
    assert rows["missing: " + str(run / "ppo" / "summary.json")]
    lrows = table_rows((tmp_path / "out" / "gpu_check.txt").read_text(), block="PPO vs PPO+LoRA")
    assert lrows["train"].split()[1:] == ["n/a", "15.0", "n/a", "220.0", "MiB", "n/a"]
    assert lrows["trained"].split(None, 1)[1].startswith("parameters PPO n/a, PPO+LoRA 16,449; optimizer state "
                                                         "PPO n/a, PPO+LoRA 0.2 MiB; roles: actor, critic")


def test_gpu_check_report_grpo_missing_cpu(tmp_path):
    """A run without GRPO (it failed, or a PPO-only run): the PPO numbers are all reported, the
    GRPO columns n/a, GRPO marked missing, exit code 1; with --no-grpo, exit code 0."""
    gc = load_gpu_check()
    run = tmp_path / "gpu_check"
    write_run(run, grpo=False)
    out = tmp_path / "out"
    assert gc.main(["--report-only", str(run), "--out", str(out)]) == 1
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["complete"] and res["missing"] == []  # the PPO pipeline is complete
    assert res["stages"]["ppo"] == {"seconds": 40.5, "peak_memory_bytes": 400 * 2**20}
    assert res["ppo_phases"]["train"] == {"seconds": 20.0, "peak_memory_bytes": 400 * 2**20}
    assert res["gold_score"] == {"before": 0.01, "after": 0.655} and res["kl_mean_final"] == 3.25
    grpo = res["grpo"]
    assert not grpo["complete"]
    assert grpo["missing"] == [str(run / "grpo" / "summary.json"), str(run / "grpo" / "metrics.jsonl")]
    assert grpo["stage"] == res["stages"]["grpo"] == {"seconds": None, "peak_memory_bytes": None}
    assert grpo["gold_score"] == {"before": None, "after": None} and grpo["kl_mean_final"] is None
    assert set(res["memory_saving_bytes"].values()) == {None}
    table = (out / "gpu_check.txt").read_text()
    rows = table_rows(table)
    assert rows["train"].split()[1:] == ["20.0", "n/a", "400.0", "MiB", "n/a", "n/a"]
    assert rows["RL stage (wall)"].split()[3:] == ["40.5", "n/a", "400.0", "MiB", "n/a", "n/a"]
    assert rows["PPO"].split()[1:4] == ["0.010", "0.655", "+0.645"]
    assert rows["GRPO"].split() == ["GRPO", "missing"]
    assert rows["roles"].split(None, 1)[1] == "PPO: actor, critic, reference, reward (4)   GRPO: n/a"
    assert f"GRPO: missing {run / 'grpo' / 'summary.json'}, {run / 'grpo' / 'metrics.jsonl'}" in table
    assert "\nmissing:" not in table  # nothing of SFT -> RM -> PPO is missing
    # PPO-only on purpose
    assert gc.main(["--report-only", str(run), "--out", str(out), "--no-grpo"]) == 0
    assert "GRPO: not run: --no-grpo" in (out / "gpu_check.txt").read_text()


def test_gpu_check_report_lora_missing_cpu(tmp_path):
    """A run without PPO with LoRA (it failed or was not run): PPO's and GRPO's numbers are all
    reported, the LoRA columns n/a, PPO+LoRA marked missing, exit code 1; with --no-lora, 0."""
    gc = load_gpu_check()
    run = tmp_path / "gpu_check"
    write_run(run, lora=False)
    out = tmp_path / "out"
    assert gc.main(["--report-only", str(run), "--out", str(out)]) == 1
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["complete"] and res["missing"] == [] and res["grpo"]["complete"]
    assert res["memory_saving_bytes"]["stage"] == 140 * 2**20  # PPO vs GRPO stands
    lora = res["ppo_lora"]
    assert not lora["complete"] and lora["stage_dir"] == str(run / "ppo_lora")
    assert lora["missing"] == [str(run / "ppo_lora" / "summary.json"), str(run / "ppo_lora" / "metrics.jsonl")]
    assert lora["stage"] == res["stages"]["ppo_lora"] == {"seconds": None, "peak_memory_bytes": None}
    assert lora["gold_score"] == {"before": None, "after": None} and lora["kl_mean_final"] is None
    assert lora["trained"] == {"roles": {}, "trainable_parameters": None, "optimizer_state": None}
    assert res["lora_memory_saving_bytes"] == dict.fromkeys(("generate", "score", "train", "eval", "stage"))
    table = (out / "gpu_check.txt").read_text()
    rows, lrows = table_rows(table), table_rows(table, block="PPO vs PPO+LoRA")
    assert rows["train"].split()[1:] == ["20.0", "12.0", "400.0", "MiB", "250.0", "MiB", "150.0", "MiB", "(38%)"]
    assert lrows["train"].split()[1:] == ["20.0", "n/a", "400.0", "MiB", "n/a", "n/a"]
    assert lrows["RL stage (wall)"].split()[3:] == ["40.5", "n/a", "400.0", "MiB", "n/a", "n/a"]
    assert lrows["trained"].split(None, 1)[1] == ("parameters PPO 524,288, PPO+LoRA n/a; optimizer state PPO 6.0 MiB, "
                                                  "PPO+LoRA n/a; roles: actor, critic")
    assert rows["PPO+LoRA"].split() == ["PPO+LoRA", "missing"]
    assert rows["GRPO"].split()[1:4] == ["0.010", "0.500", "+0.490"]
    assert f"PPO+LoRA: missing {run / 'ppo_lora' / 'summary.json'}, {run / 'ppo_lora' / 'metrics.jsonl'}" in table
    assert not [line for line in table.splitlines() if line.startswith(("missing", "GRPO:"))]
    # without LoRA on purpose; without both
    assert gc.main(["--report-only", str(run), "--out", str(out), "--no-lora"]) == 0
    assert "PPO+LoRA: not run: --no-lora" in (out / "gpu_check.txt").read_text()
    assert json.loads((out / "gpu_check.json").read_text())["ppo_lora"]["run"] == {"skipped": "--no-lora"}
    shutil.rmtree(run / "grpo")
    assert gc.main(["--report-only", str(run), "--out", str(out), "--no-lora"]) == 1
    assert gc.main(["--report-only", str(run), "--out", str(out), "--no-lora", "--no-grpo"]) == 0


def test_gpu_check_report_moe_run_cpu(tmp_path):
    """The MoE run's block and JSON from its stage directories: each stage's seconds and peak
    memory, the expert module the summaries name (the actor's first; grouped GEMM or not), gold and
    reward before/after, the routing metrics passed through (first -> last); an older summary
    without the field reads n/a, a missing MoE run is marked missing (exit code 1; --no-moe: 0)."""
    gc = load_gpu_check()
    run = tmp_path / "gpu_check"
    write_run(run)
    out = tmp_path / "out"
    assert gc.main(["--report-only", str(run), "--out", str(out)]) == 0
    moe = json.loads((out / "gpu_check.json").read_text())["moe"]
    moe_dir = tmp_path / "gpu_check_moe"
    assert moe["complete"] and moe["missing"] == [] and moe["stage_dir"] == str(moe_dir / "grpo")
    assert moe["stages"] == {"sft": {"seconds": 20.5, "peak_memory_bytes": 40 * 2**20},
                             "rm": {"seconds": 15.0, "peak_memory_bytes": 48 * 2**20},
                             "grpo": {"seconds": 35.0, "peak_memory_bytes": 96 * 2**20}}
    assert moe["expert_modules"] == MOE_MODULES and moe["expert_module"] == "TEGroupedMLP" and moe["grouped_gemm"]
    assert moe["gold_score"] == {"before": 0.02, "after": 0.45} and moe["reward"] == {"before": 0.125, "after": 1.0}
    assert moe["roles"] == GRPO_ROLES and moe["kl_mean_final"] == 0.25 and moe["phases"]["train"]["seconds"] == 9.0
    assert moe["routing"] == {  # only routing_* and expert_load* keys, the stages that logged any
        "sft": {"expert_load_max": {"first": {"step": 10, "value": 0.375}, "last": {"step": 20, "value": 0.3125}}},
        "grpo": {"expert_load": {"first": {"step": 1, "value": [0.25] * 4},
                                 "last": {"step": 40, "value": [0.5, 0.125, 0.125, 0.25]}},
                 "routing_agreement": {"first": {"step": 1, "value": 0.875}, "last": {"step": 40, "value": 0.96875}}}}
    table = (out / "gpu_check.txt").read_text()
    rows = table_rows(table, block="MoE (")
    assert rows["MoE (pipelines/tiny_cpu_moe.yaml, one process)"].split()[-3:] == ["seconds", "peak", "memory"]
    assert rows["SFT stage"].split()[2:] == ["20.5", "40.0", "MiB"]
    assert rows["RM stage"].split()[2:] == ["15.0", "48.0", "MiB"]
    assert rows["GRPO stage"].split()[2:] == ["35.0", "96.0", "MiB"]
    assert rows["expert module"].split(None, 2)[2] == (
        "actor TEGroupedMLP (grouped GEMM); SFT actor TEGroupedMLP; RM reward TEGroupedMLP; GRPO actor TEGroupedMLP, "
        "reference TEGroupedMLP, reward TEGroupedMLP")
    assert rows["gold"].split(None, 1)[1] == "0.020 -> 0.450 (+0.430); reward 0.125 -> 1.000; KL final 0.250"
    assert rows["routing (SFT)"].split(None, 2)[2] == "expert_load_max 0.375 -> 0.3125 (step 10 -> 20)"
    assert rows["routing (GRPO)"].split(None, 2)[2] == (
        "expert_load [0.25, 0.25, 0.25, 0.25] -> [0.5, 0.125, 0.125, 0.25] (step 1 -> 40); "
        "routing_agreement 0.875 -> 0.9688 (step 1 -> 40)")
    assert "MoE:" not in table

    # SequentialMLP (a GPU without Transformer Engine, or CPU), and summaries without the field
    shutil.rmtree(moe_dir)
    write_moe_run(moe_dir, modules={"sft": {"actor": "SequentialMLP"}, "rm": {"reward": "SequentialMLP"}, "grpo": {}})
    moe = gc.collect(run)["moe"]
    assert moe["expert_module"] == "SequentialMLP" and moe["grouped_gemm"] is False  # the actor's at SFT
    assert table_rows(gc.format_table(gc.collect(run)), block="MoE (")["expert module"].split(None, 2)[2] == \
        "actor SequentialMLP (no grouped GEMM: one per expert); SFT actor SequentialMLP; RM reward SequentialMLP"
    shutil.rmtree(moe_dir)
    write_moe_run(moe_dir, modules=None)
    moe = gc.collect(run)["moe"]
    assert moe["expert_modules"] == {} and moe["expert_module"] is None and moe["grouped_gemm"] is None
    assert "expert module       n/a (no stage summary names its expert module)" in gc.format_table(gc.collect(run))

    # no MoE run: missing, exit code 1; --no-moe: not required
    shutil.rmtree(moe_dir)
    assert gc.main(["--report-only", str(run), "--out", str(out)]) == 1
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["complete"] and not res["moe"]["complete"] and res["moe"]["stages"]["rm"]["seconds"] is None
    table = (out / "gpu_check.txt").read_text()
    missing = ", ".join(str(moe_dir / f) for f in ("sft/summary.json", "rm/summary.json", "grpo/summary.json",
                                                    "grpo/metrics.jsonl"))
    assert f"MoE: missing {missing}" in table and "\ngold " not in table
    assert table_rows(table, block="MoE (")["GRPO stage"].split()[2:] == ["n/a", "n/a"]
    assert gc.main(["--report-only", str(run), "--out", str(out), "--no-moe"]) == 0
    assert "MoE: not run: --no-moe" in (out / "gpu_check.txt").read_text()
    assert json.loads((out / "gpu_check.json").read_text())["moe"]["run"] == {"skipped": "--no-moe"}


def test_gpu_check_moe_overrides_cpu():
    """The MoE run's overrides load with the MoE recipe on one process (the recipe's expert
    parallel 2 does not): the GRPO run's overrides, its own run directory, bf16, every expert
    here; the stage directories are those the report reads."""
    from megatron_rlhf.config import ConfigError, load_config, validate
    from megatron_rlhf.trainers.stage_data import stage_dir

    gc = load_gpu_check()
    given = ["checkpoint.root=/tmp/r", "checkpoint.run_name=gpu_check", "model.params_dtype=bfloat16",
             "rl.critic_optimizer.lr=1e-3", "lora.rank=4", "rl.algorithm=ppo", "rl.steps=3",
             "parallel.expert_parallel=2"]
    keep, dropped = gc.moe_overrides(given)
    assert dropped == ["rl.critic_optimizer.lr=1e-3", "lora.rank=4", "rl.algorithm=ppo"]
    assert keep == ["checkpoint.root=/tmp/r", "model.params_dtype=bfloat16", "rl.steps=3", "parallel.expert_parallel=2",
                    "checkpoint.run_name=gpu_check_moe", "parallel.expert_parallel=1"]  # ours last: they win
    cfg = validate(load_config(REPO / gc.MOE_RECIPE, keep), world_size=1)
    assert cfg.parallel.expert_parallel == 1 and cfg.model.num_experts == 4 and cfg.model.params_dtype == "bfloat16"
    assert cfg.rl.algorithm == "grpo" and not cfg.rl.has_critic and cfg.rl.steps == 3 and cfg.lora.rank == 0
    assert [stage_dir(cfg, s) for s in ("sft", "rm", "rl")] == \
        [Path("/tmp/r") / gc.MOE_RUN / s for s in gc.MOE_STAGES] == [Path("/tmp/r/gpu_check_moe") / s for s in
                                                                    ("sft", "rm", "grpo")]
    with pytest.raises(ConfigError, match="expert_parallel=2"):  # what the recipe alone asks of one process
        validate(load_config(REPO / gc.MOE_RECIPE, keep[:-1]), world_size=1)
    # its share of --timeout: the shares of the runs not skipped must leave PPO some (0.21 + 0.175 + 0.7 > 1)
    with pytest.raises(SystemExit):
        gc.main(["--report-only", "/nonexistent", "--moe-share", "0.7"])
    assert gc.main(["--report-only", "/nonexistent", "--moe-share", "0.7", "--no-moe"]) == gc.EXIT_PREFLIGHT


def test_stage_summary_names_the_expert_module_cpu():
    """runner.expert_modules (a stage's summary.json `expert_modules`): the class of each role's
    megatron MoE layers' `experts` as built; roles without MoE layers (dense models) left out."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    from megatron_rlhf.trainers.runner import expert_modules

    class TEGroupedMLP(torch.nn.Module):
        pass

    class MoELayer(BaseMoELayer):  # megatron's fields only: built without a TransformerConfig or groups
        def __init__(self, experts):
            torch.nn.Module.__init__(self)
            self.router, self.experts = torch.nn.Linear(4, 2), experts

        def forward(self, hidden_states):
            return hidden_states

    moe = torch.nn.Sequential(torch.nn.Linear(4, 4), MoELayer(TEGroupedMLP()), MoELayer(TEGroupedMLP()))
    roles = {"actor": SimpleNamespace(module=moe), "reference": SimpleNamespace(module=moe),
             "reward": SimpleNamespace(module=torch.nn.Linear(4, 1))}
    assert expert_modules(roles) == {"actor": "TEGroupedMLP", "reference": "TEGroupedMLP"}
    assert expert_modules({"actor": SimpleNamespace(module=torch.nn.Linear(4, 4))}) == {}


GPU_ENV = {"python": "3.12.3", "torch": "2.11.0", "cuda": "13.0", "megatron_core": "0.19.2",
           "megatron_rlhf": str(REPO / "megatron_rlhf" / "__init__.py"), "transformer_engine": False,
           "device": "NVIDIA H200", "device_memory_bytes": 140 * 2**30}


@pytest.mark.parametrize("outcome", ["ok", "grpo_fails", "rm_unfinished", "lora_fails", "no_lora", "moe_fails",
                                     "no_moe"])
def test_gpu_check_runs_ppo_then_grpo_then_lora_cpu(tmp_path, monkeypatch, capsys, outcome):
    """main()'s four runs, with our own launcher replaced by one that writes what the stages
    write: GRPO gets the PPO run's overrides minus the critic's, rl.algorithm and lora.X; the
    LoRA run gets the PPO run's plus lora.X, minus rl.algorithm; all in the same run directory;
    then the MoE recipe's own SFT -> RM -> GRPO with the GRPO run's overrides in its own run
    directory on one process (expert parallel 1); each with its part of --timeout; PPO is
    reported whatever the others do."""
    gc = load_gpu_check()
    calls = []

    def fake_run_pipeline(py, overrides, log_path, timeout, recipe=gc.RECIPE):
        calls.append({"recipe": recipe, "overrides": list(overrides), "timeout": timeout, "log": log_path.name})
        log_path.write_text("pipeline output\n")
        root = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("checkpoint.root=")))
        run = root / next(o.split("=", 1)[1] for o in overrides if o.startswith("checkpoint.run_name="))
        if recipe == gc.MOE_RECIPE:  # its own SFT -> RM -> GRPO beside the PPO run, one process
            assert run == root / "gpu_check_moe" and overrides[-1] == "parallel.expert_parallel=1"
            if outcome == "moe_fails":
                return 1, 30.0
            write_moe_run(run)
            return 0, 60.0
        if recipe == gc.RECIPE:
            write_run(run, grpo=False, lora=False, moe=False)
            if outcome == "rm_unfinished":
                (run / "rm" / "summary.json").unlink()
                return 1, 100.0
            return 0, 100.0
        assert (run / "ppo").is_dir()  # the same run directory
        name, failed, seconds = {gc.GRPO_RECIPE: ("grpo", outcome == "grpo_fails", 45.0),
                                 gc.LORA_RECIPE: ("ppo_lora", outcome == "lora_fails", 50.0)}[recipe]
        if failed:
            return 1, 20.0
        write_run(tmp_path / name, grpo=True, lora=True, moe=False)
        (tmp_path / name / name).rename(run / name)
        return 0, seconds

    monkeypatch.setattr(gc, "run_pipeline", fake_run_pipeline)
    monkeypatch.setattr(gc, "find_python", lambda explicit, allow_cpu: {
        "executable": sys.executable, "version": [3, 12, 3], "torch": "2.11.0", "device_name": "NVIDIA H200"})
    monkeypatch.setattr(gc, "verify", lambda py: dict(GPU_ENV))
    out, root = tmp_path / "out", tmp_path / "root"
    rc = gc.main(["--no-install", "--out", str(out), "--run-root", str(root), "--timeout", "400",
                  *({"no_lora": ["--no-lora"], "no_moe": ["--no-moe"]}.get(outcome, [])), "--",
                  "rl.critic_optimizer.lr=1e-3", "ppo.steps=5", "ppo.vf_coef=0.5", "sampling.max_new_tokens=8",
                  "lora.rank=4", "rl.algorithm=ppo"])
    res = json.loads((out / "gpu_check.json").read_text())
    table = (out / "gpu_check.txt").read_text()
    stderr = capsys.readouterr().err
    rows, lrows = table_rows(table), table_rows(table, block="PPO vs PPO+LoRA")

    base = [f"checkpoint.root={root}", "checkpoint.run_name=gpu_check", "model.params_dtype=bfloat16"]
    ppo_overrides = base + ["rl.critic_optimizer.lr=1e-3", "rl.steps=5", "rl.vf_coef=0.5", "sampling.max_new_tokens=8",
                            "rl.algorithm=ppo"]
    # PPO: all but GRPO's 21%, LoRA's 17.5% and MoE's 30% of --timeout 400 (--no-lora, --no-moe: but that one's)
    assert calls[0] == {"recipe": "pipelines/tiny_cpu.yaml", "overrides": ppo_overrides, "log": "gpu_check.log",
                        "timeout": pytest.approx({"no_lora": 196.0, "no_moe": 246.0}.get(outcome, 126.0))}
    assert res["overrides"] == ppo_overrides and res["ppo"]["run"]["overrides"] == ppo_overrides
    assert res["ppo"]["run"]["overrides_not_passed"] == ["lora.rank=4"]  # the LoRA run's only
    assert res["exit_code"] == res["ppo"]["run"]["exit_code"] == (1 if outcome == "rm_unfinished" else 0)
    assert res["total_seconds"] == 100.0 and res["environment"]["params_dtype"] == "bfloat16"
    assert res["command"].endswith("--config pipelines/tiny_cpu.yaml")
    assert res["grpo_command"].endswith("--config pipelines/tiny_cpu_grpo.yaml")
    assert res["lora_command"].endswith("--config pipelines/tiny_cpu_lora.yaml")
    assert res["moe_command"] == "torchrun --standalone --nproc-per-node 1 -m megatron_rlhf pipeline --config " \
        "pipelines/tiny_cpu_moe.yaml"
    # PPO's numbers whatever GRPO and LoRA did
    assert res["ppo_phases"]["train"] == {"seconds": 20.0, "peak_memory_bytes": 400 * 2**20}
    assert res["gold_score"] == {"before": 0.01, "after": 0.655}
    assert rows["PPO"].split()[1:4] == ["0.010", "0.655", "+0.645"]
    assert "peak GPU memory" in table and "PPO GPU peak" in table and "PPO+LoRA GPU peak" in table
    assert "offload between RL phases: on" in table
    grpo_run, lora_run = res["grpo"]["run"], res["ppo_lora"]["run"]
    grpo_ov, grpo_not = base + ["rl.steps=5", "sampling.max_new_tokens=8"], \
        ["rl.critic_optimizer.lr=1e-3", "rl.vf_coef=0.5", "lora.rank=4", "rl.algorithm=ppo"]
    lora_ov = base + ["rl.critic_optimizer.lr=1e-3", "rl.steps=5", "rl.vf_coef=0.5", "sampling.max_new_tokens=8",
                      "lora.rank=4"]  # critic settings too: the LoRA recipe is PPO with a critic
    # the MoE run: the GRPO run's overrides in its own run directory, every expert on the one process,
    # in what PPO, GRPO and LoRA left of --timeout; it needs nothing of theirs
    moe, moe_run = res["moe"], res["moe"]["run"]
    moe_ov = [base[0], base[2], "rl.steps=5", "sampling.max_new_tokens=8", "checkpoint.run_name=gpu_check_moe",
              "parallel.expert_parallel=1"]
    moe_dir = root / "gpu_check_moe"
    if outcome == "no_moe":
        assert moe_run == {"skipped": "--no-moe"} and gc.MOE_RECIPE not in [c["recipe"] for c in calls]
        assert not moe["complete"] and "MoE: not run: --no-moe" in table and "MoE SFT" not in table
    else:
        left = (400 - 100 - {"rm_unfinished": 0, "grpo_fails": 20}.get(outcome, 45)
                - {"rm_unfinished": 0, "no_lora": 0, "lora_fails": 20}.get(outcome, 50))
        assert calls[-1] == {"recipe": "pipelines/tiny_cpu_moe.yaml", "log": "gpu_check_moe.log",
                             "overrides": moe_ov, "timeout": pytest.approx(left)}
        failed = outcome == "moe_fails"
        assert moe_run == {"recipe": "pipelines/tiny_cpu_moe.yaml", "overrides": moe_ov,
                           "overrides_not_passed": grpo_not, "log": "gpu_check_moe.log", "exit_code": int(failed),
                           "seconds": 30.0 if failed else 60.0, "timeout_seconds": pytest.approx(left)}
        assert f"MoE SFT -> RM -> GRPO incl. start-up: {moe_run['seconds']} s" in table
    if outcome == "moe_fails":  # marked missing, exit code 1; the other runs' numbers stand
        missing = [str(moe_dir / f) for f in ("sft/summary.json", "rm/summary.json", "grpo/summary.json",
                                              "grpo/metrics.jsonl")]
        assert rc == 1 and not moe["complete"] and moe["missing"] == missing
        assert f"MoE: the pipeline exited 1; missing {', '.join(missing)}" in table
        assert stderr == (f"gpu-check: MoE the pipeline exited 1; missing {', '.join(missing)} "
                          f"(log: {out / 'gpu_check_moe.log'})\n")
        assert res["complete"] and res["grpo"]["complete"] and res["ppo_lora"]["complete"]
    elif outcome != "no_moe":
        assert moe["complete"] and moe["expert_module"] == "TEGroupedMLP" and moe["grouped_gemm"] is True
        assert moe["gold_score"] == {"before": 0.02, "after": 0.45}
    if outcome == "rm_unfinished":
        assert len(calls) == 2 and rc == 1  # PPO's pipeline, then the MoE run
        skipped = "RM did not finish in the PPO pipeline"
        assert grpo_run == {"recipe": "pipelines/tiny_cpu_grpo.yaml", "overrides": grpo_ov,
                            "overrides_not_passed": grpo_not, "log": "gpu_check_grpo.log", "skipped": skipped}
        assert lora_run == {"recipe": "pipelines/tiny_cpu_lora.yaml", "overrides": lora_ov,
                            "overrides_not_passed": ["rl.algorithm=ppo"], "log": "gpu_check_lora.log",
                            "skipped": skipped}
        assert rows["GRPO"].split() == ["GRPO", "missing"] and rows["PPO+LoRA"].split() == ["PPO+LoRA", "missing"]
        assert f"GRPO: not run: {skipped}" in table and f"PPO+LoRA: not run: {skipped}" in table
        assert f"GRPO not run: {skipped}" in stderr and f"PPO with LoRA not run: {skipped}" in stderr
        return
    grpo_s = 20.0 if outcome == "grpo_fails" else 45.0
    assert calls[1] == {"recipe": "pipelines/tiny_cpu_grpo.yaml", "log": "gpu_check_grpo.log", "overrides": grpo_ov,
                        # what PPO left of --timeout 400, less LoRA's and MoE's shares (70 and 120 s)
                        "timeout": pytest.approx({"no_lora": 180.0, "no_moe": 230.0}.get(outcome, 110.0))}
    assert grpo_run["overrides_not_passed"] == grpo_not
    assert grpo_run["timeout_seconds"] == calls[1]["timeout"] and grpo_run["seconds"] == grpo_s
    if outcome == "no_lora":
        assert len(calls) == 3 and lora_run == {"skipped": "--no-lora"}
    else:
        lora_left = 400 - 100 - grpo_s - (0 if outcome == "no_moe" else 120)  # what is left, less MoE's share
        assert calls[2] == {"recipe": "pipelines/tiny_cpu_lora.yaml", "log": "gpu_check_lora.log",
                            "overrides": lora_ov, "timeout": pytest.approx(lora_left)}
        assert lora_run["overrides_not_passed"] == ["rl.algorithm=ppo"]
        assert lora_run["timeout_seconds"] == pytest.approx(lora_left)
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8  # the device tool brings back at most 8 files; the vLLM log would be the 9th
    summaries = json.loads((out / "summaries.json").read_text())
    metrics = [json.loads(line) for line in (out / "rl_metrics.jsonl").read_text().splitlines()]
    ran = {"grpo_fails": ["ppo_lora", "moe"], "lora_fails": ["grpo", "moe"], "no_lora": ["grpo", "moe"],
           "moe_fails": ["grpo", "ppo_lora"], "no_moe": ["grpo", "ppo_lora"]}.get(outcome, ["grpo", "ppo_lora", "moe"])
    moe_stages = ["moe_sft", "moe_rm", "moe_grpo"] if "moe" in ran else []
    assert sorted(summaries) == sorted(["ppo", "rm", "sft", *[r for r in ran if r != "moe"], *moe_stages])
    if "moe" in ran:
        assert summaries["moe_grpo"]["expert_modules"] == MOE_MODULES["grpo"]
    assert metrics[0] == {"rl_run": "ppo", "step": 0, "eval_gold_score": 0.01}
    assert [sum(m["rl_run"] == a for m in metrics) for a in ("ppo", "grpo", "ppo_lora", "moe")] == \
        [42, 40 * ("grpo" in ran), 40 * ("ppo_lora" in ran), 40 * ("moe" in ran)]
    assert files == sorted(["gpu_check.json", "gpu_check.log", "gpu_check.txt", "gpu_check_grpo.log",
                            *([] if outcome == "no_lora" else ["gpu_check_lora.log"]),
                            *([] if outcome == "no_moe" else ["gpu_check_moe.log"]),
                            "rl_metrics.jsonl", "summaries.json"])
    assert f"GRPO incl. start-up: {grpo_s}" in table
    if outcome == "grpo_fails":
        assert rc == 1 and grpo_run["exit_code"] == 1 and not res["grpo"]["complete"] and res["complete"]
        assert rows["GRPO"].split() == ["GRPO", "missing"]
        assert rows["train"].split()[1:] == ["20.0", "n/a", "400.0", "MiB", "n/a", "n/a"]
        assert f"GRPO: the pipeline exited 1; missing {root / 'gpu_check' / 'grpo' / 'summary.json'}" in table
        assert f"(log: {out / 'gpu_check_grpo.log'})" in stderr and "PPO with LoRA" not in stderr
        assert res["ppo_lora"]["complete"] and lrows["train"].split()[2] == "15.0"  # LoRA ran after it
        return
    assert res["grpo"]["complete"] and grpo_run["exit_code"] == 0
    assert res["memory_saving_bytes"]["stage"] == 140 * 2**20
    if outcome == "lora_fails":
        assert rc == 1 and lora_run["exit_code"] == 1 and not res["ppo_lora"]["complete"] and res["complete"]
        assert rows["PPO+LoRA"].split() == ["PPO+LoRA", "missing"]
        assert lrows["train"].split()[1:] == ["20.0", "n/a", "400.0", "MiB", "n/a", "n/a"]
        assert set(res["lora_memory_saving_bytes"].values()) == {None}
        path = root / "gpu_check" / "ppo_lora" / "summary.json"
        assert f"PPO+LoRA: the pipeline exited 1; missing {path}" in table
        assert f"PPO with LoRA the pipeline exited 1; missing {path}" in stderr
        assert f"(log: {out / 'gpu_check_lora.log'})" in stderr and "GRPO" not in stderr
        return
    if outcome == "moe_fails":
        return
    assert rc == 0 and stderr == ""
    if outcome == "no_lora":
        assert "PPO+LoRA: not run: --no-lora" in table and "PPO+LoRA incl." not in table
        return
    assert lora_run["exit_code"] == 0 and res["ppo_lora"]["complete"]
    assert res["lora_memory_saving_bytes"]["stage"] == 168 * 2**20
    assert res["ppo_lora"]["trained"]["trainable_parameters"] == 16449
    assert summaries["ppo_lora"]["lora"] == LORA_SUMMARY
    assert lrows["train"].split()[1:] == ["20.0", "15.0", "400.0", "MiB", "220.0", "MiB", "180.0", "MiB", "(45%)"]
    assert ("SFT -> RM -> PPO incl. start-up: 100.0 s   GRPO incl. start-up: 45.0 s   "
            "PPO+LoRA incl. start-up: 50.0 s" + ("" if outcome == "no_moe" else
                                                 "   MoE SFT -> RM -> GRPO incl. start-up: 60.0 s")) in table
    assert not [line for line in table.splitlines()
                if line.startswith(("missing", "GRPO:", "GRPO      missing", "PPO+LoRA:", "PPO+LoRA  missing"))]


def test_gpu_check_grpo_overrides_cpu():
    """The GRPO run's overrides load with the GRPO recipe (which refuses critic settings given on
    the command line); gpu_check's copy of the critic fields is the config's."""
    from megatron_rlhf.config import CRITIC_FIELDS, ConfigError, load_config, validate

    gc = load_gpu_check()
    assert gc.CRITIC_FIELDS == CRITIC_FIELDS
    assert gc.modern_overrides(["ppo.ppo_epochs=1", "ppo.kl_coef=0.1", "sft.steps=2", "model.ppo.x=1"]) == \
        ["rl.epochs=1", "rl.kl_coef=0.1", "sft.steps=2", "model.ppo.x=1"]
    overrides = ["checkpoint.root=/tmp/r", "checkpoint.run_name=gpu_check", "model.params_dtype=bfloat16",
                 "rl.critic_optimizer.lr=1e-3", "ppo.lam=0.9", "rl.algorithm=ppo", "rl.steps=3", "ppo.epochs=1"]
    keep, dropped = gc.grpo_overrides(overrides)
    assert dropped == ["rl.critic_optimizer.lr=1e-3", "rl.lam=0.9", "rl.algorithm=ppo"]
    assert keep == overrides[:3] + ["rl.steps=3", "rl.epochs=1"]
    cfg = validate(load_config(REPO / gc.GRPO_RECIPE, keep), world_size=1)
    assert cfg.rl.algorithm == "grpo" and not cfg.rl.has_critic and cfg.model.params_dtype == "bfloat16"
    assert cfg.rl.steps == 3 and cfg.checkpoint.run_name == "gpu_check"
    with pytest.raises(ConfigError, match="critic"):
        validate(load_config(REPO / gc.GRPO_RECIPE, overrides[:4]), world_size=1)  # what it would refuse
    cfg = validate(load_config(REPO / gc.RECIPE, gc.modern_overrides(overrides[:3])), world_size=1)
    assert cfg.rl.algorithm == "ppo" and cfg.rl.has_critic


def test_gpu_check_lora_overrides_cpu():
    """The LoRA run's overrides load with the LoRA recipe (critic settings included) into PPO with
    adapters whose RL stage directory is the one the report reads (<run>/ppo_lora); lora.X
    overrides reach only the LoRA run: the PPO and GRPO runs stay full fine-tuning."""
    from megatron_rlhf.config import load_config, validate
    from megatron_rlhf.trainers.stage_data import stage_dir

    gc = load_gpu_check()
    overrides = ["checkpoint.root=/tmp/r", "checkpoint.run_name=gpu_check", "model.params_dtype=bfloat16",
                 "rl.critic_optimizer.lr=1e-3", "ppo.lam=0.9", "lora.rank=4", "rl.algorithm=ppo", "rl.steps=3"]
    keep, dropped = gc.lora_overrides(overrides)
    assert dropped == ["rl.algorithm=ppo"]
    assert keep == overrides[:4] + ["rl.lam=0.9", "lora.rank=4", "rl.steps=3"]
    cfg = validate(load_config(REPO / gc.LORA_RECIPE, keep), world_size=1)
    assert cfg.rl.algorithm == "ppo" and cfg.rl.has_critic and cfg.lora.rank == 4 and cfg.lora.critic
    assert cfg.rl.critic_optimizer.lr == 1e-3 and cfg.rl.lam == 0.9 and cfg.model.params_dtype == "bfloat16"
    assert stage_dir(cfg, "rl") == Path("/tmp/r/gpu_check") / gc.RL_RUNS[2] == Path("/tmp/r/gpu_check/ppo_lora")
    assert stage_dir(validate(load_config(REPO / gc.LORA_RECIPE, overrides[:3]), world_size=1), "rl").name == \
        "ppo_lora"  # the recipe's own rank
    full, lora_only = gc.full_overrides(overrides)
    assert lora_only == ["lora.rank=4"] and "lora.rank=4" in gc.grpo_overrides(overrides)[1]
    for recipe, algorithm in ((gc.RECIPE, "ppo"), (gc.GRPO_RECIPE, "grpo")):
        ov = full if recipe == gc.RECIPE else gc.grpo_overrides(overrides)[0]
        cfg = validate(load_config(REPO / recipe, ov), world_size=1)
        assert cfg.lora.rank == 0 and stage_dir(cfg, "rl").name == algorithm


def test_gpu_check_preflight_messages_cpu():
    gc = load_gpu_check()

    def fails(probes, *words):
        with pytest.raises(gc.CheckError) as err:
            gc.diagnose(probes)
        msg = str(err.value)
        assert "\n" not in msg and all(w in msg for w in words), msg

    base = {"executable": "/usr/bin/python3", "version": [3, 12, 3]}
    fails([], "no python")
    fails([{**base, "torch_error": "ModuleNotFoundError: No module named 'torch'"}], "no torch", "/usr/bin/python3")
    fails([{**base, "torch": "2.11.0+cpu", "torch_cuda": None, "cuda_available": False}], "torch without CUDA")
    fails([{**base, "torch": "2.13.0", "torch_cuda": "13.0", "cuda_available": False}], "no CUDA device", "2.13.0")
    fails([{**base, "version": [3, 11, 7], "torch": "2.11.0", "torch_cuda": "13.0", "cuda_available": True}],
          "wrong python", "3.11.7", "3.12")
    good = {**base, "torch": "2.11.0", "torch_cuda": "13.0", "cuda_available": True}
    assert gc.diagnose([{**base, "torch_error": "x"}, good]) is good
    reqs = gc.requirements()
    assert "megatron-core==0.19.2" in reqs and not any(r.startswith("torch") for r in reqs)


def test_gpu_check_vllm_path_numbers_and_skip_line_cpu(tmp_path):
    """The vLLM rollout path's block: medians of refit GB/s, decode tokens/s and the memory the
    engine's sleep frees, read from the vLLM run's metrics; a clear line when it was not run."""
    gc = load_gpu_check()
    run = tmp_path / "gpu_check"
    write_run(run, grpo=False)
    assert gc.collect(run)["vllm"] == {}  # no vLLM run directory: no block
    assert "vLLM" not in gc.format_table(gc.collect(run))
    vllm = tmp_path / gc.VLLM_RUN
    write_run(vllm, grpo=False, moe=False)
    rows = [{"step": s, "refit_seconds": 0.5 * s, "refit_bytes_per_s": 2e9 * s, "generate_tokens_per_s": 1000.0 * s,
             "engine_sleep_freed_bytes": 2**30, "logprob_mismatch": 1e-3} for s in (1, 2, 3)]
    (vllm / "ppo" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = gc.collect(run)
    v = res["vllm"]
    assert (v["refit_seconds"], v["refit_gb_per_s"], v["decode_tokens_per_s"]) == (1.0, 4.0, 2000.0)
    assert v["sleep_freed_bytes"] == 2**30 and v["gold_score"]["after"] == 0.655
    line = next(x for x in gc.format_table(res).splitlines() if x.startswith("vLLM rollout"))
    assert "refit 4.00 GB/s" in line and "decode 2000 tokens/s" in line and "frees 1024.0 MiB" in line
    skipped = {**res, "vllm": {"run": gc.run_vllm(Path(sys.executable), [], tmp_path, tmp_path, 1, skip=True)}}
    assert "vLLM rollout (pipelines/tiny_cpu_vllm.yaml): not run: --no-vllm" in gc.format_table(skipped)
    if gc.vllm_missing(Path(sys.executable)):  # this environment has no vllm: the reason and the fix
        why = gc.run_vllm(Path(sys.executable), [], tmp_path, tmp_path, 1, skip=False)["skipped"]
        assert "does not import" in why and "'.[vllm]'" in why
