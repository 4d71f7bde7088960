"""`CheckpointManager`: write, verify, find and prune checkpoints.

A checkpoint is a directory `checkpoints/step-NNNNNN/` holding only
safetensors and JSON:

    model.safetensors      the trained weights (LoRA adapters, or every weight)
    optimizer.safetensors  the optimizer's per-parameter state (AdamW moments, step)
    rng.safetensors        torch CPU and CUDA generator states
    state.json             loop position, scheduler, python/numpy RNG, best eval, ...
    manifest.json          size and sha256 of every file above; written last

It is written into a temporary directory and renamed into place, so a process
killed at any moment (even mid-save) leaves either the whole checkpoint or
none. A checkpoint whose manifest is missing or does not verify does not
exist: it is skipped with a warning. Nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from llmcustoms.errors import ConfigError
from llmcustoms.filemodes import make_readable

TENSOR_FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors")
STATE_FILE = "state.json"
MANIFEST = "manifest.json"
NAME = re.compile(r"^step-(\d{6,})$")
# How a user names a checkpoint: step-40, step-000040 or 40.
STEP_TEXT = re.compile(r"^(?:step-)?(\d+)$")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int

    def state(self) -> dict[str, Any]:
        return json.loads((self.path / STATE_FILE).read_text())

    def tensors(self, name: str) -> dict[str, Any]:
        from safetensors.torch import load_file  # here: `generate` lists checkpoints without torch

        return load_file(str(self.path / name))


def step_named(text: str) -> int:
    """The step of a checkpoint as a user names it (`resume --from`)."""
    match = STEP_TEXT.match(text.strip())
    if match is None:
        raise ConfigError(f"--from {text}: not a checkpoint's name.", "Name it step-N, e.g. --from step-40, or just 40.")
    return int(match.group(1))


@dataclass(frozen=True)
class ResumeFrom:
    """What `resume` was asked for besides going on: the checkpoint of `step`
    (None: the newest that verifies), without its optimizer state, for a run
    extended to `epochs` in all. Given once: a restart after a failure goes on
    from the newest checkpoint as it is."""

    step: int | None = None
    reset_optimizer: bool = False
    epochs: float | None = None

    def went_on(self, position: Any, checkpoints: CheckpointManager, main: bool, total_steps: int) -> str:
        """Once the checkpoint of `position.step` is restored: the checkpoints after
        it deleted (by the `main` process), early stopping's count begun again for
        an extended run, and what to say about it."""
        step = position.step
        lines = [f"resuming from checkpoint step-{step:06d} (step {step})"]
        removed = checkpoints.remove_after(step) if main else []
        if removed:
            lines.append(f"removed the checkpoints after step {step} ({', '.join(f'step-{s}' for s in removed)}): "
                         "the steps after it are trained again")
        if self.reset_optimizer:
            lines.append("the optimizer state starts fresh (AdamW moments zero); weights, learning-rate schedule, "
                         "data order and random state are the checkpoint's")
        if self.epochs is not None:
            # More epochs asked for: a run that stopped early would otherwise stop
            # again at its next evaluation, on the count it ended with.
            position.evals_since_best = 0
            lines.append(f"extended to {self.epochs:g} epochs, {total_steps} steps in all; the learning-rate decay "
                         "is stretched over them")
        return "\n".join(lines)


class CheckpointManager:
    def __init__(self, directory: Path, keep: int, warn: Callable[[str], None] = lambda message: None):
        self.directory = Path(directory)
        self.keep = max(1, keep)
        self.warn = warn

    def save(self, step: int, tensors: dict[str, dict[str, Any]], state: dict[str, Any]) -> Checkpoint:
        """Write a checkpoint atomically. `tensors` maps each of TENSOR_FILES to a
        flat {name: tensor} dict; `state` must be JSON-serialisable."""
        from safetensors.torch import save_file

        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.at(step).path
        tmp = self.directory / f".tmp-{final.name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        for name in TENSOR_FILES:
            # safetensors needs contiguous tensors that own their memory
            save_file({k: v.detach().contiguous().cpu().clone() for k, v in tensors.get(name, {}).items()},
                      str(tmp / name))
        (tmp / STATE_FILE).write_text(json.dumps(state))
        make_readable(tmp)
        files = {}
        for name in TENSOR_FILES + (STATE_FILE,):
            _fsync(tmp / name)
            files[name] = {"size": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=2))
        _fsync(tmp / MANIFEST)
        if final.exists():
            # Re-saving a step (after a rollback): move the old one aside first,
            # so there is never a moment without a complete checkpoint.
            old = self.directory / f".old-{final.name}-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync(self.directory)
        return Checkpoint(final, step)

    def verify(self, path: Path) -> str | None:
        """None if the checkpoint is complete and intact, else what is wrong."""
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, json.JSONDecodeError):
            return "no readable manifest"
        files = manifest.get("files", {})
        for name in TENSOR_FILES + (STATE_FILE,):
            if name not in files:
                return f"{name} is not in the manifest"
            file = path / name
            if not file.is_file():
                return f"{name} is missing"
            if file.stat().st_size != files[name]["size"]:
                return f"{name} has the wrong size (truncated?)"
            if _sha256(file) != files[name]["sha256"]:
                return f"{name} does not match its checksum"
        return None

    def all(self) -> list[Checkpoint]:
        """Every checkpoint directory by name, newest first, unverified."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.iterdir():
            match = NAME.match(path.name)
            if match and path.is_dir():
                found.append(Checkpoint(path, int(match.group(1))))
        return sorted(found, key=lambda c: -c.step)

    def at(self, step: int) -> Checkpoint:
        """The checkpoint of `step` (it may not exist: `verify` says)."""
        return Checkpoint(self.directory / f"step-{step:06d}", step)

    def verified(self, step: int) -> Checkpoint:
        """The checkpoint of `step` if it verifies; else an error naming those that do."""
        checkpoint = self.at(step)
        problem = self.verify(checkpoint.path) if checkpoint.path.is_dir() else "there is none"
        if problem is None:
            return checkpoint
        good = [f"step-{c.step}" for c in reversed(self.all()) if self.verify(c.path) is None]
        raise ConfigError(f"{self.directory.parent} has no usable checkpoint of step {step} ({problem}).",
                          f"Its verified checkpoints: {', '.join(good)}." if good else "It has no verified checkpoint.")

    def remove_after(self, step: int) -> list[int]:
        """Delete the checkpoints after `step`, the steps of those deleted: going
        on from `step`, they belong to a future that will not happen, and the
        newest checkpoint must be one of the run that goes on."""
        removed = sorted(c.step for c in self.all() if c.step > step)
        for later in removed:
            shutil.rmtree(self.at(later).path, ignore_errors=True)
        return removed

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies; broken ones are reported and skipped."""
        for checkpoint in self.all():
            problem = self.verify(checkpoint.path)
            if problem is None:
                return checkpoint
            self.warn(f"checkpoint {checkpoint.path.name} is unusable ({problem}); trying an older one")
        return None

    def prune(self, best_step: int | None) -> None:
        """Keep the newest `keep` checkpoints and the one of `best_step` (the best
        evaluation's weights, in a full fine-tuning run)."""
        for index, checkpoint in enumerate(self.all()):
            if index >= self.keep and checkpoint.step != best_step:
                shutil.rmtree(checkpoint.path, ignore_errors=True)
        for leftover in self.directory.glob(".tmp-*"):
            if not leftover.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(leftover, ignore_errors=True)  # from a process killed mid-save


# ------------------------------------------------ state to tensors and JSON

def rng_state() -> tuple[dict[str, Any], dict[str, Any]]:
    """Every random generator the loop touches: (tensors, JSON)."""
    import random

    import numpy as np
    import torch

    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = state
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(keys.astype(np.int64))
    return tensors, {"python": [version, list(internal), gauss], "numpy": [kind, int(pos), int(has_gauss), float(cached)]}


def set_rng_state(tensors: dict[str, Any], state: dict[str, Any]) -> None:
    import random

    import numpy as np
    import torch

    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("cuda_"))]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))


def optimizer_state(optimizer: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """An optimizer's state_dict as flat tensors ("state.<param>.<key>") and JSON param groups."""
    return flatten_optimizer_state(optimizer.state_dict())


def flatten_optimizer_state(state_dict: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A state_dict in `torch.optim` form (parameters numbered in group order) as
    flat tensors and JSON param groups."""
    import torch

    tensors = {}
    for index, values in state_dict["state"].items():
        for key, value in values.items():
            tensors[f"state.{index}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    groups = []
    for group in state_dict["param_groups"]:
        groups.append({k: list(v) if isinstance(v, tuple) else v for k, v in group.items()})
    return tensors, groups


def unflatten_optimizer_state(tensors: dict[str, Any], groups: list[dict[str, Any]]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    restored = [{k: tuple(v) if k == "betas" else v for k, v in group.items()} for group in groups]
    return {"state": state, "param_groups": restored}


def load_optimizer_state(optimizer: Any, tensors: dict[str, Any], groups: list[dict[str, Any]]) -> None:
    optimizer.load_state_dict(unflatten_optimizer_state(tensors, groups))
