"""What `--overwrite` may remove: only what llmcustoms made, and never what a
command was given.

`train --overwrite` replaces a run directory and `export --overwrite` an
earlier export. Both once deleted whatever folder the name pointed at: a
folder that held the training data, the run being exported, the folder of
every run beside it. Now a folder is removed only when it is recognised by
its files (a run directory by plan.json or status.json, an export by the
EXPORT_MARKER file export writes first) and it is none of: a symbolic link
(its target is someone else's), the current directory or a folder above it, a
folder that holds a path the command was given (`given_paths`).
"""

from __future__ import annotations

import os
from pathlib import Path

from llmcustoms.planning.train_options import TrainOptions

# Written into every export before anything else, so `export --overwrite` (and
# a later export after one was killed half-way) knows the folder is its own.
EXPORT_MARKER = ".llmcustoms-export"


def is_run_directory(path: Path) -> bool:
    """A folder `train` made: it holds plan.json or status.json."""
    return any((path / name).is_file() and not (path / name).is_symlink() for name in ("plan.json", "status.json"))


def is_export(path: Path) -> bool:
    """A folder `export` wrote: its marker, or (an export from before the marker)
    nothing but files, among them export's model card and a model's config."""
    marker = path / EXPORT_MARKER
    if marker.is_file() and not marker.is_symlink():
        return True
    try:
        entries = list(path.iterdir())
        card = (path / "README.md").read_text(errors="replace")[:4000] if (path / "README.md").is_file() else ""
    except OSError:
        return False
    names = {entry.name for entry in entries}
    return (all(entry.is_file() and not entry.is_symlink() for entry in entries)
            and bool(names & {"adapter_config.json", "config.json"})
            and card.startswith("---\nlibrary_name:") and "tags: [llmcustoms, " in card)


def given_paths(options: TrainOptions) -> dict[str, Path]:
    """The paths `train` was given (`preparation.TrainOptions`) that a run
    directory must not hold when --overwrite removes it."""
    given = {"the training data": options.data, "the evaluation data": options.eval_data,
             "the model": options.model, "the run --from-run starts from": options.from_run}
    return {what: Path(path) for what, path in given.items() if path}


def refusal(path: Path, keep: dict[str, Path]) -> str | None:
    """Why `path` must never be removed or replaced, as words after its name
    ("is a symbolic link to ..."), or None. `keep`: what the command was given,
    by what it is ("the training data")."""
    if path.is_symlink():
        return f"is a symbolic link (to {os.readlink(path)})"
    if not path.exists():
        return None
    if not path.is_dir():
        return "is a file"
    real = path.resolve()
    here = Path.cwd().resolve()
    if real == here or real in here.parents:
        return "is the current directory" if real == here else "holds the current directory"
    for what, kept in keep.items():
        # Resolved, and as written: a link to the data inside the folder is the user's too.
        written = (Path(os.path.abspath(path)), Path(os.path.abspath(kept)))
        for folder, target in ((real, kept.absolute().resolve()), written):
            if folder == target or folder in target.parents:
                return f"{'is' if folder == target else 'holds'} {what} ({kept})"
    return None
