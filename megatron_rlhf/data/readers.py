"""Records from columnar files: a parquet file, a directory of parquet shards (as a dataset
repository's data/ holds them: read in name order), or a directory written by Hugging Face
`datasets` (`Dataset.save_to_disk`: state.json naming its data-*.arrow files, each an Arrow IPC
stream, next to dataset_info.json). Read with pyarrow alone (the `data` extra), so a run does
not need `datasets` installed; rows come back as the JSON objects a JSONL line would give.

Rows are named `path:row N` (N counted from 0, as `dataset[N]` does) in errors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron_rlhf.data.errors import DataError


def arrow_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(`path:row N`, row) for every row of a parquet file or a save_to_disk directory."""
    if not path.exists():
        raise DataError(f"{path}: file not found")
    pyarrow = _pyarrow(path)
    if path.is_dir() and not (path / "state.json").is_file() and (shards := sorted(path.glob("*.parquet"))):
        batches = (batch for file in shards for batch in _parquet_batches(pyarrow, file))
    elif path.is_dir():
        batches = (batch for file in _dataset_files(path) for batch in _stream_batches(pyarrow, file))
    else:
        batches = _parquet_batches(pyarrow, path)
    row = 0
    for batch in batches:
        for record in batch.to_pylist():
            yield f"{path}:row {row}", record
            row += 1


def _dataset_files(directory: Path) -> list[Path]:
    """The Arrow files of a save_to_disk directory, in order (state.json's `_data_files`)."""
    if (directory / "dataset_dict.json").is_file():
        dataset_dict = _json_file(directory / "dataset_dict.json", "the DatasetDict's split names")
        splits = dataset_dict.get("splits") if isinstance(dataset_dict, dict) else None
        splits = [str(split) for split in splits] if isinstance(splits, list) else []
        raise DataError(f"{directory}: a DatasetDict with splits {splits}; name one split's directory, "
                        f"e.g. {directory / (splits[0] if splits else 'train')}")
    state = directory / "state.json"
    if not state.is_file():
        raise DataError(f"{directory}: a directory without state.json or *.parquet files, so neither one "
                        "Dataset.save_to_disk wrote nor parquet shards; give a .jsonl or .parquet file or such a directory")
    try:
        names = [entry["filename"] for entry in _json_file(state, "the list of data files")["_data_files"]]
    except (KeyError, TypeError) as exc:
        raise DataError(f"{state}: no list of data files (_data_files: {exc})") from None
    if not all(isinstance(name, str) and name for name in names):
        raise DataError(f"{state}: _data_files names a file that is not a file name ({names}); write the dataset "
                        "again (Dataset.save_to_disk)")
    missing = [name for name in names if not (directory / name).is_file()]
    if missing:
        raise DataError(f"{directory}: state.json names data files that are missing: {missing}")
    return [directory / name for name in names]


def _json_file(path: Path, holding: str) -> Any:
    """A datasets metadata file's JSON; DataError naming it (and what it should hold) when it is not."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not valid JSON, so not {holding} ({exc}); write the dataset again "
                        "(Dataset.save_to_disk)") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _parquet_batches(pyarrow, file: Path) -> Iterator[Any]:
    import pyarrow.parquet as parquet

    try:
        reader = parquet.ParquetFile(file)
    except (OSError, pyarrow.ArrowException) as exc:
        raise DataError(f"{file}: not a readable parquet file ({exc})") from None
    try:
        yield from reader.iter_batches()
    except (OSError, pyarrow.ArrowException) as exc:  # a damaged page after a readable footer
        raise DataError(f"{file}: damaged parquet data ({exc}); write the file again") from None


def _stream_batches(pyarrow, file: Path) -> Iterator[Any]:
    import pyarrow.ipc as ipc

    try:
        with pyarrow.memory_map(str(file)) as source:
            try:
                reader = ipc.open_stream(source)
            except pyarrow.ArrowInvalid as exc:
                raise DataError(f"{file}: not an Arrow IPC stream ({exc})") from None
            yield from reader
    except (OSError, pyarrow.ArrowException) as exc:  # cut short (a copy that stopped), or unreadable
        raise DataError(f"{file}: truncated or damaged Arrow stream ({exc}); write the dataset again "
                        "(Dataset.save_to_disk)") from None


def _pyarrow(path: Path):
    try:
        import pyarrow
    except ImportError:
        raise DataError(f"{path}: reading parquet files and save_to_disk directories needs pyarrow; "
                        "pip install 'megatron-rlhf[data]' (or give a .jsonl file)") from None
    return pyarrow
