"""benchmarks/memory_plan.py against measurement: the activation bytes its plan gives a
microbatch equal what autograd keeps for backward (logging/memory.py: SavedActivations, an
Actor's first train step) on a tiny CPU model, without recomputation, selective, full (uniform
and block), with the logits whole or chunked, with q/k norms, at TP1 and at TP2 with sequence
parallelism; and the CLI's plan of the long-context recipe. One 2-rank launch measures every
case (TP1 first, as DP2: each rank's microbatch is the same size)."""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # as a torchrun script too: tests/ helpers
sys.path.insert(0, str(REPO / "benchmarks"))
from distributed import torchrun  # noqa: E402

import memory_plan  # noqa: E402

MODEL = ["model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
         "model.ffn_hidden_size=192", "model.vocab_size=1000", "model.max_seq_length=128"]
ROWS, SEQ = 2, 128
FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
CASES = {  # name: (logits_chunk_tokens, recompute fields)
    "none": (32, {}),
    "none_unchunked": (0, {}),
    "selective": (32, {"recompute_granularity": "selective"}),
    "full_uniform_1": (32, FULL),
    "full_uniform_2": (32, {**FULL, "recompute_num_layers": 2}),
    "full_block_2": (32, {**FULL, "recompute_method": "block", "recompute_num_layers": 2}),
    "qk_norm": (32, {"qk_layernorm": True, "family": "qwen3"}),
}
TP2_CASES = ("none", "none_unchunked", "full_uniform_1")
# The local count is exact at TP1 and within 0.1 % at TP2 (a few per-token tensors the plan leaves out).
TOLERANCE = 0.01


def model_config(case: str, tp: int = 1):
    from megatron_rlhf.config import load_config

    chunk, recompute = CASES[case]
    cfg = load_config(None, [*MODEL, f"parallel.tensor_parallel={tp}"])
    return cfg, dataclasses.replace(cfg.model, logits_chunk_tokens=chunk, **recompute)


def worker(out: Path) -> None:
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from megatron_rlhf import parallel
    from megatron_rlhf.models.roles import Actor, summed
    from megatron_rlhf.trainers.runner import start_distributed

    loss_fn = lambda o, mb: (*summed(-o["logprobs"] - 0.01 * o["entropy"]), {})  # noqa: E731
    tokens = torch.randint(0, 1000, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    measured = {}
    for tp, cases in ((1, CASES), (2, TP2_CASES)):
        cfg, _ = model_config("none", tp)
        if tp == 1:
            start_distributed(cfg)
        else:
            parallel_state.destroy_model_parallel()
            parallel.initialize(cfg.parallel, cfg.seed)
        for case in cases:
            actor = Actor(model_config(case, tp)[1], optimizer=cfg.optimizer, max_consecutive_nonfinite=3)
            actor.train_step({"tokens": tokens}, ROWS, loss_fn)
            measured[f"tp{tp}_{case}"] = actor.activation_bytes
    if torch.distributed.get_rank() == 0:
        out.write_text(json.dumps(measured))
    parallel.destroy()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory_plan") / "measured.json"
    torchrun(2, "tests/test_memory_plan.py", "--out", str(out), timeout=300)
    return json.loads(out.read_text())


@pytest.mark.parametrize("tp, case", [(1, c) for c in CASES] + [(2, c) for c in TP2_CASES])
def test_planned_activations_equal_the_saved_tensors(measured, tp, case):
    cfg, model = model_config(case, tp)
    cfg = dataclasses.replace(cfg, model=model)
    planned = memory_plan.plan(cfg, 2, seq_length=SEQ, rows=ROWS, implementation="local").activations_saved_bytes
    got = measured[f"tp{tp}_{case}"]
    print(f"TP{tp} {case}: planned {planned:.0f} B, measured {got} B ({planned / got - 1:+.2%})")
    assert abs(planned - got) <= TOLERANCE * got, (tp, case, planned, got)


def test_the_cases_differ_as_the_settings_say(measured):
    """Guards the comparison itself: the cases are far enough apart that a plan ignoring a setting fails it."""
    assert measured["tp1_full_uniform_1"] < 0.1 * measured["tp1_none"]
    assert measured["tp1_full_uniform_1"] < measured["tp1_full_block_2"] < measured["tp1_none"]
    # the unchunked logits: one fp32 [tokens x padded vocab / TP] copy more (1024 = 1000 padded to 128)
    for tp in (1, 2):
        logits = ROWS * SEQ * 1024 // tp * 4
        assert measured[f"tp{tp}_none_unchunked"] - measured[f"tp{tp}_none"] == pytest.approx(logits, rel=0.01)
    # sequence parallelism and TP2's heads: about half per rank
    assert 0.4 < measured["tp2_none"] / measured["tp1_none"] < 0.6


def test_the_long_context_recipe_fits_its_plan(tmp_path):
    out = tmp_path / "plan.json"
    assert memory_plan.main(["--config", str(REPO / "pipelines/qwen3_8b_grpo_long.yaml"), "--gpus", "16",
                             "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["fits"] and plan["layout"] == "TP4 CP2 PP1 DP2" and plan["tokens_per_microbatch"] == 34816
    # without context parallelism the same microbatch keeps twice the activations per GPU
    assert memory_plan.main(["--config", str(REPO / "pipelines/qwen3_8b_grpo_long.yaml"), "--gpus", "16",
                             "--set", "parallel.context_parallel=1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["activations_kept_gb"] == pytest.approx(2 * plan["activations_kept_gb"], rel=0.01)


def test_bad_input_names_the_field(capsys):
    assert memory_plan.main(["--config", str(REPO / "pipelines/qwen3_8b_grpo_long.yaml"), "--gpus", "12"]) == 2
    assert "parallel.context_parallel=2" in capsys.readouterr().err


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    worker(ap.parse_args().out)
