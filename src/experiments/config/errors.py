"""The one kind of user error. Free of heavy imports: every command's entry point reads it before Lightning loads."""


class ConfigError(ValueError):
    """A setting the user can fix. The message names the setting, the bad value and what is allowed."""
