"""Hugging Face tokenizers whose pad token is their eos token (SmolLM2) or that name no pad
token (Llama 3) load with pad_id == eos_id, and everything downstream (SFT / preference /
prompt collation, rollout bookkeeping, the missing-EOS penalty) gives exactly what a
tokenizer with a distinct pad token gives: lengths, masks and EOS flags never come from the
pad id."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_rlhf.config import RLConfig
from megatron_rlhf.data.encode import (
    collate_preferences,
    collate_prompts_left_padded,
    collate_sft,
    encode_preferences,
    encode_prompts,
    encode_sft,
)
from megatron_rlhf.data.jsonl import PreferenceExample, PromptExample, SFTExample
from megatron_rlhf.data.tokenizers import HFTokenizer, TokenizerError, load_tokenizer
from megatron_rlhf.rollout import Rollout
from megatron_rlhf.rollout.batch import RolloutBatch
from megatron_rlhf.rollout.megatron_engine import Decoding
from megatron_rlhf.trainers.rl import clip_scores

EOS_TOKEN = "<|endoftext|>"
WORDS = ["the", "movie", "was", "good", "bad", "plot", "great", "awful", "hello", "world"]
# Shared by every directory, so word and EOS ids agree; only "distinct" adds <pad>, last.
VOCAB = {"<unk>": 0, EOS_TOKEN: 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
DISTINCT_PAD_ID = len(VOCAB)

CONFIGS = {
    # Llama 3: no pad token anywhere.
    "no_pad": ({"eos_token": EOS_TOKEN}, None),
    # Written by transformers for a tokenizer without one: explicit nulls in both files.
    "null_pad": ({"eos_token": {"content": EOS_TOKEN}, "pad_token": None},
                 {"eos_token": EOS_TOKEN, "pad_token": None}),
    # SmolLM2: the pad token is the eos token.
    "pad_is_eos": ({"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN},
                   {"eos_token": EOS_TOKEN, "pad_token": {"content": EOS_TOKEN}}),
}


def make_tokenizer_dir(directory: Path, config: dict, special_map: dict | None = None,
                       pad_token: str | None = None) -> Path:
    """A real fast-tokenizer directory (word-level model): tokenizer.json,
    tokenizer_config.json and, when given, special_tokens_map.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = dict(VOCAB)
    if pad_token is not None:
        vocab[pad_token] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens([EOS_TOKEN] + ([pad_token] if pad_token else []))
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    if special_map is not None:
        (directory / "special_tokens_map.json").write_text(json.dumps(special_map))
    return directory


@pytest.fixture
def distinct(tmp_path) -> HFTokenizer:
    directory = make_tokenizer_dir(tmp_path / "distinct", {"eos_token": EOS_TOKEN, "pad_token": "<pad>"},
                                   pad_token="<pad>")
    tok = load_tokenizer(str(directory), None)
    assert (tok.pad_id, tok.eos_id, tok.pad_defaulted) == (DISTINCT_PAD_ID, 1, False)
    return tok


@pytest.fixture(params=list(CONFIGS))
def shared(request, tmp_path) -> HFTokenizer:
    """A tokenizer padding with EOS, one per CONFIGS case."""
    return load_tokenizer(str(make_tokenizer_dir(tmp_path / request.param, *CONFIGS[request.param])), None)


# ---------------------------------------------------------------- loading


@pytest.mark.parametrize("case", list(CONFIGS))
def test_pad_is_eos_or_missing_loads_with_pad_id_equal_to_eos_id(tmp_path, case):
    tok = load_tokenizer(str(make_tokenizer_dir(tmp_path / case, *CONFIGS[case])), None)
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == tok.pad_id == 1 and tok.vocab_size == len(VOCAB)
    assert tok.eos_token == tok.pad_token == EOS_TOKEN
    assert tok.pad_defaulted == (case != "pad_is_eos")  # only a missing pad token is defaulted
    ids = tok.encode("the movie was good")
    assert ids == [2, 3, 4, 5]  # no special tokens added
    assert tok.decode(ids + [tok.eos_id, tok.pad_id, tok.pad_id]) == "the movie was good"
    assert tok.decode(torch.tensor([tok.eos_id, 10, 11, tok.eos_id])) == "hello world"


def test_missing_eos_is_still_refused(tmp_path):
    for name, config in (("absent", {"pad_token": EOS_TOKEN}), ("null", {"eos_token": None})):
        directory = make_tokenizer_dir(tmp_path / name, config)
        with pytest.raises(TokenizerError, match='no "eos_token"') as info:
            HFTokenizer(directory)
        assert str(directory / "tokenizer_config.json") in str(info.value)


def test_named_pad_token_missing_from_vocabulary_is_still_refused(tmp_path):
    directory = make_tokenizer_dir(tmp_path / "tok", {"eos_token": EOS_TOKEN, "pad_token": "<pad>"})
    with pytest.raises(TokenizerError, match="pad_token '<pad>' is not in the vocabulary"):
        HFTokenizer(directory)


# ---------------------------------------------------------------- encoding and collation

SFT = [SFTExample("the movie", "was good"), SFTExample("hello", "world"),
       SFTExample("the plot was", "awful bad bad bad bad")]  # truncated at max_len 6
PAIRS = [PreferenceExample("the movie was", "great", "awful"),
         PreferenceExample("the plot", "was good", "was bad bad bad bad")]  # rejected truncated
PROMPTS = [PromptExample("the movie was"), PromptExample("hello"), PromptExample("the plot was good")]


def assert_same_rows(got: dict, want: dict, got_pad: int, want_pad: int) -> None:
    """Same tokens up to each length, same lengths and masks; padding is each one's pad id."""
    assert torch.equal(got["lengths"], want["lengths"])
    assert torch.equal(got["loss_mask"], want["loss_mask"])
    for row, length in enumerate(want["lengths"].tolist()):
        assert got["tokens"][row, :length].tolist() == want["tokens"][row, :length].tolist()
        assert torch.all(got["tokens"][row, length:] == got_pad)
        assert torch.all(want["tokens"][row, length:] == want_pad)


def collated(tok, encode, collate, examples, max_len: int, seq_len: int) -> dict:
    """`examples` encoded with one overlong example truncated, then collated with tok's pad id."""
    items, report = encode(examples, tok, max_len=max_len, overflow="truncate")
    assert (report.truncated, report.dropped) == (1, 0)
    return collate(items, tok.pad_id, seq_len=seq_len)


def test_sft_collation_equals_distinct_pad(shared, distinct):
    got, want = (collated(tok, encode_sft, collate_sft, SFT, max_len=6, seq_len=8) for tok in (shared, distinct))
    assert_same_rows(got, want, shared.pad_id, distinct.pad_id)
    assert got["lengths"].tolist() == [5, 3, 6]
    # The final EOS is a real token: kept in the length and trained on, though it is the pad id.
    for row, length in enumerate([5, 3]):
        assert int(got["tokens"][row, length - 1]) == shared.eos_id == shared.pad_id
    assert got["loss_mask"].tolist()[0] == [0, 1, 1, 1, 0, 0, 0, 0]  # predicts was, good, EOS
    assert got["loss_mask"].tolist()[1] == [1, 1, 0, 0, 0, 0, 0, 0]  # predicts world, EOS
    assert got["loss_mask"].tolist()[2] == [0, 0, 1, 1, 1, 0, 0, 0]  # truncated: no EOS


def test_preference_collation_equals_distinct_pad(shared, distinct):
    got, want = (collated(tok, encode_preferences, collate_preferences, PAIRS, max_len=6, seq_len=7)
                 for tok in (shared, distinct))
    assert_same_rows(got, want, shared.pad_id, distinct.pad_id)
    assert got["lengths"].tolist() == [5, 5, 5, 6]  # chosen_0, rejected_0, chosen_1, rejected_1
    # The reward model reads its score at lengths - 1: the EOS, not a token before it.
    for row in range(3):
        assert int(got["tokens"][row, int(got["lengths"][row]) - 1]) == shared.eos_id


def test_prompt_collation_equals_distinct_pad(shared, distinct):
    out = {}
    for name, tok in (("shared", shared), ("distinct", distinct)):
        prompts, _ = encode_prompts(PROMPTS, tok, max_len=8)
        out[name] = collate_prompts_left_padded(prompts, tok.pad_id)
    got, want = out["shared"], out["distinct"]
    assert torch.equal(got["lengths"], want["lengths"])
    assert torch.equal(got["attention_mask"], want["attention_mask"])
    assert torch.equal(got["tokens"][got["attention_mask"]], want["tokens"][want["attention_mask"]])
    assert torch.all(got["tokens"][~got["attention_mask"]] == shared.eos_id)


# ---------------------------------------------------------------- rollout

EOS = 1
ROLL_PROMPTS = [[2, 3, 4], [8, 9, 10, 11, 5], [6, 7], [10, 11, 2], [9, 10]]
NEW = 4
# One entry per generation step (positions 2..8), one column per row. Row 0 ends with EOS as
# its 3rd new token; row 1 runs out of budget without EOS at the last position; row 2 emits
# EOS at once; row 3 emits EOS as its last allowed token; row 4 runs out of budget without
# EOS three positions before the end, so it is followed by padding (EOS-valued when pad ==
# eos) that must not mark it finished. Rows that are done keep drawing EOS and other tokens,
# which must be ignored.
SCRIPT = [[20, 30, EOS, 50, 60], [21, 31, EOS, 51, 61], [22, 32, EOS, 52, 62], [EOS, 33, EOS, 53, 63],
          [EOS, 34, 44, EOS, EOS], [25, 35, EOS, EOS, EOS], [26, 36, 46, EOS, 66]]


def decode(pad_id: int) -> Decoding:
    """generate()'s bookkeeping with scripted samples instead of a model."""
    total = max(map(len, ROLL_PROMPTS)) + NEW
    state = Decoding.start(ROLL_PROMPTS, total, pad_id, torch.device("cpu"))
    for step, pos in enumerate(range(min(map(len, ROLL_PROMPTS)), total)):
        logprob = -torch.arange(1.0, 6.0) - pos
        state.record(pos, torch.tensor(SCRIPT[step]), logprob, EOS, pad_id, NEW)
    return state


def as_rollout(s: Decoding) -> Rollout:
    return Rollout(s.tokens, s.prompt_lengths, s.lengths, s.logprobs, s.finished)


def test_rollout_bookkeeping_with_pad_equal_to_eos_equals_distinct_pad():
    shared, distinct = decode(pad_id=EOS), decode(pad_id=DISTINCT_PAD_ID)
    # Where each row ends and whether it ended with EOS, independently of the pad id.
    assert distinct.lengths.tolist() == [6, 9, 3, 7, 6]
    assert distinct.finished.tolist() == [True, False, True, True, False]
    for name in ("prompt_lengths", "lengths", "finished", "done", "logprobs"):
        assert torch.equal(getattr(shared, name), getattr(distinct, name)), name
    a, b = as_rollout(shared), as_rollout(distinct)
    assert torch.equal(a.response_mask(), b.response_mask())
    assert torch.equal(a.response_lengths(), b.response_lengths())
    assert a.response_ids() == b.response_ids() == [
        [21, 22, EOS], [33, 34, 35, 36], [EOS], [51, 52, 53, EOS], [60, 61, 62, 63]]
    for row, length in enumerate(distinct.lengths.tolist()):
        assert torch.equal(shared.tokens[row, :length], distinct.tokens[row, :length])
        assert torch.all(shared.tokens[row, length:] == EOS)
        assert torch.all(distinct.tokens[row, length:] == DISTINCT_PAD_ID)
    # Row 2's response is its EOS alone; the EOS-valued padding after it is not response.
    assert a.response_mask()[2].tolist() == [0, 1, 0, 0, 0, 0, 0, 0, 0]

    # Joining rollouts of different widths (dynamic sampling) and the train-phase batch.
    rows = torch.tensor([2, 0, 5, 7])
    joined = {}
    for name, pad_id in (("shared", EOS), ("distinct", DISTINCT_PAD_ID)):
        s = as_rollout(decode(pad_id))
        narrow = s.select(torch.tensor([2]))
        narrow = Rollout(narrow.tokens[:, :3], narrow.prompt_lengths, narrow.lengths,
                         narrow.logprobs[:, :3], narrow.finished)
        joined[name] = Rollout.cat([narrow, s, s], pad_id).select(rows)
    j_a, j_b = joined["shared"], joined["distinct"]
    for name in ("prompt_lengths", "lengths", "finished", "logprobs"):
        assert torch.equal(getattr(j_a, name), getattr(j_b, name)), name
    assert torch.equal(j_a.response_mask(), j_b.response_mask())
    assert j_a.response_ids() == j_b.response_ids()
    batches = [RolloutBatch(tokens=r.tokens, lengths=r.lengths, prompt_lengths=r.prompt_lengths,
                            mask=r.response_mask(), group_ids=torch.zeros(len(r), dtype=torch.long),
                            old_logprobs=r.logprobs, ref_logprobs=r.logprobs, scores=torch.zeros(len(r)))
               for r in (j_a, j_b)]
    assert torch.equal(batches[0].response_mask(NEW), batches[1].response_mask(NEW))
    assert torch.equal(batches[0].response(batches[0].old_logprobs, NEW),
                       batches[1].response(batches[1].old_logprobs, NEW))


def test_missing_eos_penalty_with_pad_equal_to_eos_equals_distinct_pad():
    rl = RLConfig(missing_eos_penalty=-3.0)
    scores = torch.tensor([0.5, 1.5, -0.5, 2.0, 1.0])
    got = clip_scores(scores, as_rollout(decode(pad_id=EOS)), rl)
    want = clip_scores(scores, as_rollout(decode(pad_id=DISTINCT_PAD_ID)), rl)
    # Rows 1 and 4 ran out of budget; row 4's EOS-valued padding must not count as an EOS.
    assert got.tolist() == want.tolist() == [0.5, -3.0, -0.5, 2.0, -3.0]
