"""Nothing of the user's is ever deleted (issue 32), through the real CLI.

`--overwrite` removes only what llmcustoms made (a run directory, an earlier
export), never the run being exported, a folder above it, a folder holding the
data, a plain folder or a link's target; an export is put in place whole, so a
kill mid-export leaves the old one; the run lock holds through a link; closing
the terminal (SIGHUP) stops a run like SIGTERM, and `runs` does not call a run
whose process is gone `running`; a long model folder name makes a default run
name that is accepted.
"""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import DATA_FILES, run_cli, start_cli
from llmcustoms.runs import run_lock
from tiny_models import WIDE


def train_args(data: Path, model: Path, output_dir: Path, *extra: str) -> list[str]:
    return ["train", str(data), "--model", str(model), "--max-steps", "2", "--batch-size", "4", "--grad-accum", "1",
            "--eval-split", "0", "--yes", "--quiet", "--output-dir", str(output_dir), *extra]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_models) -> Path:
    """One finished run, trained on a copy of the data in a folder of its own
    (plan.json names it); tests copy the run rather than train again."""
    root = tmp_path_factory.mktemp("trained")
    data = root / "data" / "train.jsonl"
    data.parent.mkdir()
    shutil.copy(DATA_FILES["alpaca"], data)
    result = run_cli(*train_args(data, tiny_models["llama"], root / "runs", "--run-name", "done"), cwd=root)
    assert result.returncode == 0, result.stderr
    return root / "runs" / "done"


def contents(folder: Path) -> dict[str, object]:
    """Every path under `folder`, not following links: a file's bytes, a link's target."""
    found: dict[str, object] = {}
    for top, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(top) / name
            key = str(path.relative_to(folder))
            found[key] = ("link", os.readlink(path)) if path.is_symlink() else path.read_bytes() if path.is_file() else "dir"
    return found


def refused(result: subprocess.CompletedProcess, phrase: str) -> str:
    """The message of a user error (exit 2, no traceback), one line."""
    message = " ".join(result.stderr.split())
    assert result.returncode == 2, result.stderr
    assert phrase in message and "Traceback" not in result.stderr, message
    return message


# ------------------------------------------------- 1. export --overwrite

@pytest.mark.slow
def test_export_overwrite_never_removes_the_run_the_runs_beside_it_or_its_adapter(trained, tmp_path, cli,
                                                                                 clean_environment):
    runs = tmp_path / "runs"
    run = runs / "mine"
    shutil.copytree(trained, run)
    shutil.copytree(trained, runs / "sibling")
    before = contents(runs)
    for target in (run, runs, run / "adapter"):
        result = cli("export", str(run), "--output", str(target), "--overwrite")
        refused(result, "export never writes there, even with --overwrite")
        assert contents(runs) == before, target


@pytest.mark.slow
def test_export_overwrite_refuses_a_file_a_link_the_data_folder_and_a_folder_it_did_not_write(trained, tmp_path, cli,
                                                                                              clean_environment):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    sibling = tmp_path / "sibling"
    shutil.copytree(trained, sibling)
    link = tmp_path / "link"
    link.symlink_to(sibling)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model.safetensors").write_bytes(b"not llmcustoms'")
    data_folder = Path(json.loads((run / "plan.json").read_text())["data"]).parent  # the run's own data
    data_before = contents(data_folder)
    before = contents(tmp_path)
    for target, phrase in ((notes, "is a file"), (link, "is a symbolic link"),
                           (data_folder, "holds the training data"), (mine, "is not an export llmcustoms wrote")):
        result = cli("export", str(run), "--output", str(target), "--overwrite")
        assert "nothing was removed" in refused(result, phrase)
        assert contents(tmp_path) == before and contents(data_folder) == data_before, target
    assert link.is_symlink() and os.readlink(link) == str(sibling)


@pytest.mark.slow
def test_export_overwrite_replaces_its_own_export_whole_and_a_kill_mid_export_leaves_the_old_one(trained, tmp_path,
                                                                                                cli, clean_environment):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    out = tmp_path / "exported"
    assert cli("export", str(run), "--output", str(out)).returncode == 0
    (out / "added-later.txt").write_text("gone once the export is replaced")
    old = contents(out)
    visible = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    # A merge takes seconds: killed as soon as it starts writing (or, as it once did, deleting).
    merging = start_cli("export", str(run), "--output", str(out), "--merge", "--overwrite", stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while merging.poll() is None and time.time() < deadline:
        # Its partial or old folder (not its lock, taken just before): it has started writing.
        if any(p.name.startswith(".exported.") and p.name.endswith("-export") for p in tmp_path.iterdir()) \
                or not (out / "README.md").exists():
            merging.kill()
            break
        time.sleep(0.005)
    assert merging.wait(timeout=30) == -signal.SIGKILL, "the export ended before it could be killed"
    assert contents(out) == old  # the old export, whole
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == visible
    # The next export clears what the killed one left, and replaces its own earlier export.
    again = cli("export", str(run), "--output", str(out), "--overwrite")
    assert again.returncode == 0, again.stderr
    assert not (out / "added-later.txt").exists()  # replaced whole, not written over
    assert (out / ".llmcustoms-export").exists() and (out / "adapter_config.json").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".exported.")]


# ------------------------------------------------- 2. train --overwrite

def test_train_overwrite_never_removes_a_folder_holding_the_data_or_one_it_did_not_make(tmp_path, tiny_models, cli,
                                                                                       clean_environment):
    project = tmp_path / "project"
    project.mkdir()
    data = project / "train.jsonl"
    shutil.copy(DATA_FILES["alpaca"], data)
    (project / "notes.txt").write_text("my notes")
    before = contents(tmp_path / "project")
    args = ["train", str(data), "--model", str(tiny_models["llama"]), "--max-steps", "1", "--eval-split", "0",
            "--yes", "--quiet", "--output-dir", str(tmp_path)]
    refused(cli(*args, "--run-name", "project", "--overwrite"), "holds the training data")
    assert contents(project) == before
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"a cat")
    for extra in ([], ["--overwrite"]):
        message = refused(cli(*args, "--run-name", "photos", *extra), "is not an llmcustoms run")
        assert "pass --overwrite" not in message  # it would not help
        assert (other / "cat.jpg").read_bytes() == b"a cat"
    assert contents(project) == before


@pytest.mark.slow
def test_train_overwrite_never_follows_a_link_nor_removes_a_run_holding_the_data(trained, tmp_path, tiny_models, cli,
                                                                                clean_environment):
    runs = tmp_path / "runs"
    shutil.copytree(trained, runs / "sibling")
    (runs / "link").symlink_to(runs / "sibling")
    shutil.copytree(trained, runs / "old")
    data = runs / "old" / "train.jsonl"  # the data kept inside an old run
    shutil.copy(DATA_FILES["alpaca"], data)
    before = contents(runs)
    args = ["train", str(data), "--model", str(tiny_models["llama"]), "--max-steps", "1", "--eval-split", "0",
            "--yes", "--quiet", "--output-dir", str(runs), "--overwrite"]
    refused(cli(*args, "--run-name", "link"), "is a symbolic link")
    refused(cli(*args, "--run-name", "old"), "holds the training data")
    assert contents(runs) == before


# ------------------------------------------------- 3. the lock through a link

@pytest.mark.slow
def test_a_run_locked_by_its_real_path_is_refused_through_a_link(trained, tmp_path, cli, clean_environment):
    real = tmp_path / "runs" / "real"
    shutil.copytree(trained, real)
    status = json.loads((real / "status.json").read_text())
    (real / "status.json").write_text(json.dumps({**status, "status": "interrupted"}))  # resumable
    link = tmp_path / "link"
    link.symlink_to(real)
    before = contents(real)
    with run_lock.owning(real, "testing"):
        result = cli("resume", str(link), "--quiet")
    refused(result, f"is being trained right now (process {os.getpid()})")
    assert contents(real) == before


# ------------------------------------------------- 19. SIGHUP, and runs whose owner is gone

@pytest.fixture(scope="module")
def hung_up(tmp_path_factory, tiny_models) -> tuple[Path, int, str]:
    """A run from a model folder with a long name, under its default name, on a
    terminal (a pty) that is closed inside its step 3 and sends SIGHUP twice (the
    shell's and the kernel's): the run directory, the exit code, what it printed."""
    root = tmp_path_factory.mktemp("hung_up")
    model = root / ("tiny-llama-" + "x" * 230)
    model.symlink_to(tiny_models["llama"])
    args = train_args(DATA_FILES["alpaca"], model, root / "runs", "--max-steps", "6", "--save-every", "100")
    env = {**os.environ, "COLUMNS": WIDE, "LLMCUSTOMS_FAULT_INJECT": "slow@3"}  # step 3 is long: it is in it
    terminal, its_end = pty.openpty()
    args.remove("--quiet")  # the live display, on the terminal
    process = subprocess.Popen([sys.executable, "-m", "llmcustoms", *args], cwd=root, env=env, stdin=its_end,
                               stdout=its_end, stderr=its_end, start_new_session=True)
    os.close(its_end)
    shown = bytearray()
    reader = threading.Thread(target=_read_all, args=(terminal, shown), daemon=True)
    reader.start()
    deadline = time.time() + 180
    while '"step": 2,' not in "".join(p.read_text() for p in root.glob("runs/*/metrics.jsonl")):
        assert process.poll() is None and time.time() < deadline, shown.decode(errors="replace")
        time.sleep(0.05)
    os.close(terminal)  # the terminal window is closed
    for _ in range(2):
        process.send_signal(signal.SIGHUP)
        time.sleep(0.2)
    process.wait(timeout=60)
    (run,) = (root / "runs").glob("*/plan.json")
    return run.parent, process.returncode, shown.decode(errors="replace")


def _read_all(fd: int, into: bytearray) -> None:
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # closed
            return
        if not data:
            return
        into.extend(data)


@pytest.mark.slow
def test_sighup_stops_a_run_like_sigterm_with_a_checkpoint_of_the_last_step(hung_up):
    run, code, shown = hung_up
    assert code == 128 + signal.SIGHUP, (run / "train.log").read_text()
    status = json.loads((run / "status.json").read_text())
    assert (status["status"], status["reason"]) == ("interrupted", "stopped by SIGHUP") and status["step"] >= 2
    assert (run / "checkpoints" / f"step-{status['step']:06d}").is_dir()  # not due (--save-every 100): the stop wrote it
    assert not (run / "failure.json").exists()  # the closed terminal is no bug
    assert f"Continue with: llmcustoms resume {run}" in (run / "train.log").read_text()


def test_runs_shows_a_run_whose_process_is_gone_as_stopped(tmp_path, cli, clean_environment):
    for name in ("gone", "live"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "plan.json").write_text(json.dumps({"model": "tiny", "method": "lora", "total_steps": 4}))
        (tmp_path / name / "status.json").write_text(json.dumps({"status": "running", "step": 2, "pid": 1}))
    with run_lock.owning(tmp_path / "live", "testing"):  # this process trains "live"; nothing owns "gone"
        result = cli("runs", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.split()[:1] in (["gone"], ["live"])}
    assert "stopped" in rows["gone"] and "running" not in rows["gone"], result.stdout
    assert "running" in rows["live"], result.stdout


# ------------------------------------------------- 22. a long model folder name

@pytest.mark.slow
def test_a_long_model_folder_name_makes_a_default_run_name_that_is_accepted(hung_up):
    run, code, shown = hung_up  # trained without --run-name until the SIGHUP
    assert "--run-name" not in shown and (run / "metrics.jsonl").exists()
    assert len(run.name.encode()) <= 100, run.name
    # The model part cut short, with a hash of the whole; the preset and the time kept.
    assert re.fullmatch(r"tiny-llama-x+-[0-9a-f]{8}-quality-\d{8}-\d{6}", run.name), run.name
