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
import shutil
from pathlib import Path
from typing import Any, Callable

from llmcustoms.runs.checkpoint_content import Unusable, safetensors_header
from llmcustoms.runs.checkpoints import CheckpointManager
from llmcustoms.runs.file_modes import make_readable

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
        from safetensors.torch import save_file  # here: `generate` lists the kept steps without torch

        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.path(step)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        save_file({k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()}, str(tmp),
                  metadata={"step": str(step), "eval_loss": repr(eval_loss)})
        make_readable(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        directory = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a power loss
        finally:
            os.close(directory)

    def load(self, step: int) -> dict[str, Any] | None:
        """The weights kept for `step`, or None if there are none (or their file is not safetensors)."""
        from safetensors.torch import load_file

        try:
            safetensors_header(self.path(step))
        except Unusable:
            return None
        return load_file(str(self.path(step)))

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
        for leftover in self.directory.glob(".step-*.tmp"):
            if f".{os.getpid()}." not in leftover.name:
                leftover.unlink(missing_ok=True)  # from a process killed mid-write


class BestWeights:
    """Which weights a run keeps, and writing them at the end.

    `processes` is the run's `processes.Processes` (it gathers and writes under
    FSDP); only the main process reads and writes files, and what it finds
    there it tells the others (`main_decides`), so every rank takes the same path."""

    def __init__(self, run_dir: Any, checkpoints: CheckpointManager, processes: Any, plan: Any,
                 warn: Callable[[str], None]):
        self.run_dir = run_dir
        self.files = BestWeightFiles(run_dir.best_path)
        self.checkpoints = checkpoints
        self.processes = processes
        self.full = plan.method == "full"  # full fine-tuning: the best weights are a checkpoint of their step
        # Evaluation rows that are training rows too: the choice is said to rest on them (`Plan.evaluates_training_rows`).
        self.on_training_rows = plan.evaluates_training_rows
        self.forgetting_limit = getattr(plan, "forgetting_limit", 0.0)
        self.warn = warn

    def keep_if_best(self, model: Any, position: Any) -> bool:
        """After a step: if its evaluation beat the best so far, keep its weights.
        Returns True when that needs a checkpoint of this step (full fine-tuning)."""
        if position.best_step != position.step:
            return False
        if self.full:
            return True
        weights = self.processes.trainable_weights(model)  # every rank: under FSDP a collective
        if self.processes.is_main:
            self.files.keep(position.step, weights, position.best_eval)
            self.files.prune(self._named_by_checkpoints() | {position.step})
        return False

    def _named_by_checkpoints(self) -> set[int | None]:
        """The best step each checkpoint's state names: a rollback to it needs that
        file. Only a verified state is read: a checkpoint half-deleted by a kill,
        or damaged, is never restored from, and its state may be any bytes."""
        states = (self.checkpoints.verified_state(checkpoint) for checkpoint in self.checkpoints.all())
        return {state.get("best_step") for state in states if state is not None}

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
        weights = self._load(best, model) if best is not None and best != position.step else None
        if not self.processes.main_decides(weights is not None):
            self.processes.save_trained(model, tokenizer, output)
            if self.processes.is_main:  # one left by the run before `resume --epochs` extended it: stale now
                shutil.rmtree(last, ignore_errors=True)
            return self._account(position.step, _why_last(position, best), None, position)
        self.processes.save_trained(model, tokenizer, last)
        if self.processes.is_main or self.processes.fsdp:  # elsewhere nothing is written from the model again
            self.processes.load_trainable(model, weights)
        self.processes.save_trained(model, tokenizer, output)
        last_eval = f", eval loss {position.last_eval:.4f}" if position.last_eval is not None else ""
        which = "the best evaluation's" if position.best_within else "the evaluation's that forgot least"
        return self._account(best, f"{which}: eval loss {position.best_eval:.4f} at step {best} "
                                   f"(the last step, {position.step}{last_eval}, is in {last.name}/)", last.name, position)

    def _account(self, step: int, why: str, last_output: str | None, position: Any) -> dict[str, Any]:
        """status.json's `kept_step`, `kept` and `last_output`: whether the choice rested on
        training rows, and what the kept evaluation forgot (`general_text.py`)."""
        forgot = position.forgetting_text(self.forgetting_limit) if "eval loss" in why else ""
        why += f"; {forgot}" if forgot else ""
        if self.on_training_rows and "eval loss" in why:
            return {"kept_step": step, "kept": f"{why}; measured on rows it also trained on, not held-out ones",
                    "last_output": last_output, "eval_on_training_rows": True}
        return {"kept_step": step, "kept": why, "last_output": last_output}

    def _load(self, step: int, model: Any) -> dict[str, Any] | None:
        """The kept weights of `step` on the main process (None if they cannot be
        read, or do not fit `model`); the other processes get {}: under FSDP the
        main one shards them out."""
        from safetensors.torch import load_file

        if not self.processes.is_main:
            return {}
        if self.full:
            checkpoint = self.checkpoints.at(step)
            path = checkpoint.path / "model.safetensors"
            problem = self.checkpoints.verify(checkpoint.path) if checkpoint.path.is_dir() else "its checkpoint is gone"
        else:
            path = self.files.path(step)
            problem = None if path.is_file() else f"{path.name} is gone"
        try:  # the header against the model, before anything is loaded
            problem = problem or self.processes.weights_problem(model, safetensors_header(path), path.name)
        except Unusable as unusable:
            problem = str(unusable)
        if problem is not None:
            self.warn(f"the weights of the best evaluation (step {step}) cannot be used ({problem}); "
                      "keeping the last step's")
            return None
        return load_file(str(path))


def _why_last(position: Any, best: int | None) -> str:
    """Why the last step's weights are the ones kept."""
    if best is None:
        return "the last step's: no evaluation"
    if best == position.step:
        which = "the best eval loss" if position.best_within else "the least forgetting"
        return f"the last step's, which had {which} (eval loss {position.best_eval:.4f})"
    return "the last step's: the best evaluation's weights could not be read"
