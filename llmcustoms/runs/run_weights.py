"""Which weights of a run `generate`, `chat` and `export` load (`--checkpoint`).

Without --checkpoint: what the run kept when it ended, adapter/ (model/ for
full fine-tuning). A run that has not ended (interrupted, failed, still
training) has none yet, and `generate` and `chat` can pick other weights:

    latest   the newest checkpoint that verifies (checkpoints/step-NNNNNN/)
    best     the best evaluation's: adapter/ once the run has ended; before,
             best/step-NNNNNN.safetensors (adapters) or that step's checkpoint
    step-N   the checkpoint of optimizer step N

A checkpoint keeps only the trained tensors, by the names training gave them
(`model.safetensors`: the LoRA weights under their PeftModel names, or every
weight), and no tokenizer; `generation.load_trained` rebuilds the model from
the plan and puts them in. Choosing reads file names, manifests and JSON,
never torch, so a run with nothing to load is refused at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from llmcustoms.errors import ConfigError
from llmcustoms.runs.adapter_files import adapter_problem
from llmcustoms.runs.best_weights import BestWeightFiles
from llmcustoms.runs.checkpoints import Checkpoint, CheckpointManager
from llmcustoms.runs.run_directory import RunDirectory

STEP = re.compile(r"(?:step-)?(\d+)")
CHOICES = "latest, best or step-N"


@dataclass(frozen=True)
class Weights:
    """Weights to load: a directory written by `save_pretrained` (adapter/,
    model/), or trained tensors by name (`tensors`) to put into the model the
    plan builds."""

    plan: Any
    label: str  # as a user reads it: "the adapter", "checkpoint step-40"
    directory: Path | None = None
    tensors: Path | None = None

    @property
    def base_name(self) -> str:
        return model_name(self.plan.model)

    def describe(self) -> str:
        """What is loaded, as a line says it: "Qwen/Qwen2.5-0.5B + checkpoint step-40"."""
        if self.plan.method == "full":
            return f"{self.base_name}, fully fine-tuned: {self.label}"
        return f"{self.base_name} + {self.label}"


def model_name(model: str) -> str:
    """A model as a user reads it: a Hub id as given, a local model by its directory's name."""
    return Path(model).name if model.startswith(("/", ".", "~")) or model.count("/") > 1 else model


def trained_output(run: RunDirectory) -> tuple[Any, Path]:
    """(plan, adapter/ or model/) of a run that has ended; refused at once otherwise."""
    plan = run.read_plan()
    kept = _kept(run, plan)
    if kept is None or kept.directory is None:
        raise _unfinished(run, plan, can_pick=False)
    return plan, _whole(run, plan, kept, can_pick=False).directory


def choose_weights(run: RunDirectory, checkpoint: str | None,
                   warn: Callable[[str], None] = lambda message: None) -> Weights:
    """The weights `--checkpoint` names (None: the ones the run kept at its end).
    `warn` hears of damaged checkpoints that `latest` skips."""
    plan = run.read_plan()
    kept = _kept(run, plan)
    which = None if checkpoint is None else checkpoint.strip().lower()
    if which is None and kept is not None:
        return _whole(run, plan, kept, can_pick=True)
    if which is None:
        raise _unfinished(run, plan, can_pick=True)
    if which == "best":
        return _whole(run, plan, kept, can_pick=True) if kept else _best_so_far(run, plan)
    manager = CheckpointManager(run.checkpoints_path, keep=1, warn=warn)
    if which == "latest":
        newest = manager.latest()
        if newest is None:
            raise ConfigError(f"{run.path} has no usable checkpoint yet.", _offer(run, plan))
        return _from_checkpoint(plan, newest)
    match = STEP.fullmatch(which)
    if match is None:
        raise ConfigError(f"--checkpoint {checkpoint} is not one of {CHOICES}.", _offer(run, plan))
    found = manager.at(int(match.group(1)))
    if not found.path.is_dir():
        raise ConfigError(f"{run.path} has no checkpoint of step {found.step}.", _offer(run, plan))
    problem = manager.verify(found.path)
    if problem is not None:
        raise ConfigError(f"Checkpoint step-{found.step} of {run.path} is unusable ({problem}).",
                          _offer(run, plan))
    return _from_checkpoint(plan, found)


def _kept(run: RunDirectory, plan: Any) -> Weights | None:
    """adapter/ (model/), written when the run ended, or None before."""
    output = run.output_path(plan.method)
    if not (output / ("config.json" if plan.method == "full" else "adapter_config.json")).is_file():
        return None
    return Weights(plan, f"{output.name}/" if plan.method == "full" else "the adapter", directory=output)


def _whole(run: RunDirectory, plan: Any, kept: Weights, can_pick: bool) -> Weights:
    """`kept`, refused if it is an adapter whose files are damaged (`adapter_files`):
    what the user can do instead, `generate` and `chat` (`can_pick`) a checkpoint."""
    problem = None if plan.method == "full" or kept.directory is None else adapter_problem(kept.directory)
    if problem is None:
        return kept
    holds = _holds(run, plan)
    retrain = "train the run again (`llmcustoms train` with --overwrite), or put back adapter/ from a copy of the run"
    if holds and can_pick:
        hint = f"{holds} Try one with --checkpoint latest (or step-N), or {retrain}."
    else:
        hint = (f"{retrain[0].upper()}{retrain[1:]}."
                + (f" {holds} `generate` and `chat` can try them with --checkpoint latest." if holds else ""))
    raise ConfigError(f"The run's adapter is damaged ({problem}): {kept.directory}.", hint)


def _from_checkpoint(plan: Any, checkpoint: Checkpoint, label: str | None = None) -> Weights:
    return Weights(plan, label or f"checkpoint step-{checkpoint.step}",
                   tensors=checkpoint.path / "model.safetensors")


def _best_so_far(run: RunDirectory, plan: Any) -> Weights:
    """The best evaluation's weights of a run that has not ended."""
    step = best_step(run, plan)
    if step is not None and plan.method != "full":
        return Weights(plan, f"the best evaluation's weights (step {step})",
                       tensors=BestWeightFiles(run.best_path).path(step))
    if step is not None:  # full fine-tuning keeps a checkpoint of the best step
        return _from_checkpoint(plan, CheckpointManager(run.checkpoints_path, keep=1).at(step),
                                f"the best evaluation's weights (checkpoint step-{step})")
    raise ConfigError(f"{run.path} has no best weights yet: no evaluation has kept any.", _offer(run, plan))


def best_step(run: RunDirectory, plan: Any) -> int | None:
    """The step of the best evaluation whose weights are still on disk, or None."""
    if plan.method != "full":
        # best/ holds the current best and the earlier ones checkpoints still
        # name; each beat the one before, so the newest is the best.
        steps = BestWeightFiles(run.best_path).steps()
        return steps[-1] if steps else None
    manager = CheckpointManager(run.checkpoints_path, keep=1)
    newest = manager.latest()
    step = newest.state().get("best_step") if newest is not None else None
    return step if isinstance(step, int) and manager.verify(manager.at(step).path) is None else None


def _holds(run: RunDirectory, plan: Any) -> str | None:
    """The weights a run holds besides adapter/, in a sentence; None if none."""
    steps = [checkpoint.step for checkpoint in reversed(CheckpointManager(run.checkpoints_path, keep=1).all())]
    best = best_step(run, plan)
    if not steps and best is None:
        return None
    holds = f"Its checkpoints: {', '.join(f'step-{step}' for step in steps)}" if steps else "It has no checkpoints"
    return holds + (f"; best evaluation: step {best}." if best is not None else ".")


NO_CHECKPOINTS = "It has no checkpoints yet: the first is written after --save-every optimizer steps."


def _offer(run: RunDirectory, plan: Any) -> str:
    holds = _holds(run, plan)
    return f"{holds} Pass --checkpoint {CHOICES}." if holds else NO_CHECKPOINTS


def _unfinished(run: RunDirectory, plan: Any, can_pick: bool) -> ConfigError:
    """The refusal for a run without adapter/ (model/): how it stands, what it
    holds, and what to do: try a checkpoint (`can_pick`: `generate` and `chat`
    can, `export` cannot), finish the run, or wait for it."""
    status = run.read_status()
    step, total = status.get("step", 0), plan.total_steps
    at = f"step {step} of {total}" if total else f"step {step}"
    how = {"interrupted": f"it was interrupted at {at}", "failed": f"it failed at {at}",
           "completed": f"it completed, but {run.output_path(plan.method).name}/ is gone"}.get(status.get("status"))
    live = status.get("status") == "running" and run.running_pid() is not None
    if status.get("status") == "running":
        how = f"it is still training ({at})" if live else f"it stopped without a word at {at}"
    finish = "Wait for it to finish" if live else f"Finish it with `llmcustoms resume {run.path}`"
    holds = _holds(run, plan)
    if holds and can_pick:
        hint = f"To try its newest checkpoint, add --checkpoint latest (or best, or step-N). {finish}."
    else:
        hint = f"{finish}" + ("; `generate` and `chat` can try its checkpoints (--checkpoint latest)." if holds else ".")
    what = "model" if plan.method == "full" else "adapter"
    return ConfigError(f"{run.path} has no trained {what} yet: {how or 'it has not started training'}. "
                       + (holds or NO_CHECKPOINTS), hint)
