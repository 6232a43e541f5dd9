"""User-facing errors: raised for bad configuration or data, printed by the CLI as one line (exit code 2)."""


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the option and how to fix it."""


class DataError(ValueError):
    """The dataset cannot be used (missing, unreadable, empty, no `prompt` column, ...)."""


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable. The message names the function."""
