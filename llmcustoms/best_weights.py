"""The trained weights of the best evaluation so far, kept whatever `save_every` is.

An evaluation rarely falls on a checkpoint, so when one improves on the best
eval loss `FineTuner` keeps those weights at once: for adapters, a copy of the
trainable tensors in `best/step-NNNNNN.safetensors` here (small); for full
fine-tuning, a checkpoint of that step (`CheckpointManager` never prunes the
best one). At the end of the run these weights, not the last step's, become
`adapter/` (or `model/`).

A rollback or a resume goes back to a checkpoint, whose state names the best
step *of that moment*, so a file is kept while any checkpoint still names it;
files from steps after the checkpoint gone back to belong to a timeline that
no longer exists and are deleted. Each file is written to a temporary name
and renamed into place, so a kill mid-write leaves the previous best intact.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable

from safetensors.torch import load_file, save_file

from llmcustoms.checkpoints import Checkpoint, CheckpointManager

NAME = re.compile(r"^step-(\d{6,})\.safetensors$")


class BestWeightFiles:
    """best/step-NNNNNN.safetensors: the trainable tensors of best evaluations."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step:06d}.safetensors"

    def steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        return sorted(int(m.group(1)) for m in map(NAME.match, os.listdir(self.directory)) if m)

    def keep(self, step: int, tensors: dict[str, Any], eval_loss: float) -> None:
        """Write the weights of `step` (whole, or not at all)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.path(step)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        save_file({k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()}, str(tmp),
                  metadata={"step": str(step), "eval_loss": repr(eval_loss)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)

    def load(self, step: int) -> dict[str, Any] | None:
        """The weights kept for `step`, or None if there are none."""
        path = self.path(step)
        return load_file(str(path)) if path.is_file() else None

    def forget_after(self, step: int) -> None:
        """Drop what was kept after `step`: the run went back to a checkpoint of `step`."""
        for kept in self.steps():
            if kept > step:
                self.path(kept).unlink(missing_ok=True)

    def prune(self, needed: set[int]) -> None:
        """Delete every kept file whose step is not in `needed` (the current best,
        and the best step each remaining checkpoint names)."""
        for kept in self.steps():
            if kept not in needed:
                self.path(kept).unlink(missing_ok=True)


class BestWeights:
    """Which weights a run keeps, and writing them at the end.

    `processes` is the run's `processes.Processes` (it gathers and writes under
    FSDP); only the main process writes files."""

    def __init__(self, run_dir: Any, checkpoints: CheckpointManager, processes: Any, full: bool,
                 warn: Callable[[str], None]):
        self.run_dir = run_dir
        self.files = BestWeightFiles(run_dir.best_path)
        self.checkpoints = checkpoints
        self.processes = processes
        self.full = full  # full fine-tuning: the best weights are a checkpoint of their step
        self.warn = warn

    def keep(self, model: Any, step: int, eval_loss: float) -> None:
        """An adapter's weights at a new best evaluation (full fine-tuning saves a checkpoint instead)."""
        weights = self.processes.trainable_weights(model)  # every rank: under FSDP a collective
        if self.processes.is_main:
            self.files.keep(step, weights, eval_loss)
            named = {checkpoint.state().get("best_step") for checkpoint in self.checkpoints.all()}
            self.files.prune(named | {step})

    def went_back_to(self, step: int) -> None:
        """The run continues from a checkpoint of `step`: forget what came after it."""
        if self.processes.is_main:
            self.files.forget_after(step)

    def write(self, model: Any, tokenizer: Any, position: Any, method: str) -> dict[str, Any]:
        """Write the kept weights to adapter/ (or model/): the best evaluation's, and
        the last step's to adapter-last/ when they differ. Returns status.json's
        account of it: `kept_step`, `kept` (why), `last_output`."""
        output, last = self.run_dir.output_path(method), self.run_dir.last_output_path(method)
        best = position.best_step
        weights = self._load(best) if best is not None and best != position.step else None
        if weights is None:
            self.processes.save_trained(model, tokenizer, output)
            why = ("the last step's: no evaluation" if best is None else
                   f"the last step's, which had the best eval loss ({position.best_eval:.4f})" if best == position.step
                   else "the last step's: the best evaluation's weights could not be read")
            return {"kept_step": position.step, "kept": why, "last_output": None}
        self.processes.save_trained(model, tokenizer, last)
        self.processes.load_trainable(model, weights)
        self.processes.save_trained(model, tokenizer, output)
        last_eval = f", eval loss {position.last_eval:.4f}" if position.last_eval is not None else ""
        return {"kept_step": best, "last_output": last.name,
                "kept": f"the best evaluation's: eval loss {position.best_eval:.4f} at step {best} "
                        f"(the last step, {position.step}{last_eval}, is in {last.name}/)"}

    def _load(self, step: int) -> dict[str, Any] | None:
        """The kept weights of `step` (whole on the main process; under FSDP the others get {})."""
        if self.processes.fsdp and not self.processes.is_main:
            return {}
        if not self.full:
            weights = self.files.load(step)
        else:
            checkpoint = Checkpoint(self.checkpoints.directory / f"step-{step:06d}", step)
            problem = self.checkpoints.verify(checkpoint.path)
            weights = None if problem else checkpoint.tensors("model.safetensors")
        if weights is None:
            self.warn(f"the weights of the best evaluation (step {step}) are missing; keeping the last step's")
        return weights
