"""How a command ends: one message and an exit code for each way, and the
pieces of the terminal a command needs only once it runs (so `--help` stays fast).

Exit codes: 0 done; 1 training failed (recovery gave up, or a bug: a
traceback, and failure.json), or, quietly, the reader of the output stopped
reading (`| head -1`, as Click ends); 2 a user error (bad data, a bad flag,
nothing fits, output that cannot be written, a deleted current directory), one
message and no traceback; 128 + the signal for a stop (130 Ctrl-C, 143 SIGTERM,
129 SIGHUP); 75 an FSDP run asking to be restarted.
"""

from __future__ import annotations

import errno
import io
import json
import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import typer

from llmcustoms.errors import ConfigError, LlmcustomsError


class OutputLost(LlmcustomsError):
    """Standard output could not be written: `> /dev/full`, a full disk."""


class StandardOutput:
    """sys.stdout, whose failures to write are told apart from any other OSError
    (a bug keeps its traceback). A broken pipe (`| head -1`) is left to Click,
    which ends quietly. After a failure the descriptor writes to /dev/null, so
    what is still buffered does not fail again, noisily, as the interpreter ends."""

    def __init__(self, stream: Any):
        self._stream = stream
        self.reader_gone = False  # a broken pipe: whoever read the output stopped reading

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as error:
            raise self._lost(error) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            raise self._lost(error) from None

    def _lost(self, error: OSError) -> BaseException:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self._stream.fileno())
        finally:
            os.close(null)
        if error.errno == errno.EPIPE:
            self.reader_gone = True
            return error
        full = error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        return OutputLost("Cannot write the output: " + ("the disk (or device) is full." if full else
                                                         f"{error.strerror or error}."),
                          "Free some space, or send the output somewhere else, then run the command again.")

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, buffer: the stream's own
        return getattr(self._stream, name)


@contextmanager
def guarded_output() -> Iterator[None]:
    """The whole command with `StandardOutput`: output lost after `ending` (a table
    shown once it is over, or still buffered when it returns) ends the same way,
    one message and exit 2; a reader gone (`| head -1`) ends quietly, 1, as Click does."""
    if sys.stdout is None:  # started with stdout closed: nothing to guard
        yield
        return
    output = StandardOutput(sys.stdout)
    sys.stdout = output  # type: ignore[assignment]
    try:
        try:
            yield
        finally:
            sys.stdout.flush()  # what is still buffered fails here, not as the interpreter ends
    except OutputLost as error:
        raise SystemExit(exit_code(error)) from None
    except BrokenPipeError:
        if not output.reader_gone:
            raise
        raise SystemExit(1) from None


def tolerant(stream: Any) -> Any:
    """`stream` writing text that is not UTF-8 as the bytes it came from: a path or an
    argument of another encoding reaches Python as lone surrogates, which a strict
    stream refuses (a traceback for echoing a file name). Returned, for chaining."""
    if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
        stream.reconfigure(errors="surrogateescape")
    return stream


def check_working_directory() -> None:
    """Relative paths (./runs, ./.env) mean nothing in a folder deleted under the shell."""
    try:
        os.getcwd()
    except FileNotFoundError:
        raise ConfigError("The current directory no longer exists: it was removed after the shell went into it.",
                          "cd to a folder that does, then run the command again.") from None


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
        check_working_directory()
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


