"""A command run as a user runs it: in a terminal of 80 columns, its live display captured.

`run_in_terminal` gives the command a pseudo-terminal (so Rich draws its live display, as it
does for a person) and keeps every byte it wrote; `render` replays those bytes on a plain
grid, the way the terminal showed them: the live display's redraws (cursor up, erase line)
overwrite each other, colours are dropped, and what is left is the text a person saw last.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import termios
import time
from pathlib import Path

CSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")
OTHER_ESCAPE = re.compile(r"\x1b[\]()][^\x07\x1b]*(\x07|\x1b\\)?")


def run_in_terminal(argv: list[str], env: dict[str, str], cwd: Path, deadline: float, transcript: Path,
                    columns: int = 80, rows: int = 30) -> tuple[int | None, bool]:
    """Runs `argv` on a pseudo-terminal of `columns` x `rows` until it ends or `deadline`
    (then its process group gets SIGUSR1 for its stacks, SIGTERM, and SIGKILL 5 s later); the raw output goes to
    `transcript`. Returns (exit code or None, timed out)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    process = subprocess.Popen(argv, cwd=cwd, env={**env, "COLUMNS": str(columns), "LINES": str(rows),
                                                   "TERM": "xterm-256color"},
                               stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    timed_out, sent = False, None
    with transcript.open("wb") as out:
        while True:
            now = time.time()
            if now >= deadline and sent is None:
                timed_out, sent = True, now
                os.killpg(process.pid, signal.SIGUSR1)  # the kit's hooks/sitecustomize.py: stacks first
                time.sleep(1.0)
                os.killpg(process.pid, signal.SIGTERM)
            elif sent is not None and now - sent > 5:
                os.killpg(process.pid, signal.SIGKILL)
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every process holding the terminal has closed it
                    data = b""
                if not data:
                    break
                out.write(data)
            elif process.poll() is not None:
                break
    os.close(master)
    return process.wait(), timed_out


def render(raw: str, columns: int = 80) -> str:
    """The text left on a terminal of `columns` after `raw` was written to it (scrollback included)."""
    lines: list[list[str]] = [[]]
    row, col = 0, 0
    position = 0
    raw = OTHER_ESCAPE.sub("", raw)
    for match in list(CSI.finditer(raw)) + [None]:
        end = match.start() if match else len(raw)
        for char in raw[position:end]:
            if char == "\r":
                col = 0
            elif char == "\n":
                row, col = row + 1, 0
            elif char == "\b":
                col = max(0, col - 1)
            elif char.isprintable():
                if col >= columns:
                    row, col = row + 1, 0
                while len(lines) <= row:
                    lines.append([])
                line = lines[row]
                line.extend(" " * (col + 1 - len(line)))
                line[col] = char
                col += 1
            while len(lines) <= row:
                lines.append([])
        if match is None:
            break
        position = match.end()
        row, col = _apply(match.group(1), match.group(2), lines, row, col)
    return "\n".join("".join(line).rstrip() for line in lines).rstrip() + "\n"


def _apply(params: str, command: str, lines: list[list[str]], row: int, col: int) -> tuple[int, int]:
    """One CSI sequence: cursor moves and erasures change the grid; colours and modes do not."""
    count = int(params) if params.isdigit() else 1
    if command == "A":
        row = max(0, row - count)
    elif command == "B":
        row += count
    elif command == "C":
        col += count
    elif command == "D":
        col = max(0, col - count)
    elif command == "G":
        col = max(0, count - 1)
    elif command == "K" and row < len(lines):
        if params in ("", "0"):
            del lines[row][col:]
        elif params == "2":
            lines[row] = []
    elif command == "J" and params in ("", "0"):
        del lines[row + 1:]
        if row < len(lines):
            del lines[row][col:]
    return row, col
