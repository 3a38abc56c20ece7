"""The data layer: JSONL validation, tokenizers, encoding conventions, sampler, built-in task."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rlhf.data.encode import (
    EncodedPair,
    EncodedSFT,
    LengthReport,
    collate_preferences,
    collate_prompts_left_padded,
    collate_sft,
    encode_preferences,
    encode_prompts,
    encode_sft,
)
from megatron_rlhf.data.jsonl import (
    DataError,
    PreferenceExample,
    PromptExample,
    SFTExample,
    read_preferences,
    read_prompts,
    read_sft,
    write_jsonl,
)
from megatron_rlhf.data.sampler import EpochSampler
from megatron_rlhf.data.tasks import TASKS, TaskSizes, get_task
from megatron_rlhf.data.tokenizers import (
    HFTokenizer,
    TokenizerError,
    WordTokenizer,
    load_tokenizer,
)

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = REPO / "megatron_rlhf" / "data"
SMALL = TaskSizes(
    sft_train=60, sft_eval=10, preference_train=60, preference_eval=10, ppo_prompts=30,
    eval_prompts=10,
)


def write_lines(path: Path, *lines: str | bytes) -> Path:
    path.write_bytes(b"\n".join(l if isinstance(l, bytes) else l.encode() for l in lines) + b"\n")
    return path


# ---------------------------------------------------------------- jsonl


def test_reads_records_skipping_blank_lines_and_ignoring_extra_fields(tmp_path):
    path = write_lines(
        tmp_path / "sft.jsonl",
        '{"prompt": "hi", "response": "hello", "source": "x", "id": 7}',
        "",
        "   ",
        '{"prompt": "héllo ✓", "response": "multi\\nline"}',
    )
    assert read_sft(path) == [SFTExample("hi", "hello"), SFTExample("héllo ✓", "multi\nline")]


def test_reads_preferences_and_prompts(tmp_path):
    prefs = write_lines(tmp_path / "p.jsonl", '{"prompt": "q", "chosen": "a", "rejected": "b"}')
    prompts = write_lines(tmp_path / "q.jsonl", '{"prompt": "q1"}', '{"prompt": "q2", "x": 1}')
    assert read_preferences(prefs) == [PreferenceExample("q", "a", "b")]
    assert read_prompts(prompts) == [PromptExample("q1"), PromptExample("q2", {"x": 1})]


def test_write_jsonl_round_trips_utf8(tmp_path):
    records = [SFTExample("prompt ü", 'say "x"\n'), SFTExample("b", "c")]
    path = tmp_path / "nested" / "out.jsonl"
    assert write_jsonl(path, records) == 2
    assert read_sft(path) == records
    assert "ü" in path.read_text(encoding="utf-8")  # written as UTF-8, not \u escapes
    assert len(path.read_text(encoding="utf-8").splitlines()) == 2


def test_utf8_bom_on_first_line_is_accepted(tmp_path):
    path = write_lines(tmp_path / "bom.jsonl", b'\xef\xbb\xbf{"prompt": "p"}')
    assert read_prompts(path) == [PromptExample("p")]


GOOD_LINE = {
    read_sft: '{"prompt": "p", "response": "r"}',
    read_preferences: '{"prompt": "p", "chosen": "a", "rejected": "b"}',
    read_prompts: '{"prompt": "p"}',
}
BAD_LINES = [
    (read_sft, '{"prompt": "p"}', "field 'response': missing"),
    (read_sft, '{"prompt": 3, "response": "r"}', "field 'prompt': expected a string, got int"),
    (read_sft, '{"prompt": null, "response": "r"}',
     "field 'prompt': expected a string, got null"),
    (read_sft, '{"prompt": "p", "response": ["r"]}',
     "field 'response': expected a string, got list"),
    (read_sft, '{"prompt": "", "response": "r"}', "field 'prompt': empty string"),
    (read_sft, '{"prompt": "p", "response": "  \\n"}',
     "field 'response': whitespace-only string"),
    (read_preferences, '{"prompt": "p", "chosen": "", "rejected": "b"}',
     "field 'chosen': empty string"),
    (read_preferences, '{"prompt": "p", "chosen": "a"}', "field 'rejected': missing"),
    (read_preferences, '{"prompt": "p", "chosen": "a", "rejected": "a"}',
     "fields 'chosen' and 'rejected': identical"),
    (read_prompts, '{"text": "p"}', "field 'prompt': missing"),
    (read_sft, '{"prompt": "p" "response": "r"}', "invalid JSON (Expecting ',' delimiter"),
    (read_sft, '{"prompt": "p", "response": "r"', "invalid JSON"),
    (read_sft, b'{"prompt": "caf\xe9", "response": "r"}', "invalid UTF-8 ("),
    (read_sft, '["p", "r"]', "line is not a JSON object"),
    (read_prompts, '"just a string"', "line is not a JSON object"),
]


@pytest.mark.parametrize("reader, bad_line, expected", BAD_LINES)
def test_bad_record_error_names_path_line_and_field(tmp_path, reader, bad_line, expected):
    good = GOOD_LINE[reader]
    # Line 3 after a blank line: blank lines still count towards the line number.
    path = write_lines(tmp_path / "data.jsonl", good, "", bad_line, good)
    with pytest.raises(DataError) as info:
        reader(path)
    message = str(info.value)
    assert message.startswith(f"{path}:3: "), message
    assert expected in message


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_empty_file_is_an_error_naming_the_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match="no records") as info:
        read_prompts(path)
    assert str(info.value).startswith(f"{path}: ")


def test_missing_file_is_an_error_naming_the_path(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match="file not found") as info:
        read_sft(path)
    assert str(path) in str(info.value)


def test_prompt_extras_keep_every_other_field_with_its_json_value(tmp_path):
    path = write_lines(
        tmp_path / "q.jsonl",
        '{"prompt": "2 plus 3", "answer": "5", "tests": ["assert f(1) == 2", {"n": 3}], '
        '"weight": 0.5, "meta": null, "ok": true}',
        '{"prompt": "no extras"}',
    )
    with_extras, without = read_prompts(path)
    assert with_extras.prompt == "2 plus 3"
    assert with_extras.extra == {
        "answer": "5", "tests": ["assert f(1) == 2", {"n": 3}], "weight": 0.5, "meta": None,
        "ok": True,
    }
    assert without.extra == {}


def test_prompt_extras_do_not_relax_prompt_validation(tmp_path):
    path = write_lines(tmp_path / "q.jsonl", '{"answer": "5", "prompt": 5}')
    with pytest.raises(DataError, match="field 'prompt': expected a string, got int"):
        read_prompts(path)


def test_prompts_with_extras_round_trip_flattened(tmp_path):
    records = [
        PromptExample("what is 2 plus 3", {"answer": "5", "tests": [1, [2, "ü"]]}),
        PromptExample("plain"),
        PromptExample("nested", {"meta": {"source": "x", "n": None}}),
    ]
    path = tmp_path / "prompts.jsonl"
    assert write_jsonl(path, records) == 3
    assert read_prompts(path) == records
    first = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
    # Flattened, as users write prompt files: no "extra" key in the file.
    assert first == {"prompt": "what is 2 plus 3", "answer": "5", "tests": [1, [2, "ü"]]}


def test_prompt_extras_compare_but_do_not_break_hashing():
    assert PromptExample("p", {"answer": "1"}) != PromptExample("p", {"answer": "2"})
    assert PromptExample("p", {"answer": "1"}) == PromptExample("p", {"answer": "1"})
    assert len({PromptExample("p", {"answer": "1"}), PromptExample("p", {"answer": "1"})}) == 1


def test_prompt_extra_cannot_hold_a_prompt_key_or_be_a_non_dict():
    with pytest.raises(ValueError, match="PromptExample.extra: must not contain the key 'prompt'"):
        PromptExample("p", {"prompt": "other"})
    with pytest.raises(ValueError, match="PromptExample.extra: keys must be strings"):
        PromptExample("p", {1: "x"})
    with pytest.raises(TypeError, match="PromptExample.extra: expected a dict, got list"):
        PromptExample("p", ["answer"])


def test_write_jsonl_rejects_non_dataclasses(tmp_path):
    with pytest.raises(TypeError, match="dataclass"):
        write_jsonl(tmp_path / "x.jsonl", [{"prompt": "p"}])


# ---------------------------------------------------------------- tokenizers


def test_word_tokenizer_ids_round_trip_and_unknown_words():
    tok = WordTokenizer(["the", "film", "was", "great", "film"])
    assert (tok.pad_id, tok.eos_id, tok.unk_id) == (0, 1, 2)
    assert tok.vocab_size == 7  # 3 specials + 4 distinct words
    assert tok.encode("the film  was\tgreat") == [3, 4, 5, 6]  # first-seen order, dupes dropped
    assert tok.decode(tok.encode("the film was great")) == "the film was great"
    assert tok.encode("the popcorn was great") == [3, 2, 5, 6]
    assert tok.decode([3, 2, 6, tok.eos_id, tok.pad_id, tok.pad_id]) == "the <unk> great"
    assert tok.decode(torch.tensor([4, 1])) == "film"


def test_word_tokenizer_pad_differs_from_eos_and_rejects_bad_words():
    assert WordTokenizer([]).pad_id != WordTokenizer([]).eos_id
    with pytest.raises(TokenizerError, match="without whitespace"):
        WordTokenizer(["two words"])
    with pytest.raises(TokenizerError, match="special token"):
        WordTokenizer(["<eos>"])
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        WordTokenizer(["a"]).decode([9])


def make_hf_dir(
    directory: Path, config: dict | None = None, special_map: dict | None = None
) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4, "again": 5}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<pad>", "</s>"])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if special_map is not None:
        (directory / "special_tokens_map.json").write_text(json.dumps(special_map))
    return directory


def test_hf_tokenizer_loads_offline_and_round_trips(tmp_path):
    directory = make_hf_dir(tmp_path / "tok", {"eos_token": "</s>", "pad_token": "<pad>"})
    tok = HFTokenizer(directory)
    assert (tok.vocab_size, tok.pad_id, tok.eos_id) == (6, 0, 1)
    ids = tok.encode("hello world again")
    assert ids == [3, 4, 5]  # no special tokens added
    assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == "hello world again"
    assert tok.encode("hello mars") == [3, 2]
    assert isinstance(load_tokenizer(str(directory), task_words=None), HFTokenizer)


def test_hf_tokenizer_reads_dict_tokens_from_special_tokens_map(tmp_path):
    directory = make_hf_dir(
        tmp_path / "tok",
        config={"eos_token": {"content": "</s>", "lstrip": False}},
        special_map={"pad_token": {"content": "<pad>"}, "eos_token": "</s>"},
    )
    tok = HFTokenizer(directory)
    assert (tok.pad_id, tok.eos_id) == (0, 1)


def test_hf_tokenizer_without_pad_token_pads_with_eos(tmp_path):
    # More cases (null pad_token, collation, rollout) in test_tokenizer_padding.py.
    tok = HFTokenizer(make_hf_dir(tmp_path / "tok", {"eos_token": "</s>"}))
    assert (tok.pad_id, tok.eos_id, tok.pad_token, tok.pad_defaulted) == (1, 1, "</s>", True)


def test_hf_tokenizer_accepts_pad_equal_to_eos(tmp_path):
    tok = HFTokenizer(make_hf_dir(tmp_path / "tok", {"eos_token": "</s>", "pad_token": "</s>"}))
    assert (tok.pad_id, tok.eos_id, tok.pad_defaulted) == (1, 1, False)
    assert tok.decode([3, 4, tok.eos_id, tok.pad_id]) == "hello world"


def test_hf_tokenizer_without_eos_or_with_unknown_token_fails(tmp_path):
    with pytest.raises(TokenizerError, match='no "eos_token"'):
        HFTokenizer(make_hf_dir(tmp_path / "a", {"pad_token": "<pad>"}))
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        HFTokenizer(make_hf_dir(tmp_path / "b", {"pad_token": "[PAD]", "eos_token": "</s>"}))


def test_hf_tokenizer_without_tokenizer_json_names_directory_and_file(tmp_path):
    directory = tmp_path / "empty_tok"
    directory.mkdir()
    with pytest.raises(TokenizerError) as info:
        HFTokenizer(directory)
    assert str(directory) in str(info.value) and "tokenizer.json" in str(info.value)


def test_load_tokenizer_builtin_and_errors(tmp_path):
    tok = load_tokenizer("builtin", ["a", "b"])
    assert isinstance(tok, WordTokenizer) and tok.vocab_size == 5
    needs_task = r"data.tokenizer=builtin needs a built-in task \(data.task\)"
    with pytest.raises(TokenizerError, match=needs_task):
        load_tokenizer("builtin", None)
    with pytest.raises(TokenizerError, match="data.tokenizer="):
        load_tokenizer(str(tmp_path / "missing"), None)


# ---------------------------------------------------------------- encode and collate

# ids: <pad>=0 <eos>=1 <unk>=2 a=3 b=4 c=5 d=6 e=7
TOK = WordTokenizer(["a", "b", "c", "d", "e"])


def test_sft_sequence_and_loss_mask_convention():
    items, report = encode_sft(
        [SFTExample("a b", "c"), SFTExample("a", "d e")], TOK, max_len=8, overflow="drop"
    )
    assert items == [EncodedSFT([3, 4, 5, 1], 2), EncodedSFT([3, 6, 7, 1], 1)]
    assert (report.total, report.truncated, report.dropped) == (2, 0, 0)
    batch = collate_sft(items, TOK.pad_id, seq_len=6)
    assert batch["tokens"].tolist() == [[3, 4, 5, 1, 0, 0], [3, 6, 7, 1, 0, 0]]
    # Position t is marked iff token t+1 is a response token or the final EOS.
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0]]
    assert batch["lengths"].tolist() == [4, 4]
    assert batch["tokens"].dtype == torch.long and batch["loss_mask"].dtype == torch.float
    assert batch["lengths"].dtype == torch.long


def test_loss_mask_marks_exactly_positions_followed_by_response_or_eos():
    task = get_task("sentiment")
    tok = WordTokenizer(task.words())
    examples = task.splits(3, SMALL).sft_train
    items, _ = encode_sft(examples, tok, max_len=24, overflow="drop")
    batch = collate_sft(items, tok.pad_id, seq_len=24)
    for row, (item, example) in enumerate(zip(items, examples)):
        response_ids = set(range(item.prompt_len, len(item.tokens)))  # response + EOS positions
        expected = [1.0 if t + 1 in response_ids else 0.0 for t in range(24)]
        assert batch["loss_mask"][row].tolist() == expected
        assert item.tokens[-1] == tok.eos_id
        assert tok.decode(item.tokens[item.prompt_len :]) == example.response


def test_truncate_cuts_the_response_and_drop_drops_and_both_are_counted():
    examples = [
        SFTExample("a", "b"),            # 3 tokens: fits
        SFTExample("a b", "c d e"),      # 6 tokens: too long
        SFTExample("a b c d", "e"),      # prompt alone fills max_len=4: always dropped
    ]
    items, report = encode_sft(examples, TOK, max_len=4, overflow="truncate")
    assert items == [EncodedSFT([3, 4, 1], 1), EncodedSFT([3, 4, 5, 6], 2)]
    assert (report.total, report.truncated, report.dropped, report.kept) == (3, 1, 1, 2)
    assert str(report) == "3 examples: 2 kept (1 truncated), 1 dropped"
    items, report = encode_sft(examples, TOK, max_len=4, overflow="drop")
    assert items == [EncodedSFT([3, 4, 1], 1)]
    assert (report.total, report.truncated, report.dropped) == (3, 0, 2)
    batch = collate_sft(encode_sft(examples, TOK, 4, "truncate")[0], TOK.pad_id, 4)
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 0], [0, 1, 1, 0]]  # EOS cut: no loss past c d


def test_bad_overflow_and_nothing_left_are_errors():
    with pytest.raises(ValueError, match="data.overflow"):
        encode_sft([SFTExample("a", "b")], TOK, 8, "clip")
    with pytest.raises(ValueError, match="data.overflow"):
        encode_preferences([PreferenceExample("a", "b", "c")], TOK, 8, "clip")
    with pytest.raises(ValueError, match="no SFT examples left"):
        encode_sft([SFTExample("a b c", "d")], TOK, 3, "truncate")
    with pytest.raises(ValueError, match="seq_len=3"):
        collate_sft([EncodedSFT([3, 4, 5, 1], 1)], TOK.pad_id, 3)


def test_nothing_left_is_a_data_error_naming_the_length_field_and_the_fix():
    too_long = [SFTExample("a b", "c d e")]  # 6 tokens with EOS
    with pytest.raises(DataError) as info:
        encode_sft(too_long, TOK, 4, "drop", max_len_field="sft.seq_length")
    assert str(info.value) == (
        "no SFT examples left after encoding (1 examples: 0 kept (0 truncated), 1 dropped): "
        "none fits in sft.seq_length=4 tokens and data.overflow=drop leaves out longer ones; "
        "raise sft.seq_length or set data.overflow=truncate"
    )
    # With truncate, only prompts that fill max_len on their own are left out: truncating
    # cannot help, so it is not suggested.
    with pytest.raises(DataError, match=r"sft.seq_length=4 .*; raise sft.seq_length$"):
        encode_sft([SFTExample("a b c d", "e")], TOK, 4, "truncate", max_len_field="sft.seq_length")
    pair = PreferenceExample("a b", "c d e", "c")
    with pytest.raises(DataError, match=r"no preference pairs .* rm.seq_length=4 .*truncate"):
        encode_preferences([pair], TOK, 4, "drop", max_len_field="rm.seq_length")
    with pytest.raises(DataError, match=r"no prompts .* longer than 3 tokens \(ppo.prompt_len=4"):
        encode_prompts([PromptExample("a b c d")], TOK, 4, max_len_field="ppo.prompt_len")
    with pytest.raises(DataError, match="example 0: prompt '' encodes to no tokens"):
        encode_sft([SFTExample("", "a")], TOK, 4, "drop")


def test_cli_reports_data_that_never_fits_as_a_data_error(tmp_path):
    """One bare process (rank 0 of 1); it fails while encoding, before any model is built."""
    train = tmp_path / "sft_train.jsonl"
    write_jsonl(train, [SFTExample(" ".join(["good"] * 40), "great")])
    command = [
        sys.executable, "-m", "megatron_rlhf", "sft", "--config", "pipelines/tiny_cpu.yaml",
        f"data.sft_train={train}", "data.overflow=drop", f"checkpoint.root={tmp_path}",
        "data.task_sizes.sft_eval=8", "data.eval_fraction=0",  # the task's eval split, not a held-out part
    ]
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_RLHF_FAULT"}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "data error: no SFT examples left after encoding (1 examples: 0 kept" in proc.stderr
    assert "seq_length=32 tokens" in proc.stderr and "data.overflow=truncate" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_preference_pairs_encode_truncate_drop_and_interleave():
    examples = [
        PreferenceExample("a", "b", "c"),          # fits
        PreferenceExample("a", "b c d e", "c"),    # chosen too long
        PreferenceExample("a", "b b b d", "b b b e"),  # differ only past max_len=4
    ]
    pairs, report = encode_preferences(examples, TOK, max_len=4, overflow="truncate")
    assert pairs == [EncodedPair([3, 4, 1], [3, 5, 1], 1), EncodedPair([3, 4, 5, 6], [3, 5, 1], 1)]
    assert (report.total, report.truncated, report.dropped) == (3, 1, 1)
    pairs_dropped, report = encode_preferences(examples, TOK, max_len=4, overflow="drop")
    assert pairs_dropped == pairs[:1]
    assert (report.total, report.truncated, report.dropped) == (3, 0, 2)

    batch = collate_preferences(pairs, TOK.pad_id, seq_len=5)
    assert batch["tokens"].tolist() == [
        [3, 4, 1, 0, 0],  # chosen_0
        [3, 5, 1, 0, 0],  # rejected_0
        [3, 4, 5, 6, 0],  # chosen_1
        [3, 5, 1, 0, 0],  # rejected_1
    ]
    assert batch["lengths"].tolist() == [3, 3, 4, 3]
    assert batch["loss_mask"].tolist() == [
        [1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0],
    ]


def test_prompts_are_dropped_when_too_long_and_left_padded():
    prompts, report = encode_prompts(
        [PromptExample("a b"), PromptExample("c"), PromptExample("a b c d")], TOK, max_len=4
    )
    assert prompts == [[3, 4], [5]]  # 4 tokens leave no room to generate under max_len=4
    assert (report.total, report.truncated, report.dropped) == (3, 0, 1)
    batch = collate_prompts_left_padded(prompts + [[6, 7, 3]], TOK.pad_id)
    assert batch["tokens"].tolist() == [[0, 3, 4], [0, 0, 5], [6, 7, 3]]
    assert batch["attention_mask"].tolist() == [
        [False, True, True], [False, False, True], [True, True, True],
    ]
    assert batch["attention_mask"].dtype == torch.bool
    assert batch["lengths"].tolist() == [2, 1, 3]


def test_length_report_counts_kept():
    assert LengthReport(10, 2, 3).kept == 7


# ---------------------------------------------------------------- sampler


def test_sampler_is_deterministic_per_seed():
    a, b, c = EpochSampler(50, seed=7), EpochSampler(50, seed=7), EpochSampler(50, seed=8)
    stream_a = [a.next_indices(8) for _ in range(20)]
    assert stream_a == [b.next_indices(8) for _ in range(20)]
    assert stream_a != [c.next_indices(8) for _ in range(20)]


def test_sampler_crosses_epochs_with_a_new_permutation_each():
    sampler = EpochSampler(10, seed=0)
    stream = sampler.next_indices(25)
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
    assert stream[:10] != stream[10:20]
    assert sampler.state_dict() == {"epoch": 2, "position": 5, "seed": 0, "n": 10}
    assert EpochSampler(4, seed=0, shuffle=False).next_indices(6) == [0, 1, 2, 3, 0, 1]
    assert sampler.next_indices(0) == []


@pytest.mark.parametrize("consumed", [3, 10, 17])
def test_sampler_resumed_from_state_dict_continues_identically(consumed):
    uninterrupted = EpochSampler(10, seed=5)
    uninterrupted.next_indices(consumed)
    expected = [uninterrupted.next_indices(4) for _ in range(8)]

    first = EpochSampler(10, seed=5)
    first.next_indices(consumed)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
    resumed = EpochSampler(10, seed=5)
    resumed.load_state_dict(state)
    assert [resumed.next_indices(4) for _ in range(8)] == expected


def test_sampler_refuses_state_from_changed_data_or_seed():
    state = EpochSampler(10, seed=5).state_dict()
    with pytest.raises(ValueError, match="data changed"):
        EpochSampler(11, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        EpochSampler(10, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        EpochSampler(10, seed=5).load_state_dict({"n": 10})
    with pytest.raises(ValueError, match="positive"):
        EpochSampler(0, seed=5)


# ---------------------------------------------------------------- built-in task


def test_gold_score_on_hand_written_responses():
    task = get_task("sentiment")
    assert task.gold_score("the film was", "great great awful") == pytest.approx(1 / 3)
    assert task.gold_score("the film was", "the movie and the plot") == 0.0
    assert task.gold_score("the film was", "dull and boring and awful") == -1.0
    assert task.gold_score("great great", "wonderful popcorn xyzzy") == 1.0  # prompt ignored
    assert task.gold_score("p", "Great, but dull!") == 0.0


def test_sentiment_splits_are_a_pure_function_of_the_seed():
    task = get_task("sentiment")
    first, again, other = task.splits(1, SMALL), task.splits(1, SMALL), task.splits(2, SMALL)
    assert first == again
    assert first.sft_train != other.sft_train and first.ppo_prompts != other.ppo_prompts
    # Each split has its own stream: eval prompts are not a copy of the PPO prompts.
    assert [p.prompt for p in first.eval_prompts] != [p.prompt for p in first.ppo_prompts[:10]]
    sizes = (len(first.sft_train), len(first.preference_eval), len(first.ppo_prompts))
    assert sizes == (60, 10, 30)


def test_sentiment_data_shape_and_preferences():
    task = get_task("sentiment")
    splits = task.splits(4, SMALL)
    for pair in splits.preference_train + splits.preference_eval:
        chosen = task.gold_score(pair.prompt, pair.chosen)
        assert chosen > task.gold_score(pair.prompt, pair.rejected), pair
    for example in splits.sft_train + splits.sft_eval:
        assert 3 <= len(example.prompt.split()) <= 6
        assert 6 <= len(example.response.split()) <= 12
    scores = {task.gold_score(e.prompt, e.response) for e in splits.sft_train}
    assert min(scores) == -1.0 and max(scores) == 1.0 and len(scores) >= 5  # spread, not clustered


def test_sentiment_vocabulary_covers_all_data_and_fits_128():
    task = get_task("sentiment")
    tok = load_tokenizer("builtin", task.words())
    assert tok.vocab_size <= 128
    assert len(task.words()) == len(set(task.words()))
    assert tok.unk_id not in tok.encode(" ".join(task.words()))
    splits = task.splits(5, SMALL)
    texts = [e.prompt + " " + e.response for e in splits.sft_train]
    texts += [p.prompt + " " + p.chosen + " " + p.rejected for p in splits.preference_train]
    texts += [p.prompt for p in splits.ppo_prompts]
    for text in texts:
        assert tok.unk_id not in tok.encode(text), text


def test_task_splits_write_and_read_back(tmp_path):
    splits = get_task("sentiment").splits(6, SMALL)
    paths = splits.write(tmp_path / "data")
    assert sorted(p.name for p in paths.values()) == sorted(
        f"{name}.jsonl" for name in (
            "sft_train", "sft_eval", "preference_train", "preference_eval", "ppo_prompts",
            "eval_prompts",
        )
    )
    assert read_sft(paths["sft_train"]) == splits.sft_train
    assert read_preferences(paths["preference_eval"]) == splits.preference_eval
    assert read_prompts(paths["ppo_prompts"]) == splits.ppo_prompts


def test_unknown_task_and_bad_sizes_are_errors():
    assert "sentiment" in TASKS
    unknown = "data.task: unknown task 'poetry'; known tasks: arithmetic, calculator, sentiment"
    with pytest.raises(ValueError, match=unknown):
        get_task("poetry")
    with pytest.raises(ValueError, match="TaskSizes.sft_eval"):
        TaskSizes(sft_eval=0)


def test_data_layer_does_not_import_megatron():
    for path in DATA_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] != "megatron", f"{path} imports {name}"
