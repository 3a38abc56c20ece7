"""Tokenizers: a built-in word-level one for the toy tasks, and local Hugging Face ones.

Both follow one contract the rest of the code relies on: `encode` adds no special tokens
(the data layer appends EOS itself, so there is exactly one) and `decode` drops PAD and EOS.

PAD may equal EOS, and a Hugging Face tokenizer without a pad token gets EOS as its PAD
(many ship that way: Llama 3, SmolLM2). That is safe because PAD is only a filler value:
every length, loss mask, response mask and "ended with EOS" flag comes from sequence
lengths and explicit flags, never from comparing tokens with `pad_id`, so the real EOS at
the end of a sequence is never taken for padding.

A run records its tokenizer once (`record_tokenizer`): its files, in Hugging Face format, in
<run>/tokenizer/ with RECORD_FILE naming where it came from and its fingerprint. Later stages
use it (trainers/stage_data.py run_tokenizer) and export-hf ships it with the model.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# The files of a Hugging Face tokenizer directory: copied with a run and into exports.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja")
# Next to a recorded tokenizer's files: {"data.tokenizer", "data.task", "fingerprint"}.
RECORD_FILE = "recorded_from.json"


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or used; the message names the file and the fix."""


class Tokenizer(ABC):
    """What the data layer and the models need from a tokenizer."""

    vocab_size: int
    pad_id: int  # a filler for positions past a sequence's length; may equal eos_id
    eos_id: int
    # True when the tokenizer names no pad token and pad_id was set to eos_id, so a caller
    # can tell users that padding uses EOS (harmless, see the module docstring).
    pad_defaulted: bool = False
    # The id the tokenizer's post-processor puts first (a BOS), or None: chat rendering adds it
    # when the template does not write it itself (data/chat.py).
    bos_id: int | None = None
    # The chat template `messages` records are rendered with (data/chat.py ChatTemplate), set
    # from data.chat_template when a stage loads the tokenizer; None: no template.
    chat_template: Any = None

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without any special tokens."""

    @abstractmethod
    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """encode's ids and each token's (start, end) character offsets in `text`."""

    @abstractmethod
    def special_tokens(self) -> dict[str, str]:
        """{"eos_token": ..., "bos_token": ..., ...}: the variables a chat template is rendered with."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, skipping PAD and EOS."""

    @abstractmethod
    def fingerprint(self) -> str:
        """sha256 of what decides the ids: equal fingerprints, the same tokenizer."""

    @abstractmethod
    def save_hf(self, directory: str | os.PathLike[str]) -> Path:
        """This tokenizer as Hugging Face tokenizer files in `directory` (created)."""

    def _check_special_ids(self, source: str) -> None:
        # pad_id == eos_id is allowed: nothing derives lengths or masks from the pad id.
        for name, value in (("pad", self.pad_id), ("eos", self.eos_id)):
            if not 0 <= value < self.vocab_size:
                raise TokenizerError(
                    f"{source}: {name} id {value} is outside the vocabulary "
                    f"(size {self.vocab_size})"
                )


class WordTokenizer(Tokenizer):
    """Whitespace word-level tokenizer: 0 `<pad>`, 1 `<eos>`, 2 `<unk>`, then `words` in order."""

    def __init__(self, words: Sequence[str]) -> None:
        specials = (PAD, EOS, UNK)
        vocab: list[str] = list(specials)
        for index, word in enumerate(words):
            if not isinstance(word, str) or not word or word.split() != [word]:
                raise TokenizerError(
                    f"WordTokenizer: word {index} ({word!r}) must be a non-empty string "
                    "without whitespace"
                )
            if word in specials:
                raise TokenizerError(f"WordTokenizer: word {index} ({word!r}) is a special token")
        # dict.fromkeys dedupes while keeping first-seen order, so ids are deterministic.
        vocab.extend(dict.fromkeys(words))
        self.vocab = vocab
        self._ids = {word: i for i, word in enumerate(vocab)}
        self.vocab_size = len(vocab)
        self.pad_id, self.eos_id, self.unk_id = 0, 1, 2
        self._check_special_ids("WordTokenizer")

    def encode(self, text: str) -> list[int]:
        """Ids of the whitespace-separated words of `text`; unknown words become `<unk>`."""
        return [self._ids.get(word, self.unk_id) for word in text.split()]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        words = list(re.finditer(r"\S+", text))
        return [self._ids.get(w.group(), self.unk_id) for w in words], [w.span() for w in words]

    def special_tokens(self) -> dict[str, str]:
        return {"eos_token": EOS, "pad_token": PAD, "unk_token": UNK}

    def decode(self, ids: Sequence[int]) -> str:
        """Words of `ids` joined by single spaces, skipping `<pad>` and `<eos>`."""
        words = []
        for token in ids:
            token = int(token)
            if token in (self.pad_id, self.eos_id):
                continue
            if not 0 <= token < self.vocab_size:
                raise TokenizerError(
                    f"WordTokenizer: id {token} is outside the vocabulary (size {self.vocab_size})"
                )
            words.append(self.vocab[token])
        return " ".join(words)

    def fingerprint(self) -> str:
        """Of the vocabulary in id order (not of save_hf's JSON, which a tokenizers release may reformat)."""
        return hashlib.sha256("\n".join(["builtin", *self.vocab]).encode()).hexdigest()

    def save_hf(self, directory: str | os.PathLike[str]) -> Path:
        """Write this vocabulary as a Hugging Face fast tokenizer (tokenizer.json with a
        word-level model, tokenizer_config.json naming the special tokens), so an exported
        model ships with the tokenizer it was trained with; HFTokenizer reads it back."""
        import tokenizers
        from tokenizers import decoders, models, pre_tokenizers

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tok = tokenizers.Tokenizer(models.WordLevel(dict(self._ids), unk_token=UNK))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
        tok.add_special_tokens([PAD, EOS, UNK])
        tok.save(str(directory / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": PAD, "eos_token": EOS,
                  "unk_token": UNK, "model_max_length": 1_000_000}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return directory


class HFTokenizer(Tokenizer):
    """A Hugging Face fast tokenizer read offline from a local directory's tokenizer.json.

    The eos token is required (it ends every sequence and stops generation). The pad token
    is optional: when tokenizer_config.json and special_tokens_map.json name none, pad_id is
    eos_id and `pad_defaulted` is True; a pad token equal to the eos token is accepted as is.
    """

    CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        directory = Path(directory)
        if not directory.is_dir():
            raise TokenizerError(f"tokenizer directory not found: {directory}")
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(
                f"{directory}: no tokenizer.json (expected {tokenizer_file}; only tokenizers "
                "saved in the Hugging Face 'fast' format are supported)"
            )
        try:
            # Imported here: only runs that point data.tokenizer at a directory need it.
            import tokenizers
        except ImportError:
            raise TokenizerError(
                f"{directory}: loading a Hugging Face tokenizer needs the 'tokenizers' package "
                "(pip install tokenizers)"
            ) from None
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise TokenizerError(f"{tokenizer_file}: cannot load ({exc})") from None
        self.directory = directory
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        eos_token = self._special_token(directory, "eos_token")
        if eos_token is None:
            # Without EOS, responses could not end and generation could not stop.
            raise TokenizerError(
                f"{directory}: no \"eos_token\" in tokenizer_config.json or "
                f"special_tokens_map.json; set \"eos_token\" in "
                f"{directory / 'tokenizer_config.json'} to the end-of-text token"
            )
        pad_token = self._special_token(directory, "pad_token")
        self.pad_defaulted = pad_token is None
        self.eos_token = eos_token
        self.pad_token = eos_token if pad_token is None else pad_token
        self.eos_id = self._token_id(directory, "eos_token", self.eos_token)
        self.pad_id = self._token_id(directory, "pad_token", self.pad_token)
        self._check_special_ids(str(directory))
        # What the post-processor adds in front of a text (TemplateProcessing "<bos> $A"), if anything.
        probe = self._tokenizer.encode("a", add_special_tokens=True)
        self.bos_id = probe.ids[0] if probe.ids and probe.special_tokens_mask[0] else None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS or other template tokens."""
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return list(encoding.ids), [tuple(o) for o in encoding.offsets]

    def special_tokens(self) -> dict[str, str]:
        names = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
        found = {name: self._special_token(self.directory, name) for name in names}
        return {name: token for name, token in found.items() if token is not None}

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, skipping PAD, EOS and other special tokens."""
        kept = [int(i) for i in ids if int(i) not in (self.pad_id, self.eos_id)]
        return self._tokenizer.decode(kept, skip_special_tokens=True)

    def fingerprint(self) -> str:
        """Of its tokenizer files, so a copy of the directory has the fingerprint of the original."""
        digest = hashlib.sha256()
        for name in TOKENIZER_FILES:
            if (self.directory / name).is_file():
                digest.update(name.encode() + b"\0" + (self.directory / name).read_bytes() + b"\0")
        return digest.hexdigest()

    def save_hf(self, directory: str | os.PathLike[str]) -> Path:
        """Its tokenizer files, copied."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            if (self.directory / name).is_file():
                shutil.copy2(self.directory / name, directory / name)
        return directory

    def _special_token(self, directory: Path, key: str) -> str | None:
        """The token `key` names (a null value counts as unset), or None when neither file
        sets it."""
        # tokenizer_config.json is read first (unlike transformers, where
        # special_tokens_map.json wins) because it is the file our errors tell users to edit.
        for name in self.CONFIG_FILES:
            value = _read_config(directory / name).get(key)
            if value is None:
                continue
            if isinstance(value, dict):
                value = value.get("content")
            if not isinstance(value, str) or not value:
                raise TokenizerError(
                    f"{directory / name}: \"{key}\" must be a string or a dict with a "
                    f"\"content\" string, got {value!r}"
                )
            return value
        return None

    def _token_id(self, directory: Path, key: str, token: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise TokenizerError(
                f"{directory}: {key} {token!r} is not in the vocabulary of tokenizer.json"
            )
        return token_id


def load_tokenizer(spec: str, task_words: Sequence[str] | None) -> Tokenizer:
    """`"builtin"` -> WordTokenizer over the task's words; anything else is an HF directory."""
    if spec == "builtin":
        if task_words is None:
            raise TokenizerError(
                "data.tokenizer=builtin needs a built-in task (data.task); a run on your own data that starts from "
                "another run's checkpoint (rl.sft_from, dpo.init_from, rm.init_from, sft.init_from) or from "
                "model.init_from_hf: set data.tokenizer=auto (the tokenizer recorded with the checkpoint it starts "
                "from, or model.init_from_hf's), or data.tokenizer=<a Hugging Face tokenizer directory>"
            )
        return WordTokenizer(task_words)
    if not spec or not Path(spec).is_dir():
        raise TokenizerError(
            f"data.tokenizer={spec!r}: not 'builtin' and not a directory; use 'builtin' or "
            "the path of a local Hugging Face tokenizer directory"
        )
    return HFTokenizer(spec)


def record_tokenizer(tokenizer: Tokenizer, spec: str, task: str | None, directory: str | os.PathLike[str]) -> Path:
    """Write `tokenizer` (loaded from data.tokenizer=`spec`, data.task=`task`) into `directory`
    as Hugging Face files plus RECORD_FILE; all at once (a temporary directory renamed), and
    only if `directory` holds no record yet: the first record is the one kept."""
    directory = Path(directory)
    if (directory / RECORD_FILE).is_file():
        return directory
    tmp = directory.with_name(f"{directory.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_hf(tmp)
    record = {"data.tokenizer": spec, "data.task": task if spec == "builtin" else None,
              "fingerprint": tokenizer.fingerprint()}
    (tmp / RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")
    try:
        tmp.rename(directory)
    except OSError:  # another process recorded it first (rename onto a non-empty directory)
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def read_tokenizer_record(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """RECORD_FILE of a recorded tokenizer directory, or None when there is none."""
    path = Path(directory) / RECORD_FILE
    return _read_config(path) if path.is_file() else None


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
