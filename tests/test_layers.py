"""The rules of CONTRIBUTING.md that a machine can check: planning never
imports torch, Rich stays in the UI module, no import cycles, and modules
and functions small enough to read."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "llmcustoms"
MODULES = sorted(PACKAGE.glob("*.py"))
# The modules that may import Rich: everything the user sees is drawn there.
UI_MODULES = {"console.py", "dataview.py", "dialog.py", "tuneview.py", "trainview.py"}
# The planning layer: pure, and importing nothing from running or the UI.
PLANNING = ("errors", "options", "settings", "presets", "hardware", "memory", "sizing", "duration", "fitting", "plan",
            "planning", "dataadvice", "objectives", "diskspace", "stepchoices")
# Planning and everything `--help` touches: importable without torch.
WITHOUT_TORCH = tuple(f"llmcustoms.{name}" for name in PLANNING) + (
    "llmcustoms.cli", "llmcustoms.flags", "llmcustoms.launching", "llmcustoms.rundir", "llmcustoms.reporting")


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            if node.module == "llmcustoms":  # `from llmcustoms import console`
                names.update(f"llmcustoms.{alias.name}" for alias in node.names)
    return names


def test_planning_and_the_cli_import_no_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in WITHOUT_TORCH)
            + "heavy = [m for m in ('torch', 'transformers', 'peft', 'optuna') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_planning_imports_nothing_from_running_or_the_ui():
    for name in PLANNING:
        ours = {m for m in imported_modules(PACKAGE / f"{name}.py") if m.startswith("llmcustoms.")}
        outside = ours - {f"llmcustoms.{other}" for other in PLANNING}
        assert not outside, f"{name}.py imports {sorted(outside)}"


def test_rich_only_in_the_ui_module():
    offenders = [p.name for p in MODULES if p.name not in UI_MODULES
                 and any(name == "rich" or name.startswith("rich.") for name in imported_modules(p))]
    assert not offenders, f"Rich imported outside {sorted(UI_MODULES)}: {offenders}"


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in MODULES:
        name = f"llmcustoms.{path.stem}"
        graph[name] = {m for m in imported_modules(path) if m.startswith("llmcustoms.") and m != name}
    return graph


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}  # 1 visiting, 2 done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt in graph and state.get(nxt) is None:
                visit(nxt)
        path.pop()
        state[node] = 2

    for module in sorted(graph):
        if state.get(module) is None:
            visit(module)


def test_modules_and_functions_are_small():
    too_long = {p.name: n for p in MODULES if (n := len(p.read_text().splitlines())) > 450}
    assert not too_long, f"modules over 450 lines: {too_long}"
    assert len((PACKAGE / "cli.py").read_text().splitlines()) < 350
    long_functions = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 70:
                    long_functions.append(f"{path.name}:{node.name} ({length} lines)")
    assert not long_functions, f"functions over 70 lines: {long_functions}"


def test_nothing_imports_the_command_line_and_the_loop_never_imports_the_ui():
    graph = _graph()
    for module, imports in graph.items():
        if module not in ("llmcustoms.cli", "llmcustoms.__main__"):
            assert not imports & {"llmcustoms.cli", "llmcustoms.flags"}, f"{module} imports the command line"
    loop = ("finetuner", "processes", "position", "losses", "optimization", "batching", "checkpoints", "recovery",
            "faults", "modeling", "sharding")
    for name in loop:
        ui = graph[f"llmcustoms.{name}"] & {"llmcustoms.console", "llmcustoms.dialog", "llmcustoms.trainview"}
        assert not ui, f"{name}.py imports {sorted(ui)}: report through reporting.Reporter"
