"""Checks before a weight loads or a file is written: that the installed torch
can use the GPUs this machine has, and that a run (or an export) fits on its disk.

The arithmetic and the messages are planning's (`hardware.usable_by_torch`,
`diskspace.py`); here are the readings they need from the machine. Torch is
imported only when NVML found a GPU, so `plan` and `hardware` on a machine
without one never pay for importing it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from llmcustoms import diskspace, hardware, launching
from llmcustoms.hardware import Hardware, usable_by_torch


def usable_hardware() -> Hardware:
    """This machine as training will use it: `hardware.detect()` without the
    GPUs the installed torch cannot use (its `torch_note` says why)."""
    found = hardware.detect()  # through the module: tests give it the machines we do not have
    if not found.has_gpu:
        return found
    import torch

    return usable_by_torch(found, torch.cuda.is_available(), torch.__version__, torch.version.cuda)


def free_space(path: Path) -> int:
    """Bytes this user may still write on the disk `path` is on (or will be on:
    the disk of its nearest existing parent)."""
    existing = Path(path).absolute()
    while not existing.exists():
        existing = existing.parent
    return shutil.disk_usage(existing).free


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
    not fit, else None. Only the main process writes, so only it checks."""
    if not launching.is_main_process():
        return None
    return diskspace.check_run_fits(plan, free_space(run_path), bytes_under(run_path), str(run_path), model_params,
                                    resuming)


def check_export_space(output: Path, needed: int, what: str, dtype: str = "") -> None:
    """Stop (exit 2) before `export` writes `needed` bytes into `output` when its disk cannot take them."""
    diskspace.check_export_fits(needed, free_space(output), str(output), what, dtype)
