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


# ----------------------------------------------------------------------------- what a later stage reads from its start
def started_from(tmp_path, **model):
    """<tmp>/first/sft: a committed checkpoint (weights never read here) that recorded the
    recipe's model with `model` changed, as an SFT run with those overrides leaves it."""
    from test_damaged_run_files import fake_checkpoint

    recorded = dataclasses.replace(load_config(None, ["model.vocab_size=87"]).model, **model)
    fake_checkpoint(tmp_path / "first" / "sft", 2, {"step": 2, "model_config": dataclasses.asdict(recorded)})
    return tmp_path / "first" / "sft"


def test_a_later_stage_takes_the_length_its_start_was_trained_at(tmp_path):
    """DPO after an SFT trained at max_seq_length 256 (the recipe says 128): the recipe's value is
    replaced by the checkpoint's (with a note); a command-line override is the run's choice; a
    stage length the adopted value cannot hold names the checkpoint's value and the override."""
    from megatron_rlhf.trainers.stage_data import architecture_from_start

    start = started_from(tmp_path, max_seq_length=256)
    where = [f"dpo.init_from={start}", f"checkpoint.root={tmp_path}", "model.vocab_size=87"]
    cfg, notes = architecture_from_start(load_config(None, where), "dpo")
    assert cfg.model.max_seq_length == 256
    assert any("model.max_seq_length=128 by 256" in note for note in notes), notes
    # the length the DPO run asks for on the command line: kept, not refused
    cfg, _ = architecture_from_start(load_config(None, [*where, "model.max_seq_length=512"]), "dpo")
    assert cfg.model.max_seq_length == 512
    # an SFT trained shorter than the recipe's DPO length: both named
    start = started_from(tmp_path / "short", max_seq_length=32)
    short = [f"dpo.init_from={start}", "model.vocab_size=87", "sft.seq_length=32", "rm.seq_length=32"]
    with pytest.raises(ConfigError, match=r"dpo.seq_length=64: longer than model.max_seq_length=32: "
                                          r"model.max_seq_length=32 is the length .*first/sft/iter_0000002.*"
                                          r"recipe's 128 is replaced\); set model.max_seq_length="):
        architecture_from_start(load_config(None, short), "dpo")


def test_builtin_tokenizer_without_a_task_names_auto_which_reads_the_start_runs_tokenizer(tmp_path):
    """A run on user data (data.task=null) that starts from another run's SFT with the recipe's
    data.tokenizer=builtin: the error names data.tokenizer=auto, and auto is the tokenizer the
    start run recorded."""
    from megatron_rlhf.data.tokenizers import TokenizerError, record_tokenizer
    from megatron_rlhf.trainers.stage_data import run_tokenizer

    start = started_from(tmp_path)
    tok = make_hf_dir(tmp_path / "tok", {"eos_token": "</s>", "pad_token": "<pad>"})
    record_tokenizer(tokenizer_for(user_config(tmp_path)), str(tok), None, start.parent / "tokenizer")
    second = ["data.task=null", f"rl.sft_from={start}", f"checkpoint.root={tmp_path}", "checkpoint.run_name=second"]
    with pytest.raises(TokenizerError, match=r"needs a built-in task \(data.task\).*another run's checkpoint "
                                             r"\(rl.sft_from.*set data.tokenizer=auto"):
        run_tokenizer(load_config(None, [*second, "data.tokenizer=builtin"]), "rl")
    cfg, tokenizer, notes = run_tokenizer(load_config(None, [*second, "data.tokenizer=auto"]), "rl")
    assert cfg.data.tokenizer == str(start.parent / "tokenizer") and tokenizer.eos_id is not None, notes


def test_the_issues_dpo_command_runs_at_the_length_its_sft_trained_at(tmp_path):
    """`dpo ... dpo.seq_length=200` with the recipe's model.max_seq_length=128 after an SFT
    trained at 256: the launcher's pre-flight (and a stage's start-up, start_distributed) check
    the stage against the architecture it starts from. Before: 'dpo.seq_length=200: longer
    than model.max_seq_length=128', from the recipe, before the checkpoint was read."""
    from megatron_rlhf.torchrun import check

    start = started_from(tmp_path, max_seq_length=256)
    where = [f"dpo.init_from={start}", f"checkpoint.root={tmp_path}", "model.vocab_size=87", "dpo.seq_length=200"]
    assert check(load_config(None, where), "dpo", 1) is None
    assert "dpo.seq_length=300: longer than model.max_seq_length=256" in check(
        load_config(None, [*where[:3], "dpo.seq_length=300"]), "dpo", 1)
