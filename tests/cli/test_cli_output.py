"""Where a command writes and runs (issue 46, 15): standard output that cannot be
written (`> /dev/full`, a full disk) is one message on stderr and exit 2; a reader
that stops reading (`| head -1`) ends the command quietly; a current directory
deleted under the shell is one message and exit 2. Never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmcustoms.endings import OutputLost, StandardOutput, guarded_output

FULL = "Cannot write the output: the disk (or device) is full."


def run(*args: str, stdout, unbuffered: bool = False, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCUSTOMS_") and k != "PYTHONUNBUFFERED"}
    env.update({"COLUMNS": "100", **({"PYTHONUNBUFFERED": "1"} if unbuffered else {})})
    return subprocess.run([sys.executable, "-m", "llmcustoms", *args], stdout=stdout, stderr=subprocess.PIPE,
                          env=env, text=True, timeout=120, **kwargs)


@pytest.mark.parametrize("unbuffered", [False, True])
@pytest.mark.parametrize("argv", [["settings", "--example"], ["runs", "--output-dir", "nowhere"]])
def test_output_to_a_full_device_is_one_message_and_exit_2(argv, unbuffered):
    """print() and Rich; buffered, the write fails when the command has returned, unbuffered at once."""
    with open("/dev/full", "w") as full:
        result = run(*argv, stdout=full, unbuffered=unbuffered)
    assert result.returncode == 2, result.stderr
    assert FULL in " ".join(result.stderr.split()) and "Traceback" not in result.stderr
    assert "Exception ignored" not in result.stderr


def test_a_reader_that_stops_reading_ends_the_command_quietly():
    """`llmcustoms settings --example | head -c 1`: the pipe is closed before the command writes."""
    reading, writing = os.pipe()
    os.close(reading)
    try:
        result = run("settings", "--example", stdout=writing)
    finally:
        os.close(writing)
    assert result.returncode == 1 and result.stderr == "", result.stderr


@pytest.mark.parametrize("argv", [["runs"], ["settings"]])
def test_a_deleted_current_directory_is_one_message_and_exit_2(tmp_path, argv):
    gone = tmp_path / "gone"
    gone.mkdir()

    def enter_and_delete() -> None:  # in the child, before it starts: the shell's `cd x && rmdir ../x`
        os.chdir(gone)
        os.rmdir(gone)

    result = run(*argv, stdout=subprocess.PIPE, preexec_fn=enter_and_delete)
    flat = " ".join(result.stderr.split())
    assert result.returncode == 2, result.stderr
    assert "The current directory no longer exists" in flat and "cd to a folder that does" in flat
    assert "Traceback" not in result.stderr


def test_only_a_failure_to_write_the_output_becomes_a_message(monkeypatch):
    """An OSError of anything else is a bug: it keeps its traceback."""
    with open("/dev/full", "w") as full:
        output = StandardOutput(full)
        output.write("table")
        with pytest.raises(OutputLost, match="the disk"):
            output.flush()
        output.write("more")
        output.flush()  # the descriptor now writes to /dev/null: nothing fails again as the interpreter ends
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # guarded_output replaces it
    with pytest.raises(PermissionError):
        with guarded_output():
            raise PermissionError(13, "not ours to handle")
