"""`llmcustoms tune`: an Optuna study around the same `FineTuner` and `Plan` as `train`.

Each trial is a short real training run, scored twice (Optuna's two
objectives, both minimized): by eval loss on one fixed, seeded held-out split,
and by forgetting, its general-text loss over the base model's
(`commands/tune_pareto.py`). What is searched, and each trial's plan, are in
`commands/tune_space.py`: the preset's own values are the study's first trial.
Trials are judged by eval loss at the rungs of successive halving, which stops
all but the best third at each. After the search the pick (the lowest eval
loss among the trials forgetting no more than the preset's own) and the preset
are trained for a whole run and only the winner is written
(`commands/tune_confirm.py`).
The study lives in a storage (SQLite in the output directory by default), so
running the same command again continues it, and several processes can share
one study through an RDB or journal storage. `commands/tune_studies.py` holds the study's
name, storage and sampler, `tune_identity.py` its identity; this module runs its trials.

Ctrl-C or SIGTERM in a trial stops it after the micro-batch: the trial is
recorded as interrupted (Optuna's `pruned`, with the signal in its
attributes), the study stops, and the command exits 128 + the signal.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from llmcustoms.commands.tune_confirm import FullLengthCheck, enqueue_preset, preset_trial
from llmcustoms.commands.tune_identity import check_identity, choose_study, study_identity
from llmcustoms.commands.tune_pareto import BaseGeneral, objective_values, pick, points, write_pareto
from llmcustoms.commands.tune_results import StudyOutcome, trial_rows, write_best_preset, write_trials_csv
from llmcustoms.commands.tune_space import (
    LR_FIND_SPAN,
    LR_SPAN,
    SearchSpace,
    goes_on,
    preset_point,
    search_space,
    trial_plan,
    trial_steps,
)
from llmcustoms.commands.tune_studies import (
    FullDisk,
    TrialSeededSampler,
    TuneSettings,
    claim,
    default_name,
    duplicate_of,
    fail_stale_trials,
    open_storage,
    redact_storage,
    storage_full,
    stored_choices,
    study_dir,
    taking_turns,
)
from llmcustoms.errors import ConfigError
from llmcustoms.planning.hardware import Hardware
from llmcustoms.planning.presets import TrainingPreset
from llmcustoms.planning.train_options import TrainOptions
from llmcustoms.preparation.prepared_run import PreparedRun, no_progress
from llmcustoms.preparation.preparing import prepare_run
from llmcustoms.recovery.faults import FaultInjector, disk_full_from
from llmcustoms.recovery.recovery_system import TrainingFailed, TrainingInterrupted
from llmcustoms.reporting import Reporter, SilentReporter
from llmcustoms.runs import run_lock
from llmcustoms.runs.run_directory import RunDirectory
from llmcustoms.training import finetuner  # the module: tests put a rigged FineTuner in it
from llmcustoms.training.position import StopCause
from llmcustoms.training.preflight import usable_hardware

__all__ = ["LR_FIND_SPAN", "LR_SPAN", "SearchSpace", "TuneSettings", "prepare_study", "run_study", "search_space"]

# A trial that drew the values of an earlier one is skipped and another drawn in
# its place, in at most this many rounds (an exhausted grid draws only repeats).
REDRAW_ROUNDS = 3


class TrialFailed(Exception):
    """A trial that could not finish (out of memory or divergence beyond recovery)."""


@dataclass(frozen=True)
class StudyRequest:
    """What `tune` was asked for, besides the plan's values."""

    trials: int
    max_steps: int | None = None
    budget_tokens: int | None = None
    timeout: float | None = None
    storage: str | None = None
    study_name: str | None = None
    sampler: str = "tpe"
    confirm: bool = True  # train the best and the preset at full length before writing the preset


@dataclass
class PreparedStudy:
    prepared: PreparedRun
    hardware: Hardware
    settings: TuneSettings
    space: SearchSpace
    tokens_per_trial: int


def prepare_study(options: TrainOptions, output_dir: Path, request: StudyRequest, progress: Any = None) -> PreparedStudy:
    """The base plan (as `train` would make it), the trial length and the study's name and place."""
    if request.max_steps and request.budget_tokens:
        raise ConfigError("--max-steps and --budget-tokens both set the length of a trial.", "Pass one of them.")
    if request.study_name is not None:
        study_dir(output_dir, request.study_name)  # a name that leaves --output-dir: refused before any work
    if request.storage is not None:
        open_storage(request.storage, output_dir)  # unreachable, or no driver: said before the data is prepared
    hardware = usable_hardware()
    prepared = prepare_run(options, hardware, progress=progress or no_progress)
    base = prepared.plan
    mean_tokens = float(prepared.train.lengths.mean())
    steps = trial_steps(base, request.max_steps, request.budget_tokens, mean_tokens)
    name, note = choose_study(request.storage, output_dir, request.study_name or default_name(options.data, base.model),
                              request.study_name is not None, study_identity(base, steps))
    given = base.sources.get("forgetting_limit", "default") != "default"  # a flag, the environment, .env
    settings = TuneSettings(trials=request.trials, steps=steps, study_name=name, study_dir=study_dir(output_dir, name),
                            storage=request.storage, sampler=request.sampler, timeout=request.timeout, seed=base.seed,
                            confirm=request.confirm, note=note, forgetting_limit=base.forgetting_limit if given else None)
    return PreparedStudy(prepared, hardware, settings, search_space(base, hardware),
                         round(steps * base.effective_batch_size * mean_tokens))


def make_sampler(name: str, space: SearchSpace, seed: int) -> Any:
    import optuna

    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        return optuna.samplers.GridSampler(space.grid(), seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def run_study(prepared: PreparedRun, preset: TrainingPreset, hardware: Hardware, settings: TuneSettings,
              on_update: Callable[[list[dict[str, Any]]], None] = lambda rows: None, faults: Any = None,
              warn: Callable[[str], None] = lambda text: None, say: Callable[[str], None] = lambda text: None,
              reporter_for: Callable[[str], Reporter] | None = None) -> StudyOutcome:
    """Run `settings.trials` more trials of the study (creating it if needed;
    the preset's point first, unless the study has it), write the Pareto front
    (`pareto.json`), check the pick at full length, and write the winner. `say` tells how the check goes. A storage that
    fails (a full disk, a lost database) ends it with one message: what the
    storage holds stays, and the same command continues it. `reporter_for(what)`
    is the Reporter of one training run ("trial 3"): a trial's steps take
    minutes before its row shows anything. None: its warnings to `warn`, nothing else."""
    base = prepared.plan
    if base.eval_rows == 0 or not prepared.evaluation:
        raise ConfigError("Tuning needs held-out rows to score trials, and this plan has none.",
                          "Pass --eval-split 0.1 (or more), or --eval-data FILE.")
    settings.study_dir.mkdir(parents=True, exist_ok=True)
    full_disk = FullDisk(disk_full_from())
    storage = open_storage(settings.storage, settings.study_dir, full_disk)
    space = search_space(base, hardware, settings.lr_centre).matching(stored_choices(storage, settings.study_name))
    trials = StudyTrials(prepared, settings, space, open_study(settings, space, storage),
                         faults or FaultInjector.from_env(), on_update, full_disk,  # one injector: faults fire once
                         reporter_for or (lambda what: SilentReporter(warn)))
    outcome = trials.outcome
    try:
        check_identity(outcome.study, study_identity(base, settings.steps))
        outcome.stale = fail_stale_trials(storage, outcome.study, settings.study_dir)
        with taking_turns(settings.storage, settings.study_dir):  # two `tune` starting at once queue it once
            enqueue_preset(outcome.study, space.preset)
        trials.optimize()
        outcome.rows = trial_rows(outcome.study, settings.forgetting_limit)
        write_trials_csv(outcome.rows, settings.study_dir / "trials.csv")
        outcome.points = points(outcome.study)
        outcome.pick = pick(outcome.points, settings.forgetting_limit) if outcome.points else None
        if outcome.pick is not None:
            write_pareto(settings.study_dir / "pareto.json", outcome.points, outcome.pick)
            # Two `tune` of one study check at full length in turn: the second reads
            # what the first trained (kept in the study) instead of training it again.
            with taking_turns(settings.storage, settings.study_dir, lambda: say(
                    "Another `tune` of this study is checking at full length; waiting for it to finish...")):
                trials.conclude(preset, say)
    except (ConfigError, KeyboardInterrupt):
        raise
    except Exception as error:
        failure = _storage_failure(error, settings)
        if failure is error:
            raise
        raise failure from None
    return outcome


def _storage_failure(error: Exception, settings: TuneSettings) -> Exception:
    """The one message for a study whose storage failed; `error` itself when it was no storage's."""
    from sqlalchemy.exc import SQLAlchemyError

    again = "run the same command again to continue the study (the trial that was running is marked failed)."
    if storage_full(error):
        return ConfigError(f"The disk is full: the study {settings.study_name} could not be saved in {settings.where}. "
                           "Its trials finished before are kept.", f"Make room on that disk, then {again}")
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, SQLAlchemyError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return error  # not the storage's: a bug, with its traceback
    first = redact_storage(str(cause).splitlines()[0] if str(cause) else type(cause).__name__, settings.storage)
    return ConfigError(f"The study's storage {settings.where} failed: {first}. Its trials finished before are kept.",
                       f"Check the database is reachable and has room, then {again}")


class StudyTrials:
    """One `tune` command's trials in a study: the objective Optuna calls, and what they did."""

    def __init__(self, prepared: PreparedRun, settings: TuneSettings, space: SearchSpace, study: Any, faults: Any,
                 on_update: Callable[[list[dict[str, Any]]], None], full_disk: FullDisk,
                 reporter_for: Callable[[str], Reporter]):
        self.prepared, self.settings, self.space, self.study = prepared, settings, space, study
        self.faults, self.on_update, self.full_disk, self.reporter_for = faults, on_update, full_disk, reporter_for
        self.outcome = StudyOutcome(study=study, trials_this_run=0, steps_run=0, steps_budgeted=0, best_preset_path=None,
                                    confirm=settings.confirm, lr_centre=settings.lr_centre)
        self.redraws = 0  # trials skipped for drawing an earlier trial's values
        self.base = BaseGeneral()  # forgetting's zero, measured by this process's first run

    def optimize(self) -> None:
        """`settings.trials` trials, plus one for each skipped as a repeat (`tune_studies.duplicate_of`)."""
        deadline = None if self.settings.timeout is None else time.monotonic() + self.settings.timeout
        remaining = self.settings.trials
        try:
            for _ in range(REDRAW_ROUNDS + 1):
                before = self.redraws
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                self.study.optimize(self.objective, n_trials=remaining, timeout=timeout, catch=(TrialFailed,),
                                    callbacks=[self.after_trial])
                remaining = self.redraws - before
                if not remaining or self.outcome.interrupted or (deadline is not None and time.monotonic() >= deadline):
                    break
        except KeyboardInterrupt:  # Ctrl-C between trials (in one, the trial records it)
            self.outcome.signum = signal.SIGINT

    def objective(self, trial: Any) -> tuple[float, float]:
        import optuna

        claim(trial)  # first: another `tune` of this study must see the trial is alive
        params = self.space.suggest(trial)
        same = duplicate_of(self.study, trial, params)
        if same is not None:
            self.redraws += 1
            trial.set_user_attr("reason", f"drew the values of trial {same}: skipped, another drawn")
            raise optuna.TrialPruned(f"same values as trial {same}")
        # Trial numbers are unique in a shared study; the lock keeps a stray second `tune` out anyway.
        run_dir = RunDirectory(self.settings.study_dir / f"trial-{trial.number:04d}")
        with run_lock.owning(run_dir.path, "running a trial in it"):
            return self.run_trial(trial, params, run_dir)

    def run_trial(self, trial: Any, params: dict[str, Any], run_dir: RunDirectory) -> tuple[float, float]:
        """The trial's held-out loss and forgetting (`tune_pareto.objective_values`), or TrialPruned."""
        import optuna

        plan = trial_plan(self.prepared.plan, params, self.settings.steps)
        run_dir.create(overwrite=True)
        run_dir.write_plan(plan)
        tuner = finetuner.FineTuner(plan, self.prepared.tokenizer, self.prepared.train, self.prepared.evaluation, run_dir,
                          self.reporter_for(f"trial {trial.number}"), faults=self.faults,
                          on_evaluate=self._pruning_report(trial), save_artifacts=False,
                          baseline=self.base.baseline())  # every trial starts from the same base model: one measures it
        self.base.start(tuner)
        started, steps_before = time.perf_counter(), self.outcome.steps_run
        try:
            result = tuner.run()
        except TrainingFailed as failed:
            trial.set_user_attr("reason", failed.report["reason"])
            raise TrialFailed(failed.report["reason"]) from None
        except TrainingInterrupted as stopped:
            self._interrupted(trial, stopped.signum, stopped.step)
        except KeyboardInterrupt:  # a second Ctrl-C: the trial stops at once
            self._interrupted(trial, signal.SIGINT, tuner.position.step)
        finally:
            self.base.learn(tuner)
            self.outcome.steps_run = steps_before + tuner.position.step
            self.outcome.steps_budgeted += self.settings.steps
            _note_trial(trial, run_dir, tuner.position.step, self.settings.steps, time.perf_counter() - started)
        if tuner.signals.received is not None:  # it came in the last step: the trial is whole, the study stops
            self.outcome.signum = tuner.signals.received
            self.study.stop()
        if result.stop is not None and result.stop.cause is StopCause.CALLER:
            step, budget = tuner.position.step, self.settings.steps
            trial.set_user_attr("reason", f"pruned at step {step} of {budget}: not in the best third at step {step}")
            raise optuna.TrialPruned(f"pruned at step {step} of {budget}")
        if result.stop is not None and result.stop.cause is StopCause.EARLY_STOPPING:
            # its score is final: `train` would have stopped here too, keeping its best
            trial.set_user_attr("reason", f"{result.stop.text}: stopped at step {result.stop.step} of "
                                          f"{self.settings.steps}, as `train` would")
        # The kept evaluation's pair (`Position.early_stop`): its eval loss is the lowest, unless a lower one forgot
        # more than the plan's limit, which `train` would not keep either.
        return objective_values(result.best_eval_loss, result.forgetting)

    def _interrupted(self, trial: Any, signum: int, step: int) -> None:
        """A trial stopped by a signal: recorded as interrupted (pruned, for Optuna:
        neither a failure nor a result), and no trial after it."""
        import optuna

        name = signal.Signals(signum).name
        self.outcome.signum = signum
        trial.set_user_attr("interrupted", name)
        trial.set_user_attr("reason", f"interrupted by {name} at step {step}")
        self.study.stop()
        raise optuna.TrialPruned(f"interrupted by {name}")

    def after_trial(self, study: Any, trial: Any) -> None:
        self.outcome.trials_this_run += 1
        _refresh(study, self.on_update, self.settings.forgetting_limit)

    def conclude(self, preset: TrainingPreset, say: Callable[[str], None]) -> None:
        """After the trials: check the pick (`tune_pareto.pick`) at full length
        (unless --no-confirm), then write the winner as the study's preset. When
        no trial qualifies the preset's own values are written: there is nothing
        to check. Nothing is written when a signal stopped the study or the
        check: the same command checks it."""
        outcome, base = self.outcome, self.prepared.plan
        point, chosen = self.space.preset or preset_point(base), outcome.pick.point
        best = None if chosen is None else next(t for t in self.study.trials if t.number == chosen.trial)
        if best is None:
            outcome.search_won = False
        elif self.settings.confirm:
            if outcome.interrupted:
                return
            check = FullLengthCheck(self.prepared, self.settings, self.study, self.faults, self.reporter_for, say,
                                    self.base)
            try:
                outcome.confirmation = check.run(best, preset_trial(self.study, point), point)
            except TrainingInterrupted as stopped:
                outcome.signum = stopped.signum
            except KeyboardInterrupt:  # a second Ctrl-C
                outcome.signum = signal.SIGINT
            if outcome.interrupted:
                return
            outcome.search_won = outcome.confirmation.search_won
        said = _winner_said(outcome.confirmation, outcome.pick, len(self.study.trials))
        params = best.params if best is not None and outcome.search_won else point
        outcome.best_preset_path = write_best_preset(base, preset, self.prepared, self.settings, params, said)

    def _pruning_report(self, trial: Any) -> Callable[[int, float], bool]:
        """The trial's `on_evaluate`: keeps the trial's lowest eval loss so far
        and, at each rung, says whether successive halving stops the trial
        (`tune_space.goes_on`, by that loss). The lowest, not the latest: `train`
        keeps its best evaluation's weights, so a point that is best at step 18
        and overfits after is worth its step 18 (on code the preset's trial
        ended at 0.8855, and `train` would have kept 0.8444). The halving sees
        every trial's values at the rungs, the preset's too, but never stops
        the preset's (the mark the others are measured against) nor a trial at
        its last step (it is finished)."""
        last: dict[str, float] = {}
        judged: set[int] = set()
        steps_before = self.outcome.steps_run
        stoppable = not trial.user_attrs.get("preset")

        def report(step: int, eval_loss: float) -> bool:
            self.full_disk.steps = steps_before + step
            if "eval_loss" not in last or (math.isfinite(eval_loss) and not eval_loss >= last["eval_loss"]):
                last["eval_loss"] = eval_loss  # a NaN or infinite loss is kept only until a finite one comes
            stop = False
            if step in self.settings.rungs and step not in judged:  # a rollback replays steps; each rung judges once
                judged.add(step)
                stop = not goes_on(self.study, trial, step, last["eval_loss"]) and stoppable
            # the live row shows the trial's score (its lowest so far), as its row will when it ends
            _refresh(self.study, self.on_update, self.settings.forgetting_limit,
                     running=(trial.number, step, last["eval_loss"]))
            return stop

        return report


def open_study(settings: TuneSettings, space: SearchSpace, storage: Any) -> Any:
    """The study in its storage, created if it is new."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # a failed trial's traceback: the table gives its reason
    sampler = TrialSeededSampler(lambda seed: make_sampler(settings.sampler, space, seed), settings.seed)
    try:
        # Held-out loss and forgetting (`tune_pareto.py`). Optuna prunes no study of two objectives:
        # the trials' `on_evaluate` applies successive halving itself (`tune_space.goes_on`).
        return optuna.create_study(study_name=settings.study_name, storage=storage, sampler=sampler,
                                   pruner=optuna.pruners.NopPruner(), directions=["minimize", "minimize"],
                                   load_if_exists=True)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(f"Cannot open the study {settings.study_name} in {settings.where}: "
                          f"{redact_storage(str(exc), settings.storage)}",
                          "Use an Optuna storage URL such as sqlite:///study.db, postgresql://..., or journal:FILE.") from None


def _winner_said(check: Any, chosen: Any, trials: int) -> str:
    """The preset file's description of what it holds: the pick (`tune_pareto.Pick`) and the check's verdict."""
    said, count = chosen.said.rstrip("."), f"{trials} trials in all"
    if chosen.point is None or (check is not None and check.same):
        return f"{said}; {count}."
    if check is None:
        return f"{said}; {count}; not checked at full length."
    if check.search_won:
        return (f"{said}; {count}; at full length ({check.steps} steps) its "
                f"validation loss {check.best:.4f} beat the preset's {_loss(check.preset)}.")
    return (f"the preset's own values: the pick ({said}; {count}) did not beat them at "
            f"full length ({check.steps} steps; validation loss {_loss(check.best)} vs {_loss(check.preset)}).")


def _loss(value: float | None) -> str:
    return "none (failed)" if value is None else f"{value:.4f}"


def _note_trial(trial: Any, run_dir: RunDirectory, steps: int, budget: int, seconds: float) -> None:
    """What a trial did, kept with it in the study: steps (of its budget), time, recoveries."""
    trial.set_user_attr("steps", steps)
    trial.set_user_attr("budget", budget)
    trial.set_user_attr("seconds", round(seconds, 2))
    recoveries = run_dir.read_status().get("recoveries", [])
    if recoveries:
        trial.set_user_attr("recoveries", [f"{r['kind']} at step {r['step']}: {r['action']}" for r in recoveries])


def _refresh(study: Any, on_update: Callable[[list[dict[str, Any]]], None], limit: float | None,
             running: tuple[int, int, float] | None = None) -> None:
    rows = trial_rows(study, limit)
    if running is not None:
        number, step, loss = running
        for row in rows:
            if row["trial"] == number:
                row.update(state="running", eval_loss=loss, steps=step)
    on_update(rows)


