"""The example dataset `setup` offers to a user with no data file yet:
`examples/identity.json` (300 ShareGPT conversations from FastChat, Apache-2.0,
by LMSYS; examples/README.md says more), where it is, and copying it where the
user wants it.

It lives at the top of the repository, beside `presets/`, and a wheel copies
it into the package (pyproject.toml), as it does the presets: a clone finds it
at the root, a pip install inside `llmcustoms/`.
"""

from __future__ import annotations

import filecmp
import shutil
from pathlib import Path

from llmcustoms.errors import ConfigError

EXAMPLE_NAME = "identity.json"
# The answer to the data question that takes the example.
EXAMPLE_ANSWER = "example"
WHAT_IT_TEACHES = ("300 short conversations that teach the model it is Vicuna, a language model made by LMSYS "
                   "(FastChat's example data, Apache-2.0)")


def example_path() -> Path:
    """The shipped example: inside the installed package (wheel), or at the
    repository root (editable install, source checkout)."""
    package = Path(__file__).resolve().parent.parent  # llmcustoms/, above commands/
    for candidate in (package / "examples" / EXAMPLE_NAME, package.parent / "examples" / EXAMPLE_NAME):
        if candidate.is_file():
            return candidate
    raise ConfigError("The example data is missing from this installation.",
                      "Reinstall llmcustoms (`pip install .` from the source tree), or give your own data file.")


def is_available() -> bool:
    try:
        example_path()
    except ConfigError:
        return False
    return True


def free_copy_name(directory: Path) -> str:
    """Where to suggest copying the example in `directory`: identity.json, or
    identity-2.json, ... when a different file already has the name (the
    same file is fine: it is the example already copied)."""
    source, stem = example_path(), Path(EXAMPLE_NAME).stem
    for n in range(1, 100):
        name = EXAMPLE_NAME if n == 1 else f"{stem}-{n}.json"
        if not (directory / name).exists() or same_file(directory / name, source):
            return name
    return EXAMPLE_NAME  # refused when given, with why


def same_file(path: Path, source: Path) -> bool:
    return path.is_file() and filecmp.cmp(path, source, shallow=False)


def copy_problem(target: Path) -> str | None:
    """Why the example cannot be copied to `target`, or None."""
    if target.is_dir():
        return f"{target} is a directory; give a file name, such as {target / EXAMPLE_NAME}."
    if target.exists() and not same_file(target, example_path()):
        return f"{target} exists and is not the example; give another name (nothing is overwritten)."
    if not target.parent.is_dir():
        return f"{target.parent} is not a directory here."
    return None


def copy_example(target: Path) -> Path:
    """The example copied to `target` (kept if it is already there), so the
    user's `.env` names a file of theirs, which an upgrade will not move."""
    source = example_path()
    if not same_file(target, source):
        try:
            shutil.copyfile(source, target)
        except OSError as error:
            raise ConfigError(f"Cannot copy the example to {target}: {error.strerror or type(error).__name__}.",
                              "Give a path in a directory you can write to.") from None
    return target
