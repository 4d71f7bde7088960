"""`python -m llmcustoms ARGS` for the benchmark scripts that start many commands (attack.py,
kill_anywhere.py, quality.py).

Once `start_server` has run, each command is forked from a server that imported torch and
transformers once (tests/fork_server.py): a process of its own (pid, exit code, signals,
stdio, working directory, environment) without the 6-8 s a fresh interpreter spends on
imports. A command whose environment differs from the server's in what a library reads at
import, or any command when no server could start, runs as a real subprocess. What these
scripts measure is a command's own work (where a kill lands, a run's losses), never how long
an interpreter takes to start.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/fork_server.py

_SERVER: list = []  # the server, once started (None: it could not start)


def start_server(env: dict[str, str]) -> None:
    """The server every later command forks from, its environment `env` (the one the commands share)."""
    from fork_server import ForkServer

    stop_server()
    try:
        _SERVER.append(ForkServer.start(env))
    except (OSError, RuntimeError):  # no server here (a socket it cannot bind): real subprocesses
        _SERVER.append(None)


def stop_server() -> None:
    while _SERVER:
        server = _SERVER.pop()
        if server is not None:
            server.stop()


def run(args: list[str], env: dict[str, str], cwd: Path | str | None = None, timeout: float | None = None,
        stdin: str | None = None, errors: str = "replace") -> subprocess.CompletedProcess:
    """As `subprocess.run(..., capture_output=True, text=True)`; `errors`: how bytes that are not UTF-8
    are read and written ("surrogateescape" keeps them)."""
    server = _SERVER[0] if _SERVER else None
    ran = server.run(args, env, cwd, stdin or "", timeout or 24 * 3600, errors=errors) if server else None
    return ran or subprocess.run([sys.executable, "-m", "llmcustoms", *args], cwd=cwd, env=env, capture_output=True,
                                 text=True, errors=errors, timeout=timeout, input=stdin or "")


def popen(args: list[str], env: dict[str, str], cwd: Path | str | None = None, stdout: int | None = None,
          stderr: int | None = None, text: bool = True):
    """As `subprocess.Popen` (stdin empty): poll, wait, send_signal and communicate."""
    server = _SERVER[0] if _SERVER else None
    process = server.popen(args, env, cwd, stdout, stderr, text) if server else None
    return process or subprocess.Popen([sys.executable, "-m", "llmcustoms", *args], cwd=cwd, env=env,
                                       stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, text=text)
