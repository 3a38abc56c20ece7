"""The data layer's error, in a module of its own so every reader can raise it (jsonl.py re-exports it)."""


class DataError(ValueError):
    """A bad data file; the message starts with `path:line: ` when a line is to blame."""
