"""The fork server the CLI tests start commands from (tests/fork_server.py): a forked command
behaves as a real `python -m llmcustoms` process: its output, exit code, signals, and several
at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import DATA_FILES
from fork_server import ForkServer


@pytest.fixture(scope="module")
def server():
    started = ForkServer.start({**os.environ, "COLUMNS": "100"})
    yield started
    started.stop()


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "COLUMNS": "100", **extra}


def test_a_forked_command_prints_and_exits_as_a_real_one(server):
    real = subprocess.run([sys.executable, "-m", "llmcustoms", "--version"], capture_output=True, text=True, env=env())
    forked = server.run(["--version"], env())
    started = server.popen(["--version"], env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = started.communicate(timeout=60)
    assert (forked.returncode, forked.stdout) == (started.returncode, out) == (real.returncode, real.stdout) == (0, real.stdout)
    assert real.stdout.strip()
    # A user error: exit 2 and its message, from the forked child as from the real process.
    assert server.run(["train", "no-such-file.jsonl"], env()).returncode == 2


def test_an_environment_read_at_import_gets_a_real_subprocess(server):
    assert server.run(["--version"], env(PYTHONHASHSEED="7")) is None
    assert server.popen(["--version"], env(PYTHONHASHSEED="7")) is None
    assert server.run(["--version"], env(LLMCUSTOMS_LOG_LEVEL="debug")) is not None


def test_commands_run_side_by_side_and_a_signal_reaches_the_one_it_is_sent_to(server, tiny_models, tmp_path):
    # Every micro-batch of step 1 takes longer: the run is still training when it is signalled.
    args = ["train", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["llama"]), "--max-steps", "3",
            "--batch-size", "4", "--output-dir", str(tmp_path), "--run-name", "slow", "--yes", "--quiet"]
    training = server.popen(args, env(LLMCUSTOMS_FAULT_INJECT="slow@1"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "slow" / "status.json"
    deadline = time.time() + 120
    while not metrics.exists() and time.time() < deadline and training.poll() is None:
        time.sleep(0.05)
    assert training.poll() is None, "the run ended before it was signalled"
    # A second command starts, runs and ends while the first one is still running.
    assert server.run(["--version"], env(), timeout=60).returncode == 0
    assert training.poll() is None
    training.send_signal(signal.SIGINT)
    _, err = training.communicate(timeout=120)
    assert training.returncode == 130, err
    assert "Traceback" not in err
