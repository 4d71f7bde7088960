"""After `tune`'s search: is its pick (`tune_pareto.pick`) really better than the preset?

Trials are short, and a point that leads after S steps may not lead after a
whole run (a high lr learns fast and then overshoots). So the picked trial's
values and the preset's own are each trained for as long as `train` would run
them (`tune_space.full_plan`; the preset's is the base plan itself), and
compared on the held-out rows by the eval loss of the weights `train` keeps
(its best evaluation within the forgetting limit). Only the winner is written
as the study's preset.

- When the trials were already as long as a whole run, their own evaluations
  are those numbers: nothing is trained again.
- Each full-length result is kept in the study (user attribute
  `full_length`, by the plan's values), so a continued study trains again only
  what changed: usually just a new best.
- A full-length run that fails (divergence beyond recovery) loses; a signal
  stops the check (the command exits 128 + the signal) and nothing is written.
- `tune --no-confirm` skips the check: the search's best is written as it is.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from llmcustoms.commands.tune_pareto import BaseGeneral, trial_loss
from llmcustoms.commands.tune_space import full_plan
from llmcustoms.commands.tune_studies import TuneSettings
from llmcustoms.preparation.prepared_run import PreparedRun
from llmcustoms.reporting import Reporter
from llmcustoms.runs import run_lock
from llmcustoms.runs.run_directory import RunDirectory

FULL_LENGTH_ATTR = "full_length"


@dataclass
class Confirmation:
    """The search's best against the preset at full length."""

    steps: int  # a whole run's optimizer steps
    best_trial: int
    best: float | None = None  # validation loss of the weights `train` keeps; None: it failed
    preset: float | None = None
    same: bool = False  # the best trial is the preset's own point: nothing to compare
    from_trials: bool = False  # the trials were whole runs: their evaluations are the numbers
    runs: int = 0  # full-length runs trained now
    steps_run: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # what failed, what was known from before

    @property
    def search_won(self) -> bool:
        if self.same or self.best is None:
            return False
        return self.preset is None or self.best < self.preset

    @property
    def change(self) -> float | None:
        """The best's validation loss against the preset's, as a fraction (-0.029: 2.9% lower)."""
        if self.best is None or self.preset is None or not self.preset:
            return None
        return self.best / self.preset - 1


def plan_key(plan: Any) -> str:
    """What a full-length result depends on, as a short key: the searched values and the run's shape."""
    shape = {"lr": plan.lr, "warmup_steps": plan.warmup_steps, "total_steps": plan.total_steps,
             "lora": [plan.lora.r, plan.lora.alpha, plan.lora.dropout] if plan.lora else None,
             "batch": [plan.micro_batch_size, plan.effective_batch_size], "max_seq_len": plan.max_seq_len,
             "seed": plan.seed, "eval_every": plan.eval_every, "patience": plan.early_stopping_patience,
             "scheduler": plan.lr_scheduler, "method": plan.method,
             "forgetting_limit": plan.forgetting_limit}  # it decides which evaluation `train` keeps
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]


class FullLengthCheck:
    """The best trial's values and the preset's, each trained for a whole run."""

    def __init__(self, prepared: PreparedRun, settings: TuneSettings, study: Any, faults: Any,
                 reporter_for: Callable[[str], Reporter], say: Callable[[str], None], base: BaseGeneral | None = None):
        """`reporter_for(what)`: the Reporter of a whole run's training (`tune.run_study`'s); `base`:
        the base model's general loss, so the runs keep their weights within the forgetting limit as `train` does."""
        self.prepared, self.settings, self.study, self.faults = prepared, settings, study, faults
        self.reporter_for, self.say, self.base = reporter_for, say, base or BaseGeneral()

    def run(self, best: Any, preset_trial: Any, point: dict[str, Any]) -> Confirmation:
        """`best`: the search's pick (`tune_pareto.pick`); `preset_trial`: the complete trial of
        the preset's `point`, if any. A signal in a run raises TrainingInterrupted."""
        base = self.prepared.plan
        check = Confirmation(steps=base.total_steps, best_trial=best.number)
        if best.params == point or (preset_trial is not None and best.number == preset_trial.number):
            check.same = True
            return check
        if preset_trial is not None and self.settings.steps >= base.total_steps:
            check.from_trials = True
            check.best, check.preset = trial_loss(best), trial_loss(preset_trial)
            return check
        started = time.perf_counter()
        check.preset = self._loss(base, "the preset", check)
        check.best = self._loss(full_plan(base, best.params), f"the search's best (trial {best.number})", check)
        check.seconds = time.perf_counter() - started
        return check

    def _loss(self, plan: Any, what: str, check: Confirmation) -> float | None:
        """The plan's full-length validation loss: known from an earlier check of
        the study, or trained now. None when the run failed (said in the notes)."""
        key = plan_key(plan)
        known = self.study.user_attrs.get(FULL_LENGTH_ATTR, {})
        if key in known:
            check.notes.append(f"{what}: known from an earlier check of this study")
            self.say(f"{_first_up(what)} at full length: validation loss {_shown(known[key])} (from an earlier check).")
            return known[key]
        self.say(f"Training {what} at full length ({plan.total_steps} steps)...")
        loss, failed = self._train(plan, RunDirectory(self.settings.study_dir / f"full-{key}"), check,
                                   f"{what} at full length")
        if failed is not None:
            check.notes.append(f"{what} failed at full length: {failed}")
            self.say(f"{_first_up(what)} failed at full length: {failed}")
            return None
        self.study.set_user_attr(FULL_LENGTH_ATTR, {**self.study.user_attrs.get(FULL_LENGTH_ATTR, {}), key: loss})
        self.say(f"{_first_up(what)} at full length: validation loss {_shown(loss)}.")
        return loss

    def _train(self, plan: Any, run_dir: RunDirectory, check: Confirmation,
               what: str) -> tuple[float | None, str | None]:
        """One whole run (no weights kept: the preset file is what comes of it);
        its best eval loss, or None and why it failed."""
        from llmcustoms.recovery.recovery_system import TrainingFailed, TrainingInterrupted
        from llmcustoms.training.finetuner import FineTuner

        with run_lock.owning(run_dir.path, "checking a trial at full length in it"):
            run_dir.create(overwrite=True)
            run_dir.write_plan(plan)
            prepared = self.prepared
            tuner = FineTuner(plan, prepared.tokenizer, prepared.train, prepared.evaluation, run_dir,
                              self.reporter_for(what), faults=self.faults, save_artifacts=False,
                              baseline=self.base.baseline())
            self.base.start(tuner)
            check.runs += 1
            try:
                result = tuner.run()
            except TrainingFailed as failed:
                return None, failed.report["reason"]
            finally:
                check.steps_run += tuner.position.step
                self.base.learn(tuner)
        if tuner.signals.received is not None:  # it came in the last step: the run is whole, the command stops after
            raise TrainingInterrupted(tuner.signals.received, tuner.position.step)
        loss = result.best_eval_loss
        return (loss, None) if loss is not None and math.isfinite(loss) else (None, "no finite eval loss")


def _first_up(text: str) -> str:
    return text[:1].upper() + text[1:]


def _shown(loss: float | None) -> str:
    return "none" if loss is None else f"{loss:.4f}"


def preset_trial(study: Any, point: dict[str, Any] | None) -> Any:
    """The study's complete trial of the preset's own point, the first if several."""
    from optuna.trial import TrialState

    if point is None:
        return None
    return next((t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                 if t.params == point and trial_loss(t) is not None), None)


def enqueue_preset(study: Any, point: dict[str, Any] | None) -> bool:
    """Put the preset's point first in the queue, unless the study holds it
    already: tried (complete, pruned, failed), running or waiting. A trial of it
    stopped by a signal, or whose process was killed, counts as not tried.
    Whether it was enqueued. Callers on one machine take turns around it
    (`tune_studies.taking_turns`)."""
    from optuna.trial import TrialState

    if point is None:
        return False
    for trial in study.get_trials(deepcopy=False):
        params = trial.system_attrs.get("fixed_params", trial.params)
        cut_short = trial.user_attrs.get("interrupted") or trial.user_attrs.get("killed")
        if params == point and not (cut_short and trial.state in (TrialState.PRUNED, TrialState.FAIL)):
            return False
    study.enqueue_trial(point, user_attrs={"preset": True})
    return True
