"""The rules of CONTRIBUTING.md that a machine can check, one per folder of
`llmcustoms/`: each folder imports only from the folders below it, planning
never imports torch, Rich stays in `ui/`, no import cycles, and modules and
functions small enough to read."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "llmcustoms"
MODULES = sorted(PACKAGE.rglob("*.py"))
# The folders, lowest first: a module may import from its own folder and the
# folders before it, never from one after it. CONTRIBUTING.md says what each holds.
FOLDERS = ("planning", "recovery", "data", "runs", "models", "preparation", "losses", "training", "ui", "commands")
# Modules at the top: two leaves everything may import (they import nothing of
# ours), and the command line, which may import everything and which nothing imports.
LEAVES = {"errors", "reporting"}
COMMAND_LINE = {"cli", "flags", "endings", "__main__", "__init__"}
# Importable without torch: all of planning/, and everything `--help` touches.
WITHOUT_TORCH_ALSO = ("llmcustoms.cli", "llmcustoms.flags", "llmcustoms.endings", "llmcustoms.reporting", "llmcustoms.errors",
                      "llmcustoms.training.launching", "llmcustoms.runs.run_directory")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts)


def folder_of(name: str) -> str | None:
    """`planning` for `llmcustoms.planning.plan`; None for a top-level module."""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 else None


def imported_modules(path: Path) -> set[str]:
    """Every module of ours `path` imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            # `from llmcustoms.ui import console` imports the module llmcustoms.ui.console
            names.update(f"{node.module}.{alias.name}" for alias in node.names
                         if (PACKAGE.parent / node.module.replace(".", "/") / f"{alias.name}.py").exists())
    return {n for n in names if n.startswith("llmcustoms.") and (PACKAGE.parent / f"{n.replace('.', '/')}.py").exists()}


def _graph() -> dict[str, set[str]]:
    return {module_name(p): imported_modules(p) - {module_name(p)} for p in MODULES}


def test_every_module_sits_in_a_folder_with_a_rule_and_the_top_stays_small():
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top <= LEAVES | COMMAND_LINE, f"modules at the top with no folder: {sorted(top - LEAVES - COMMAND_LINE)}"
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} - {"presets"}
    assert folders == set(FOLDERS), f"folders without a rule in this file: {sorted(folders ^ set(FOLDERS))}"
    for folder in FOLDERS:
        init = PACKAGE / folder / "__init__.py"
        assert init.exists() and not init.read_text().strip(), f"{folder}/__init__.py must exist and stay empty"


def test_no_import_runs_back_up_a_folder():
    rank = {folder: i for i, folder in enumerate(FOLDERS)}
    for module, imports in _graph().items():
        folder = folder_of(module)
        for imported in imports:
            below = folder_of(imported)
            if folder is None:
                if module.split(".")[-1] in LEAVES:
                    pytest.fail(f"{module} must import nothing of ours, but imports {imported}")
                continue  # the command line may import anything
            if below is None:
                assert imported.split(".")[-1] in LEAVES, f"{module} imports the command line ({imported})"
            else:
                assert rank[below] <= rank[folder], (
                    f"{module} ({folder}/) imports {imported} ({below}/), a folder above it: "
                    "move the shared piece down, or pass it in")


def test_planning_and_the_cli_import_no_torch():
    planning = [module_name(p) for p in sorted((PACKAGE / "planning").glob("*.py")) if p.stem != "__init__"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in planning + list(WITHOUT_TORCH_ALSO))
            + "heavy = [m for m in ('torch', 'transformers', 'peft', 'optuna') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_rich_only_in_the_ui_folder():
    offenders = []
    for path in MODULES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            if any(n == "rich" or n.startswith("rich.") for n in names) and folder_of(module_name(path)) != "ui":
                offenders.append(module_name(path))
    assert not offenders, f"Rich imported outside ui/: {sorted(set(offenders))}"


def _benchmark_graph() -> dict[str, set[str]]:
    """benchmarks/ scripts import each other by bare name (each folder is on sys.path when one runs)."""
    graph: dict[str, set[str]] = {}
    for folder in (PACKAGE.parent / "benchmarks", PACKAGE.parent / "benchmarks" / "gpu"):
        siblings = {p.stem for p in folder.glob("*.py")}
        for path in folder.glob("*.py"):
            names = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names.add(node.module.split(".")[0])
            graph[f"{folder.name}/{path.stem}"] = {f"{folder.name}/{name}" for name in names & siblings - {path.stem}}
    return graph


@pytest.mark.parametrize("graph_of", [lambda: _graph(), _benchmark_graph], ids=["llmcustoms", "benchmarks"])
def test_no_import_cycles(graph_of):
    graph = graph_of()
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
    too_long = {module_name(p): n for p in MODULES if (n := len(p.read_text().splitlines())) > 450}
    assert not too_long, f"modules over 450 lines: {too_long}"
    assert len((PACKAGE / "cli.py").read_text().splitlines()) < 350
    long_functions = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 70:
                    long_functions.append(f"{module_name(path)}:{node.name} ({length} lines)")
    assert not long_functions, f"functions over 70 lines: {long_functions}"


def test_imports_are_sorted_by_the_modules_real_names():
    """ruff's isort rules (pyproject.toml): `ruff check --select I --fix llmcustoms` sorts them."""
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    result = subprocess.run([ruff, "check", "--select", "I", "--no-cache", str(PACKAGE)], capture_output=True,
                            text=True, cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stdout[-3000:]


def test_the_design_table_names_every_module_of_each_folder():
    """docs/design.md's "Folders, lowest first" table: each folder's row names each of its modules."""
    import re

    rows = {match.group(1): match.group(2) for match in re.finditer(r"^\| `(\w+)/` \|.*\| (.*) \|$",
                                                                     (PACKAGE.parent / "docs" / "design.md").read_text(),
                                                                     re.MULTILINE)}
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert sorted(rows) == folders
    missing = {folder: sorted(p.stem for p in (PACKAGE / folder).glob("*.py") if p.stem != "__init__"
                              and f"`{p.stem}`" not in rows[folder]) for folder in folders}
    assert not any(missing.values()), missing
