"""Checks of the composed config, run before any data is made or any rank is started."""


class ConfigError(ValueError):
    """A setting the user can fix. The message names the setting, the bad value and what is allowed."""
