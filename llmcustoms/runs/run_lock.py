"""One owner per run directory: the lock `train`, `resume` and tune trials hold.

Without it, `train --overwrite` deleted a run that was training under it, and
two `resume` of one run both trained it (one deleting the other's checkpoint
in progress, or both appending the same steps to metrics.jsonl).

The lock is `fcntl.flock` on a file beside the run directory, `.NAME.lock` in
its parent, not inside it: `--overwrite` deletes and remakes the directory,
and a lock on a deleted file would let a third command in. The OS releases a
flock when its process dies, kill -9 included, so a killed run never leaves a
stale lock. The owner deletes the lock file when it is done, while still
holding it; a command that locked a file just deleted (it opened it a moment
before) sees that the path no longer names what it locked, and tries again,
so two owners cannot both hold "the" lock.

Within one process the lock is re-entrant (a tuning study runs many trials,
tests run many commands in one interpreter): flock would refuse a second
description of the same file even to its own process.

An export's --output has a lock of the same kind (`exporting`),
`.NAME.export-lock` beside it: a second export to the same folder once
cleared the first's partial folder as a killed export's leftover, and the
first failed half-way (FileNotFoundError).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from llmcustoms.errors import ConfigError

# Held in this process: lock file -> (descriptor, how many holds).
_held: dict[Path, tuple[int, int]] = {}


def lock_path(run_dir: Path, kind: str = "lock") -> Path:
    # Resolved: through a link (or "..") the same run must find the same lock, or two `resume`s train it at once.
    run_dir = Path(run_dir).resolve()
    return run_dir.parent / f".{run_dir.name}.{kind}"


def file_in_the_way(path: Path) -> Path | None:
    """The first of `path` and the folders above it that is there but is no
    folder: nothing can be made in it (a run directory, a lock beside one)."""
    for parent in [Path(path), *Path(path).parents]:
        if parent.exists() and not parent.is_dir():
            return parent
    return None


def folder_for_runs(output_dir: Path) -> Path:
    """`output_dir`, refused when a file stands where it or a folder above it
    would be: said so at once, not as the lock's "File exists" or a traceback."""
    found = file_in_the_way(output_dir)
    if found is not None:
        where = "" if found == Path(output_dir) else f", so the output directory {output_dir} cannot be made under it"
        raise ConfigError(f"{found} is a file, not a folder{where}: the runs cannot go there.",
                          "Choose another --output-dir (or LLMCUSTOMS_OUTPUT_DIR).")
    return Path(output_dir)


def holder(run_dir: Path) -> int | None:
    """The pid of another process holding the run's lock, or None (free, or ours).
    0 when it is held but the holder did not say who it is."""
    path = lock_path(run_dir)
    if path in _held or not path.exists():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _pid_in(fd)
    finally:
        os.close(fd)  # closing the descriptor drops a lock it took
    return None


@contextmanager
def owning(run_dir: Path, doing: str) -> Iterator[None]:
    """Hold the run's lock for the block; a run held by another process is
    refused at once (exit 2), before anything is read or written. `doing` says
    what this command was about to do, for the message."""
    path = lock_path(run_dir)
    _take(path, lambda who: ConfigError(f"{run_dir} is in use by another llmcustoms command ({who}); not {doing}.",
                                        "Wait for it to finish, or stop it (Ctrl-C) and run this again; "
                                        "or choose another --run-name."),
          lambda why: ConfigError(f"Cannot lock the run directory {run_dir}: {why}.",
                                  "Check that you can write to its parent directory (--output-dir)."))
    try:
        yield
    finally:
        _release(path)


@contextmanager
def exporting(output: Path) -> Iterator[None]:
    """Hold the lock of an export's --output for the block: a second export to
    the same folder is refused at once (exit 2), before it clears anything."""
    path = lock_path(output, "export-lock")
    _take(path, lambda who: ConfigError(f"Another export is writing {output} ({who}); this one did not start.",
                                        "Wait for it to finish, or stop it (Ctrl-C) and run this again; "
                                        "or choose another --output."),
          lambda why: ConfigError(f"Cannot write the export beside {output}: {why}.",
                                  "Check that you can write to that folder, or choose another --output."))
    try:
        yield
    finally:
        _release(path)


def _take(path: Path, busy: Callable[[str], ConfigError], unlockable: Callable[[str], ConfigError]) -> None:
    """Lock `path`; `busy(who)` is raised when another process holds it,
    `unlockable(why)` when the lock file cannot be made."""
    if path in _held:
        fd, holds = _held[path]
        _held[path] = (fd, holds + 1)
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        found = file_in_the_way(path.parent)
        raise unlockable(f"{found} is a file, not a folder" if found else f"{exc.strerror} ({path})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _pid_in(fd)
        os.close(fd)
        raise busy(f"process {pid}" if pid else "another process") from None
    if not _still_named(path, fd):  # its owner deleted it as we opened it: lock the new one
        os.close(fd)
        return _take(path, busy, unlockable)
    _write_pid(fd)
    _held[path] = (fd, 1)


def _still_named(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except OSError:
        return False


def _release(path: Path) -> None:
    fd, holds = _held[path]
    if holds > 1:
        _held[path] = (fd, holds - 1)
        return
    del _held[path]
    try:
        path.unlink()  # while still held: see the module's docstring
    except OSError:
        pass  # a read-only or full disk: a lock file left behind is harmless
    os.close(fd)  # releases the flock


def _write_pid(fd: int) -> None:
    # Only for the message another command shows; a full disk must not stop the run here.
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except OSError:
        pass


def _pid_in(fd: int) -> int:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0
