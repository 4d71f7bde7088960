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
exist: it is skipped with a warning, and so is one whose files are not what
they must be (`checkpoint_content`) or whose tensors do not fit the model being
trained (the manager's `check`). Deleting one (pruning, going back to an
earlier step) first renames it out of the step-N names, so a kill mid-delete
never leaves a half-deleted step-N. Nothing is ever unpickled.
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
from llmcustoms.runs.checkpoint_content import BNB_STATE, Unusable, manifest_problem, read_json, safetensors_header, state_problem
from llmcustoms.runs.file_modes import make_readable

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
    """A checkpoint directory. Read `state` and `tensors` only of one that
    `CheckpointManager.verify` (or `latest`, `verified`) has passed: anything
    else may be half-deleted, truncated or of another shape."""

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
    extended to `epochs` in all, or set to `max_steps` in all. Given once: a
    restart after a failure goes on from the newest checkpoint as it is."""

    step: int | None = None
    reset_optimizer: bool = False
    epochs: float | None = None
    max_steps: int | None = None

    @property
    def resizes(self) -> bool:
        """Whether the run's length is changed: a completed run goes on then."""
        return self.epochs is not None or self.max_steps is not None

    def planned(self, plan: Any, last_step: int) -> Any:
        """The run's plan with its new length, if one was asked for; an error if it
        cannot be. `last_step`: the step the run is at (status.json's), unless --from says."""
        if self.epochs is not None and self.max_steps is not None:
            raise ConfigError("--epochs and --max-steps both set the run's length.", "Give one of them.")
        if self.epochs is not None:
            return plan.extended_to(self.epochs)
        if self.max_steps is not None:
            return plan.with_max_steps(self.max_steps, last_step if self.step is None else self.step)
        return plan

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
        if self.resizes:
            # A new length asked for: a run that stopped early would otherwise stop
            # again at its next evaluation, on the count it ended with.
            position.evals_since_best = 0
            length, decay = ((f"extended to {self.epochs:g} epochs", "is stretched over them")
                             if self.epochs is not None else ("set by --max-steps", "follows them"))
            lines.append(f"{length}, {total_steps} steps in all; the learning-rate decay {decay}")
        return "\n".join(lines)


class CheckpointManager:
    """`check`, given by the training loop, says what keeps an intact checkpoint
    from being restored into the model and optimizer it has (tensors of other
    names, shapes or dtypes), or None; `latest` and `verified` use it after `verify`."""

    def __init__(self, directory: Path, keep: int, warn: Callable[[str], None] = lambda message: None,
                 check: Callable[[Checkpoint], str | None] = lambda checkpoint: None,
                 point: Callable[[int | None, str], None] = lambda step, where: None):
        """`point(step, where)` is called at each point of a save (step) or a delete
        (None) where a kill would leave the disk in another state: fault injection
        (`faults.kill_saving`) kills the process there."""
        self.directory = Path(directory)
        self.keep = max(1, keep)
        self.warn = warn
        self.check = check
        self.point = point

    def save(self, step: int, tensors: dict[str, dict[str, Any]], state: dict[str, Any]) -> Checkpoint:
        """Write a checkpoint atomically. `tensors` maps each of TENSOR_FILES to a
        flat {name: tensor} dict; `state` must be JSON-serialisable. A write that
        fails (a full disk) removes what it wrote, and raises: the checkpoints
        before it are as they were."""
        from safetensors.torch import save_file

        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.at(step).path
        tmp = self.directory / f".tmp-{final.name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        self.point(step, "started")
        try:
            for name in TENSOR_FILES:
                # safetensors needs contiguous tensors that own their memory
                save_file({k: v.detach().contiguous().cpu().clone() for k, v in tensors.get(name, {}).items()},
                          str(tmp / name))
                self.point(step, name)
            (tmp / STATE_FILE).write_text(json.dumps(state))
            self.point(step, STATE_FILE)
            make_readable(tmp)
            files = {}
            for name in TENSOR_FILES + (STATE_FILE,):
                _fsync(tmp / name)
                files[name] = {"size": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
            (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=2))
            _fsync(tmp / MANIFEST)
            self.point(step, MANIFEST)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # its room back at once: the disk may be full
            raise
        if final.exists():
            # Re-saving a step (after a rollback): move the old one aside first,
            # so there is never a moment without a complete checkpoint.
            old = self.directory / f".old-{final.name}-{os.getpid()}"
            os.replace(final, old)
            self.point(step, "moved aside")
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        self.point(step, "renamed")
        _fsync(self.directory)
        return Checkpoint(final, step)

    def verify(self, path: Path) -> str | None:
        """None if the checkpoint is complete and intact and its files hold what
        they must (`checkpoint_content`: the manifest's shape, each safetensors
        header, state.json's values), else what is wrong. Never raises on any
        bytes, and never imports torch (`generate` lists checkpoints without it)."""
        try:
            manifest = _manifest(path)
            for name in TENSOR_FILES + (STATE_FILE,):
                _check_intact(path / name, manifest["files"][name])
            for name in TENSOR_FILES:
                safetensors_header(path / name)
            return state_problem(read_json(path / STATE_FILE), _step_of(path))
        except Unusable as unusable:
            return str(unusable)

    def problem(self, checkpoint: Checkpoint) -> str | None:
        """What keeps `checkpoint` from being restored: `verify`, then `check`."""
        if not checkpoint.path.is_dir():
            return "there is none"
        return self.verify(checkpoint.path) or self.check(checkpoint)

    def verified_state(self, checkpoint: Checkpoint) -> dict[str, Any] | None:
        """The checkpoint's state.json if it matches its manifest and holds what it
        must, else None: cheaper than `verify`, for readers of the state alone."""
        try:
            manifest = _manifest(checkpoint.path)
            _check_intact(checkpoint.path / STATE_FILE, manifest["files"][STATE_FILE])
            state = read_json(checkpoint.path / STATE_FILE)
        except Unusable:
            return None
        return state if state_problem(state, checkpoint.step) is None else None

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
        """The checkpoint of `step` if it verifies and fits (`check`); else an error naming those that do."""
        checkpoint = self.at(step)
        problem = self.problem(checkpoint)
        if problem is None:
            return checkpoint
        good = [f"step-{c.step}" for c in reversed(self.all()) if self.problem(c) is None]
        raise ConfigError(f"{self.directory.parent} has no usable checkpoint of step {step} ({problem}).",
                          f"Its verified checkpoints: {', '.join(good)}." if good else "It has no verified checkpoint.")

    def remove_after(self, step: int) -> list[int]:
        """Delete the checkpoints after `step`, the steps of those deleted: going
        on from `step`, they belong to a future that will not happen, and the
        newest checkpoint must be one of the run that goes on."""
        removed = sorted(c.step for c in self.all() if c.step > step)
        self._delete([self.at(later).path for later in removed])
        return removed

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies and fits (`check`); others are reported and skipped."""
        for checkpoint in self.all():
            problem = self.problem(checkpoint)
            if problem is None:
                return checkpoint
            self.warn(f"checkpoint {checkpoint.path.name} is unusable ({problem}); trying an older one")
        return None

    def prune(self, best_step: int | None) -> None:
        """Keep the newest `keep` whole checkpoints and the one of `best_step` (the
        best evaluation's weights, in a full fine-tuning run). One that is not
        whole (half-deleted by a kill, truncated) is deleted: it is never read.
        Whole means its files have the manifest's sizes; hashing every kept
        checkpoint at every save would cost more than a checkpoint's worth."""
        kept, doomed = 0, []
        for checkpoint in self.all():
            if _whole(checkpoint.path) and (kept < self.keep or checkpoint.step == best_step):
                kept += 1
            else:
                doomed.append(checkpoint.path)
        self._delete(doomed)
        mine = f"-{os.getpid()}"
        for leftover in self.directory.glob(".*-step-*"):
            # .tmp- and .old-: from a process killed mid-save (this one's own are its
            # save's to finish); .deleting-: from a kill, or a failure, mid-delete.
            if leftover.name.startswith(".deleting-") or (
                    leftover.name.startswith((".tmp-", ".old-")) and not leftover.name.endswith(mine)):
                shutil.rmtree(leftover, ignore_errors=True)

    def _delete(self, paths: list[Path]) -> None:
        """Delete checkpoints: each first renamed out of the step-N names (all of
        them before any file goes), so a kill or a failure mid-delete leaves
        .deleting- leftovers that `prune` removes, never a half-deleted step-N
        that later saves and resumes would read."""
        renamed = []
        for path in paths:
            doomed = self.directory / f".deleting-{path.name}-{os.getpid()}"
            if doomed.exists():  # left by a failed delete of this step before
                shutil.rmtree(doomed, ignore_errors=True)
            try:
                os.replace(path, doomed)
            except FileNotFoundError:
                continue
            except OSError as error:
                self.warn(f"checkpoint {path.name} could not be deleted ({error.strerror or error})")
                continue
            renamed.append(doomed)
        if renamed:
            _fsync(self.directory)  # the renames outlive a power loss before the files go
        for doomed in renamed:
            self.point(None, "deleting")
            shutil.rmtree(doomed, ignore_errors=True)


def _step_of(path: Path) -> int | None:
    match = NAME.match(path.name)
    return int(match.group(1)) if match else None


def _manifest(path: Path) -> dict[str, Any]:
    """A checkpoint's manifest, of the right shape; Unusable if not."""
    if not (path / MANIFEST).is_file():
        raise Unusable("no readable manifest")
    manifest = read_json(path / MANIFEST)
    problem = manifest_problem(manifest, _step_of(path), TENSOR_FILES + (STATE_FILE,))
    if problem is not None:
        raise Unusable(problem)
    return manifest


def _check_intact(file: Path, entry: dict[str, Any]) -> None:
    """Unusable unless `file` has the size and sha256 its manifest `entry` gives."""
    try:
        if not file.is_file():
            raise Unusable(f"{file.name} is missing")
        if file.stat().st_size != entry["size"]:
            raise Unusable(f"{file.name} has the wrong size (truncated?)")
        if _sha256(file) != entry["sha256"]:
            raise Unusable(f"{file.name} does not match its checksum")
    except OSError as error:
        raise Unusable(f"{file.name} cannot be read ({error.strerror or error})") from None


def _whole(path: Path) -> bool:
    """Whether a checkpoint has its manifest and every file of the manifest's size (not hashed)."""
    try:
        manifest = _manifest(path)
        return all((path / name).stat().st_size == manifest["files"][name]["size"]
                   for name in TENSOR_FILES + (STATE_FILE,))
    except (Unusable, OSError):
        return False

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
            # bitsandbytes nests its quantized moments and block scales one level down (BNB_STATE).
            nested = value if isinstance(value, dict) else {None: value}
            for sub, item in nested.items():
                name = f"state.{index}.{key}" if sub is None else f"state.{index}.{key}.{sub}"
                tensors[name] = item if torch.is_tensor(item) else torch.tensor(item)
    groups = []
    for group in state_dict["param_groups"]:
        groups.append({k: list(v) if isinstance(v, tuple) else v for k, v in group.items()})
    return tensors, groups


def unflatten_optimizer_state(tensors: dict[str, Any], groups: list[dict[str, Any]]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        values = state.setdefault(int(index), {})
        if key.startswith(BNB_STATE + "."):
            values.setdefault(BNB_STATE, {})[key.split(".", 1)[1]] = value
        else:
            values[key] = value
    for values in state.values():
        if BNB_STATE in values:  # bitsandbytes counts steps in a Python int
            values["step"] = int(values["step"])
    restored = [{k: tuple(v) if k == "betas" else v for k, v in group.items()} for group in groups]
    return {"state": state, "param_groups": restored}


def load_optimizer_state(optimizer: Any, tensors: dict[str, Any], groups: list[dict[str, Any]]) -> None:
    optimizer.load_state_dict(unflatten_optimizer_state(tensors, groups))
