"""Every `llmcustoms` command in the README and docs/ runs from a fresh clone as written
(issue 47, 8): its subcommand and each of its flags exist, every path it names is in the
clone or made by an earlier command of the same page (never `../shared/...` or a developer's
cache), and the cheap ones (`plan`, `presets`, `hardware`, `settings`) run, against a copy of
the fixture data under the names the docs give the user's own files."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest
import typer.main

from conftest import DATA_FILES, FIXTURES
from llmcustoms.cli import app

ROOT = Path(__file__).parent.parent
# Pages a user follows. docs/benchmarks.md is the developers' (its commands name their cache and data).
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")]
FENCED = re.compile(r"^```(?:bash|sh|shell|console)?\n(.*?)^```", re.MULTILINE | re.DOTALL)
# The names the docs give the user's own data: stand-ins, made from the fixtures when a command runs.
USERS_FILES = {"data.jsonl": DATA_FILES["alpaca"], "my_data.jsonl": DATA_FILES["alpaca"],
               "prefs.jsonl": FIXTURES / "shapes" / "preference_arithmetic.jsonl", "replies.jsonl": DATA_FILES["alpaca"],
               "chats.json": DATA_FILES["sharegpt"], "data.csv": DATA_FILES["prompt_completion"]}
# What the docs name as the user's own (a model folder, a GGUF of theirs, a run by the name they chose).
USERS_OWN = re.compile(r"^(\./my-local-model|~/models/|runs/|my-model)")
CHEAP = {"plan", "presets", "hardware", "settings"}


def doc_commands() -> list[tuple[str, list[str]]]:
    """(page:line, argv after `llmcustoms`) of each command in a fenced block, continuation lines
    joined and comments dropped; `<run-name>` style placeholders kept as they are."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for block in FENCED.finditer(text):
            lines = block.group(1).replace("\\\n", " ").splitlines()
            first = text[:block.start(1)].count("\n") + 1
            for offset, line in enumerate(lines):
                if line.strip().startswith("llmcustoms "):
                    argv = shlex.split(line.replace("<", "'<").replace(">", ">'"), comments=True)[1:]
                    found.append((f"{page.relative_to(ROOT)}:{first + offset}", argv))
    return found


COMMANDS = doc_commands()


def options_of(name: str) -> set[str]:
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}


def test_the_commands_are_found():
    pages = {where.split(":")[0] for where, _ in COMMANDS}
    assert len(COMMANDS) >= 45 and {"README.md", "docs/first-run.md", "docs/train-and-plan.md"} <= pages


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_each_command_and_flag_exists(where, argv):
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    assert argv and argv[0] in commands, f"{where}: no command {argv[:1]}"
    known = options_of(argv[0])
    unknown = [a.split("=")[0] for a in argv[1:] if a.startswith("--") and a.split("=")[0] not in known]
    assert not unknown, f"{where}: `{argv[0]}` has no {', '.join(unknown)}"


def named_paths(argv: list[str]) -> list[str]:
    """The arguments that are paths: with a slash, or a file name with an extension."""
    return [a for a in argv[1:] if not a.startswith("-") and not a.startswith("<") and
            ("/" in a or re.search(r"\.(jsonl?|csv|parquet|txt|ya?ml|gguf)$", a)) and not re.fullmatch(r"[\w.-]+/[\w.-]+", a)
            or a.startswith(("../", "~/", "/"))]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_path_a_command_names_is_in_the_clone_or_made_before(page):
    """A path is the clone's (examples/, presets/), the user's own data under the names above,
    what an earlier command of the page made (`--output`, `--run-name`), or the user's own
    model or run; never a file a clone does not have (`../shared/data/...`, `~/.cache/...`)."""
    made: set[str] = set()
    wrong = []
    for where, argv in (c for c in COMMANDS if c[0].split(":")[0] == str(page.relative_to(ROOT))):
        for path in named_paths(argv):
            if path.startswith(("../", "/")) or path.startswith("~/.cache"):
                wrong.append(f"{where}: {path} is outside the clone")
            elif not ((ROOT / path).exists() or Path(path).name in USERS_FILES or USERS_OWN.match(path)
                      or any(path.startswith(m) for m in made)):
                wrong.append(f"{where}: {path} is neither in the clone nor made by an earlier command")
        for flag in ("--output", "--run-name", "--output-dir"):
            if flag in argv[:-1]:
                made.add(argv[argv.index(flag) + 1])
    assert not wrong, "\n".join(wrong)


CHEAP_COMMANDS = [(w, a) for w, a in COMMANDS if a[0] in CHEAP]


@pytest.mark.slow
@pytest.mark.parametrize("where,argv", CHEAP_COMMANDS, ids=[w for w, _ in CHEAP_COMMANDS])
def test_the_cheap_commands_run_as_written(where, argv, tmp_path, cli):
    for name, fixture in USERS_FILES.items():
        shutil.copy(fixture, tmp_path / name)
    ran = cli(*argv, cwd=tmp_path, env={"HF_HUB_OFFLINE": "1"}, timeout=300)
    assert ran.returncode == 0, f"{where}: {' '.join(argv)}\n{(ran.stdout + ran.stderr)[-2000:]}"
    assert "Traceback" not in ran.stderr
