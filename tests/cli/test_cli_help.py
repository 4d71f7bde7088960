"""Every command's --help at 80 columns: the usage line names arguments as the
docs do (DATA, RUN), every flag is shown whole, and no line is cut."""

from __future__ import annotations

import re

import pytest
import typer
import typer.core
from typer.testing import CliRunner

from llmcustoms.cli import app
from llmcustoms.flags import Command

GROUP = typer.main.get_command(app)
COMMANDS = sorted(GROUP.commands)  # type: ignore[attr-defined]


def help_at_80_columns(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    return result.output


def flags_of(command: typer.core.TyperCommand) -> set[str]:
    return {name for param in command.params if isinstance(param, typer.core.TyperOption)
            for name in (*param.opts, *param.secondary_opts)}


EVERY_FLAG = {"--help"}.union(*(flags_of(GROUP.commands[name]) for name in COMMANDS))  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", COMMANDS)
def test_help_at_80_columns_shows_every_flag_whole(name):
    text = help_at_80_columns(name)
    assert "…" not in text and "<bool>" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    for flag in flags_of(GROUP.commands[name]):  # type: ignore[attr-defined]
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), f"{flag} is not shown whole"
    # A flag a help text mentions is not broken at a line's end ("--eval-" / "split").
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", text))
    assert mentioned <= EVERY_FLAG, f"cut or unknown flags: {sorted(mentioned - EVERY_FLAG)}"


@pytest.mark.parametrize("name", COMMANDS)
def test_usage_names_arguments_in_capitals(name):
    usage = help_at_80_columns(name).splitlines()[0]
    assert usage.startswith(f"Usage: llmcustoms {name} [OPTIONS]")
    command = GROUP.commands[name]  # type: ignore[attr-defined]
    assert isinstance(command, Command), f"{name}: @app.command(cls=flags.Command)"
    for argument in [p for p in command.params if isinstance(p, typer.core.TyperArgument)]:
        assert re.search(rf"\b{argument.name.upper()}\b", usage), usage
    assert "{" not in usage and not re.search(r"\[[a-z_]+\]", usage), usage


def test_train_usage_reads_data():
    text = help_at_80_columns("train")
    assert text.splitlines()[0] == "Usage: llmcustoms train [OPTIONS] [DATA]"
    assert re.search(r"^  DATA ", text, re.MULTILINE)  # the argument's row says DATA too
    assert "--gradient-checkpointing / --no-gradient-checkpointing" in text


def test_root_help_lists_every_command():
    text = help_at_80_columns()
    assert all(re.search(rf"^  {re.escape(name)} ", text, re.MULTILINE) for name in COMMANDS)


def test_root_help_shows_each_commands_first_line_whole():
    # Click cuts a summary longer than the column beside the names with "..." ("settings  Show
    # the LLMCUSTOMS_ settings in effect and where each comes..."): each first line fits.
    text = help_at_80_columns()
    assert "..." not in text.partition("Commands:")[2]
    for name in COMMANDS:
        first = (GROUP.commands[name].help or "").strip().splitlines()[0]  # type: ignore[attr-defined]
        shown = re.search(rf"^  {re.escape(name)} +(.+)$", text, re.MULTILINE)
        # Its first sentence, whole (Click shows no more: chat's "/exit or Ctrl-D ends it" is its help's).
        assert shown and shown[1].endswith(".") and first.startswith(shown[1]), (name, first)


def test_runs_help_names_what_its_table_shows():
    text = help_at_80_columns("runs")
    assert "perplexity" in text and "best eval loss" not in text
