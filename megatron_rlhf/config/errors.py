"""The error every configuration problem raises: its message names the field and the fix."""


class ConfigError(ValueError):
    """A bad configuration value; the message names the field and the fix."""
