"""The data layer: JSONL datasets, tokenizers, encoding and batching, sampling, built-in tasks.

Pure Python and torch (no megatron-core), so it can be used and tested without a model.

- `jsonl`: read and validate SFT / preference / prompt records (flat or conversations), with
  column mapping (`RecordFields`), from JSONL; write them back.
- `readers`: the same records from parquet files and `datasets` save_to_disk directories (pyarrow).
- `errors`: `DataError`, what every reader raises (`file:line: field ...`).
- `tokenizers`: the `Tokenizer` contract, the builtin word-level tokenizer, local HF ones.
- `chat`: chat templates: conversations rendered as transformers renders them, the assistant tokens trained on.
- `template_budget`, `template_sizes`: the render budget a chat template (code from a download)
  renders within: output, value sizes, allocations and time, checked before anything is made.
- `encode`: examples -> token ids (with a length report) -> padded batch tensors.
- `sampler`: a deterministic, resumable index stream over epochs.
- `tasks`: built-in tasks (data generators with a gold scorer), e.g. `sentiment`.
"""
