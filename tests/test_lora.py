"""LoRA (models/lora.py) on the actor and the critic: a fresh adapter changes nothing, the
adapter-free reference is the base model bit for bit, merged weights give the adapted model's
outputs, only the adapters (and a critic's value head) train, TP2 and PP2 equal TP1 (outputs
and one optimizer step, from adapters saved at TP1), checkpoints hold the trained weights only
and resume bit for bit; a LoRA checkpoint loads into a later stage's roles merged, at any layout."""

import pytest
import torch

from distributed import TINY_MODEL, read_global_tensors

pytestmark = pytest.mark.slow

# OVERRIDES, BASE, LAYOUTS: the runs of the lora_runs fixture (tests/conftest.py), shared with test_lora_export
OVERRIDES = [*TINY_MODEL, "optimizer.lr=0.01", "optimizer.adam_eps=1e-4", "seed=7"]
BASE = "tp1pp1"
LAYOUTS = {"tp2pp1": (2, 1), "tp1pp2": (1, 2)}
ATOL = 1e-5


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_zero_b_leaves_outputs_unchanged(lora_runs, role):
    root, _ = lora_runs
    assert torch.load(root / f"fresh_{role}.pt")["b_zero_equal"]


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
def test_reference_is_the_base_model_bitwise(lora_runs, layout):
    out = lora_runs[1][layout]["outputs"]
    for key, base in out["base"].items():
        assert torch.equal(out["reference"][key], base), key
    assert (out["actor"]["logprobs"] - out["base"]["logprobs"]).abs().max() > 0.1, "the adapters must change the actor"
    assert lora_runs[1][layout]["adapters_on_after_reference"]


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
def test_merged_weights_give_the_adapted_outputs(lora_runs, layout):
    out = lora_runs[1][layout]["outputs"]
    for key, want in out["actor"].items():
        torch.testing.assert_close(out["merged"][key], want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
def test_a_lora_checkpoint_starts_a_later_stage_merged(lora_runs, layout):
    """The TP1 adapter checkpoints loaded at this layout into a frozen role (and a frozen critic,
    with the value head the LoRA run trained), and as the base of new adapters: each gives the
    adapted model's outputs; the new role's own adapters start fresh and are what trains."""
    result = lora_runs[1][layout]
    out = result["outputs"]
    for got in ("loaded_merged", "stacked", "stacked_reference"):
        for key, want in out["actor"].items():
            torch.testing.assert_close(out[got][key], want, atol=ATOL, rtol=0, msg=lambda m: f"{got} {key}: {m}")
    torch.testing.assert_close(out["critic_loaded_merged"]["values"], out["critic"]["values"], atol=ATOL, rtol=0)
    assert not torch.allclose(out["loaded_merged"]["logprobs"], out["base"]["logprobs"], atol=1e-3)
    assert result["stacked_own_adapters_fresh"] and result["stacked_own_adapters_trained"]


def test_resuming_across_a_lora_change_is_refused(lora_runs):
    refusals = lora_runs[1][BASE]["refusals"]
    assert sorted(refusals) == ["adapters_into_full", "full_into_lora", "rank"], refusals
    assert "rank 4" in refusals["rank"] and "lora.rank=2" in refusals["rank"]
    assert "with LoRA adapters" in refusals["adapters_into_full"]
    assert "without LoRA adapters" in refusals["full_into_lora"]


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
def test_only_adapters_and_value_head_train(lora_runs, layout):
    for role, t in lora_runs[1][layout]["trainable"].items():
        assert t["names"] and all(n.endswith((".lora_A", ".lora_B")) for n in t["names"] if n not in t["non_adapters"])
        head = ["output_layer.weight", "output_layer.bias"]
        assert t["non_adapters"] in ([], head) and (role == "critic" or not t["non_adapters"])
        assert t["in_buffers"] == t["numel"] == t["in_optimizer_main_params"]
        assert t["moved"] == sorted(t["names"]), f"{role}: frozen weights moved or adapters did not"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_outputs_and_step_match_tp1(lora_runs, layout):
    root, results = lora_runs
    for role, outputs in results[BASE]["outputs"].items():
        for key, want in outputs.items():
            torch.testing.assert_close(results[layout]["outputs"][role][key], want, atol=ATOL, rtol=0)
    for role, loss in results[BASE]["losses"].items():
        assert results[layout]["losses"][role] == pytest.approx(loss, abs=ATOL)
        want = read_global_tensors(root / "after_step" / BASE / role)
        start = read_global_tensors(root / "init" / f"{role}_adapters")
        assert max((want[k] - start[k]).abs().max().item() for k in want) > 100 * ATOL
        got = read_global_tensors(root / "after_step" / layout / role)
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], atol=ATOL, rtol=0, msg=lambda m: f"{role} {key}: {m}")


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_checkpoint_holds_only_trained_weights(lora_runs, role):
    root, _ = lora_runs
    saved = read_global_tensors(root / "after_step" / BASE / role)
    weights = [k for k in saved if not k.startswith("optimizer.")]
    assert weights and all(k.endswith((".lora_A", ".lora_B")) or k.startswith("output_layer.") for k in weights)
    assert ("output_layer.weight" in weights) == (role == "critic")  # a value head trains in full
    assert ("output_layer.lora_A" in weights) == (role == "actor")  # the policy's LM head has an adapter
    base = read_global_tensors(root / "init" / f"{role}_base")
    assert sum(v.numel() for k, v in saved.items() if k in weights) < 0.2 * sum(v.numel() for v in base.values())


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
def test_resume_is_exact(lora_runs, layout):
    for role, r in lora_runs[1][layout]["resume"].items():
        assert r["loss_resumed"] == r["loss"], role
        assert r["max_param_diff"] == 0.0, role
    # the checkpoint recorded the base the adapters trained on (roles.lora_base_warnings compares it)
    assert lora_runs[1][layout]["base_recorded"] == {"actor": True, "critic": True}
