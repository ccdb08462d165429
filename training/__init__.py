"""The training loop, EMA, checkpoints, metrics and evaluation as importable functions."""


class ConfigError(ValueError):
    """A config value that cannot work; raised before any long work starts."""
