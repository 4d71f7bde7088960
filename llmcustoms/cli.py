"""The `llmcustoms` command line. Each command parses flags, calls one function
and renders the result; heavy libraries (torch, transformers, peft) are
imported inside commands so `llmcustoms --help` starts instantly.

Exit codes: 0 done; 2 user error; 1 unexpected bug; 130/143 interrupted.
"""

from __future__ import annotations

import os
import re
import sys
import time
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Iterator, Optional

import typer

from llmcustoms import __version__
from llmcustoms.console import console, print_error
from llmcustoms.errors import LlmcustomsError

class Method(str, Enum):
    lora = "lora"
    qlora = "qlora"
    full = "full"


class Scheduler(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class Distributed(str, Enum):
    ddp = "ddp"
    fsdp = "fsdp"


class Precision(str, Enum):
    no = "no"
    bf16 = "bf16"
    fp16 = "fp16"


app = typer.Typer(
    name="llmcustoms",
    help="Fine-tune a small open LLM on your own data with one command.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn an `LlmcustomsError` into one clear message and exit code 2."""
    try:
        yield
    except LlmcustomsError as exc:
        print_error(exc.message, exc.hint)
        raise typer.Exit(exc.exit_code) from None


def _quiet_libraries() -> None:
    """Keep the libraries' own progress bars and advice out of the user's terminal."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import logging
    import warnings

    # bitsandbytes announces on import that an optional Hub-hosted CPU kernel is
    # missing; it falls back to its own kernel, so the notice only confuses.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(torch|transformers|peft|bitsandbytes)\..*")


def _version_callback(value: bool) -> None:
    if value:
        console.print(f"llmcustoms {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True,
                                       help="Show the version and exit.")) -> None:
    """Fine-tune a small open LLM on your own data with one command."""


def default_run_name(model: str, preset: str) -> str:
    short = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model.rstrip("/")).name).strip("-").lower() or "model"
    return f"{short}-{Path(preset).stem}-{time.strftime('%Y%m%d-%H%M%S')}"


# Options shared by `train`, `plan` (and later `tune`), declared once.
Data = Annotated[str, typer.Argument(help="Training data: .jsonl, .json, .csv, .parquet or a saved datasets directory.")]
ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Hugging Face Hub id or local model directory. Default: the preset's best model that fits.")]
PresetOpt = Annotated[Optional[str], typer.Option("--preset", "-p", help="highspeed, quality (default), bestaccuracy, or a preset YAML file.")]
MethodOpt = Annotated[Optional[Method], typer.Option("--method", help="lora, qlora (4-bit base) or full fine-tuning. Default: what fits.")]
EpochsOpt = Annotated[Optional[float], typer.Option("--epochs", min=0.01, help="Passes over the training data.")]
MaxStepsOpt = Annotated[Optional[int], typer.Option("--max-steps", min=1, help="Stop after this many optimizer steps (overrides --epochs).")]
BatchOpt = Annotated[Optional[int], typer.Option("--batch-size", min=1, help="Micro-batch size: rows per forward pass. Default: the largest that fits.")]
AccumOpt = Annotated[Optional[int], typer.Option("--grad-accum", min=1, help="Micro-batches per optimizer step.")]
LrOpt = Annotated[Optional[float], typer.Option("--lr", min=0.0, help="Peak learning rate.")]
SchedulerOpt = Annotated[Optional[Scheduler], typer.Option("--lr-scheduler", help="Learning-rate decay after warmup.")]
WarmupOpt = Annotated[Optional[float], typer.Option("--warmup-ratio", min=0.0, max=0.99, help="Share of steps spent warming up.")]
SeqOpt = Annotated[Optional[int], typer.Option("--max-seq-len", min=16, help="Longest sequence in tokens; longer rows are truncated.")]
RankOpt = Annotated[Optional[int], typer.Option("--lora-r", min=1, help="LoRA rank.")]
AlphaOpt = Annotated[Optional[int], typer.Option("--lora-alpha", min=1, help="LoRA alpha (scale = alpha / r).")]
DropoutOpt = Annotated[Optional[float], typer.Option("--lora-dropout", min=0.0, max=0.99, help="Dropout on the LoRA path.")]
EvalSplitOpt = Annotated[Optional[float], typer.Option("--eval-split", min=0.0, max=0.9, help="Share of rows held out for evaluation.")]
EvalDataOpt = Annotated[Optional[str], typer.Option("--eval-data", help="A separate evaluation file (replaces --eval-split).")]
SaveEveryOpt = Annotated[Optional[int], typer.Option("--save-every", min=1, help="Checkpoint every N optimizer steps.")]
KeepOpt = Annotated[Optional[int], typer.Option("--keep", min=1, help="Checkpoints to keep (plus the best by eval loss). Default: 3.")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Random seed: same seed, same run.")]
PatienceOpt = Annotated[Optional[int], typer.Option("--early-stopping-patience", min=0, help="Stop after N evaluations without a better eval loss (0: never).")]
CheckpointingOpt = Annotated[Optional[bool], typer.Option("--gradient-checkpointing/--no-gradient-checkpointing", help="Recompute activations to save memory (slower). Default: only when needed.")]
PrecisionOpt = Annotated[Optional[Precision], typer.Option("--mixed-precision", help="Autocast precision. Default: bf16 or fp16 on a GPU, none on CPU.")]
PromptOpt = Annotated[bool, typer.Option("--train-on-prompt", help="Also compute the loss on prompts, not only on responses.")]
EnvFileOpt = Annotated[Optional[Path], typer.Option("--env-file", help="Read settings from this file instead of ./.env.")]
ReportToOpt = Annotated[Optional[str], typer.Option("--report-to", help="Also send metrics to tensorboard or wandb (optional extras). Default: none.")]
OutputDirOpt = Annotated[Optional[Path], typer.Option("--output-dir", "-o", help="Where run directories go. Default: runs.")]
ProcessesOpt = Annotated[Optional[int], typer.Option("--num-processes", min=1, help="Processes per machine (one per GPU), launched through accelerate.")]
DistributedOpt = Annotated[Optional[Distributed], typer.Option("--distributed", help="With several processes: ddp (each holds the model; default) or fsdp (full fine-tuning sharded over the processes).")]
MachinesOpt = Annotated[Optional[int], typer.Option("--num-machines", min=1, help="Machines training together (run the same command on each).")]
MachineRankOpt = Annotated[int, typer.Option("--machine-rank", min=0, help="This machine's index, 0 on the main one.")]
MainIpOpt = Annotated[Optional[str], typer.Option("--main-process-ip", help="Address of machine 0, for several machines.")]
MainPortOpt = Annotated[Optional[int], typer.Option("--main-process-port", help="Port on machine 0 for the processes to meet.")]
SkipOpt = Annotated[bool, typer.Option("--skip-bad-rows", help="Skip rows that fail validation instead of stopping.")]
RemoteOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow the model repository to run its own code.")]


# Command parameters that become plan values (by parameter name).
PLAN_FLAGS = ("method", "epochs", "max_steps", "batch_size", "grad_accum", "lr", "lr_scheduler", "warmup_ratio",
              "max_seq_len", "lora_r", "lora_alpha", "lora_dropout", "eval_split", "save_every", "keep", "seed",
              "early_stopping_patience", "gradient_checkpointing", "mixed_precision", "train_on_prompt",
              "trust_remote_code", "distributed")


def _train_options(arguments: dict[str, Any], settings: Any) -> Any:
    """TrainOptions from a command's parsed arguments (its `locals()`) and the
    settings: flag > environment > preset > default. Unset values are the plan's."""
    from llmcustoms.preparation import TrainOptions

    flags = {name: arguments[name] for name in PLAN_FLAGS if name in arguments}
    data, model, preset = arguments["data"], arguments["model"], arguments["preset"]
    eval_data, skip_bad_rows = arguments["eval_data"], arguments["skip_bad_rows"]
    names = {"batch_size": "micro_batch_size", "keep": "keep_checkpoints"}
    for switch in ("train_on_prompt", "trust_remote_code"):  # plain switches: off means "not given"
        if flags.get(switch) is False:
            flags[switch] = None
    overrides = dict(settings.plan_overrides())
    overrides.update({names.get(k, k): (v.value if isinstance(v, Enum) else v, "flag")
                      for k, v in flags.items() if v is not None})
    model_source = "flag" if model else "env LLMCUSTOMS_MODEL"
    preset_source = "flag" if preset else "env LLMCUSTOMS_PRESET" if settings.get("preset") else "default"
    return TrainOptions(data=data, model=model or settings.get("model"), preset=preset or settings.get("preset"),
                        eval_data=eval_data, skip_bad_rows=skip_bad_rows, overrides=overrides,
                        model_source=model_source, preset_source=preset_source)


def _output_dir(flag: Optional[Path], settings: Any) -> Path:
    return flag or Path(settings.get("output_dir") or "runs")


@app.command()
def train(
    data: Data,
    model: ModelOpt = None,
    preset: PresetOpt = None,
    method: MethodOpt = None,
    output_dir: OutputDirOpt = None,
    run_name: Annotated[Optional[str], typer.Option("--run-name", help="Name of this run's directory. Default: model-preset-time.")] = None,
    epochs: EpochsOpt = None,
    max_steps: MaxStepsOpt = None,
    batch_size: BatchOpt = None,
    grad_accum: AccumOpt = None,
    lr: LrOpt = None,
    lr_scheduler: SchedulerOpt = None,
    warmup_ratio: WarmupOpt = None,
    max_seq_len: SeqOpt = None,
    lora_r: RankOpt = None,
    lora_alpha: AlphaOpt = None,
    lora_dropout: DropoutOpt = None,
    eval_split: EvalSplitOpt = None,
    eval_data: EvalDataOpt = None,
    save_every: SaveEveryOpt = None,
    keep: KeepOpt = None,
    seed: SeedOpt = None,
    early_stopping_patience: PatienceOpt = None,
    gradient_checkpointing: CheckpointingOpt = None,
    mixed_precision: PrecisionOpt = None,
    train_on_prompt: PromptOpt = False,
    skip_bad_rows: SkipOpt = False,
    trust_remote_code: RemoteOpt = False,
    report_to: ReportToOpt = None,
    env_file: EnvFileOpt = None,
    num_processes: ProcessesOpt = None,
    num_machines: MachinesOpt = None,
    machine_rank: MachineRankOpt = 0,
    main_process_ip: MainIpOpt = None,
    main_process_port: MainPortOpt = None,
    distributed: DistributedOpt = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing run directory of the same name.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress display; for scripts.")] = False,
) -> None:
    """Fine-tune a model on DATA and save a LoRA adapter (or full model) into a run directory."""
    from llmcustoms import launching

    if (num_processes or 1) * (num_machines or 1) > 1 and not launching.inside_launch():
        with user_errors():
            from llmcustoms.data import read_dataset
            from llmcustoms.planning import check_distributed_method
            from llmcustoms.rundir import RunDirectory
            from llmcustoms.settings import load_settings

            settings = load_settings(env_file)
            # Refused here, once (exit 2), rather than by every process behind the
            # launcher, whose own report would bury the message.
            check_distributed_method(method.value if method else settings.get("method"),
                                     distributed.value if distributed else None)
            read_dataset(data, skip_bad_rows=skip_bad_rows)
            # Every process must write to the same run: name it once, here.
            name = run_name or default_run_name(model or settings.get("model") or "auto",
                                                preset or settings.get("preset") or "quality")
            target = RunDirectory.inside(_output_dir(output_dir, settings), name)
            target.check_available(overwrite)
            argv = launching.strip_launch_options(sys.argv[1:])
            argv += [] if run_name else ["--run-name", name]
            argv += [] if yes else ["--yes"]  # the processes cannot ask
            resume_options = _resume_options(quiet, env_file, report_to)
        raise typer.Exit(launching.relaunch(argv, num_processes or 1, num_machines or 1, machine_rank,
                                            main_process_ip, main_process_port, target.path, resume_options))
    with user_errors():
        _quiet_libraries()
        from llmcustoms import console as ui
        from llmcustoms.hardware import detect
        from llmcustoms.preparation import prepare_run
        from llmcustoms.rundir import RunDirectory
        from llmcustoms.settings import load_settings
        from llmcustoms.tracking import check_tracker

        settings = load_settings(env_file)
        output_dir = _output_dir(output_dir, settings)
        tracker = check_tracker(report_to or settings.get("report_to") or "none")
        options = _train_options(locals(), settings)
        world = launching.world_size()
        quiet = quiet or not launching.is_main_process()  # one display, from the main process
        # Fail before any slow work, not after it.
        if run_name:
            RunDirectory.inside(output_dir, run_name).check_available(overwrite or world > 1)
        else:
            RunDirectory(output_dir).check_available(overwrite=True)
        hardware = detect()
        prepared = prepare_run(options, hardware, world_size=world)
        plan = prepared.plan
        run_dir = RunDirectory.inside(output_dir, run_name or default_run_name(plan.model, plan.preset))

        if not quiet:
            ui.show_prepared(prepared, data)
            ui.show_plan(plan, hardware)
        if not yes and not quiet and not ui.confirm("Start training?"):
            raise typer.Exit(0)
        if launching.is_main_process():
            run_dir.create(overwrite=overwrite or world > 1)  # the launching process already checked
            run_dir.write_plan(plan)
        _wait_for_all_processes(world)
        _run_training(prepared, run_dir, quiet, resume=False, tracker=tracker if launching.is_main_process() else "none")


def _wait_for_all_processes(world: int) -> None:
    """A barrier between the processes of a distributed run (nothing with one process)."""
    if world > 1:
        import torch
        from accelerate import PartialState

        # The same cpu= as the trainer's Accelerator: the first state made is the one kept.
        PartialState(cpu=not torch.cuda.is_available()).wait_for_everyone()


def _run_training(prepared: Any, run_dir: Any, quiet: bool, resume: bool, tracker: str = "none",
                  faults_spent_through: int = 0) -> None:
    """Train (or resume), then map how it ended to what the user sees and the exit code."""
    from llmcustoms import console as ui
    from llmcustoms.faults import FaultInjector
    from llmcustoms.finetuner import FineTuner
    from llmcustoms import launching
    from llmcustoms.launching import EXIT_RESTART
    from llmcustoms.recovery import RestartNeeded, TrainingFailed, TrainingInterrupted
    from llmcustoms.tracking import TrackingReporter

    reporter = TrackingReporter.wrap(ui.make_reporter(quiet), tracker, run_dir, prepared.plan)
    tuner = FineTuner(prepared.plan, prepared.tokenizer, prepared.train, prepared.evaluation, run_dir, reporter,
                      faults=FaultInjector.from_env(spent_through=faults_spent_through))
    try:
        result = tuner.run(resume=resume)
    except RestartNeeded as restart:
        if restart.rank == launching.process_rank():  # one message, from the process that failed
            what = f"Process {restart.rank} ran out of memory at step {restart.step}, inside FSDP's collectives."
            if launching.restarts_on_request():
                ui.print_error(what + " Every process restarts from the last checkpoint with a smaller micro-batch.",
                               None)
            else:
                ui.print_error(what, f"Continue with: {launching.resume_hint(run_dir.path)} "
                                     "(it lowers the micro-batch first)")
        sys.stderr.flush()
        # Not a normal exit: the other processes wait in a collective this one
        # left, and interpreter shutdown could wait for them.
        os._exit(EXIT_RESTART)
    except TrainingInterrupted as stop:
        if launching.is_main_process():
            resume = launching.resume_hint(run_dir.path) if launching.world_size() > 1 else f"llmcustoms resume {run_dir.path}"
            ui.print_error(f"Interrupted at step {stop.step}; a checkpoint was saved.", f"Continue with: {resume}")
        raise typer.Exit(128 + stop.signum) from None
    except TrainingFailed as failed:
        ui.show_failure(failed.report, run_dir.path)
        if failed.__cause__ is not None:  # a bug, not a recoverable condition: show where
            import traceback

            traceback.print_exception(failed.__cause__)
        raise typer.Exit(1) from None
    from llmcustoms.launching import is_main_process

    if not is_main_process():
        return
    if quiet:
        print(result.output_path)
    else:
        ui.show_summary(result)


class Sampler(str, Enum):
    tpe = "tpe"
    random = "random"
    grid = "grid"


@app.command()
def tune(
    data: Data,
    trials: Annotated[int, typer.Option("--trials", "-n", min=1, help="Trials to run now (added to the study's earlier ones).")] = 20,
    model: ModelOpt = None,
    preset: PresetOpt = None,
    method: MethodOpt = None,
    max_steps: Annotated[Optional[int], typer.Option("--max-steps", min=1, help="Optimizer steps per trial. Default: 100, or one run if shorter.")] = None,
    budget_tokens: Annotated[Optional[int], typer.Option("--budget-tokens", min=1, help="Training tokens per trial (instead of --max-steps).")] = None,
    timeout: Annotated[Optional[float], typer.Option("--timeout", min=1, help="Stop starting new trials after this many seconds.")] = None,
    storage: Annotated[Optional[str], typer.Option("--storage", help="Optuna storage URL (sqlite:///..., postgresql://..., journal:FILE). Default: SQLite in the study directory.")] = None,
    study_name: Annotated[Optional[str], typer.Option("--study-name", help="Name of the study. Default: from the data file and model.")] = None,
    sampler: Annotated[Sampler, typer.Option("--sampler", help="tpe (default), random or grid.")] = Sampler.tpe,
    output_dir: OutputDirOpt = None,
    batch_size: BatchOpt = None,
    grad_accum: AccumOpt = None,
    max_seq_len: SeqOpt = None,
    eval_split: EvalSplitOpt = None,
    eval_data: EvalDataOpt = None,
    seed: SeedOpt = None,
    gradient_checkpointing: CheckpointingOpt = None,
    mixed_precision: PrecisionOpt = None,
    train_on_prompt: PromptOpt = False,
    skip_bad_rows: SkipOpt = False,
    trust_remote_code: RemoteOpt = False,
    env_file: EnvFileOpt = None,
) -> None:
    """Search learning rate and LoRA shape with Optuna; write the best as a preset `train` accepts."""
    if max_steps and budget_tokens:
        print_error("--max-steps and --budget-tokens both set the length of a trial.", "Pass one of them.")
        raise typer.Exit(2)
    with user_errors():
        _quiet_libraries()
        from llmcustoms import console as ui
        from llmcustoms.hardware import detect
        from llmcustoms.preparation import prepare_run
        from llmcustoms.presets import load_preset
        from llmcustoms.settings import load_settings
        from llmcustoms.tuning import TuneSettings, run_study, search_space, trial_steps

        env_settings = load_settings(env_file)
        output_dir = _output_dir(output_dir, env_settings)
        options = _train_options({**locals(), "max_steps": None}, env_settings)  # --max-steps is per trial here
        hardware = detect()
        prepared = prepare_run(options, hardware)
        base = prepared.plan
        mean_tokens = sum(len(e.input_ids) for e in prepared.train) / max(1, len(prepared.train))
        steps = trial_steps(base, max_steps, budget_tokens, mean_tokens)
        name = study_name or re.sub(r"[^A-Za-z0-9._-]+", "-", f"{Path(data).stem}-{Path(base.model.rstrip('/')).name}").lower()
        settings = TuneSettings(trials=trials, steps=steps, study_name=name, study_dir=output_dir / f"tune-{name}",
                                storage=storage, sampler=sampler.value, timeout=timeout, seed=base.seed)
        ui.show_prepared(prepared, data)
        ui.show_search(search_space(base, hardware), base, settings, round(steps * base.effective_batch_size * mean_tokens))
        with ui.TrialsDisplay() as display:
            outcome = run_study(prepared, load_preset(options.preset or "quality"), hardware, settings,
                                on_update=display.update)
        ui.show_study_outcome(outcome, data, options.model)
        if outcome.interrupted:
            raise typer.Exit(130)


@app.command()
def resume(
    run_dir: Annotated[Optional[Path], typer.Argument(help="The run to continue. Default: the newest unfinished run under --output-dir.")] = None,
    output_dir: OutputDirOpt = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress display; for scripts.")] = False,
    env_file: EnvFileOpt = None,
    report_to: ReportToOpt = None,
    num_processes: ProcessesOpt = None,
    num_machines: MachinesOpt = None,
    machine_rank: MachineRankOpt = 0,
    main_process_ip: MainIpOpt = None,
    main_process_port: MainPortOpt = None,
) -> None:
    """Continue an interrupted or failed run from its last good checkpoint (with any number of processes)."""
    from llmcustoms import launching

    if (num_processes or 1) * (num_machines or 1) > 1 and not launching.inside_launch():
        with user_errors():
            from llmcustoms.rundir import RunDirectory, find_unfinished_run
            from llmcustoms.settings import load_settings

            target = RunDirectory(run_dir) if run_dir else find_unfinished_run(_output_dir(output_dir, load_settings(env_file)))
            target.read_plan()  # a damaged run fails here, once, not in every process
            options = _resume_options(quiet, env_file, report_to)
        raise typer.Exit(launching.relaunch(["resume", str(target.path)] + options, num_processes or 1,
                                            num_machines or 1, machine_rank, main_process_ip, main_process_port,
                                            target.path, options))
    with user_errors():
        _quiet_libraries()
        from llmcustoms import console as ui
        from llmcustoms.preparation import prepare_resume
        from llmcustoms.rundir import RunDirectory, find_unfinished_run
        from llmcustoms.settings import load_settings
        from llmcustoms.tracking import check_tracker

        settings = load_settings(env_file)
        directory = RunDirectory(run_dir) if run_dir else find_unfinished_run(_output_dir(output_dir, settings))
        plan = directory.read_plan()
        status = directory.read_status()
        if status.get("status") == "completed":
            raise LlmcustomsError(f"{directory.path} has already completed; there is nothing to resume.",
                                  "Start a new run with `llmcustoms train`, or use this one (`report`, `chat`, `export`).")
        if directory.running_pid() is not None and launching.world_size() == 1:
            raise LlmcustomsError(f"{directory.path} is being trained right now (process {directory.running_pid()}).",
                                  "Wait for it, or stop it with Ctrl-C first; then resume.")
        world = launching.world_size()
        quiet = quiet or not launching.is_main_process()
        prepared = prepare_resume(plan, world_size=world)
        restart = directory.pending_restart()
        recovery = None
        if restart is not None:  # a process failed where the others could not learn of it
            prepared, recovery = _recover_before_restart(prepared, restart, directory)
            _wait_for_all_processes(world)  # every process has read the request before it goes
        if launching.is_main_process():
            if prepared.plan != plan:
                directory.write_plan(prepared.plan)  # new world size, or recovery
            if recovery is not None:
                directory.add_recovery(recovery.to_json())
                directory.clear_restart()
        _wait_for_all_processes(world)
        for reason in prepared.plan.reasons[len(plan.reasons):]:
            if reason.startswith("warning:") and launching.is_main_process():
                ui.print_warning(reason.removeprefix("warning: "))
        if not quiet:
            ui.console.print(f"Resuming [bold]{ui.escape(str(directory.path))}[/] "
                             f"({plan.model}, step {directory.read_status().get('step', 0)} of {plan.total_steps})")
        tracker = check_tracker(report_to or settings.get("report_to") or "none")
        _run_training(prepared, directory, quiet, resume=True,
                      tracker=tracker if launching.is_main_process() else "none",
                      faults_spent_through=restart["step"] if restart else 0)


def _resume_options(quiet: bool, env_file: Optional[Path], report_to: Optional[str]) -> list[str]:
    """The options a relaunched or restarted `resume` passes on."""
    return ((["--quiet"] if quiet else []) + (["--env-file", str(env_file)] if env_file else [])
            + (["--report-to", report_to] if report_to else []))


def _recover_before_restart(prepared: Any, restart: dict[str, Any], directory: Any) -> tuple[Any, Any]:
    """The resumed run's plan after the failure a process reported (the same on
    every process), or the failure report if recovery has run out of options."""
    from dataclasses import replace

    from llmcustoms import console as ui
    from llmcustoms.recovery import TrainingFailed, TrainingRecoverySystem

    from llmcustoms.launching import is_main_process, world_size

    try:
        plan, recovery = TrainingRecoverySystem().after_oom(prepared.plan, int(restart["step"]))
    except TrainingFailed as failed:
        _wait_for_all_processes(world_size())  # every process has read the request before it goes
        if is_main_process():
            directory.write_status("failed", reason=failed.report["reason"], suggestions=failed.report["suggestions"])
            directory.clear_restart()
            ui.show_failure(failed.report, directory.path)
        raise typer.Exit(1) from None
    return replace(prepared, plan=plan), recovery


@app.command()
def plan(
    data: Data,
    model: ModelOpt = None,
    preset: PresetOpt = None,
    method: MethodOpt = None,
    vram: Annotated[Optional[float], typer.Option("--vram", min=0.5, help="Plan for a GPU with this many GB instead of this machine's.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the plan as JSON (the shape of plan.json) and nothing else.")] = False,
    epochs: EpochsOpt = None,
    max_steps: MaxStepsOpt = None,
    batch_size: BatchOpt = None,
    grad_accum: AccumOpt = None,
    lr: LrOpt = None,
    lr_scheduler: SchedulerOpt = None,
    warmup_ratio: WarmupOpt = None,
    max_seq_len: SeqOpt = None,
    lora_r: RankOpt = None,
    lora_alpha: AlphaOpt = None,
    lora_dropout: DropoutOpt = None,
    eval_split: EvalSplitOpt = None,
    eval_data: EvalDataOpt = None,
    save_every: SaveEveryOpt = None,
    seed: SeedOpt = None,
    early_stopping_patience: PatienceOpt = None,
    gradient_checkpointing: CheckpointingOpt = None,
    mixed_precision: PrecisionOpt = None,
    train_on_prompt: PromptOpt = False,
    skip_bad_rows: SkipOpt = False,
    trust_remote_code: RemoteOpt = False,
    env_file: EnvFileOpt = None,
    num_processes: ProcessesOpt = None,
    num_machines: MachinesOpt = None,
    distributed: DistributedOpt = None,
) -> None:
    """Show what `train` would do with DATA, and whether it fits, without training."""
    with user_errors():
        _quiet_libraries()
        from llmcustoms import console as ui
        from llmcustoms.hardware import GIB, Hardware, detect
        from llmcustoms.preparation import prepare_run
        from llmcustoms.settings import load_settings

        options = _train_options(locals(), load_settings(env_file))
        hardware = detect()
        if vram is not None:
            machine = hardware
            # Cards sold as "24 GB" have 24 GiB.
            hardware = Hardware.with_gpu(vram, name=f"a {vram:g} GB GPU", ram_gib=machine.ram_bytes / GIB,
                                         cores=machine.cpu_cores)
        prepared = prepare_run(options, hardware, tokenizer_required=False,
                               world_size=(num_processes or 1) * (num_machines or 1))
        if json_output:
            print(prepared.plan.dumps())
            return
        ui.show_prepared(prepared, data)
        ui.show_plan(prepared.plan, hardware)


@app.command()
def hardware() -> None:
    """Show this machine's GPUs, CPU and memory, and which models and methods fit."""
    with user_errors():
        from llmcustoms import console as ui
        from llmcustoms.hardware import detect
        from llmcustoms.presets import load_families

        ui.show_hardware(detect(), load_families())


@app.command()
def presets() -> None:
    """List the training presets and the model families they choose from."""
    with user_errors():
        from llmcustoms import console as ui
        from llmcustoms.presets import builtin_preset_names, load_families, load_preset

        ui.show_presets([load_preset(name) for name in builtin_preset_names()], load_families())


@app.command()
def setup(
    data: Annotated[Optional[str], typer.Option("--data", help="Your training data (asked for if not given).")] = None,
    env_file: Annotated[Path, typer.Option("--env-file", help="The settings file to write.")] = Path(".env"),
) -> None:
    """Interactive set-up: checks your data, picks a goal and a model that fits, writes .env."""
    with user_errors():
        from llmcustoms.hardware import detect
        from llmcustoms.wizard import run_wizard

        try:
            command = run_wizard(detect(), env_file, data)
        except KeyboardInterrupt:
            print_error("Setup cancelled; nothing was written.", None)
            raise typer.Exit(130) from None
        if command:
            console.print("Next, train with:")
            console.print("  " + " ".join(command), soft_wrap=True)


@app.command()
def runs(output_dir: OutputDirOpt = None, env_file: EnvFileOpt = None) -> None:
    """List the runs under the output directory: model, method, status, steps, best eval loss."""
    with user_errors():
        from llmcustoms import console as ui
        from llmcustoms.settings import load_settings

        ui.show_runs(_output_dir(output_dir, load_settings(env_file)))


RunArg = Annotated[Path, typer.Argument(help="A run directory, e.g. runs/my-run.")]


def _run_directory(path: Path) -> Any:
    from llmcustoms.errors import ConfigError
    from llmcustoms.rundir import RunDirectory

    if not (path / "plan.json").is_file():
        raise ConfigError(f"{path} is not an llmcustoms run directory (no plan.json).",
                          "`llmcustoms runs` lists the runs under ./runs.")
    return RunDirectory(path)


@app.command()
def report(
    run: RunArg,
    plot: Annotated[bool, typer.Option("--plot", help="Also write loss.png (train/eval loss and learning rate) into the run.")] = False,
) -> None:
    """Analyse a run: convergence, overfitting, learning rate, throughput, recoveries, and what to change."""
    with user_errors():
        from llmcustoms import console as ui
        from llmcustoms.report import analyse
        from llmcustoms.report import plot as draw

        directory = _run_directory(run)
        ui.show_report(analyse(directory))
        if plot:
            console.print(f"Wrote {draw(directory)}")


MaxTokensOpt = Annotated[int, typer.Option("--max-new-tokens", min=1, help="Longest reply in tokens.")]
TemperatureOpt = Annotated[float, typer.Option("--temperature", min=0.0, help="0 for greedy; higher is more varied.")]


@app.command()
def generate(
    run: RunArg,
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="What to ask the model.")],
    max_new_tokens: MaxTokensOpt = 256,
    temperature: TemperatureOpt = 0.7,
    seed: SeedOpt = None,
) -> None:
    """Generate a reply to one prompt with the run's model."""
    with user_errors():
        _quiet_libraries()
        import sys

        from llmcustoms.generation import generate as reply
        from llmcustoms.generation import load_trained

        if seed is not None:
            from transformers import set_seed

            set_seed(seed)
        model, tokenizer, plan = load_trained(_run_directory(run))
        reply(model, tokenizer, plan, [{"role": "user", "content": prompt}], max_new_tokens, temperature,
              on_text=lambda text: (sys.stdout.write(text), sys.stdout.flush()))
        sys.stdout.write("\n")


@app.command()
def chat(
    run: RunArg,
    max_new_tokens: MaxTokensOpt = 512,
    temperature: TemperatureOpt = 0.7,
    system: Annotated[Optional[str], typer.Option("--system", help="A system message for the whole conversation.")] = None,
) -> None:
    """Talk with the run's model. /exit or Ctrl-D ends it; /reset starts over."""
    with user_errors():
        _quiet_libraries()
        import sys

        from llmcustoms.generation import generate as reply
        from llmcustoms.generation import load_trained

        model, tokenizer, plan = load_trained(_run_directory(run))
        start = [{"role": "system", "content": system}] if system else []
        messages = list(start)
        console.print(f"Chatting with [bold]{run}[/] ({plan.model} + adapter). /exit or Ctrl-D to quit, /reset to start over.")
        while True:
            try:
                text = console.input("[bold green]you>[/] ")
            except (EOFError, KeyboardInterrupt):
                console.print()
                break
            if text.strip() in ("/exit", "/quit"):
                break
            if text.strip() == "/reset":
                messages = list(start)
                continue
            if not text.strip():
                continue
            messages.append({"role": "user", "content": text})
            console.print("[bold blue]model>[/] ", end="")
            answer = reply(model, tokenizer, plan, messages, max_new_tokens, temperature,
                           on_text=lambda piece: (sys.stdout.write(piece), sys.stdout.flush()))
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": answer})


@app.command()
def export(
    run: RunArg,
    output: Annotated[Path, typer.Option("--output", help="Directory to write the exported model into.")],
    merge: Annotated[bool, typer.Option("--merge", help="Merge the adapter into a standalone 16-bit model.")] = False,
    dtype: Annotated[str, typer.Option("--dtype", help="Weights of the merged model: auto (the base's own), bfloat16, float16, float32.")] = "auto",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty --output directory.")] = False,
) -> None:
    """Copy the adapter (with tokenizer and a model card), or merge it into a standalone model."""
    with user_errors():
        _quiet_libraries()
        from llmcustoms.export import export_run

        written = export_run(_run_directory(run), output, merge, dtype, overwrite)
        console.print(f"Exported {'a merged model' if merge else 'the adapter'} to {written}")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        print_error("Interrupted.", None)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
