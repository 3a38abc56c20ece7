"""The data layer: JSONL datasets, tokenizers, encoding and batching, sampling, built-in tasks.

Pure Python and torch (no megatron-core), so it can be used and tested without a model.

- `jsonl`: read and validate SFT / preference / prompt JSONL files, write them back.
- `tokenizers`: the `Tokenizer` contract, the builtin word-level tokenizer, local HF ones.
- `encode`: examples -> token ids (with a length report) -> padded batch tensors.
- `sampler`: a deterministic, resumable index stream over epochs.
- `tasks`: built-in tasks (data generators with a gold scorer), e.g. `sentiment`.
"""
