"""benchmarks/memory_plan.py against measurement: the activation bytes its plan gives a
microbatch equal what autograd keeps for backward (logging/memory.py: SavedActivations, an
Actor's first train step) on a tiny CPU model, without recomputation, selective, full (uniform
and block) and with the logits whole or chunked; and the CLI's plan of the long-context recipe.
One 1-rank launch measures every case."""

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
}
# The local implementation's count is exact up to a few per-sequence tensors the plan leaves out.
TOLERANCE = 0.02


def model_config(case: str):
    from megatron_rlhf.config import load_config

    chunk, recompute = CASES[case]
    cfg = load_config(None, MODEL)
    return cfg, dataclasses.replace(cfg.model, logits_chunk_tokens=chunk, **recompute)


def worker(out: Path) -> None:
    torch.set_num_threads(1)
    from megatron_rlhf import parallel
    from megatron_rlhf.models.roles import Actor, summed
    from megatron_rlhf.trainers.runner import start_distributed

    cfg, _ = model_config("none")
    start_distributed(cfg)
    loss_fn = lambda o, mb: (*summed(-o["logprobs"] - 0.01 * o["entropy"]), {})  # noqa: E731
    tokens = torch.randint(0, 1000, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    measured = {}
    for case in CASES:
        actor = Actor(model_config(case)[1], optimizer=cfg.optimizer, max_consecutive_nonfinite=3)
        actor.train_step({"tokens": tokens}, ROWS, loss_fn)
        measured[case] = actor.activation_bytes
    out.write_text(json.dumps(measured))
    parallel.destroy()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory_plan") / "measured.json"
    torchrun(1, "tests/test_memory_plan.py", "--out", str(out), timeout=300)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_planned_activations_equal_the_saved_tensors(measured, case):
    cfg, model = model_config(case)
    cfg = dataclasses.replace(cfg, model=model)
    planned = memory_plan.plan(cfg, 1, seq_length=SEQ, rows=ROWS, implementation="local").activations_saved_bytes
    assert abs(planned - measured[case]) <= TOLERANCE * measured[case], (case, planned, measured[case])


def test_the_cases_differ_as_the_settings_say(measured):
    """Guards the comparison itself: the cases are far enough apart that a plan ignoring a setting fails it."""
    assert measured["full_uniform_1"] < 0.1 * measured["none"]
    assert measured["full_uniform_1"] < measured["full_block_2"] < measured["none"]
    # the unchunked logits: one fp32 [tokens x padded vocab] copy more (1024 = 1000 padded to 128)
    assert measured["none_unchunked"] - measured["none"] == ROWS * SEQ * 1024 * 4


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
