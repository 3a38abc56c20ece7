"""Hugging Face checkpoints in the stages users run, as a new user does: SFT starting from a
local HF model (`model.init_from_hf`, no model.* overrides although its shape is not the
recipe's: the architecture comes from config.json) evaluates exactly as transformers does on
the same data; `export-hf --ckpt <the SFT stage>` needs nothing else and gives a model
transformers evaluates as our run did, with the run's tokenizer, special-token ids and the
model's own generation config; later stages (and the pipeline's export) take the architecture and the
tokenizer from what the SFT run recorded; a model field given next to the HF directory that
disagrees with it stops before any model is built; import-hf -> export-hf keeps config.json."""

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
import torch

from distributed import REPO
from stages import RECIPE, stage, summary

pytestmark = pytest.mark.slow

SFT = ["sft.steps=2", "sft.optimizer.warmup_steps=1", "sft.eval_interval=2", "data.task_sizes.sft_train=64",
       "data.task_sizes.sft_eval=32"]
# config.json's special-token ids: not the tokenizer's (eos 1, pad 0, no bos), so an export that
# writes these back took them from the import, not from the tokenizer
HF_TOKEN_IDS = {"bos_token_id": 3, "eos_token_id": [1, 2], "pad_token_id": 0}


def tiny_qwen2_unlike_the_recipe(path):
    """A random Qwen2ForCausalLM (q/k/v biases, tied embeddings) whose shape is not
    pipelines/tiny_cpu.yaml's, with 96 embedding rows for the built-in tokenizer's 87 tokens,
    which it ships in Hugging Face format (the same ids)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_rlhf.data.tasks import get_task
    from megatron_rlhf.data.tokenizers import WordTokenizer

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, **HF_TOKEN_IDS)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    WordTokenizer(get_task("sentiment").words()).save_hf(path)
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
        logits = model(batch["tokens"]).logits[..., :87].double()  # the tokenizer's ids only, as ours
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(2, batch["tokens"][:, 1:, None]).squeeze(2)
    logprobs = torch.cat([logprobs, torch.zeros_like(logprobs[:, :1])], 1)  # position t predicts t+1
    mask = batch["loss_mask"].double()
    return float(-(logprobs * mask).sum() / mask.sum())


@pytest.mark.parametrize("nproc,layout", [(1, []), (2, ["parallel.tensor_parallel=2"])], ids=["TP1", "TP2"])
def test_sft_from_a_hf_checkpoint_starts_where_transformers_is(tmp_path, nproc, layout, caplog):
    hf = tiny_qwen2_unlike_the_recipe(tmp_path / "hf")
    # the HF directory's tokenizer (the recipe's is builtin); checkpoints at steps 1 and 2
    out = stage(nproc, "sft", tmp_path, "from_hf", *SFT, *layout, f"model.init_from_hf={tmp_path / 'hf'}",
                f"data.tokenizer={tmp_path / 'hf'}", "sft.save_interval=1", "sampling.temperature=0.7").stdout
    assert f"initialised from the Hugging Face checkpoint {tmp_path / 'hf'}" in out
    # the tiny recipe's from-scratch SFT lr on a pretrained start: said at the stage's start
    assert f"warning: sft.optimizer.lr=0.003 with model.init_from_hf={tmp_path / 'hf'}" in out
    seq_length = 32  # the recipe's sft.seq_length
    want = hf_response_nll(hf, tmp_path / "from_hf", seq_length)
    result = summary(tmp_path, "from_hf", "sft")
    assert result["eval_loss_start"] == pytest.approx(want, rel=1e-5)
    if nproc == 2:
        return
    # export-hf needs only the stage directory: the checkpoint recorded its model config
    proc = subprocess.run([sys.executable, "-m", "megatron_rlhf", "export-hf", "--ckpt", str(tmp_path / "from_hf" / "sft"),
                           "--role", "actor", "--out", str(tmp_path / "exported")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", local_files_only=True).eval()
    assert type(trained).__name__ == "Qwen2ForCausalLM"
    assert trained.config.max_position_embeddings == 256  # the model's context, not the run's max_seq_length
    assert hf_response_nll(trained, tmp_path / "from_hf", seq_length) == pytest.approx(result["eval_loss"], rel=1e-5)
    assert result["eval_loss"] < result["eval_loss_start"]
    check_the_export_is_complete(tmp_path / "exported", tmp_path / "hf")
    check_later_stages_read_the_recorded_model(tmp_path, "from_hf")
    check_export_refuses_a_damaged_newest_checkpoint(tmp_path, tmp_path / "from_hf" / "sft", caplog)


def check_the_export_is_complete(exported, tokenizer_dir):
    """The run's tokenizer and special-token ids, and the HF model's own generation config (the
    run recorded it), not the run's rollout settings (sampling.temperature=0.7, max_new_tokens):
    generation stops, and is not cut at the rollouts' length."""
    from transformers import GenerationConfig

    config = json.loads((exported / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"]) == (1, 0)
    generation = GenerationConfig.from_pretrained(exported)
    assert (generation.eos_token_id, generation.pad_token_id) == (1, 0)
    written = json.loads((exported / "generation_config.json").read_text())
    own = tokenizer_dir / "generation_config.json"  # the HF directory's (save_pretrained's), if any
    own = json.loads(own.read_text()) if own.is_file() else {}
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    assert {k: v for k, v in written.items() if k not in ids} == {k: v for k, v in own.items() if k not in ids}
    assert not {"max_new_tokens", "temperature", "do_sample"} & set(written), written
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (exported / name).read_bytes() == (tokenizer_dir / name).read_bytes(), name


def check_later_stages_read_the_recorded_model(root, run):
    """rm with the recipe alone (model.init_from_hf and data.tokenizer were SFT overrides): the
    architecture comes from the SFT checkpoint, the tokenizer from <run>/tokenizer/; an override
    that contradicts the checkpoint is refused. The pipeline's export uses the checkpoint's too."""
    from megatron_rlhf.config import ConfigError, load_config
    from megatron_rlhf.pipeline import export_actor
    from megatron_rlhf.trainers.stage_data import preflight, resolve_run

    where = [f"checkpoint.root={root}", f"checkpoint.run_name={run}"]
    cfg = load_config(REPO / RECIPE[1], where)
    notes = preflight(cfg, "rm")
    cfg = resolve_run(cfg, "rm").config  # as the rm stage resolves it (the loaded config is never changed)
    model = dataclasses.asdict(cfg.model)
    assert {k: model[k] for k in ("family", "num_layers", "hidden_size", "qkv_bias", "vocab_size")} == {
        "family": "qwen2", "num_layers": 2, "hidden_size": 48, "qkv_bias": True, "vocab_size": 96}
    assert cfg.data.tokenizer == str(root / run / "tokenizer")
    assert any("replaces the recipe's" in note and "model.num_layers=4 by 2" in note for note in notes), notes
    with pytest.raises(ConfigError, match=r"rm.init_from: .*\n  model.hidden_size=64: the checkpoint recorded 48"):
        preflight(load_config(REPO / RECIPE[1], [*where, "model.hidden_size=64"]), "rm")
    with pytest.raises(ConfigError, match=r"data.tokenizer=builtin .*: not the tokenizer this run's checkpoints"):
        preflight(load_config(REPO / RECIPE[1], [*where, "data.tokenizer=builtin"]), "rm")
    exported = export_actor(load_config(REPO / RECIPE[1], where), "sft")  # the recipe's model is another one
    assert json.loads((exported / "config.json").read_text())["hidden_size"] == 48
    assert (exported / "tokenizer.json").is_file()


def check_export_refuses_a_damaged_newest_checkpoint(tmp_path, sft, caplog):
    """export-hf of a stage whose newest checkpoint is damaged names the older one instead of
    exporting it silently; --iter picks it. Copied out of its run, it has no tokenizer: said."""
    from megatron_rlhf.__main__ import main

    damaged = tmp_path / "damaged" / "sft"
    shutil.copytree(sft, damaged)
    (damaged / "iter_0000002" / "actor" / ".metadata").write_bytes(b"")
    export = ["export-hf", "--ckpt", str(damaged), "--role", "actor", "--out"]
    assert main([*export, str(tmp_path / "refused")]) == 2 and not (tmp_path / "refused").exists()
    assert main([*export, str(tmp_path / "older"), "--iter", "1"]) == 0
    assert json.loads((tmp_path / "older" / "config.json").read_text())["hidden_size"] == 48
    assert "no eos_token_id" in caplog.text and "never stops" in caplog.text


def test_a_model_field_that_differs_from_the_hf_one_is_refused(tmp_path):
    tiny_qwen2_unlike_the_recipe(tmp_path / "hf")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rlhf", "sft", *RECIPE, f"model.init_from_hf={tmp_path / 'hf'}",
         "model.num_layers=4", "model.qkv_bias=false", f"checkpoint.root={tmp_path}"],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "config error" in proc.stderr
    assert "set model.num_layers=2" in proc.stderr and "set model.qkv_bias=true" in proc.stderr  # both, at once
    assert "Traceback" not in proc.stderr and not (tmp_path / "default").exists()


def test_import_and_export_commands(tmp_path):
    """`import-hf` at TP2 then `export-hf` in one process give back the HF tensors exactly."""
    from safetensors.torch import load_file

    tiny_qwen2_unlike_the_recipe(tmp_path / "hf")
    from distributed import torchrun

    torchrun(2, "-m", "megatron_rlhf", "import-hf", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "imported"),
             "parallel.tensor_parallel=2")
    assert (tmp_path / "imported" / "latest").read_text().strip() == "iter_0000000"
    proc = subprocess.run(  # the recipe as well (docs/hf_models.md's example): the recorded model config wins
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
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    from megatron_rlhf.convert.hf_config import read_hf_config

    # the original's config.json, special-token ids included (read as our converter reads it)
    before, after = read_hf_config(tmp_path / "hf"), read_hf_config(tmp_path / "exported")
    assert dataclasses.replace(after, path=None) == dataclasses.replace(before, path=None)
    assert {k: getattr(after, k) for k in HF_TOKEN_IDS} == HF_TOKEN_IDS
    generation = json.loads((tmp_path / "exported" / "generation_config.json").read_text())
    assert {k: generation[k] for k in HF_TOKEN_IDS} == HF_TOKEN_IDS
    assert (tmp_path / "exported" / "tokenizer.json").is_file()  # the import recorded the HF model's
    proc = subprocess.run(  # an override that contradicts the recorded config is named
        [sys.executable, "-m", "megatron_rlhf", "export-hf", "--ckpt", str(tmp_path / "imported"), "--role", "actor",
         "--out", str(tmp_path / "other"), "model.hidden_size=64"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2 and "model.hidden_size=64: the checkpoint recorded 48" in proc.stderr


def test_lora_sft_on_a_hf_checkpoint_trains_on_its_one_time_import(tmp_path):
    """LoRA SFT from `model.init_from_hf`: the HF weights imported once into <run>/hf_import (the
    adapters' base, referenced by their checkpoints); fresh adapters start where transformers
    is; a later run whose model.init_from_hf names another directory is refused, not mixed."""
    hf = tiny_qwen2_unlike_the_recipe(tmp_path / "hf")
    lora = ["lora.rank=4", "lora.stages=[sft]"]
    stage(1, "sft", tmp_path, "lora_hf", *SFT, *lora, f"model.init_from_hf={tmp_path / 'hf'}")
    result = summary(tmp_path, "lora_hf", "sft_lora")
    assert result["eval_loss_start"] == pytest.approx(hf_response_nll(hf, tmp_path / "lora_hf", 32), rel=1e-5)
    base = tmp_path / "lora_hf" / "hf_import" / "iter_0000000" / "actor"
    assert result["lora"]["actor"]["base"] == str(base) and (base / ".metadata").is_file()
    assert result["eval_loss"] != result["eval_loss_start"]  # the adapters trained
    tiny_qwen2_unlike_the_recipe(tmp_path / "hf_other")
    proc = stage(1, "sft", tmp_path, "lora_hf", *SFT, *lora, f"model.init_from_hf={tmp_path / 'hf_other'}",
                 check=False)
    assert proc.returncode != 0 and f"holds an import of {tmp_path / 'hf'}" in proc.stdout + proc.stderr
