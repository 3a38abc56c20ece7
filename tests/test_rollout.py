"""The in-place Megatron rollout engine: KV-cached decoding equals full recomputation,
TP2 / PP2 / TP2-PP2 generate exactly what TP1-PP1 does (decoding without the sequence
parallelism TP2 scores with), rollout log-probs equal the
actor's recomputed ones, EOS stops a row and the rest is padding, and multi-turn continuation
from the turn cache equals generating each turn from the whole sequence."""

import pytest
import torch

from distributed import TINY_MODEL, torchrun
from megatron_rlhf.rollout import Rollout
from workers import layout_args
from workers.rollout_layouts import EOS, NEW, PAD, PROMPTS

pytestmark = pytest.mark.slow
LAYOUTS = {"tp2pp1": (2, 1, 2), "tp1pp2": (1, 2, 2), "tp2pp2": (2, 2, 4)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    worker = "tests/workers/rollout_layouts.py"
    torchrun(1, worker, f"--root={root}", "--layout=tp1pp1=1x1", "--init", *TINY_MODEL)
    by_world = {}  # one launch per world size (workers.run_layouts)
    for layout, (tp, pp, n) in LAYOUTS.items():
        by_world.setdefault(n, {})[layout] = (tp, pp)
    for n, layouts in sorted(by_world.items()):
        torchrun(n, worker, f"--root={root}", *layout_args(layouts), *TINY_MODEL)
    return {name: torch.load(root / f"rollout_{name}.pt", weights_only=False) for name in ["tp1pp1", *LAYOUTS]}


def test_kv_cached_greedy_equals_full_recomputation(runs):
    greedy = runs["tp1pp1"]["greedy"]
    for row, want in enumerate(runs["tp1pp1"]["no_cache_greedy"]):
        length = int(greedy["lengths"][row])
        assert length == len(want)
        assert greedy["tokens"][row, :length].tolist() == want


@pytest.mark.parametrize("layout", ["tp1pp1", *LAYOUTS])
def test_the_turn_cache_continues_rows_as_recomputing_them_does(runs, layout):
    """Multi-turn continuation (rollout/megatron_engine.py TurnCache): rows that grew by an
    observation of their own length, some dropped and reordered, some ended early and fed
    padding, continue from the cache (the observation as one chunk after the cached keys) and
    sample what a generate from their whole sequences samples (same seed); so do rows of one
    length whose last sampled tokens were never fed ("even")."""
    for turns in runs[layout]["turns"].values():
        for cached, again, _ in turns:
            for key in ("tokens", "prompt_lengths", "lengths", "finished"):
                assert torch.equal(cached[key], again[key]), key
            torch.testing.assert_close(cached["logprobs"], again["logprobs"], atol=1e-5, rtol=0)
        assert turns[-1][2] > 2 * 10  # later turns started from the cache
    first = runs[layout]["turns"]["ragged"][0][0]
    assert first["finished"].any() and not first["finished"].all()  # some rows ended early (a stop id)
    assert (first["lengths"] - first["prompt_lengths"]).min() < NEW
    even = runs[layout]["turns"]["even"][0][0]
    assert (even["lengths"] - even["prompt_lengths"]).tolist() == [NEW] * len(PROMPTS)


@pytest.mark.parametrize("layout", ["tp1pp1", *LAYOUTS])
def test_decoding_runs_without_sequence_parallelism_and_restores_it(runs, layout):
    """TP > 1 scores with sequence parallelism (parallel.sequence_parallel: auto); generation
    switches it off for decoding and every switch is back afterwards."""
    assert runs[layout]["sequence_parallel"] == (LAYOUTS.get(layout, (1,))[0] > 1)
    assert runs[layout]["switches_restored"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_generation_matches_tp1pp1(runs, layout):
    base, got = runs["tp1pp1"], runs[layout]
    for kind in ("greedy", "sampled", "eos_run"):
        assert torch.equal(got[kind]["tokens"], base[kind]["tokens"]), kind
        assert torch.equal(got[kind]["lengths"], base[kind]["lengths"]), kind
        torch.testing.assert_close(got[kind]["logprobs"], base[kind]["logprobs"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["tp1pp1", *LAYOUTS])
def test_rollout_logprobs_equal_recomputed(runs, layout):
    r = runs[layout]
    mask = r["response_mask"]
    assert mask.sum() > 0 and torch.all(r["sampled"]["logprobs"][mask == 0] == 0)
    torch.testing.assert_close(r["sampled"]["logprobs"], r["recomputed_logprobs"], atol=1e-5, rtol=0)


def test_ragged_prompts_are_kept_and_responses_bounded(runs):
    r = runs["tp1pp1"]["sampled"]
    rollout = Rollout(**r)
    assert rollout.response_lengths().tolist() == [len(ids) for ids in rollout.response_ids()]
    assert rollout.response_ids()[1] == r["tokens"][1, len(PROMPTS[1]) : int(r["lengths"][1])].tolist()
    for row, prompt in enumerate(PROMPTS):
        assert r["tokens"][row, : len(prompt)].tolist() == prompt
        assert int(r["prompt_lengths"][row]) == len(prompt)
        assert 0 < int(r["lengths"][row]) - len(prompt) <= NEW
        assert torch.all(r["tokens"][row, int(r["lengths"][row]):] == PAD)


def test_eos_stops_the_row_and_pads_the_rest(runs):
    r, eos = runs["tp1pp1"]["eos_run"], runs["tp1pp1"]["eos_id"]
    assert eos != EOS
    end = len(PROMPTS[0]) + 3  # EOS is the third generated token of row 0
    assert int(r["lengths"][0]) == end and bool(r["finished"][0])
    assert int(r["tokens"][0, end - 1]) == eos
    assert torch.all(r["tokens"][0, end:] == PAD)
    greedy = runs["tp1pp1"]["greedy"]
    for row in range(1, len(PROMPTS)):  # other rows are unaffected unless they emit it too
        n = int(r["lengths"][row])
        assert r["tokens"][row, :n].tolist() == greedy["tokens"][row, :n].tolist()
