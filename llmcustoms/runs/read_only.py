"""A run folder that cannot be written, refused before a command that writes it begins.

`resume` writes all over its run (plan.json, status.json, metrics.jsonl,
train.log, checkpoints/, adapter/) and `report --plot` writes loss.png. In a
folder this account cannot write (copied from another one, `chmod -R a-w`,
a read-only mount) they ended in a PermissionError traceback, `resume`
after the model had loaded. The OS is asked (`os.access`): it answers for the
mode bits, the account (root writes whatever they say), immutable files and
read-only mounts alike. `report` without --plot, `generate`, `chat` and
`export` write nothing into the run, and never ask.
"""

from __future__ import annotations

import os
from pathlib import Path

from llmcustoms.errors import ConfigError


def check_writable(run: Path, doing: str, names: tuple[str, ...] | None = None) -> None:
    """Refuse the run folder `run` unless this process can write it: the folder
    and the files `names` in it that exist (None: every folder and file under
    it). `doing` ends the message: "so it cannot be resumed"."""
    run = Path(run)
    if names is None:
        inside = [Path(top) / name for top, folders, files in os.walk(run) for name in folders + files]
    else:
        inside = [run / name for name in names]
    unwritable = [path for path in [run, *inside]
                  if (path.exists() and not path.is_symlink()) and not os.access(path, os.W_OK)]
    if not unwritable:
        return
    first = unwritable[0]
    which = "the folder itself" if first == run else f"{first.relative_to(run)} in it"
    raise ConfigError(f"The run folder {run} cannot be written ({which} is read-only), {doing}.",
                      f"Make it writable (chmod -R u+w {run}), or copy it somewhere you can write "
                      f"(cp -r {run} COPY) and use the copy; nothing was changed.")
