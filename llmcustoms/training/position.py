"""Where the training loop is, and how a run ended.

`Position` is one plain record of the loop's progress (step, epoch, tokens,
losses, best evaluation): `FineTuner` saves it in every checkpoint, as flat
keys of state.json, and restores it from there. `StopReason` says, as a value,
why a run ended before its last step; `TrainResult` is what a finished run
returns, with its time and speed (`RunPace`) for the whole run, as `runs` and
`report` give them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any

from llmcustoms.runs.speeds import run_tokens_per_s
from llmcustoms.runs.training_time import training_seconds
from llmcustoms.training.general_text import forgetting, within_limit


class StopCause(Enum):
    """Why a run ended before its last step (a signal ends it with TrainingInterrupted instead)."""
    EARLY_STOPPING = "early stopping"
    CALLER = "stopped by the caller"  # `on_evaluate` returned True (tuning's pruner)


@dataclass(frozen=True)
class StopReason:
    cause: StopCause
    step: int
    text: str  # for people: status.json's reason and the summary


@dataclass
class Position:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    index: int = 0  # next step within the epoch
    tokens: int = 0  # input tokens trained on
    final_loss: float | None = None
    best_eval: float | None = None
    best_step: int | None = None
    last_eval: float | None = None
    evals_since_best: int = 0
    base_eval: float | None = None  # the model's eval loss before the first step
    # Forgetting (`general_text.py`): the general rows' loss before the first step, and at the best evaluation.
    base_general: float | None = None
    best_general: float | None = None
    best_within: bool = True  # the best evaluation forgot no more than the limit (False: none did; it forgot least)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Position:
        """The position saved in a checkpoint's state (other keys are ignored;
        a key an older version did not save keeps its default)."""
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})

    def advance(self, tokens: int, loss: float) -> None:
        """One optimizer step done."""
        self.index += 1
        self.step += 1
        self.tokens += tokens
        self.final_loss = loss

    def losses(self) -> dict[str, float | int | None]:
        """The losses a finished run's status.json gives."""
        return {"final_loss": self.final_loss, "best_eval_loss": self.best_eval, "best_eval_step": self.best_step,
                "base_eval_loss": self.base_eval, "forgetting": self.forgetting()}

    def forgetting(self) -> float | None:
        """The kept evaluation's general loss over the base model's, less 1 (`general_text.forgetting`)."""
        return forgetting(self.base_general, self.best_general)

    def next_epoch(self) -> None:
        self.epoch, self.index = self.epoch + 1, 0

    def early_stop(self, eval_loss: float, patience: int, general_loss: float | None = None,
                   limit: float = 0.0) -> StopReason | None:
        """Count an evaluation towards early stopping: a reason to stop once eval
        loss has not improved for `patience` evaluations (0: never). Only an
        evaluation whose forgetting is within `limit` (`general_text.within_limit`)
        can be the best; until one is, the one that forgot least is kept, and it
        counts as no progress."""
        # A non-finite eval loss never counts as the best: its weights are no use.
        finite = math.isfinite(eval_loss)
        if finite and within_limit(self.base_general, general_loss, limit):
            if self.best_eval is None or not self.best_within or eval_loss < self.best_eval:
                self._best(eval_loss, general_loss, True)
                return None
        elif finite and not self.best_within and _less(general_loss, self.best_general):
            self._best(eval_loss, general_loss, False, progress=False)
        elif finite and self.best_eval is None:  # the first evaluation, and it forgot too much
            self._best(eval_loss, general_loss, False, progress=False)
        self.evals_since_best += 1
        if patience and self.evals_since_best >= patience:
            text = (f"eval loss has not improved for {self.evals_since_best} evaluations since step {self.best_step}"
                    if self.best_within else f"none of {self.evals_since_best} evaluations forgot within the limit")
            return StopReason(StopCause.EARLY_STOPPING, self.step, f"early stopping: {text}")
        return None

    def _best(self, eval_loss: float, general_loss: float | None, within: bool, progress: bool = True) -> None:
        self.best_eval, self.best_step, self.best_general, self.best_within = eval_loss, self.step, general_loss, within
        if progress:
            self.evals_since_best = 0

    def forgetting_text(self, limit: float) -> str:
        """What the kept evaluation forgot, for the account of the weights kept ("" when not measured)."""
        rise = self.forgetting()
        if rise is None:
            return ""
        if self.best_within:
            return f"general loss {rise:+.1%} against the base model" + (f", within the {limit:.0%} limit" if limit else "")
        return (f"no evaluation stayed within the {limit:.0%} forgetting limit; this one forgot least "
                f"(general loss {rise:+.1%} against the base model)")


def _less(value: float | None, than: float | None) -> bool:
    return value is not None and (than is None or value < than)


@dataclass(frozen=True)
class RunPace:
    """How long a run trained and how fast, one number each wherever they are
    shown: its training time, every segment summed (`train` and each `resume`:
    status.json's, as `runs` gives it), and its tokens/s in training steps
    (`speeds.run_tokens_per_s`, as `report` gives it)."""

    seconds: float
    tokens_per_s: float

    @classmethod
    def of(cls, status: dict[str, Any], rows: list[dict[str, Any]], seconds: float, tokens: int) -> "RunPace":
        """From status.json and metrics.jsonl as the run ends; this process's
        `seconds` and `tokens` where they have nothing (a run directory it cannot write)."""
        total = training_seconds(status, running=False) if "training_seconds" in status else None
        speed = run_tokens_per_s(rows)
        return cls(seconds if total is None else total, tokens / max(seconds, 1e-9) if speed is None else speed)


@dataclass
class TrainResult:
    status: str
    steps: int
    final_loss: float | None
    best_eval_loss: float | None
    best_eval_step: int | None
    seconds: float  # the whole run's training time, a resume's included (`RunPace`)
    tokens_per_s: float  # input tokens over the time in training steps (`RunPace`)
    output_path: Path
    stop: StopReason | None = None
    base_eval_loss: float | None = None  # before the first step
    kept: str | None = None  # which weights output_path holds, and why
    last_output: str | None = None  # where the last step's weights went, when not kept
    samples: list[dict[str, str]] = field(default_factory=list)  # samples.side_by_side entries
    held_out: dict[str, float] = field(default_factory=dict)  # the loss's `held_out`: DPO's best evaluation row
    memory: dict[str, Any] = field(default_factory=dict)  # measured peak against the plan's (`resource_use.compare`)
    general: dict[str, Any] = field(default_factory=dict)  # status.json's general_knowledge (`runs/forgetting.py`)
    eval_on_training_rows: bool = False  # the evaluation rows are training rows too (`Plan.evaluates_training_rows`)
    forgetting: float | None = None  # the kept weights' general loss rise (`general_text.py`); None: not measured

    @classmethod
    def finished(cls, position: Position, stop: StopReason | None, pace: RunPace, output_path: Path,
                 kept: dict[str, Any], samples: list[dict[str, str]], held_out: dict[str, float],
                 memory: dict[str, Any]) -> "TrainResult":
        """A completed run's result; `kept`: which weights `output_path` holds (`BestWeights.write`)."""
        return cls(status="completed", steps=position.step, final_loss=position.final_loss,
                   best_eval_loss=position.best_eval, best_eval_step=position.best_step, seconds=pace.seconds,
                   tokens_per_s=pace.tokens_per_s, output_path=output_path, stop=stop,
                   base_eval_loss=position.base_eval, kept=kept.get("kept"), last_output=kept.get("last_output"),
                   samples=samples, held_out=held_out, memory=memory,
                   eval_on_training_rows=bool(kept.get("eval_on_training_rows")), forgetting=position.forgetting())

    @property
    def stop_reason(self) -> str | None:
        """Why the run ended early, as shown to the user."""
        return self.stop.text if self.stop else None
