"""How a command ends: one message and an exit code for each way, and the
pieces of the terminal a command needs only once it runs (so `--help` stays fast).

Exit codes: 0 done; 1 training failed (recovery gave up, or a bug: a
traceback, and failure.json); 2 a user error (bad data, a bad flag, nothing
fits), one message and no traceback; 128 + the signal for a stop (130 Ctrl-C,
143 SIGTERM, 129 SIGHUP); 75 an FSDP run asking to be restarted.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Any, Iterator

import typer

from llmcustoms.errors import LlmcustomsError


def ui() -> Any:
    """The UI module, imported when first used: Rich and the plan maths it shows are half of `--help`'s start."""
    from llmcustoms.ui import console as ui

    return ui


def quiet_libraries() -> None:
    from llmcustoms.models.loading import quiet_libraries

    quiet_libraries()


def exit_code(error: BaseException) -> int | None:
    """The exit code for an exception that ends a command, None for one that is
    a bug (it propagates with its traceback). Messages were shown already,
    except for user errors, shown here.

    The exits that are not exceptions: Ctrl-C anywhere else is 130 (`main`,
    `setup`), an interrupted `tune` 128 + the signal; a process that asks every process of an
    FSDP run to restart leaves with 75 at once (`_exit_for_restart` in `commands/train.py`),
    and a second Ctrl-C during training quits at once with 128 + the signal
    (`stop_signals.StopSignals`): both skip the interpreter's shutdown on purpose."""
    from llmcustoms.recovery.recovery_system import TrainingFailed, TrainingInterrupted

    if isinstance(error, LlmcustomsError):  # bad data, a bad flag, nothing fits: 2
        ui().print_error(error.message, error.hint)
        return error.exit_code
    if isinstance(error, TrainingInterrupted):  # SIGINT 130, SIGTERM 143, SIGHUP 129, after a checkpoint
        return 128 + error.signum
    if isinstance(error, TrainingFailed):  # recovery gave up, or a bug inside training
        return 1
    return None


@contextmanager
def ending(json_errors: bool = False) -> Iterator[None]:
    """Turn the ways a command can end into one message and an exit code.
    With `json_errors` (`plan --json`), a user error is also one JSON object on
    stdout, {"error": {"message", "hint", "exit_code"}}, so a script reading
    stdout always gets JSON; the message for people still goes to stderr."""
    try:
        yield
    except (typer.Exit, typer.Abort):
        raise
    except Exception as error:
        code = exit_code(error)
        if code is None:
            raise
        if json_errors and isinstance(error, LlmcustomsError):
            print(json.dumps({"error": {"message": error.message, "hint": error.hint, "exit_code": code}}))
        raise typer.Exit(code) from None


