"""Files written with the mode every other file gets.

safetensors writes its files readable by their owner only (0600), while the
rest of a run directory or an export (JSON, tokenizer, model card) gets the
usual mode (0644 under the common umask 022): an exported adapter's weights
could not be read by the account that serves them. `make_readable` gives
them the usual mode.
"""

from __future__ import annotations

import os
from pathlib import Path


def usual_mode() -> int:
    """What a newly created file gets under this process's umask."""
    mask = os.umask(0o022)  # reading the umask means setting it: put straight back
    os.umask(mask)
    return 0o666 & ~mask


def make_readable(path: Path) -> None:
    """`path`, a file, or every file directly in a directory, with the usual mode."""
    mode = usual_mode()
    for file in [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]:
        os.chmod(file, mode)
