"""User-facing errors.

Anything the user can fix (bad data, a bad flag, a model that cannot be found,
a plan that does not fit) is raised as an `LlmcustomsError`. The CLI prints its
message and hint as one paragraph and exits with code 2; no traceback. Messages
never contain the content of a data row: rows may be private.
"""

from __future__ import annotations


class LlmcustomsError(Exception):
    """An error the user can act on. `hint` says what to do next."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n{self.hint}"


class DataError(LlmcustomsError):
    """The training or evaluation data cannot be used as it is."""


class ModelError(LlmcustomsError):
    """The model cannot be found, loaded or adapted."""


class ConfigError(LlmcustomsError):
    """A flag, preset or setting has a value that cannot work."""


class CheckFailed(LlmcustomsError):
    """What a command wrote does not behave like what it came from (an export
    whose model answers differently): exit 1, the files kept for inspection."""

    exit_code = 1
