"""Settings a run infers instead of asking for: the model vocabulary from the tokenizer, and
a held-out eval split from a single training file. Checked before workers start (preflight)."""

import dataclasses
import json

import pytest

from megatron_rlhf.config import ConfigError, load_config, validate
from megatron_rlhf.data.jsonl import DataError
from megatron_rlhf.trainers.stage_data import load_stage_data, preflight, resolve_run, resolve_vocab_size, tokenizer_for
from test_data import make_hf_dir


def user_config(tmp_path, *overrides):
    tok = make_hf_dir(tmp_path / "tok", {"eos_token": "</s>", "pad_token": "<pad>"})
    return load_config(None, ["data.task=null", f"data.tokenizer={tok}", *overrides])


def write_sft(path, n):
    path.write_text("".join(json.dumps({"prompt": f"hello {i}", "response": "world"}) + "\n" for i in range(n)))
    return path


def test_vocab_size_defaults_to_the_tokenizers_size(tmp_path):
    cfg = user_config(tmp_path)
    assert cfg.model.vocab_size is None
    with pytest.raises(ConfigError, match="model.vocab_size is not known yet"):
        cfg.model.padded_vocab_size
    cfg, note = resolve_vocab_size(cfg, tokenizer_for(cfg))
    assert cfg.model.vocab_size == 6 and cfg.model.token_vocab_size == 6 and cfg.model.padded_vocab_size == 128
    assert "tokenizer's size" in note


def test_a_larger_model_vocabulary_masks_the_ids_the_tokenizer_lacks(tmp_path):
    cfg = load_stage_data(user_config(tmp_path, "model.vocab_size=10"), ()).config
    # the embedding keeps its 10 rows (checkpoint shapes); sampling and log-probs use 6
    assert (cfg.model.vocab_size, cfg.model.token_vocab_size) == (10, 6)


def test_a_tokenizer_larger_than_the_model_is_refused_with_the_fix(tmp_path):
    cfg = user_config(tmp_path, "model.vocab_size=5")
    with pytest.raises(ConfigError, match=r"has 6 tokens.*remove model.vocab_size .* or set model.vocab_size=6"):
        load_stage_data(cfg, ())


def test_eval_fraction_holds_out_a_seeded_part_of_one_file(tmp_path):
    train = write_sft(tmp_path / "sft.jsonl", 40)
    cfg = user_config(tmp_path, f"data.sft_train={train}", "data.eval_fraction=0.25")
    data = load_stage_data(cfg, ("sft_train", "sft_eval"))
    train_part, eval_part = data.splits["sft_train"], data.splits["sft_eval"]
    assert (len(train_part), len(eval_part)) == (30, 10)
    assert not {e.prompt for e in eval_part} & {e.prompt for e in train_part}
    assert "10 of 40 records" in data.sources["sft_eval"] and "30 of 40" in data.sources["sft_train"]
    # deterministic from the seed (the RM stage reads the same eval part again); another seed, another part
    again = load_stage_data(cfg, ("sft_eval",)).splits["sft_eval"]
    assert again == eval_part
    other = load_stage_data(user_config(tmp_path, f"data.sft_train={train}", "data.eval_fraction=0.25", "seed=7"),
                            ("sft_eval",)).splits["sft_eval"]
    assert other != eval_part and len(other) == 10


def test_an_eval_file_wins_over_the_fraction_and_zero_needs_one(tmp_path):
    train, evals = write_sft(tmp_path / "sft.jsonl", 8), write_sft(tmp_path / "eval.jsonl", 3)
    cfg = user_config(tmp_path, f"data.sft_train={train}", f"data.sft_eval={evals}")
    data = load_stage_data(cfg, ("sft_train", "sft_eval"))
    assert (len(data.splits["sft_train"]), len(data.splits["sft_eval"])) == (8, 3)
    cfg = user_config(tmp_path, f"data.sft_train={train}", "data.eval_fraction=0")
    with pytest.raises(ConfigError, match="data.sft_eval: no file given and data.eval_fraction=0"):
        load_stage_data(cfg, ("sft_eval",))
    with pytest.raises(ConfigError, match=r"data.eval_fraction=1.0: must be in \[0, 1\)"):
        validate(user_config(tmp_path, "data.eval_fraction=1.0"))


def test_preflight_finds_missing_files_and_sources_before_workers_start(tmp_path):
    train = write_sft(tmp_path / "sft.jsonl", 8)
    cfg = user_config(tmp_path, f"data.sft_train={train}")
    assert "model.vocab_size=6" in preflight(cfg, "sft")[0]
    cfg = user_config(tmp_path, f"data.sft_train={tmp_path / 'missing.jsonl'}")
    with pytest.raises(DataError, match=r"data.sft_train=.*missing.jsonl: file not found"):
        preflight(cfg, "sft")
    # the pipeline's RM stage needs preference pairs: named before an SFT run is spent
    cfg = user_config(tmp_path, f"data.sft_train={train}", "pipeline.stages=[sft,rm]")
    with pytest.raises(ConfigError, match="data.preference_train: no file given and data.task is null"):
        preflight(cfg, "pipeline")


def test_the_vocabulary_divisor_error_suggests_a_value():
    cfg = load_config(None, ["model.make_vocab_size_divisible_by=100", "parallel.tensor_parallel=8",
                             "model.num_attention_heads=8", "model.hidden_size=64"])
    with pytest.raises(ConfigError, match="set model.make_vocab_size_divisible_by=200"):
        validate(cfg, world_size=8)


def test_a_stage_derives_its_settings_beside_the_loaded_config_which_stays_as_loaded(tmp_path):
    cfg = user_config(tmp_path, "model.vocab_size=10")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.vocab_size = 6
    run = resolve_run(cfg)
    assert (run.config.model.vocab_size, run.config.model.token_vocab_size) == (10, 6)
    assert cfg.model.token_vocab_size == 10 and cfg.recipe is run.config.recipe  # the loaded one untouched
    assert any("6 tokens, 4 ids the tokenizer lacks are masked" in note for note in run.notes)
    with pytest.raises(ConfigError, match="recipe: unknown key"):  # what loading learned is not a recipe key
        load_config(None, ["recipe.notes=[x]"])
