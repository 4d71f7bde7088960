"""Shared fixtures: tiny local models, fixture data, and ways to run the CLI.

Nothing here touches the network or the user's home directory: the Hugging
Face cache and hub access are pointed at a temp dir and switched offline.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# The tests sit in folders that mirror llmcustoms/'s; some reuse another test
# module's small helpers (`from test_checkpoints import save`), by name, from any folder.
sys.path[1:1] = [str(folder) for folder in sorted(Path(__file__).parent.iterdir())
                 if folder.is_dir() and folder.name not in ("fixtures", "__pycache__")]

from tiny_models import FIXTURES, TEMPLATE_FAMILIES, WIDE, build_model  # noqa: E402


def _wide_consoles() -> None:
    """What this process prints (CliRunner, the UI modules) is as wide as a
    command a test starts. Rich fixes a console's width from COLUMNS when the
    console is made, so the UI's consoles are made now, under WIDE; pytest's
    own output keeps the terminal's width."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDE
    try:
        import llmcustoms.ui.console  # noqa: F401
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


_wide_consoles()

FAMILIES = ("llama", "mistral", "qwen2", "phi", "phi3")
DATA_FILES = {
    "alpaca": FIXTURES / "alpaca.jsonl",
    "sharegpt": FIXTURES / "sharegpt.json",
    "messages": FIXTURES / "messages.jsonl",
    "prompt_completion": FIXTURES / "prompt_completion.csv",
    "text": FIXTURES / "text.jsonl",
}


# What llmcustoms sets in its own process when it first loads a model (models/loading.py:
# `from_pretrained`, `quiet_libraries`), set from the start: the first in-process test to load
# one would otherwise change this process's environment, and each CLI command's with it, from
# the fork server's (`cli_fork_server`), costing a second server.
# The slow tier's longest tests (a minute or so each on the reference machine, most
# of it their own subprocesses), started first: the two workers then end together,
# where one left to finish a long test alone held the tier up to a minute and a half.
STARTED_FIRST = ("test_gpu_kit.py::test_the_dry_run_runs_every_step_on_this_cpu",
                 "test_gpu_peers.py::test_the_dry_run_of_part_3_runs_the_side_by_side_and_the_profile_on_this_cpu",
                 "test_first_run_terminal.py::test_the_readmes_first_run_reads_whole_and_its_numbers_hold",
                 "test_attack.py::test_the_reduced_attack_finds_nothing",
                 "test_benchmarks.py::test_quality_trains_through_the_cli_and_scores_against_the_base_model",
                 "test_benchmarks.py::test_sharding_memory_measures_ddp_and_fsdp_per_process")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """STARTED_FIRST first, longest first; pytest-xdist hands tests out in this order."""
    def rank(item: pytest.Item) -> int:
        return next((i for i, name in enumerate(STARTED_FIRST) if item.nodeid.endswith(name)), len(STARTED_FIRST))

    items.sort(key=rank)


LOADING_SETS = {"DISABLE_SAFETENSORS_CONVERSION": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


@pytest.fixture(scope="session", autouse=True)
def offline_hub(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf_home")
    cache = tmp_path_factory.mktemp("llmcustoms_cache")
    saved = {k: os.environ.get(k) for k in ("HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "LLMCUSTOMS_CACHE_DIR",
                                          "LLMCUSTOMS_REPLAY", *LOADING_SETS)}
    os.environ.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", LLMCUSTOMS_CACHE_DIR=str(cache))
    os.environ.update(LOADING_SETS)
    # Module- and session-wide runs too (see `no_replay_unless_asked`).
    os.environ["LLMCUSTOMS_REPLAY"] = "0"
    import llmcustoms.planning.step_choices as step_choices

    step_choices.DEFAULT_REPLAY = 0.0
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def no_replay_unless_asked(monkeypatch):
    """Runs in tests train without replay (`training/replay.py`, on by default) unless a test
    asks for it with `replay=`/`--replay`: the loop's own tests count rows, steps, tokens and
    losses of the data alone, as tests that compare runs bit for bit pin the precision.
    tests/training/test_replay.py tests replay, and the planner's tests its default. The
    environment reaches the CLI in a subprocess; the default, plans made in this process."""
    monkeypatch.setenv("LLMCUSTOMS_REPLAY", "0")
    monkeypatch.setattr("llmcustoms.planning.step_choices.DEFAULT_REPLAY", 0.0)


@pytest.fixture
def clean_environment(monkeypatch, tmp_path):
    """No LLMCUSTOMS_* setting or token from the environment, a cache of the
    test's own, and the test's directory as the working one (where .env is read)."""
    for name in list(os.environ):
        if name.startswith("LLMCUSTOMS_") or name == "HF_TOKEN":
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LLMCUSTOMS_CACHE_DIR", str(tmp_path / "cache"))  # never the user's ~/.cache
    monkeypatch.setenv("LLMCUSTOMS_REPLAY", "0")  # as every test: replay only where asked (`no_replay_unless_asked`)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """model_type -> directory of a two-layer random model with its tokenizer."""
    root = tmp_path_factory.mktemp("models")
    return {family: build_model(family, root / f"tiny-{family}") for family in FAMILIES}


@pytest.fixture(scope="session")
def family_models(tmp_path_factory) -> dict[str, Path]:
    """Today's families (Qwen3, Qwen3.5, Llama 3.2, Gemma 3, Phi-3.5) -> a two-layer
    model of each with its original chat template (`tiny_models.TEMPLATE_FAMILIES`)."""
    root = tmp_path_factory.mktemp("family-models")
    return {family: build_model(family, root / f"tiny-{family}") for family in TEMPLATE_FAMILIES}


# This process's fork servers (`fork_server.py`), each started at the first command that needs
# its environment. A new one when this process's own environment has changed in what a library
# reads at import (an in-process test's library set HF_HUB_DISABLE_PROGRESS_BARS, say): from then
# on every command would differ from the older server's. At most MAX_FORK_SERVERS, then real subprocesses.
_FORK_SERVERS: list = []
MAX_FORK_SERVERS = 3


def cli_fork_server():
    """The fork server for this process's present environment; None when turned off
    (TESTS_NO_FORK_SERVER=1), when one cannot start, or past MAX_FORK_SERVERS."""
    if os.environ.get("TESTS_NO_FORK_SERVER"):
        return None
    from fork_server import ForkServer, differs_at_import

    base = {**os.environ, "COLUMNS": WIDE}
    server = next((s for s in _FORK_SERVERS if s is None or not differs_at_import(base, s.env)), None)
    if server is None and None not in _FORK_SERVERS and len(_FORK_SERVERS) < MAX_FORK_SERVERS:
        try:
            server = ForkServer.start(base)
        except (OSError, RuntimeError):  # no server here (a socket it cannot bind): real subprocesses
            server = None
        _FORK_SERVERS.append(server)
    return server


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: int = 300,
            input: str | None = None) -> subprocess.CompletedProcess:
    """Run `python -m llmcustoms ARGS` as a process of its own: forked from a server that has
    torch and transformers imported already (`fork_server.py`; TESTS_NO_FORK_SERVER=1: never),
    or a real subprocess where the environment differs in what a library reads at import."""
    full_env = {**os.environ, "COLUMNS": WIDE, **(env or {})}
    server = cli_fork_server()
    result = server.run(list(args), full_env, cwd, input, timeout) if server else None
    if result is not None:
        return result
    return subprocess.run([sys.executable, "-m", "llmcustoms", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout, input=input)


def start_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None, stdout: int | None = None,
              stderr: int | None = None, text: bool = False):
    """Start `python -m llmcustoms ARGS` as `subprocess.Popen` would (to signal it, or wait for a
    file while it runs), forked from the fork server where the environment allows; stdin is empty."""
    full_env = {**os.environ, "COLUMNS": WIDE, **(env or {})}
    server = cli_fork_server()
    process = server.popen(list(args), full_env, cwd, stdout, stderr, text) if server else None
    return process or subprocess.Popen([sys.executable, "-m", "llmcustoms", *args], cwd=cwd, env=full_env,
                                       stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, text=text)


@pytest.fixture
def cli():
    return run_cli
