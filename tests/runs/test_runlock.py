"""One owner per run directory: a run that is training cannot be overwritten,
resumed twice or started again under the same name, and a killed one leaves
no stale lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import DATA_FILES, start_cli
from tiny_models import WIDE

from llmcustoms.errors import ConfigError
from llmcustoms.runs import run_lock

HOLD = ("import sys, time\nfrom pathlib import Path\nfrom llmcustoms.runs import run_lock\n"
        "with run_lock.owning(Path(sys.argv[1]), 'testing'):\n    print('held', flush=True)\n    time.sleep(600)\n")


def hold_in_another_process(run: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_lock_held_elsewhere_is_refused_with_its_pid_and_freed_by_kill_9(tmp_path):
    run = tmp_path / "runs" / "mine"
    other = hold_in_another_process(run)
    try:
        assert run_lock.holder(run) == other.pid
        with pytest.raises(ConfigError) as refused:
            with run_lock.owning(run, "resuming it"):
                pass
        assert f"process {other.pid}" in str(refused.value) and "resuming it" in str(refused.value)
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait(timeout=30)
    # The OS dropped the dead process's lock: nothing stale to clean up.
    assert run_lock.holder(run) is None
    with run_lock.owning(run, "resuming it"):
        assert run_lock.holder(run) is None  # ours, not another's


def test_the_lock_is_reentrant_in_a_process_and_lives_beside_the_run(tmp_path):
    run = tmp_path / "mine"
    with run_lock.owning(run, "a"):
        with run_lock.owning(run, "b"):
            pass
        # Still held after the inner block: another process cannot take it.
        probe = subprocess.run([sys.executable, "-c", "import sys\nfrom pathlib import Path\nfrom llmcustoms.runs import run_lock\n"
                                "print(run_lock.holder(Path(sys.argv[1])))", str(run)], capture_output=True, text=True)
        assert probe.stdout.strip() == str(os.getpid())
        assert run_lock.lock_path(run).exists() and run_lock.lock_path(run) == tmp_path / ".mine.lock"
    assert not run.exists()  # taking the lock makes nothing inside the run's place
    assert not run_lock.lock_path(run).exists()  # and leaves nothing behind


def test_a_file_where_the_runs_would_go_is_named_not_reported_as_a_lock_error(tmp_path):
    """`train --output-dir data/rows.jsonl` said "Cannot lock the run directory ...: File exists" (issue 46, 17)."""
    afile = tmp_path / "rows.jsonl"
    afile.write_text("{}\n")
    for output_dir in (afile, afile / "deeper"):
        with pytest.raises(ConfigError, match="rows.jsonl is a file, not a folder") as refused:
            run_lock.folder_for_runs(output_dir)
        assert "--output-dir" in refused.value.hint
    assert run_lock.folder_for_runs(tmp_path / "new" / "runs") == tmp_path / "new" / "runs"
    with pytest.raises(ConfigError, match="rows.jsonl is a file, not a folder") as refused:
        with run_lock.owning(afile / "run", "starting another run in it"):
            pass
    assert "File exists" not in refused.value.message and "Not a directory" not in refused.value.message


class ReachedPreparation(Exception):
    pass


@pytest.mark.parametrize("rank", ["0", "1"])
def test_behind_a_launcher_only_the_main_process_refuses_a_half_made_run_directory(rank, tmp_path, monkeypatch,
                                                                                   clean_environment):
    """CI, 2026-12-03: process 1 of an FSDP run started late, found the run folder the
    main process had just made with plan.json not yet in it, refused it as "not an
    llmcustoms run" and stopped the run. The launcher checked the folder already:
    only the main process looks again; the others go on to prepare their data."""
    from llmcustoms.commands import train as train_command

    half_made = tmp_path / "runs" / "run"
    half_made.mkdir(parents=True)
    (half_made / ".plan.json.tmp").write_text("{")  # the main process writing plan.json
    for name, value in (("WORLD_SIZE", "2"), ("LOCAL_RANK", rank), ("RANK", rank)):
        monkeypatch.setenv(name, value)

    def prepare_run(*args, **kwargs):
        raise ReachedPreparation

    monkeypatch.setattr(train_command, "prepare_run", prepare_run)
    session = train_command.Session.load({"output_dir": str(tmp_path / "runs"), "data": DATA_FILES["alpaca"]},
                                          None, quiet=True)
    refused = pytest.raises(ConfigError, match="is not an llmcustoms run")
    with refused if rank == "0" else pytest.raises(ReachedPreparation):
        train_command.train(session.train_options(), session, "run", False, True, lambda question: True)


def train_args(model: Path, output: Path, name: str, *extra: str) -> list[str]:
    return ["train", str(DATA_FILES["alpaca"]), "--model", str(model), "--max-steps", "40", "--save-every", "2",
            "--batch-size", "2", "--grad-accum", "1", "--output-dir", str(output), "--run-name", name, "--yes",
            "--quiet", *extra]


@pytest.mark.slow
def test_a_training_run_cannot_be_overwritten_resumed_or_started_again(tmp_path, tiny_models, cli):
    run = tmp_path / "run"
    # Steps 3 to 14 slowed: the run is still training while the other commands try it.
    env = {**os.environ, "COLUMNS": WIDE, "LLMCUSTOMS_FAULT_INJECT": ",".join(f"slow@{s}" for s in range(3, 15))}
    training = start_cli(*train_args(tiny_models["llama"], tmp_path, "run"), env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (run / "checkpoints" / "step-000002").exists() and time.time() < deadline:
            assert training.poll() is None, training.stderr.read()
            time.sleep(0.05)
        plan_before = (run / "plan.json").read_bytes()

        overwrite = cli(*train_args(tiny_models["llama"], tmp_path, "run", "--overwrite"))
        assert overwrite.returncode == 2, overwrite.stderr
        assert "in use by another llmcustoms command" in overwrite.stderr and "Traceback" not in overwrite.stderr
        assert (run / "plan.json").read_bytes() == plan_before and (run / "metrics.jsonl").exists()

        second = cli("resume", str(run), "--quiet")
        assert second.returncode == 2 and "being trained right now" in second.stderr, second.stderr
        latest = cli("resume", "--output-dir", str(tmp_path), "--quiet")  # the run in progress is not "unfinished"
        assert latest.returncode == 2 and "No unfinished run" in latest.stderr, latest.stderr

        # Refused before its data is read: a file with nothing usable would be an error of its own.
        broken = tmp_path / "broken.jsonl"
        broken.write_text("not json\n")
        args = train_args(tiny_models["llama"], tmp_path, "run")
        args[1] = str(broken)
        again = cli(*args)
        assert again.returncode == 2 and "in use by another llmcustoms command" in again.stderr, again.stderr
    finally:
        training.send_signal(signal.SIGINT)
        training.communicate(timeout=120)
    assert training.returncode == 130
    state = json.loads((run / "status.json").read_text())
    assert state["status"] == "interrupted"
    finished = cli("resume", str(run), "--quiet")
    assert finished.returncode == 0, finished.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == sorted(set(steps))  # no step written twice
