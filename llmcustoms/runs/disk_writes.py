"""Writing a run's files on a disk that may be full.

A full disk (ENOSPC, or EDQUOT: a quota) must not turn the writing of a
status or a log line into a crash, and must not leave half-written files:
a temp file that could not be completed is removed, a line appended is
whole or taken back, and a small file may be rewritten in place, in the room
it already has, when nothing new can be allocated. What could not be written
is said on stderr, once a file (`runs/run_directory.py` decides which files may be lost).
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from pathlib import Path
from typing import Any

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# The files this process has said (on stderr) it could not write: once each,
# since status.json is written again every few seconds.
_said_unwritten: set[Path] = set()
# How an error that is no OSError says it: safetensors' are Rust's I/O errors,
# "I/O error: No space left on device (os error 28)".
_WORDS = {code: (os.strerror(code), f"(os error {code})") for code in DISK_FULL}


def disk_full_code(error: BaseException | None) -> int | None:
    """ENOSPC or EDQUOT when `error`, or one it came from, says the disk (or a
    quota) is full; else None."""
    seen: list[BaseException] = []
    while error is not None and not any(error is e for e in seen):
        seen.append(error)
        if isinstance(error, OSError) and error.errno in DISK_FULL:
            return error.errno
        text = str(error)
        for code, words in _WORDS.items():
            if any(w in text for w in words):
                return code
        error = error.__cause__ or error.__context__
    return None


def replace_file(path: Path, text: str) -> None:
    """Write a temp file and rename it over `path`; the temp file goes if that fails.
    Its name is this process's and thread's: a signal-watching thread writes status.json too."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _quietly(tmp.unlink, missing_ok=True)  # the error that matters is the write's
        raise


def overwrite(path: Path, text: str) -> bool:
    """`text` over `path`'s content, in place, when it fits in the blocks the
    file already has: on a full disk nothing new can be allocated. Not atomic,
    so a last resort (a reader of a half-written status.json is told it is
    damaged); False if it did not fit or failed."""
    data = text.encode("utf-8")
    try:
        if not path.is_file():
            return False
        stat = path.stat()
        if len(data) > max(stat.st_size, stat.st_blocks * 512):  # st_blocks counts 512-byte units
            return False
        with open(path, "r+b") as f:
            f.write(data)
            f.truncate()
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        return False
    return True


def append_lines(path: Path, lines: list[str]) -> None:
    """Append each line whole or not at all: one cut short by a full disk is
    taken back, or the next line appended would be glued onto it."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        for line in lines:
            # A path of another encoding (lone surrogates) is written \udce9: the file stays UTF-8 for its readers.
            end, data = os.fstat(fd).st_size, line.encode("utf-8", "backslashreplace")
            try:
                while data:
                    data = data[os.write(fd, data):]
            except OSError:
                _quietly(os.ftruncate, fd, end)  # failing that, a cut line is skipped when read
                raise
    finally:
        os.close(fd)


def _quietly(undo: Any, *args: Any, **kwargs: Any) -> None:
    """Undo what a failed write left; an error doing so would hide the write's."""
    try:
        undo(*args, **kwargs)
    except OSError:
        pass


def say_unwritten(path: Path, exc: OSError, consequence: str) -> None:
    """One line on stderr (this is no UI module), once per file."""
    if path in _said_unwritten:
        return
    _said_unwritten.add(path)
    print(f"Warning: {path} could not be written ({exc.strerror or exc}): {consequence}.", file=sys.stderr,
          flush=True)
