"""The checkpoint error, in a module of its own: validate (which checks checkpoints and loads
their trainer state through safe_load) and safe_load (which refuses unsafe files) both raise it."""


class CheckpointError(FileNotFoundError):
    """No usable checkpoint where one was asked for (a FileNotFoundError, so callers that
    treat 'nothing to load' as missing keep working; the message says what is wrong)."""
