"""The errors every configuration problem raises: their messages name the field and the fix."""


class ConfigError(ValueError):
    """A bad configuration value; the message names the field and the fix."""


class ConvertError(ValueError):
    """A checkpoint or HF model that cannot be converted; the message names the HF config
    field, tensor or `model.<field>` involved, and the fix."""
