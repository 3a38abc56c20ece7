"""Tokenising examples and batching them into the tensors the model roles consume.

Sequence convention (the roles rely on it): a sequence is `prompt + response + [EOS]`,
right-padded with PAD. The model's log-prob at position t scores token t+1, so
`loss_mask[b, t] = 1` exactly when token t+1 is a response token or the final EOS;
`lengths[b]` counts the sequence's tokens (its EOS included). Both come from the sequences'
lengths, never from comparing tokens with PAD, because PAD may equal EOS (see
data/tokenizers.py). Prompt and response are encoded separately so the boundary between
them is exact; a tokenizer that needs a leading space on the response must get it from the
data. Flat text gets no special tokens but that EOS (no BOS: give it in the data if the model
wants one).

A conversation record (`messages`) is rendered with the tokenizer's chat template instead
(data/chat.py: BOS and EOS as the template and tokenizer define them); an SFT conversation
is trained on its assistant turns only (`EncodedSFT.targets`), a preference pair on everything
after the shared prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_rlhf.data.chat import tokenize_chat, tokenize_chat_prompt
from megatron_rlhf.data.jsonl import DataError, PreferenceExample, PromptExample, SFTExample
from megatron_rlhf.data.tokenizers import Tokenizer

OVERFLOW_MODES = ("truncate", "drop")


@dataclass
class LengthReport:
    """How many examples were read, cut to fit `max_len`, and left out."""

    total: int
    truncated: int
    dropped: int

    @property
    def kept(self) -> int:
        """Examples that made it into the encoded data (truncated ones included)."""
        return self.total - self.dropped

    def __str__(self) -> str:
        return (
            f"{self.total} examples: {self.kept} kept ({self.truncated} truncated), "
            f"{self.dropped} dropped"
        )


@dataclass(frozen=True)
class EncodedSFT:
    """`tokens` = prompt + response + EOS (maybe truncated); the first `prompt_len` are prompt.
    A conversation's `targets[i]` says whether token i is trained on (its assistant turns);
    None: every token from prompt_len on is."""

    tokens: list[int]
    prompt_len: int
    targets: tuple[bool, ...] | None = None


@dataclass(frozen=True)
class EncodedPair:
    """Chosen and rejected sequences sharing their first `prompt_len` (prompt) tokens."""

    chosen: list[int]
    rejected: list[int]
    prompt_len: int


def encode_sft(
    examples: Sequence[SFTExample], tokenizer: Tokenizer, max_len: int, overflow: str,
    max_len_field: str = "seq_length",
) -> tuple[list[EncodedSFT], LengthReport]:
    """Encode SFT examples to at most `max_len` tokens, truncating or dropping the rest.
    `max_len_field`: the config field max_len comes from (e.g. "sft.seq_length"), for errors."""
    _check_overflow(overflow)
    _check_max_len(max_len)
    encoded, truncated, dropped = [], 0, 0
    for index, example in enumerate(examples):
        if example.messages is not None:
            item, was_cut = _fit_conversation(tokenizer, example, index, max_len, overflow)
        else:
            prompt = _encode_prompt(tokenizer, example.prompt, index)
            response = tokenizer.encode(example.response)
            tokens, was_cut = _fit(prompt, response, tokenizer.eos_id, max_len, overflow)
            item = None if tokens is None else EncodedSFT(tokens, len(prompt))
        if item is None:
            dropped += 1
            continue
        truncated += was_cut
        encoded.append(item)
    report = LengthReport(len(examples), truncated, dropped)
    _check_not_empty(report, "SFT examples", _too_long(max_len, max_len_field, overflow))
    return encoded, report


def encode_preferences(
    examples: Sequence[PreferenceExample], tokenizer: Tokenizer, max_len: int, overflow: str,
    max_len_field: str = "seq_length",
) -> tuple[list[EncodedPair], LengthReport]:
    """Encode preference pairs; a pair is dropped if either side is, or if both sides are equal.
    `max_len_field`: the config field max_len comes from (e.g. "rm.seq_length"), for errors."""
    _check_overflow(overflow)
    _check_max_len(max_len)
    encoded, truncated, dropped = [], 0, 0
    eos = tokenizer.eos_id
    for index, example in enumerate(examples):
        if example.chosen_messages is not None:
            full_chosen, full_rejected, prompt_len = _conversation_pair(tokenizer, example, index)
            chosen, chosen_cut = _fit_tokens(full_chosen, prompt_len, max_len, overflow)
            rejected, rejected_cut = _fit_tokens(full_rejected, prompt_len, max_len, overflow)
            prompt = full_chosen[:prompt_len]
        else:
            prompt = _encode_prompt(tokenizer, example.prompt, index)
            chosen, chosen_cut = _fit(prompt, tokenizer.encode(example.chosen), eos, max_len, overflow)
            rejected, rejected_cut = _fit(
                prompt, tokenizer.encode(example.rejected), eos, max_len, overflow
            )
        # Identical sides (the difference was past max_len, or both texts map to the same
        # ids) carry no preference signal; they are counted with the dropped ones.
        if chosen is None or rejected is None or chosen == rejected:
            dropped += 1
            continue
        truncated += chosen_cut or rejected_cut
        encoded.append(EncodedPair(chosen, rejected, len(prompt)))
    report = LengthReport(len(examples), truncated, dropped)
    _check_not_empty(report, "preference pairs", _too_long(max_len, max_len_field, overflow))
    return encoded, report


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt's token ids and the record they came from (its text and extra fields, which
    reward functions read: they travel with the prompt through sampling and sharding)."""

    ids: list[int]
    example: PromptExample


def encode_prompts(
    examples: Sequence[PromptExample], tokenizer: Tokenizer, max_len: int,
    max_len_field: str = "model.max_seq_length - sampling.max_new_tokens",
) -> tuple[list[list[int]], LengthReport]:
    """Encode prompts, dropping those that leave no room (over `max_len - 1`) to generate.
    `max_len_field`: the config fields max_len comes from, for errors."""
    encoded, report = encode_prompt_records(examples, tokenizer, max_len, max_len_field)
    return [prompt.ids for prompt in encoded], report


def encode_prompt_records(
    examples: Sequence[PromptExample], tokenizer: Tokenizer, max_len: int,
    max_len_field: str = "model.max_seq_length - sampling.max_new_tokens",
) -> tuple[list[EncodedPrompt], LengthReport]:
    """encode_prompts, keeping each kept prompt's record with its ids."""
    _check_max_len(max_len)
    encoded, dropped = [], 0
    for index, example in enumerate(examples):
        if example.messages is not None:
            prompt = tokenize_chat_prompt(tokenizer, example.messages, f"example {index}", example.tools)
        else:
            prompt = _encode_prompt(tokenizer, example.prompt, index)
        if len(prompt) > max_len - 1:
            dropped += 1
            continue
        encoded.append(EncodedPrompt(prompt, example))
    report = LengthReport(len(examples), 0, dropped)
    why = (
        f"every prompt is longer than {max_len - 1} tokens ({max_len_field}={max_len}, less one "
        f"token to generate); raise {max_len_field}"
    )
    _check_not_empty(report, "prompts", why)
    return encoded, report


def collate_sft(items: Sequence[EncodedSFT], pad_id: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Batch SFT sequences: `tokens` [B,S] long, `loss_mask` [B,S] float, `lengths` [B] long."""
    return _collate_rows([(item.tokens, item.prompt_len, item.targets) for item in items], pad_id, seq_len)


def collate_preferences(
    items: Sequence[EncodedPair], pad_id: int, seq_len: int
) -> dict[str, torch.Tensor]:
    """Batch pairs as rows [chosen_0, rejected_0, chosen_1, ...]: `tokens`, `loss_mask`, `lengths`.

    Shapes are [2B, S], [2B, S] (float) and [2B], with the same convention as `collate_sft`.
    """
    # Interleaved so that any even-sized microbatch split keeps each pair together.
    rows = []
    for item in items:
        rows.append((item.chosen, item.prompt_len, None))
        rows.append((item.rejected, item.prompt_len, None))
    return _collate_rows(rows, pad_id, seq_len)


def collate_prompts_left_padded(
    prompts: Sequence[Sequence[int]], pad_id: int
) -> dict[str, torch.Tensor]:
    """Left-pad prompts to the longest: `tokens` [B,P], `attention_mask` [B,P], `lengths` [B].

    `attention_mask` is bool with True at real tokens (not megatron's True-means-masked).
    """
    if not prompts:
        raise ValueError("collate_prompts_left_padded: no prompts")
    if any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("collate_prompts_left_padded: empty prompt")
    # Left padding puts every prompt's last token in the same column, so generation
    # appends the first new token at one position for the whole batch.
    width = max(len(prompt) for prompt in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = True
    lengths = torch.tensor([len(prompt) for prompt in prompts], dtype=torch.long)
    return {"tokens": tokens, "attention_mask": attention_mask, "lengths": lengths}


def _check_overflow(overflow: str) -> None:
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"data.overflow: expected one of {OVERFLOW_MODES}, got {overflow!r}")


def _check_max_len(max_len: int) -> None:
    if max_len < 2:
        # One prompt token plus one token to learn or generate is the least that is useful.
        raise ValueError(f"max_len: must be at least 2, got {max_len}")


def _encode_prompt(tokenizer: Tokenizer, text: str, index: int) -> list[int]:
    prompt = tokenizer.encode(text)
    if not prompt:
        raise DataError(f"example {index}: prompt {text!r} encodes to no tokens")
    return prompt


def _fit(
    prompt: list[int], response: list[int], eos_id: int, max_len: int, overflow: str
) -> tuple[list[int] | None, bool]:
    """(`prompt + response + EOS` cut to `max_len`, was it cut); None when it must be dropped."""
    return _fit_tokens(prompt + response + [eos_id], len(prompt), max_len, overflow)


def _fit_tokens(tokens: list[int], prompt_len: int, max_len: int, overflow: str) -> tuple[list[int] | None, bool]:
    """(`tokens` cut to `max_len`, was it cut); None when it must be dropped."""
    if len(tokens) <= max_len:
        return tokens, False
    # With the prompt filling max_len there is no response token left to train on.
    if overflow == "drop" or prompt_len >= max_len:
        return None, False
    return tokens[:max_len], True


def _fit_conversation(tokenizer: Tokenizer, example: SFTExample, index: int, max_len: int,
                      overflow: str) -> tuple[EncodedSFT | None, bool]:
    """(the conversation's tokens and targets cut to `max_len`, was it cut); None: dropped."""
    last_only = getattr(tokenizer.chat_template, "last_assistant_only", False)
    chat = tokenize_chat(tokenizer, example.messages, example.first_trained, last_only, f"example {index}",
                         example.tools)
    first_target = chat.targets.index(True)
    tokens, was_cut = _fit_tokens(chat.ids, first_target, max_len, overflow)
    if tokens is None:
        return None, False
    return EncodedSFT(tokens, first_target, tuple(chat.targets[: len(tokens)])), was_cut


def _conversation_pair(tokenizer: Tokenizer, example: PreferenceExample, index: int) -> tuple[list[int], list[int], int]:
    """(chosen tokens, rejected tokens, the length of the prompt tokens they share)."""
    prompt = example.prompt_messages or ()
    where = f"example {index}"
    chosen = tokenize_chat(tokenizer, prompt + example.chosen_messages, len(prompt), False, where, example.tools)
    rejected = tokenize_chat(tokenizer, prompt + example.rejected_messages, len(prompt), False, where, example.tools)
    prompt_len = chosen.targets.index(True)
    if rejected.targets.index(True) != prompt_len or chosen.ids[:prompt_len] != rejected.ids[:prompt_len]:
        raise DataError(f"{where}: the chat template renders the prompt differently before the chosen and the "
                        "rejected answer; a preference pair needs one prompt")
    return chosen.ids, rejected.ids, prompt_len


def _too_long(max_len: int, field: str, overflow: str) -> str:
    """Why nothing fits, and the fix. With truncate, only examples whose prompt alone fills
    max_len are left out (nothing left to learn), so only a longer max_len helps."""
    if overflow == "drop":
        return (
            f"none fits in {field}={max_len} tokens and data.overflow=drop leaves out longer ones; "
            f"raise {field} or set data.overflow=truncate"
        )
    return (
        f"cut to {field}={max_len} tokens, none has a response left to train on (its prompt "
        f"fills them); raise {field}"
    )


def _check_not_empty(report: LengthReport, what: str, why: str) -> None:
    # A DataError (not a ValueError) so the CLI reports it like every other data problem.
    if report.kept == 0:
        reason = why if report.total else "there were none"
        raise DataError(f"no {what} left after encoding ({report}): {reason}")


def _collate_rows(
    rows: Sequence[tuple[Sequence[int], int, Sequence[bool] | None]], pad_id: int, seq_len: int
) -> dict[str, torch.Tensor]:
    if not rows:
        raise ValueError("collate: no examples")
    tokens = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), seq_len), dtype=torch.float)
    lengths = torch.zeros(len(rows), dtype=torch.long)
    for row, (sequence, prompt_len, targets) in enumerate(rows):
        length = len(sequence)
        if length > seq_len:
            raise ValueError(f"collate: row {row} has {length} tokens, more than seq_len={seq_len}")
        tokens[row, :length] = torch.tensor(list(sequence), dtype=torch.long)
        lengths[row] = length
        # Position t predicts token t+1: the response starts at prompt_len, so its first
        # token is predicted from position prompt_len - 1, the last from length - 2.
        if targets is not None:  # a conversation: only its assistant tokens are predicted
            loss_mask[row, : length - 1] = torch.tensor(list(targets[1:length]), dtype=torch.float)
            continue
        loss_mask[row, max(prompt_len - 1, 0) : length - 1] = 1.0
    return {"tokens": tokens, "loss_mask": loss_mask, "lengths": lengths}
