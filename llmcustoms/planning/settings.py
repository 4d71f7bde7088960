"""Settings from `.env` and `LLMCUSTOMS_*` environment variables.

Precedence, for every value: flag > environment > preset > default. The
environment is the process environment, then the env file (`./.env`, or
`--env-file PATH`): a variable set in the shell wins over the file. Every
variable is an option of `planning/options.py` and is documented in the
example .env that `example_file()` writes from that table (`llmcustoms settings
--example` prints it; `.env.example` in the repository is its copy).

Other variables in the file (HF_TOKEN, HF_HOME, ...) are exported to this
process for the libraries that read them. HF_TOKEN is never printed, logged
or written anywhere by llmcustoms.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcustoms.errors import ConfigError
from llmcustoms.planning.options import BY_VARIABLE, OPTIONS, PREFIX, Given

# Variables with the prefix that are not settings: a testing aid, and what
# the launcher tells its processes.
NOT_SETTINGS = ("LLMCUSTOMS_FAULT_INJECT", "LLMCUSTOMS_RESTARTS_ON_REQUEST")
# The settings: every option of the table that has a variable.
SETTINGS = tuple(option for option in OPTIONS if option.env)


@dataclass
class Settings:
    """Values from the environment, each with where it came from."""

    values: dict[str, Given]  # option name -> value, and "environment variable LLMCUSTOMS_X" or ".env line N"

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, Given(default, "")).value


def read_env_file(path: Path) -> dict[str, tuple[str, int]]:
    """NAME -> (value, line) from a .env file; a malformed line is an error naming it."""
    from dotenv.parser import parse_stream

    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text.", "Save the env file as UTF-8.") from None
    except OSError as exc:
        raise ConfigError(f"Cannot read {path}: {exc.strerror}.") from None
    values = {}
    for binding in parse_stream(io.StringIO(text)):
        line = binding.original.line
        if binding.error or (binding.key is not None and binding.value is None and binding.key.startswith(PREFIX)):
            raise ConfigError(f"{path}, line {line}: not a NAME=value line.",
                              "Fix or delete that line; lines starting with # are comments.")
        if binding.key is not None and binding.value is not None:
            if "\x00" in binding.key + binding.value:  # no environment can hold one: os.environ would refuse it
                raise ConfigError(f"{path}, line {line}: a NUL character in a NAME=value line.",
                                  "Fix or delete that line; save the file as plain text.")
            values[binding.key] = (binding.value, line)
    return values


def load_settings(env_file: Path | None = None) -> Settings:
    """Read `env_file` (default ./.env if present), export its non-llmcustoms
    variables to this process, and return the LLMCUSTOMS_* values."""
    path = env_file if env_file is not None else Path(".env")
    if env_file is not None and not path.is_file():
        # A named pipe or a folder is there, but is no file to read (a pipe would wait for a writer).
        raise ConfigError(f"Env file {path} is not a regular file." if path.exists() else f"Env file not found: {path}",
                          "Check the path, or run `llmcustoms setup` to write one.")
    from_file = read_env_file(path) if path.is_file() else {}
    for name, (value, _) in from_file.items():
        if not name.startswith(PREFIX):
            os.environ.setdefault(name, value)  # the shell's own value wins
    values: dict[str, Given] = {}
    problems = []
    for name, option in BY_VARIABLE.items():
        if name in os.environ:
            raw, where = os.environ[name], f"environment variable {name}"
        elif name in from_file:
            raw, line = from_file[name]
            where = f"{path}, line {line} ({name})"
        else:
            continue
        if not raw.strip():
            continue  # NAME= with nothing after it means "not set"
        try:
            values[option.name] = Given(option.parse(raw), f"env {name}")
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
    unknown = sorted(n for n in set(os.environ) | set(from_file) if n.startswith(PREFIX) and n not in BY_VARIABLE
                     and n not in NOT_SETTINGS)
    # A name of bytes that are not UTF-8 (as surrogates) could not even be printed.
    problems += [f"unknown setting {n if n.isprintable() else ascii(n)}" for n in unknown]
    if problems:
        raise ConfigError("Invalid setting(s):\n  " + "\n  ".join(problems),
                          "`llmcustoms settings --example` lists every LLMCUSTOMS_ variable and its values.")
    return Settings(values)


def settings_in_effect(env_file: Path | None = None) -> list[tuple[str, str, str]]:
    """(variable, value, where it comes from) for each setting that is set, as
    `load_settings` reads them (an error, as there, for one that is not valid)."""
    load_settings(env_file)
    path = env_file if env_file is not None else Path(".env")
    from_file = read_env_file(path) if path.is_file() else {}
    found = []
    for option in SETTINGS:
        name = option.variable
        if name in os.environ:  # the shell's, even empty (then not set), wins over the file
            found += [(name, os.environ[name], "environment")] if os.environ[name].strip() else []
        elif name in from_file and from_file[name][0].strip():
            found.append((name, from_file[name][0], f"{path}, line {from_file[name][1]}"))
    return found


def example_file() -> str:
    """The text of .env.example: every variable, documented, commented out."""
    lines = ["# An example .env, as `llmcustoms settings --example` prints it. Save it as .env in the directory",
             "# you run llmcustoms from (or pass --env-file PATH), and set the variables you want.",
             "# Precedence for every value: command-line flag > environment > preset > default.",
             "# A variable already set in the shell wins over this file. `llmcustoms setup` writes one for you.",
             "", "# --- llmcustoms settings (each is the default for the flag of the same name) ---"]
    for option in SETTINGS:
        like = option.flag or "the DATA argument"
        kind = "" if option.kind is str and not option.choices else f": {option.describe_range()}"
        lines += [f"# {option.help} ({like}{kind})", f"# {option.variable}="]
    lines += ["", "# --- read by the libraries llmcustoms uses ---",
              "# Access token for gated models (Mistral, some Llama checkpoints). llmcustoms never",
              "# prints, logs or saves it. Never commit your .env.",
              "# HF_TOKEN=hf_...",
              "# Where downloaded models are cached (default: ~/.cache/huggingface).",
              "# HF_HOME=/data/huggingface",
              "# Set to 1 to never touch the network: only cached or local models load.",
              "# HF_HUB_OFFLINE=1",
              "# Which GPUs to use, by index (default: all).",
              "# CUDA_VISIBLE_DEVICES=0",
              "# For --report-to wandb.",
              "# WANDB_API_KEY=...",
              ""]
    return "\n".join(lines)
