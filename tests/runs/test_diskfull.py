"""A full disk is a classified failure that loses nothing: status writes never
crash, a checkpoint that cannot be written (found before writing it, or
filling the disk while written) ends the run with exit 1, status.json
`failed` saying how much room is needed and free, no half-written files and
the earlier checkpoints intact; `resume` on a disk still full is one message
(exit 2), and after room is made it ends as the uninterrupted run does.

Without root no real disk can be filled: a temp file's write raises ENOSPC
(`fill_the_disk`), safetensors' own error is raised in its place, and
`LLMCUSTOMS_FAULT_INJECT=diskfull@N` makes the free-space checks read a full disk."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import SafetensorError

from conftest import run_cli
from tiny_models import WIDE
from llmcustoms.runs import disk_writes as diskwrites
from llmcustoms.training import preflight
from llmcustoms.runs.checkpoints import CheckpointManager
from llmcustoms.planning.disk_space import CHECKPOINT_MARGIN_BYTES, MIB, DiskFull
from llmcustoms.runs.disk_writes import disk_full_code
from llmcustoms.errors import ConfigError
from llmcustoms.runs.failure_report import classify
from llmcustoms.recovery.faults import disk_full_from
from llmcustoms.runs.run_directory import RunDirectory
from llmcustoms.runs.run_log import RunLog
from test_checkpoints import plan, save
from test_recovery import adapter, max_difference, status, train_args

NO_SPACE = "Error while serializing: I/O error: No space left on device (os error 28)"  # safetensors' words


def fill_the_disk(monkeypatch) -> None:
    """From now on no new file can be written: a temp file is created, as on a
    full disk, and writing it raises ENOSPC. An existing file's blocks still take writes."""
    def full_open(file, mode="r", *args, **kwargs):
        if str(file).endswith(".tmp") and "w" in mode:
            open(file, mode, *args, **kwargs).close()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        return open(file, mode, *args, **kwargs)

    monkeypatch.setattr(diskwrites, "open", full_open, raising=False)


def leftovers(run: Path) -> list[str]:
    return sorted(p.name for p in run.rglob(".*") if p.name.startswith((".tmp-", ".old-")) or p.name.endswith(".tmp"))


# ---------------------------------------------------------- status and logs

def test_a_status_write_on_a_full_disk_never_raises_and_writes_what_fits(tmp_path, capsys, monkeypatch):
    run = RunDirectory(tmp_path / "run")
    run.path.mkdir()
    run.write_status("running", step=3)
    room = os.stat(run.status_path).st_blocks * 512  # what status.json has: its blocks
    fill_the_disk(monkeypatch)
    # status.json is written over its old content, in the room it already has.
    run.write_status("failed", step=4, reason="disk full")
    assert json.loads(run.status_path.read_text())["status"] == "failed"
    assert leftovers(run.path) == [] and capsys.readouterr().err == ""
    # Too large for that room: what is needed to know how the run stands, without what only `report` shows.
    run.write_status("failed", step=4, reason="still full", data={"advice": ["x" * room]})
    written = json.loads(run.status_path.read_text())
    assert (written["status"], written["step"], written["reason"]) == ("failed", 4, "still full")
    assert "data" not in written and leftovers(run.path) == []
    # Not even that fits: it keeps what it held, and stderr says so, once.
    for _ in range(2):
        run.write_status("interrupted", step=5, reason="r" * room)
    assert json.loads(run.status_path.read_text())["reason"] == "still full"
    err = capsys.readouterr().err
    assert err.count("could not be written (No space left on device)") == 1 and "status.json" in err
    assert leftovers(run.path) == []


class FullAfter:
    """`os` for disk_writes, whose `write` takes `room` more bytes, then raises ENOSPC."""

    def __init__(self, room: int):
        self.room = room

    def __getattr__(self, name: str):
        return getattr(os, name)

    def write(self, fd: int, data: bytes) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        taken = os.write(fd, data[:self.room])
        self.room -= taken
        return taken


def test_appended_rows_are_whole_or_absent_on_a_full_disk(tmp_path, monkeypatch, capsys):
    run = RunDirectory(tmp_path)
    step_row = {"step": 1, "loss": 1.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0}
    run.append_metrics(step_row)
    first = {"step": 2, "row": 0, "label": "trained", "prompt": "p", "reply": "a"}
    second = {**first, "row": 1, "reply": "b" * 60}
    room = len(json.dumps(first)) + 1 + 20  # the next row fits, the one after it only in part
    monkeypatch.setattr(diskwrites, "os", FullAfter(room=room))
    run.append_samples([first, second])
    run.append_metrics({**step_row, "step": 2, "loss": 0.5})
    monkeypatch.undo()
    assert run.read_samples() == [first]
    assert run.read_metrics() == [step_row]
    assert run.samples_path.read_text().endswith("\n")  # nothing glued onto the next row
    err = capsys.readouterr().err
    assert "samples.jsonl could not be written" in err and "metrics.jsonl could not be written" in err
    run.append_metrics({**step_row, "step": 2, "loss": 0.5})  # room again
    assert run.read_metrics() == [step_row, {**step_row, "step": 2, "loss": 0.5}]


def test_train_log_leaves_lines_out_while_the_disk_is_full_and_goes_on_after(tmp_path, monkeypatch):
    warnings = []
    log = RunLog(tmp_path / "train.log", warnings.append)
    log.write("info", "step 1")
    monkeypatch.setattr(diskwrites, "os", FullAfter(room=10))
    log.write("info", "step 2")
    log.write("info", "step 3")
    monkeypatch.undo()
    log.write("error", "failed: the disk filled up")
    lines = (tmp_path / "train.log").read_text().splitlines()
    assert [line.split(maxsplit=2)[2] for line in lines] == ["step 1", "failed: the disk filled up"]
    assert len(warnings) == 1 and "while the disk is full" in warnings[0]


def test_status_written_from_two_threads_at_once_never_collides(tmp_path):
    """A signal-watching thread writes status.json too: each thread has its own temp file."""
    run = RunDirectory(tmp_path)
    errors = []

    def write(name: str) -> None:
        try:
            for step in range(150):
                run.write_status("running", step=step, writer=name)
        except Exception as error:  # a shared temp name: one thread's rename takes the other's file
            errors.append(error)

    threads = [threading.Thread(target=write, args=(name,)) for name in ("loop", "signals")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and run.read_status()["step"] == 149 and leftovers(tmp_path) == []


# -------------------------------------------------------------- checkpoints

def test_a_checkpoint_that_fills_the_disk_leaves_nothing_and_the_earlier_ones_intact(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, keep=3)
    earlier = save(manager, 3)
    import safetensors.torch

    real = safetensors.torch.save_file

    def fills_the_disk(tensors, filename, metadata=None):
        if filename.endswith("optimizer.safetensors"):  # after model.safetensors was written
            raise SafetensorError(NO_SPACE)
        return real(tensors, filename, metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", fills_the_disk)
    with pytest.raises(SafetensorError):
        save(manager, 6)
    assert [c.step for c in manager.all()] == [3] and leftovers(tmp_path) == []
    assert manager.verify(earlier.path) is None


def test_the_check_before_a_checkpoint_asks_for_the_last_ones_size_and_a_margin(tmp_path, monkeypatch):
    run = RunDirectory(tmp_path / "run")
    save(CheckpointManager(run.checkpoints_path, keep=3), 3)
    last = preflight.bytes_under(run.checkpoints_path / "step-000003")
    writing, needed = preflight.checkpoint_need(run.path, 6)
    assert writing.startswith("checkpoint step-000006 (about ")
    assert last + CHECKPOINT_MARGIN_BYTES < needed < 2 * last + CHECKPOINT_MARGIN_BYTES
    monkeypatch.setattr(preflight, "free_space", lambda path: needed)
    assert preflight.checkpoint_shortfall(run.path, 6, writing, needed) is None
    monkeypatch.setattr(preflight, "free_space", lambda path: needed - 1)
    report = preflight.checkpoint_shortfall(run.path, 6, writing, needed)
    assert report["kind"] == "disk_full" and report["step"] == 6
    assert "not enough disk space after step 6 for checkpoint step-000006" in report["reason"]
    assert "the last good checkpoint is step-000003" in report["reason"]
    assert f"`llmcustoms resume {run.path}`" in report["suggestions"][0]
    assert not (run.checkpoints_path / "step-000006").exists()  # checked before anything is written


def test_resume_needs_room_for_its_next_checkpoint_even_when_the_rest_seems_to_fit(tmp_path, monkeypatch):
    """Near its end a run's directory holds nearly all it will: it may seem to fit on a disk still full."""
    run = RunDirectory(tmp_path / "run")
    save(CheckpointManager(run.checkpoints_path, keep=3), 9)
    monkeypatch.setattr(preflight, "free_space", lambda path: MIB)
    with pytest.raises(ConfigError) as refused:
        preflight.check_disk_space(plan(), run.path, resuming=True)
    said = refused.value.message
    assert "Not enough disk space to resume this run: its next checkpoint needs about 16 MiB free" in said
    assert "has 1 MiB free" in said and "resume the run again" in refused.value.hint
    monkeypatch.setattr(preflight, "free_space", lambda path: 100 * MIB)
    assert preflight.check_disk_space(plan(), run.path, resuming=True) is None
    monkeypatch.setenv("LLMCUSTOMS_FAULT_INJECT", "diskfull@20")  # the disk reads as full for `resume`
    with pytest.raises(ConfigError):
        preflight.check_disk_space(plan(), run.path, resuming=True)


def test_what_a_full_disk_report_says():
    full = DiskFull(step=9, writing="checkpoint step-000009", needed=40 * MIB, free=2 * MIB, where="runs/r",
                    filesystem="/data", last_checkpoint=6, to_finish=300 * MIB, error="No space left on device")
    report = full.report()
    assert report["reason"] == ("the disk filled up after step 9 while writing checkpoint step-000009 (No space left "
                                "on device): it needs 40 MiB free and the disk of runs/r has 2 MiB free; the last "
                                "good checkpoint is step-000006")
    # Enough for `resume`'s own check, which wants the rest of the run to fit.
    assert report["suggestions"][0] == ("free at least 298 MiB (what the rest of the run needs) on /data (the file "
                                        "system of runs/r), then `llmcustoms resume runs/r`")
    quota = DiskFull(step=0, writing="plan.json", needed=40 * MIB, free=900 * MIB, where="runs/r", filesystem="/home",
                     last_checkpoint=None, error="Disk quota exceeded", quota=True).report()
    assert "your disk quota on /home is used up" in quota["reason"] and "900 MiB" not in quota["reason"]
    assert "there is no checkpoint yet" in quota["reason"] and "quota -s" in quota["suggestions"][1]


def test_a_full_disk_outside_the_loop_ends_the_run_the_same_way(tmp_path):
    """Writing the adapter after the last step: `train._record_escaped`."""
    from llmcustoms.recovery.recovery_system import TrainingFailed
    from llmcustoms.commands.train import _record_escaped

    run = RunDirectory(tmp_path / "run")
    run.path.mkdir()
    run.write_status("running", step=12)
    save(CheckpointManager(run.checkpoints_path, keep=3), 12)
    half_written = run.path / f".plan.json.{os.getpid()}.{threading.get_ident()}.tmp"
    half_written.write_text("{")
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(run.path / "adapter" / "adapter_model.safetensors"))
    except OSError as raised:
        error = raised
        with pytest.raises(TrainingFailed) as failed:
            _record_escaped(error, SimpleNamespace(plan=plan(), position=SimpleNamespace(step=12)), run,
                            RunLog(run.log_path))
    assert failed.value.report["kind"] == "disk_full" and failed.value.__cause__ is error
    state = run.read_status()
    assert state["status"] == "failed" and state["step"] == 12
    assert state["reason"].startswith("the disk filled up after step 12 while writing "
                                      "adapter/adapter_model.safetensors (No space left on device)")
    assert "the last good checkpoint is step-000012" in state["reason"] and leftovers(run.path) == []
    assert state["suggestions"][0].startswith("free some space on ")  # this plan has no estimate of the rest
    assert json.loads(run.failure_path.read_text())["failure"] == "disk_full"


def test_a_full_disk_found_as_an_unexpected_error_in_the_loop_is_said_as_one(tmp_path, monkeypatch):
    """The best weights of an evaluation could not be written: `Processes.failure`
    made it a bug's report; `train._say_failed` says it is a full disk."""
    import safetensors.torch

    from llmcustoms.runs.best_weights import BestWeightFiles
    from llmcustoms.runs.failure_report import describe
    from llmcustoms.recovery.recovery_system import TrainingFailed, create_failure_report
    from llmcustoms.commands.train import _say_failed

    run = RunDirectory(tmp_path / "run")
    run.path.mkdir()

    def fills_the_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half")
        raise SafetensorError(NO_SPACE)

    monkeypatch.setattr(safetensors.torch, "save_file", fills_the_disk)
    try:
        BestWeightFiles(run.best_path).keep(6, {"w": torch.zeros(2)}, 1.5)
    except SafetensorError as error:
        failed = TrainingFailed(create_failure_report("error", plan(), 7, describe(error)))
        failed.__cause__ = error
    run.write_status("failed", step=6, reason=failed.report["reason"])
    _say_failed(failed, plan(), run, RunLog(run.log_path), main=True)
    assert failed.report["kind"] == "disk_full"
    state = run.read_status()
    assert state["reason"].startswith("the disk filled up after step 6 while writing the best weights in best/")
    assert "there is no checkpoint yet" in state["reason"] and leftovers(run.path) == []


def test_a_full_disk_is_recognised_and_classified_whatever_raised_it():
    assert disk_full_code(SafetensorError(NO_SPACE)) == errno.ENOSPC
    assert disk_full_code(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))) == errno.EDQUOT
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("saving failed") from inner
    except RuntimeError as outer:
        assert disk_full_code(outer) == errno.ENOSPC and classify(outer) == "disk_full"
    assert disk_full_code(RuntimeError("boom")) is None and classify(RuntimeError("boom")) == "bug"
    assert classify(None, "disk_full") == "disk_full"


def test_the_diskfull_fault_names_the_step_the_disk_fills_at():
    assert disk_full_from("oom@2, diskfull@9,diskfull@7") == 7
    assert disk_full_from("oom@2") is None and disk_full_from("") is None


# ---------------------------------------------------------- end to end (CLI)

# Runs `llmcustoms ARGS` with safetensors failing as a full disk does while
# checkpoint step-000009's optimizer file is written (its model file was).
FILLS_AT_CHECKPOINT_9 = f"""
import sys
import safetensors.torch
from safetensors import SafetensorError

real = safetensors.torch.save_file

def save_file(tensors, filename, metadata=None):
    if "/.tmp-step-000009-" in filename and filename.endswith("optimizer.safetensors"):
        raise SafetensorError({NO_SPACE!r})
    return real(tensors, filename, metadata)

safetensors.torch.save_file = save_file
from llmcustoms.cli import main
sys.argv = ["llmcustoms", *sys.argv[1:]]
main()
"""


@pytest.fixture(scope="module")
def uninterrupted(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    result = run_cli(*train_args(tiny_models["llama"], root, "run", 0.1))
    assert result.returncode == 0, result.stderr
    return adapter(root / "run")


def assert_stopped_cleanly(run: Path, result: subprocess.CompletedProcess, said: str) -> dict:
    """Exit 1, one failure panel and no traceback, status.json failed saying so,
    failure.json's class, nothing half-written, the checkpoints before intact."""
    err = " ".join(result.stderr.split())
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and said in err and "Training stopped" in err
    state = status(run)
    assert state["status"] == "failed" and said in state["reason"] and "free" in state["reason"]
    assert "the last good checkpoint is step-000006" in state["reason"]
    assert f"llmcustoms resume {run}" in state["suggestions"][0]
    assert json.loads((run / "failure.json").read_text())["failure"] == "disk_full"
    checkpoints = CheckpointManager(run / "checkpoints", keep=3)
    assert [c.step for c in checkpoints.all()] == [6, 3]
    assert all(checkpoints.verify(c.path) is None for c in checkpoints.all()) and leftovers(run) == []
    return state


@pytest.mark.slow
def test_a_full_disk_found_before_a_checkpoint_stops_cleanly_and_resume_goes_on_exactly(tmp_path, tiny_models,
                                                                                         uninterrupted, cli):
    run = tmp_path / "run"
    full = {"LLMCUSTOMS_FAULT_INJECT": "diskfull@7"}  # the check before step 9's checkpoint reads a full disk
    stopped = cli(*train_args(tiny_models["llama"], tmp_path, "run", 0.1), env=full)
    state = assert_stopped_cleanly(run, stopped, "not enough disk space after step 9 for checkpoint step-000009")
    assert state["step"] == 9 and "0 KiB free" in state["reason"]
    still_full = cli("resume", str(run), env=full)
    assert still_full.returncode == 2 and "Traceback" not in still_full.stderr
    assert "Not enough disk space to finish this run" in " ".join(still_full.stderr.split())
    assert status(run)["status"] == "failed"
    freed = cli("resume", str(run), "--quiet")
    assert freed.returncode == 0, freed.stderr
    assert status(run)["status"] == "completed"
    assert max_difference(adapter(run), uninterrupted) <= 1e-5


@pytest.mark.slow
def test_a_checkpoint_that_fills_the_disk_ends_the_run_cleanly_and_resume_goes_on_exactly(tmp_path, tiny_models,
                                                                                          uninterrupted):
    run = tmp_path / "run"
    stopped = subprocess.run([sys.executable, "-c", FILLS_AT_CHECKPOINT_9,
                              *train_args(tiny_models["llama"], tmp_path, "run", 0.1)],
                             env={**os.environ, "COLUMNS": WIDE}, capture_output=True, text=True, timeout=300)
    assert_stopped_cleanly(run, stopped, "the disk filled up after step 9 while writing checkpoint step-000009")
    assert "No space left on device" in status(run)["reason"]
    freed = run_cli("resume", str(run), "--quiet")
    assert freed.returncode == 0, freed.stderr
    assert max_difference(adapter(run), uninterrupted) <= 1e-5


# A real full disk, where user namespaces allow a tmpfs to be mounted without
# root: the run's disk is filled to the last byte once its first checkpoint
# exists (step 5 is slowed so that happens mid-run), then freed after `resume`
# has been refused. Run inside the namespace, since the mount exists only there;
# what the test checks is copied out to OUT.
ON_A_FULL_DISK = r"""
mount -t tmpfs -o size=80m tmpfs "$DISK" || exit 97
"$PYTHON" -m llmcustoms "$@" --output-dir "$DISK" > /dev/null 2> "$OUT/train.err" &
pid=$!
while [ ! -d "$DISK/run/checkpoints/step-000003" ] && kill -0 $pid 2> /dev/null; do sleep 0.05; done
head -c "$(df -B1 --output=avail "$DISK" | tail -1)" /dev/zero > "$DISK/filler" 2> /dev/null
wait $pid; echo $? > "$OUT/train.rc"
cp "$DISK/run/status.json" "$OUT/status.json"; cp -r "$DISK/run/checkpoints" "$OUT/checkpoints"
find "$DISK/run" -name '.*' > "$OUT/hidden.txt"
export LLMCUSTOMS_FAULT_INJECT=
"$PYTHON" -m llmcustoms resume "$DISK/run" > /dev/null 2> "$OUT/full.err"; echo $? > "$OUT/full.rc"
rm "$DISK/filler"
"$PYTHON" -m llmcustoms resume "$DISK/run" --quiet > /dev/null 2> "$OUT/freed.err"; echo $? > "$OUT/freed.rc"
cp -r "$DISK/run/adapter" "$OUT/adapter"
"""


def user_namespaces_mount(tmp_path: Path) -> bool:
    (tmp_path / "probe").mkdir()
    try:
        probe = subprocess.run(["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs",
                                str(tmp_path / "probe")], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@pytest.mark.slow
def test_a_real_full_disk_mid_run_is_a_classified_failure_and_loses_nothing(tmp_path, tiny_models, uninterrupted):
    if not user_namespaces_mount(tmp_path):
        pytest.skip("no user namespaces here: a tmpfs cannot be mounted without root")
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    args = [a for a in train_args(tiny_models["llama"], tmp_path, "run", 0.1) if a != str(tmp_path)]
    args.remove("--output-dir")
    subprocess.run(["unshare", "-rm", "bash", "-c", ON_A_FULL_DISK, "full-disk", *args], timeout=600, check=True,
                   env={**os.environ, "COLUMNS": WIDE, "DISK": str(disk), "OUT": str(out), "PYTHON": sys.executable,
                        "LLMCUSTOMS_FAULT_INJECT": "slow@5"})
    err = (out / "train.err").read_text()
    assert (out / "train.rc").read_text().strip() == "1", err
    assert "Traceback" not in err and "Training stopped" in err
    state = json.loads((out / "status.json").read_text())
    assert state["status"] == "failed" and "free" in state["reason"], state
    assert "disk" in state["reason"] and "the last good checkpoint is step-000003" in state["reason"]
    checkpoints = CheckpointManager(out / "checkpoints", keep=3)
    assert [c.step for c in checkpoints.all()] == [3] and checkpoints.verify(checkpoints.all()[0].path) is None
    assert (out / "hidden.txt").read_text() == ""  # no temp file, no half checkpoint
    full = (out / "full.err").read_text()
    assert (out / "full.rc").read_text().strip() == "2" and "Traceback" not in full
    assert "Not enough disk space to finish this run" in " ".join(full.split())
    assert (out / "freed.rc").read_text().strip() == "0", (out / "freed.err").read_text()
    assert max_difference(adapter(out), uninterrupted) <= 1e-5
