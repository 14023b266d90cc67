"""Errors that mean "fix your input", as opposed to transient failures worth retrying."""


class BadInputError(ValueError):
    """The input or config is wrong; retrying the same step cannot help."""


class ConfigError(BadInputError):
    """A config failed validation. The message names the field, the value and what is allowed."""
