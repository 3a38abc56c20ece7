"""Hugging Face checkpoints in the stages users run: SFT starting from a local HF Llama
(`model.init_from_hf`) evaluates exactly as transformers does on the same data, and a model
config that does not match the HF one stops before training with the field to fix."""

import json
import subprocess
import sys

import pytest
import torch

from distributed import REPO
from stages import RECIPE, stage, summary

pytestmark = pytest.mark.slow

SFT = ["sft.steps=2", "sft.optimizer.warmup_steps=1", "sft.eval_interval=2", "data.task_sizes.sft_train=64",
       "data.task_sizes.sft_eval=32"]


def tiny_llama_like_the_recipe(path):
    """A random LlamaForCausalLM with pipelines/tiny_cpu.yaml's model shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=87, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def hf_response_nll(model, run_dir, seq_length) -> float:
    """The SFT eval loss (token-weighted response NLL) computed by transformers."""
    from megatron_rlhf.data.encode import collate_sft, encode_sft
    from megatron_rlhf.data.jsonl import read_sft
    from megatron_rlhf.data.tasks import get_task
    from megatron_rlhf.data.tokenizers import WordTokenizer

    tokenizer = WordTokenizer(get_task("sentiment").words())
    examples, _ = encode_sft(read_sft(run_dir / "data" / "sft_eval.jsonl"), tokenizer, seq_length, "truncate")
    batch = collate_sft(examples, tokenizer.pad_id, seq_length)
    with torch.no_grad():
        logits = model(batch["tokens"]).logits.double()
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(2, batch["tokens"][:, 1:, None]).squeeze(2)
    logprobs = torch.cat([logprobs, torch.zeros_like(logprobs[:, :1])], 1)  # position t predicts t+1
    mask = batch["loss_mask"].double()
    return float(-(logprobs * mask).sum() / mask.sum())


@pytest.mark.parametrize("nproc,layout", [(1, []), (2, ["parallel.tensor_parallel=2"])], ids=["TP1", "TP2"])
def test_sft_from_a_hf_checkpoint_starts_where_transformers_is(tmp_path, nproc, layout):
    hf = tiny_llama_like_the_recipe(tmp_path / "hf")
    out = stage(nproc, "sft", tmp_path, "from_hf", *SFT, *layout, f"model.init_from_hf={tmp_path / 'hf'}").stdout
    assert f"initialised from the Hugging Face checkpoint {tmp_path / 'hf'}" in out
    seq_length = 32  # the recipe's sft.seq_length
    want = hf_response_nll(hf, tmp_path / "from_hf", seq_length)
    assert summary(tmp_path, "from_hf", "sft")["eval_loss_start"] == pytest.approx(want, rel=1e-5)


def test_a_model_config_that_differs_from_the_hf_one_is_refused(tmp_path):
    tiny_llama_like_the_recipe(tmp_path / "hf")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rlhf", "sft", *RECIPE, f"model.init_from_hf={tmp_path / 'hf'}",
         "model.num_layers=2", f"checkpoint.root={tmp_path}"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "conversion error" in proc.stderr and "model.num_layers" in proc.stderr
    assert not (tmp_path / "default" / "sft" / "latest").exists()


def test_import_and_export_commands(tmp_path):
    """`import-hf` at TP2 then `export-hf` in one process give back the HF tensors exactly."""
    from safetensors.torch import load_file

    tiny_llama_like_the_recipe(tmp_path / "hf")
    from distributed import torchrun

    torchrun(2, "-m", "megatron_rlhf", "import-hf", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "imported"),
             "parallel.tensor_parallel=2")
    assert (tmp_path / "imported" / "latest").read_text().strip() == "iter_0000000"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rlhf", "export-hf", *RECIPE, "--ckpt", str(tmp_path / "imported"),
         "--role", "actor", "--out", str(tmp_path / "exported")], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    original = load_file(tmp_path / "hf" / "model.safetensors")
    exported = {}
    for shard in sorted((tmp_path / "exported").glob("*.safetensors")):
        exported.update(load_file(shard))
    assert original.keys() == exported.keys()
    for key in original:
        assert torch.equal(original[key], exported[key]), key
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
