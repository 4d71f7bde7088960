"""Writing the .env file `llmcustoms setup` makes: the answers set, and
everything else of the user's kept as it was (comments, order, quoting, the
other variables, a symlink and the mode), written atomically and checked to
read back through python-dotenv as meant before it replaces the old file."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

from llmcustoms.errors import ConfigError


def _unwritable(path: Path, error: OSError) -> ConfigError:
    return ConfigError(f"Cannot write the settings file {path}: {error.strerror or type(error).__name__}.",
                       "Pass --env-file with a path in a directory you can write to (not on a read-only disk); "
                       "nothing was written.")


def check_writable(path: Path) -> None:
    """Refuse an env file that cannot be written, by writing its temporary
    file and removing it (on a read-only file system or directory, or a path
    under a file); `os.access` says yes to root on a read-only directory.
    What exists must be a regular file (through a link): reading a named pipe
    would wait forever for a writer, and a folder or a device is no env file."""
    try:
        kind = stat.S_IFMT(path.stat().st_mode)
    except OSError:  # absent (written new), or under a file: the write below says which
        kind = stat.S_IFREG
    if kind != stat.S_IFREG:
        what = {stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFDIR: "a folder", stat.S_IFSOCK: "a socket"}
        raise ConfigError(f"The settings file {path} is {what.get(kind, 'a device')}, not a regular file.",
                          "Pass --env-file with the path of a file (or of one to create); nothing was written.")
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.unlink(missing_ok=True)
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        tmp.unlink()
    except OSError as error:
        raise _unwritable(path, error) from None


def write_env(path: Path, values: dict[str, str]) -> None:
    """Merge `values` into the env file atomically: other variables stay."""
    try:
        _write_env(path, values)
    except OSError as error:
        try:  # a temporary file written halfway goes; the old env file was never touched
            path.with_name(f".{path.name}.tmp").unlink(missing_ok=True)
        except OSError:
            pass
        raise _unwritable(path, error) from None


def _write_env(path: Path, values: dict[str, str]) -> None:
    """The file with `values` set and everything else of the user's as it was:
    comments, order, quoting, other variables. Through a symlink, its target
    is what is replaced (atomically), and the link stays."""
    target = path.resolve() if path.is_symlink() else path
    old = target.read_text(encoding="utf-8") if target.exists() else ""
    text = env_text(old, values)
    _check_reads_back(text, old, values, path)
    # It may hold HF_TOKEN: a new file is the owner's alone (0600); an existing one
    # keeps the mode its owner gave it. The temporary file never has a wider one.
    mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o600
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.unlink(missing_ok=True)
    descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        file.write(text)
        os.fchmod(file.fileno(), mode)
    os.replace(tmp, target)


def env_text(old: str, values: dict[str, str]) -> str:
    """`old` (a .env file's text) with each of `values` set: a variable it has
    is rewritten where it first stands (later lines of it dropped: the last
    would win), the others are added at the end; every other line stays."""
    from dotenv.parser import parse_stream

    out, written = [], set()
    for binding in parse_stream(io.StringIO(old)):
        key = binding.key
        if key in values:
            if key not in written:
                out.append(f"{key}={_quote(values[key])}\n")
                written.add(key)
            continue
        out.append(binding.original.string)
    text = "".join(out)
    if text and not text.endswith("\n"):
        text += "\n"
    new = [f"{k}={_quote(v)}\n" for k, v in values.items() if k not in written]
    if new:
        header = "# Written by `llmcustoms setup`. `llmcustoms settings --example` prints every variable, explained.\n"
        text += (("\n" if text.strip() else "") if text else header) + "".join(new)
    return text


def _check_reads_back(text: str, old: str, values: dict[str, str], path: Path) -> None:
    """Refuse to write a file that python-dotenv would not read as meant."""
    from dotenv.parser import parse_stream

    def read(source: str) -> dict[str, str | None]:
        return {b.key: b.value for b in parse_stream(io.StringIO(source)) if b.key is not None}

    if read(text) != {**read(old), **values}:
        raise ConfigError(f"setup could not write {path} so that it reads back as meant; nothing was changed.",
                          "Set the LLMCUSTOMS_* variables in it by hand (`llmcustoms settings --example` lists them).")


def _quote(value: str) -> str:
    """A value as python-dotenv reads it back exactly: bare when it is plain,
    else in single quotes, where only \\ and \' are escapes."""
    if value and all(c.isalnum() or c in "_-./:@%+,=" for c in value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
