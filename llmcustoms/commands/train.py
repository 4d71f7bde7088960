"""The bodies of `train` and `resume`: from settings to a finished run directory.

`cli.py` parses flags and calls these; they plan, prepare the run directory,
run the `FineTuner` and say how it ended. With `--num-processes` the command
is first checked here (once, so a user error is one message) and then started
again under accelerate's launcher (`launching.relaunch`); every launched
process comes back through the same functions.

An ending the user should see (interrupted, failed) is shown here, where the
run directory is known, and re-raised: `cli.py` maps it to the exit code.
"""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from llmcustoms.data.dataset import read_dataset
from llmcustoms.data.token_cache import cache_dir
from llmcustoms.errors import LlmcustomsError
from llmcustoms.models.loading import Allowed
from llmcustoms.planning.options import Given
from llmcustoms.planning.planner import check_distributed_method
from llmcustoms.planning.settings import Settings, load_settings
from llmcustoms.planning.train_options import TrainOptions, train_options
from llmcustoms.preparation.prepared_run import PreparedRun, no_progress
from llmcustoms.preparation.preparing import prepare_resume, prepare_run
from llmcustoms.recovery.faults import FaultInjector
from llmcustoms.recovery.recovery_system import (
    RestartNeeded,
    TrainingFailed,
    TrainingInterrupted,
    TrainingRecoverySystem,
    create_failure_report,
)
from llmcustoms.runs import overwriting, read_only, run_lock
from llmcustoms.runs.checkpoints import CheckpointManager, ResumeFrom, step_named
from llmcustoms.runs.failure_report import describe, save_failure_report
from llmcustoms.runs.run_directory import RunDirectory, default_run_name, find_unfinished_run
from llmcustoms.runs.run_log import LoggingReporter, completed_text, failed_text, plan_line
from llmcustoms.runs.speeds import record_speed
from llmcustoms.runs.tracking import TrackingReporter, check_tracker
from llmcustoms.training import (
    finetuner,  # the module: tests put a rigged FineTuner in it
    launching,
)
from llmcustoms.training.base_replies import planned_with_kept_answers
from llmcustoms.training.preflight import as_disk_full, check_disk_space, disk_full_failure, usable_hardware
from llmcustoms.training.samples import run_samples
from llmcustoms.ui import console
from llmcustoms.ui.data_view import PreparationProgress, show_prepared
from llmcustoms.ui.train_view import make_reporter


@dataclass(frozen=True)
class Launch:
    """How many processes, on how many machines (the launch flags)."""

    processes: int | None = None
    machines: int | None = None
    machine_rank: int = 0
    main_ip: str | None = None
    main_port: int | None = None

    def needs_relaunch(self) -> bool:
        """Several processes asked for, and this is not one of them yet."""
        return (self.processes or 1) * (self.machines or 1) > 1 and not launching.inside_launch()

    def relaunch(self, argv: list[str], run_dir: Path, resume_options: list[str]) -> int:
        return launching.relaunch(argv, self.processes or 1, self.machines or 1, self.machine_rank, self.main_ip,
                                  self.main_port, run_dir, resume_options)


@dataclass(frozen=True)
class Session:
    """What a training command was told besides the plan's values."""

    settings: Settings
    quiet: bool = False
    env_file: Path | None = None
    report_to: str | None = None  # as a flag, for the processes a relaunch starts
    start: ResumeFrom = ResumeFrom()  # `resume`'s --from, --reset-optimizer and --epochs
    allowed: Allowed = Allowed()  # remote code, pickle weights: `resume`'s own flags, never its plan.json
    model_changed_ok: bool = False  # `resume --model-changed-ok`: go on although the base model's files changed

    @classmethod
    def load(cls, given: dict[str, Any], env_file: Path | None, quiet: bool = False,
             allowed: Allowed | None = None) -> "Session":
        """The settings with the command's flags over them: flag > environment.
        `allowed`: `resume`'s flags; for `train`, its settings."""
        settings = load_settings(env_file)
        settings.values.update({name: Given(value, "flag") for name, value in given.items()})
        if allowed is None:
            allowed = Allowed(bool(settings.get("trust_remote_code")), bool(settings.get("allow_pickle_weights")))
        return cls(settings, quiet=quiet, env_file=env_file, report_to=given.get("report_to"), allowed=allowed)

    def train_options(self) -> Any:
        """What to train, as `preparation.TrainOptions`; what is not given, the plan decides."""
        return train_options(self.settings)

    @property
    def output_dir(self) -> Path:
        return run_lock.folder_for_runs(Path(self.settings.get("output_dir") or "runs"))

    def tracker(self) -> str:
        """The metrics tracker asked for; an error now if its package is missing."""
        return check_tracker(self.settings.get("report_to") or "none")

    def resume_options(self) -> list[str]:
        """The options a relaunched or restarted `resume` passes on."""
        return ((["--quiet"] if self.quiet else []) + (["--env-file", str(self.env_file)] if self.env_file else [])
                + (["--report-to", self.report_to] if self.report_to else []) + self.allowed.flags())

    def resuming(self, from_step: str | None, reset_optimizer: bool, epochs: float | None,
                 model_changed_ok: bool = False, max_steps: int | None = None) -> "Session":
        """This session with `resume`'s own flags. `epochs` and `max_steps` are the flags' values
        only: LLMCUSTOMS_EPOCHS or _MAX_STEPS, set for `train`, must not change a run at every resume."""
        step = step_named(from_step) if from_step is not None else None
        start = ResumeFrom(step, reset_optimizer, epochs, max_steps)
        return replace(self, start=start, model_changed_ok=model_changed_ok)

    def start_options(self) -> list[str]:
        """`resume`'s own flags, for the processes a relaunch starts: not for a
        restart after a failure, which goes on from the newest checkpoint as it is."""
        start = self.start
        return ((["--from", str(start.step)] if start.step is not None else [])
                + (["--reset-optimizer"] if start.reset_optimizer else [])
                + (["--epochs", repr(start.epochs)] if start.epochs is not None else [])
                + (["--max-steps", str(start.max_steps)] if start.max_steps is not None else [])
                + (["--model-changed-ok"] if self.model_changed_ok else []))


def launch_train(options: TrainOptions, session: Session, launch: Launch, run_name: str | None, overwrite: bool,
                 yes: bool) -> int:
    """Check what can be checked once, then start every process of the run."""
    # Refused here, once (exit 2), rather than by every process behind the
    # launcher, whose own report would bury the message.
    check_distributed_method(options.override("method", None), options.override("distributed", None))
    read_dataset(options.data, options.policy)
    # Every process must write to the same run: name it once, here.
    name = run_name or default_run_name(options.model or "auto", options.preset or "quality")
    target = RunDirectory.inside(session.output_dir, name)
    argv = launching.strip_launch_options(sys.argv[1:])
    argv += [] if run_name else ["--run-name", name]
    argv += [] if yes else ["--yes"]  # the processes cannot ask
    # The launcher owns the run for all its processes (and their restarts); they do not lock it.
    with run_lock.owning(target.path, "starting another run in it"):
        target.check_available(overwrite, overwriting.given_paths(options))
        return launch.relaunch(argv, target.path, session.resume_options())


def train(options: TrainOptions, session: Session, run_name: str | None, overwrite: bool, yes: bool,
          confirm: Callable[[str], bool]) -> Any:
    """Plan, show the plan, ask, train. Returns the `TrainResult` (None when
    the user declined or this is not the main process).

    A named run is locked before anything else: a second `train` of the same
    name (or `--overwrite` of a run that is training) is refused before its
    data preparation, not after it."""
    if run_name and not launching.inside_launch():
        with run_lock.owning(RunDirectory.inside(session.output_dir, run_name).path, "starting another run in it"):
            return _train(options, session, run_name, overwrite, yes, confirm)
    return _train(options, session, run_name, overwrite, yes, confirm)


def _train(options: TrainOptions, session: Session, run_name: str | None, overwrite: bool, yes: bool,
           confirm: Callable[[str], bool]) -> Any:

    tracker = session.tracker()
    world = launching.world_size()
    quiet = session.quiet or not launching.is_main_process()  # one display, from the main process
    keep = overwriting.given_paths(options)  # what --overwrite must never remove
    # Fail before any slow work, not after it. Behind a launcher only the main
    # process looks: the launcher checked already, and another process could find
    # the folder half made by the main one (no plan.json yet) and refuse it.
    if launching.is_main_process():
        check_run_directory_early(session.output_dir, run_name, overwrite or world > 1, keep)
    hardware = usable_hardware()  # without GPUs the installed torch cannot use: the plan says so
    with PreparationProgress() if not quiet else nullcontext(no_progress) as progress:
        prepared = prepare_run(options, hardware, world_size=world, progress=progress)
    plan = prepared.plan
    run_dir = RunDirectory.inside(session.output_dir, run_name or default_run_name(plan.model, plan.preset))
    # Stops (exit 2) before anything is written, and before the question, if the run cannot fit on the disk.
    disk_warning = check_disk_space(plan, run_dir.path, prepared.model_params)
    plan = planned_with_kept_answers(session.output_dir, plan.with_warning(disk_warning) if disk_warning else plan)
    prepared = replace(prepared, plan=plan)
    if not quiet:
        show_prepared(prepared, options.data)
        console.show_plan(plan, hardware)
        if not yes and not confirm("Start training?"):
            return None
    # Re-entrant: a named run is held already; a run named just now is locked here, before it is made.
    with nullcontext() if launching.inside_launch() else run_lock.owning(run_dir.path, "starting another run in it"):
        if launching.is_main_process():
            run_dir.create(overwrite or world > 1, keep)  # the launching process already checked
            run_dir.write_plan(plan)
            # Bad rows skipped, advice: from the start. Its training time starts with the loop, the model loaded.
            run_dir.write_status("running", training=False, step=0, data=plan.data_report)
        if not quiet:
            console.print_path("Run directory", run_dir.path)
        wait_for_all_processes(world)
        return run_training(prepared, run_dir, quiet, resume=False, tracker=tracker, cache=options.cache_dir)


def check_run_directory_early(output_dir: Path, run_name: str | None, overwrite: bool, keep: dict[str, Path]) -> None:
    """Refuse a run directory that cannot be used before the data is prepared."""
    if run_name:
        RunDirectory.inside(output_dir, run_name).check_available(overwrite, keep)
    else:
        RunDirectory(output_dir).check_no_file_in_the_way()


def launch_resume(run_dir: Path | None, session: Session, launch: Launch) -> int:
    # A damaged run, a finished one, a bad --from or --epochs fail here, once, not in every process.
    target = _resumable(run_dir, session)
    options = session.resume_options()
    with run_lock.owning(target.path, "resuming it"):  # for all the processes it starts
        return launch.relaunch(["resume", str(target.path)] + options + session.start_options(), target.path, options)


def _resumable(run_dir: Path | None, session: Session) -> Any:
    """The run to continue, refused if finished (unless its length changes) or
    being trained right now, or if --from, --epochs or --max-steps cannot be done."""
    directory = RunDirectory(run_dir) if run_dir else find_unfinished_run(session.output_dir)
    plan, start = session.allowed.applied_to(directory.read_plan()), session.start  # remote code refused here
    status = directory.read_status()
    if status.get("status") == "completed" and not start.resizes:
        raise LlmcustomsError(f"{directory.path} has already completed; there is nothing to resume.",
                              "Start a new run with `llmcustoms train`, extend this one with `llmcustoms resume "
                              "RUN --epochs N` (or --max-steps N), or use it (`report`, `chat`, `export`).")
    read_only.check_writable(directory.path, "so it cannot be resumed")  # before the model loads: it writes everywhere
    start.planned(plan, status.get("step", 0))  # an error now, before the data is read, if it cannot be
    if start.step is not None:
        CheckpointManager(directory.checkpoints_path, keep=1).verified(start.step)
    pid = None if launching.inside_launch() else directory.running_pid()  # a launcher holds it for its processes
    if pid is not None:
        raise LlmcustomsError(f"{directory.path} is being trained right now (process {pid or '?'}).",
                              "Wait for it, or stop it with Ctrl-C first; then resume.")
    return directory


def resume(run_dir: Path | None, session: Session) -> Any:
    """Continue a run from its last good checkpoint; returns the `TrainResult`
    (None on a process other than the main one). The run is locked for it."""
    if launching.inside_launch():
        return _resume(run_dir, session)
    directory = _resumable(run_dir, session)
    with run_lock.owning(directory.path, "resuming it"):
        return _resume(directory.path, session)


def _resume(run_dir: Path | None, session: Session) -> Any:

    directory = _resumable(run_dir, session)
    plan = session.allowed.applied_to(directory.read_plan())
    world = launching.world_size()
    prepared = prepare_resume(plan, world_size=world, model_changed_ok=session.model_changed_ok)
    prepared = replace(prepared, plan=session.start.planned(prepared.plan, directory.read_status().get("step", 0)))
    check_disk_space(prepared.plan, directory.path, resuming=True)  # exit 2 if the rest of the run cannot fit
    restart = directory.pending_restart()
    recovery = None
    if restart is not None:  # a process failed where the others could not learn of it
        prepared, recovery = _recover_before_restart(prepared, restart, directory)
    # Every process has read plan.json (and the request) before it changes: the
    # check of --epochs or --max-steps in a process that read it later would fail.
    wait_for_all_processes(world)
    if launching.is_main_process():
        if prepared.plan != plan:
            directory.write_plan(prepared.plan)  # new world size, recovery, or another length
        if recovery is not None:
            directory.add_recovery(recovery.to_json())
            directory.clear_restart()
        for warning in prepared.plan.warnings[len(plan.warnings):]:
            console.print_warning(warning)
    wait_for_all_processes(world)
    quiet = session.quiet or not launching.is_main_process()
    if not quiet:
        at = session.start.step if session.start.step is not None else directory.read_status().get("step", 0)
        console.console.print(f"Resuming [bold]{console.escape(str(directory.path))}[/] "
                         f"({console.escape(plan.model)}, step {at} of {prepared.plan.total_steps})")
    return run_training(prepared, directory, quiet, resume=session.start, tracker=session.tracker(),
                        faults_spent_through=restart["step"] if restart else 0,
                        cache=session.settings.get("cache_dir"))


def _recover_before_restart(prepared: PreparedRun, restart: dict[str, Any], directory: Any) -> tuple[Any, Any]:
    """The resumed run's plan after the failure a process reported (the same on
    every process), or the failure report if recovery has run out of options."""
    try:
        plan, recovery = TrainingRecoverySystem().after_oom(prepared.plan, int(restart["step"]))
    except TrainingFailed as failed:
        wait_for_all_processes(launching.world_size())  # every process has read the request before it goes
        if launching.is_main_process():
            directory.write_status("failed", reason=failed.report["reason"], suggestions=failed.report["suggestions"])
            directory.clear_restart()
            console.show_failure(failed.report, directory.path)
        raise
    return replace(prepared, plan=plan), recovery


def wait_for_all_processes(world: int) -> None:
    """A barrier between the processes of a distributed run (nothing with one process)."""
    if world > 1:
        import torch  # only with several processes: one process never starts the distributed state
        from accelerate import PartialState

        # The same cpu= as the trainer's Accelerator: the first state made is the one kept.
        PartialState(cpu=not torch.cuda.is_available()).wait_for_everyone()


def run_training(prepared: PreparedRun, run_dir: Any, quiet: bool, resume: bool | ResumeFrom, tracker: str = "none",
                 faults_spent_through: int = 0, cache: str | None = None) -> Any:
    """Train (or resume); show how it ended if it did not finish, and re-raise;
    train.log says how it ended either way. `cache`: the cache directory, where
    the measured speed is kept."""
    main = launching.is_main_process()
    # One writer of train.log, as of every file of the run: the main process. The plan: the ETA counts the end too.
    reporter = LoggingReporter(TrackingReporter.wrap(make_reporter(quiet, console.console, console.err_console, prepared.plan),
                                                     tracker if main else "none", run_dir, prepared.plan),
                               run_dir.log_path if main and run_dir.writable else None)
    reporter.log.write("info", ("resuming: " if resume else "starting: ") + plan_line(prepared.plan))
    for warning in () if resume else prepared.plan.warnings:  # the plan table's, in train.log (and said, if quiet)
        reporter.message(warning, warning=True) if quiet else reporter.log.write("warning", warning)
    samples = run_samples(prepared, run_dir, warn=lambda text: reporter.message(text, warning=True))
    tuner = finetuner.FineTuner(prepared.plan, prepared.tokenizer, prepared.train, prepared.evaluation, run_dir, reporter,
                      faults=FaultInjector.from_env(spent_through=faults_spent_through), samples=samples)
    try:
        result = tuner.run(resume=resume)
    except RestartNeeded as restart:
        reporter.log.write("error", restart.reason)
        _exit_for_restart(restart, run_dir)
    except TrainingInterrupted as stop:
        if main:
            _say_interrupted(stop, run_dir, reporter.log)
        raise
    except TrainingFailed as failed:
        _say_failed(failed, tuner.plan, run_dir, reporter.log, main)
        raise
    except Exception as error:  # not one of the loop's endings: a user error, or a bug outside the loop
        if main:
            _record_escaped(error, tuner, run_dir, reporter.log)
        raise
    finally:
        reporter.activity(None)  # a spinner left by a failure outside the live display
        if main and launching.world_size() == 1:
            _keep_speed(prepared.plan, run_dir, cache)
    result.general = run_dir.read_status().get("general_knowledge") or {}  # the forgetting check's, for the summary
    reporter.log.write("info", completed_text(result))
    return result if main else None


def _say_interrupted(stop: Any, run_dir: Any, log: Any) -> None:

    command = (launching.resume_hint(run_dir.path) if launching.world_size() > 1
               else f"llmcustoms resume {run_dir.path}")
    kept = "a checkpoint of it was saved" if stop.step else "no step had finished yet"
    console.print_notice(f"Stopped at step {stop.step}; {kept}.", f"Continue with: {command}")
    log.write("warning", f"interrupted: stopped at step {stop.step}; {kept}.\nContinue with: {command}")


def _say_failed(failed: Any, plan: Any, run_dir: Any, log: Any, main: bool) -> None:
    """The failure panel, the bug's traceback (not a full disk's: `preflight.as_disk_full`),
    and (from the main process) failure.json."""
    cause = failed.__cause__
    agreed = failed.report["kind"] == "disk_full"  # at a checkpoint, where every process stops together
    if main:
        as_disk_full(failed, run_dir)
    if main or not agreed:  # one panel for what every process knows
        console.show_failure(failed.report, run_dir.path)
    if cause is not None and failed.report["kind"] != "disk_full":  # a bug, not a recoverable condition: show where
        import traceback  # only for a bug's traceback

        traceback.print_exception(cause)
    if main:
        _report_failure(run_dir, plan, cause or failed, failed.report, log)
    if agreed:  # no process exits, and has the launcher stop the others, before the main one's reports are written
        wait_for_all_processes(launching.world_size())


def _record_escaped(error: Exception, tuner: Any, run_dir: Any, log: Any) -> None:
    """An exception out of `tuner.run` from outside the loop's own handling (loading
    the model, saving the weights). A user error is the CLI's to say; a full disk is
    said, and raised as `TrainingFailed` (exit 1, no traceback); anything else is a
    bug: status.json and failure.json say so, and it goes on with its traceback."""
    if isinstance(error, LlmcustomsError):
        log.write("error", f"stopped: {error}")
        return
    step = tuner.position.step
    full = disk_full_failure(error, run_dir.path, step)
    report = full or create_failure_report("error", tuner.plan, step, describe(error))
    run_dir.write_status("failed", step=step, reason=report["reason"], suggestions=report["suggestions"])
    if full is not None:
        console.show_failure(full, run_dir.path)
    _report_failure(run_dir, tuner.plan, error, report, log)
    if full is not None:
        raise TrainingFailed(full) from error


def _report_failure(run_dir: Any, plan: Any, error: BaseException, report: dict[str, Any], log: Any) -> None:
    """failure.json, where it is said, and the ending in train.log."""
    said = save_failure_report(run_dir, plan, error, report)
    if said:
        console.err_console.print(console.escape(said), soft_wrap=True)  # the path whole, to copy
    log.write("error", failed_text(report, said))


def _keep_speed(plan: Any, run_dir: Any, cache: str | None) -> None:
    """This run's measured speed, for the next plan's duration (`runs/speeds.py`)."""
    if not plan.objective_kind.token_loss:  # DPO's tokens/s include the reference's forward: not the speed plans are drawn from
        return
    try:
        # The hardware the run used: a CPU-only torch's speed is not the GPU's.
        record_speed(cache_dir(cache), usable_hardware().as_used(plan.mixed_precision), plan.model, plan.method, run_dir.read_metrics())
    except Exception:  # a nicety: never in the way of how the run ended (it runs in a finally)
        return


def _exit_for_restart(restart: Any, run_dir: Any) -> None:

    if restart.rank == launching.process_rank():  # one message, from the process that failed
        what = f"Process {restart.rank} ran out of memory at step {restart.step}, inside FSDP's collectives."
        if launching.restarts_on_request():
            console.print_error(what + " Every process restarts from the last checkpoint with a smaller micro-batch.", None)
        else:
            console.print_error(what, f"Continue with: {launching.resume_hint(run_dir.path)} "
                                 "(it lowers the micro-batch first)")
    sys.stderr.flush()
    # Not a normal exit: the other processes wait in a collective this one
    # left, and interpreter shutdown could wait for them.
    os._exit(launching.EXIT_RESTART)
