"""Checks before a weight loads or a file is written: that the installed torch
can use the GPUs this machine has, and that a run (or an export) fits on its disk;
while it trains, that the next checkpoint does, and what to say when the disk is full.

The arithmetic and the messages are planning's (`hardware.usable_by_torch`,
`planning/disk_space.py`); here are the readings they need from the machine. Torch is
imported only when NVML found a GPU, so `plan` and `hardware` on a machine
without one never pay for importing it.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import traceback
from pathlib import Path
from typing import Any

from llmcustoms.errors import ConfigError
from llmcustoms.planning import disk_space, hardware
from llmcustoms.planning.hardware import Hardware, usable_by_torch
from llmcustoms.recovery import faults
from llmcustoms.runs.checkpoints import CheckpointManager
from llmcustoms.runs.disk_writes import disk_full_code
from llmcustoms.runs.run_directory import RunDirectory
from llmcustoms.training import launching

# The modules that write a run's large files, and what they write.
WRITERS = {"best_weights": "the best weights in best/", "checkpoints": "a checkpoint in checkpoints/",
           "loading": "the trained weights", "dpo_reference": "the reference log-probabilities"}
# A temp file of `disk_writes.replace_file` (.NAME.PID.THREAD.tmp) or of best_weights (.NAME.PID.tmp).
TEMP_NAME = re.compile(r"^\.(.+?)(?:\.\d+){1,2}\.tmp$")


def usable_hardware() -> Hardware:
    """This machine as training will use it: `hardware.detect()` without the
    GPUs the installed torch cannot use (its `torch_note` says why)."""
    found = hardware.detect()  # through the module: tests give it the machines we do not have
    if not found.has_gpu:
        return found
    import torch

    return usable_by_torch(found, torch.cuda.is_available(), torch.__version__, torch.version.cuda)


def _existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists: where it will be."""
    existing = Path(path).absolute()
    while not existing.exists():
        existing = existing.parent
    return existing


def free_space(path: Path) -> int:
    """Bytes this user may still write on the disk `path` is on (or will be on:
    the disk of its nearest existing parent)."""
    return shutil.disk_usage(_existing(path)).free


def mount_point(path: Path) -> str:
    """Where the file system that `path` is on (or will be on) is mounted."""
    current = _existing(path)
    while not os.path.ismount(current):
        current = current.parent
    return str(current)


def _free_for_run(run_path: Path, step: int | None) -> int:
    """The free space of a run's disk; none from the step a `diskfull` fault
    names on (`step` None, for `resume`'s check: as soon as one is set)."""
    full_from = faults.disk_full_from()
    if full_from is not None and (step is None or step >= full_from):
        return 0
    return free_space(run_path)


def bytes_under(path: Path) -> int:
    """Bytes in the files under `path`; 0 when it does not exist."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue  # removed while we counted
    return total


def check_disk_space(plan: Any, run_path: Path, model_params: int = 0, resuming: bool = False) -> str | None:
    """Stop (exit 2) before anything is written when the run's files cannot fit
    on the disk of `run_path`; what is in it already counts as room (a resumed
    run's own checkpoints, a run --overwrite replaces). Returns a warning for
    the plan when a later `export --merge` (of a model of `model_params`) would
    not fit, else None. Only the main process writes, so only it checks.

    A resumed run must also have room for its next checkpoint: near its end,
    what the run directory holds may count for all the rest, on a disk that
    is still full."""
    if not launching.is_main_process():
        return None
    free = _free_for_run(run_path, None) if resuming else free_space(run_path)
    warning = disk_space.check_run_fits(plan, free, bytes_under(run_path), str(run_path), model_params, resuming)
    if resuming:
        disk_space.check_checkpoint_fits(next_checkpoint_room(run_path)[1], free, str(run_path))
    return warning


def check_export_space(output: Path, needed: int, what: str, dtype: str = "") -> None:
    """Stop (exit 2) before `export` writes `needed` bytes into `output` when its disk cannot take them."""
    disk_space.check_export_fits(needed, free_space(output), str(output), what, dtype)


# ------------------------------------------------------ while a run trains

def next_checkpoint_room(run_path: Path) -> tuple[int | None, int]:
    """The size of the newest checkpoint of the run in `run_path` (None before
    the first), and the room the next one asks for: that size (the plan's
    estimate before the first) with a margin (`disk_space.checkpoint_room`)."""
    run = RunDirectory(run_path)
    newest = CheckpointManager(run.checkpoints_path, keep=1).all()
    last = bytes_under(newest[0].path) if newest else None
    return last, disk_space.checkpoint_room(last, None if newest else _plan(run))


def checkpoint_need(run_path: Path, step: int) -> tuple[str, int]:
    """The checkpoint of `step` as a message names it, and the room it asks for."""
    last, room = next_checkpoint_room(run_path)
    about = f" (about {disk_space.size(last)}, as the last one)" if last else ""
    return f"checkpoint step-{step:06d}{about}", room


def checkpoint_shortfall(run_path: Path, step: int, writing: str, needed: int) -> dict[str, Any] | None:
    """Before `writing` (`checkpoint_need`) is written: the disk-full report
    (kind "disk_full") when the disk of `run_path` has less than `needed` free; else None."""
    free = _free_for_run(run_path, step)
    return disk_full_report(run_path, step, writing, needed, free=free) if needed > free else None


def disk_full_failure(error: BaseException, run_path: Path, step: int, writing: str | None = None,
                      needed: int | None = None) -> dict[str, Any] | None:
    """When `error` is a full disk (or quota), anywhere in a run: its report,
    once what this process left half-written is removed (`remove_partial_files`:
    its room is free again). None for any other error. `step`: the last
    finished; `writing`, `needed`: what was being written (default: as the
    error names it), and its size (default: the rest of the run's need)."""
    if disk_full_code(error) is None:
        return None
    remove_partial_files(run_path)
    return disk_full_report(run_path, step, writing or _written(error, run_path), needed, error=error)


def as_disk_full(failed: Any, run_dir: RunDirectory) -> None:
    """An unexpected error's `TrainingFailed` (`Processes.failure`) that is a full
    disk becomes one: its report the full disk's, in status.json too."""
    if failed.__cause__ is None or failed.report["kind"] != "error":
        return
    step = max(0, failed.report["step"] - 1)  # `Processes.failure` names the step being trained
    full = disk_full_failure(failed.__cause__, run_dir.path, step)
    if full is not None:
        failed.report = full
        run_dir.write_status("failed", step=step, reason=full["reason"], suggestions=full["suggestions"])


def disk_full_report(run_path: Path, step: int, writing: str, needed: int | None = None,
                     error: BaseException | None = None, free: int | None = None) -> dict[str, Any]:
    """A full disk's report (`disk_space.DiskFull`): what `writing` needed (None:
    not known, so the rest of the run's need), what is free and where, the last
    good checkpoint, and the system's words from `error`."""
    run = RunDirectory(run_path)
    plan = _plan(run)
    to_finish = disk_space.rest_of_run(plan, bytes_under(run_path))
    code = disk_full_code(error)
    last = CheckpointManager(run.checkpoints_path, keep=1).latest()
    return disk_space.DiskFull(step=step, writing=writing, needed=needed if needed is not None else to_finish,
                              free=free if free is not None else _free_for_run(run_path, step),
                              where=str(run_path), filesystem=mount_point(run_path),
                              last_checkpoint=last.step if last else None, to_finish=to_finish,
                              error=os.strerror(code) if code else "", quota=code == errno.EDQUOT,
                              whole_run=needed is None).report()


def remove_partial_files(run_path: Path) -> None:
    """What this process left half-written in a run directory: a checkpoint's
    temporary directory, a best-weights file, a JSON file's temp."""
    pid = os.getpid()
    for pattern in (f"checkpoints/.tmp-*-{pid}", f"best/.*.{pid}.tmp", f".*.{pid}.*.tmp"):
        for leftover in Path(run_path).glob(pattern):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)


def _plan(run: RunDirectory) -> Any:
    """The run's plan, or None when plan.json cannot be read: an estimate is then not made."""
    try:
        return run.read_plan()
    except ConfigError:
        return None


def _written(error: BaseException, run_path: Path) -> str:
    """What a full disk stopped, as `error` (or one it came from) says: the file
    of the run directory it names, else the module of ours that was writing."""
    run = Path(run_path).absolute()
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and not any(current is seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    for name in (e.filename for e in chain if isinstance(e, OSError) and e.filename is not None):
        parts = Path(os.fsdecode(name)).absolute().parts
        if parts[:len(run.parts)] == run.parts and len(parts) > len(run.parts):
            inside = Path(*parts[len(run.parts):])
            temp = TEMP_NAME.match(inside.name)  # a file's temp name: the file it was to become
            return str(inside.parent / temp.group(1)) if temp else str(inside)
    for link in chain:  # safetensors' errors name no file: who was writing does
        files = [Path(frame.f_code.co_filename) for frame, _ in traceback.walk_tb(link.__traceback__)]
        modules = [file.stem for file in files if "llmcustoms" in file.parent.parts]
        for module in reversed(modules):
            if module in WRITERS:
                return WRITERS[module]
    return "the run's files"
