"""The `llmcustoms` command line. Each command parses flags, calls one function
and renders the result; heavy libraries (torch, transformers, peft) are
imported inside commands so `llmcustoms --help` starts instantly.

The options that set values come from the table in `planning/options.py` (through
`flags.takes_options`); how each way of ending maps to an exit code is
`endings.exit_code`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

from llmcustoms import __version__, flags
from llmcustoms.endings import ending, guarded_output, quiet_libraries, tolerant, ui
from llmcustoms.errors import LlmcustomsError
from llmcustoms.flags import takes_options

app = typer.Typer(
    name="llmcustoms",
    help="Fine-tune a small open LLM on your own data with one command.",
    no_args_is_help=True, add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help: at 80 columns Rich's help panels cut the variable names short.
    rich_markup_mode=None,
)


def _version_callback(value: bool) -> None:
    if value:
        ui().console.print(f"llmcustoms {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True,
                                       help="Show the version and exit.")) -> None:
    """Fine-tune a small open LLM on your own data with one command."""


def _session(values: dict[str, Any], env_file: Optional[Path], quiet: bool = False, allowed: Any = None) -> Any:
    from llmcustoms.commands.train import Session

    return Session.load(flags.given_values(values), env_file, quiet, allowed)


@app.command(cls=flags.Command)
@takes_options("train")
def train(run_name: flags.RunName = None, overwrite: flags.Overwrite = False, yes: flags.Yes = False,
          quiet: flags.Quiet = False, env_file: flags.EnvFile = None, num_processes: flags.NumProcesses = None,
          num_machines: flags.NumMachines = None, machine_rank: flags.MachineRank = 0,
          main_process_ip: flags.MainIp = None, main_process_port: flags.MainPort = None, **values: Any) -> None:
    """Fine-tune a model on DATA into a run directory.

    Saves a LoRA adapter (or the full model), with checkpoints along the way."""
    from llmcustoms.commands import train as train_command

    launch = train_command.Launch(num_processes, num_machines, machine_rank, main_process_ip, main_process_port)
    with ending():
        if not launch.needs_relaunch():
            quiet_libraries()
        session = _session(values, env_file, quiet)
        options = session.train_options()
        if launch.needs_relaunch():
            raise typer.Exit(train_command.launch_train(options, session, launch, run_name, overwrite, yes))
        result = train_command.train(options, session, run_name, overwrite, yes, confirm=ui().confirm)
    if result is not None:
        print(result.output_path) if session.quiet else ui().show_summary(result)


@app.command(cls=flags.Command)
@takes_options("resume")
@flags.takes_permissions
def resume(run_dir: flags.ResumeRun = None, from_step: flags.FromStep = None, reset_optimizer: flags.ResetOptimizer = False,
           epochs: flags.ResumeEpochs = None, max_steps: flags.ResumeMaxSteps = None,
           model_changed_ok: flags.ModelChangedOk = False, quiet: flags.Quiet = False, env_file: flags.EnvFile = None,
           num_processes: flags.NumProcesses = None, num_machines: flags.NumMachines = None,
           machine_rank: flags.MachineRank = 0, main_process_ip: flags.MainIp = None,
           main_process_port: flags.MainPort = None, allowed: Any = None, **values: Any) -> None:
    """Continue an interrupted or failed run from its checkpoint.

    From the last good checkpoint or --from one, with any number of processes; --epochs or --max-steps
    changes its length."""
    from llmcustoms.commands import train as train_command

    launch = train_command.Launch(num_processes, num_machines, machine_rank, main_process_ip, main_process_port)
    with ending():
        session = _session(values, env_file, quiet, allowed).resuming(from_step, reset_optimizer, epochs,
                                                                      model_changed_ok, max_steps)
        if launch.needs_relaunch():
            raise typer.Exit(train_command.launch_resume(run_dir, session, launch))
        quiet_libraries()
        result = train_command.resume(run_dir, session)
    if result is not None:
        print(result.output_path) if session.quiet else ui().show_summary(result)


@app.command(cls=flags.Command)
@takes_options("plan")
def plan(vram: flags.Vram = None, json_output: flags.Json = False, env_file: flags.EnvFile = None,
         num_processes: flags.NumProcesses = None, num_machines: flags.NumMachines = None, **values: Any) -> None:
    """Show what `train` would do with DATA, without training.

    The model, method, batch shape and schedule, and whether it fits in memory."""
    with ending(json_errors=json_output):
        quiet_libraries()
        from llmcustoms.planning.hardware import GIB, Hardware
        from llmcustoms.preparation.preparing import prepare_run
        from llmcustoms.training import preflight
        from llmcustoms.training.base_replies import planned_with_kept_answers
        from llmcustoms.ui.data_view import PreparationProgress, show_prepared

        session = _session(values, env_file)
        options = session.train_options()
        hardware = preflight.usable_hardware()  # a CPU-only torch on a GPU machine: a CPU plan that says so
        if vram is not None:  # cards sold as "24 GB" have 24 GiB
            hardware = Hardware.with_gpu(vram, name=f"a {vram:g} GB GPU", ram_gib=hardware.ram_bytes / GIB,
                                         cores=hardware.cpu_cores)
        with PreparationProgress() as progress:
            prepared = prepare_run(options, hardware, tokenizer_required=False, progress=progress,
                                   world_size=(num_processes or 1) * (num_machines or 1))
        plan = planned_with_kept_answers(session.output_dir, prepared.plan)
    if json_output:
        print(plan.dumps())
        return
    show_prepared(prepared, options.data)
    ui().show_plan(plan, hardware)


@app.command(cls=flags.Command)
@takes_options("tune")
def tune(trials: flags.Trials = 20, max_steps: flags.TrialSteps = None, budget_tokens: flags.BudgetTokens = None,
         timeout: flags.Timeout = None, storage: flags.Storage = None, study_name: flags.StudyName = None,
         sampler: flags.SamplerOpt = flags.Sampler.tpe, lr_find: flags.LrFind = None, confirm: flags.Confirm = True,
         env_file: flags.EnvFile = None, **values: Any) -> None:
    """Search hyperparameters with Optuna; write the best preset.

    Learning rate, warmup and LoRA shape; the best is written as a preset `train` accepts."""
    with ending():
        quiet_libraries()
        from llmcustoms.commands.lr_find import centre_study
        from llmcustoms.commands.tune import StudyRequest, prepare_study, run_study
        from llmcustoms.planning.presets import load_preset
        from llmcustoms.ui import tune_view
        from llmcustoms.ui.data_view import PreparationProgress, show_prepared

        session = _session(values, env_file)
        options = session.train_options()
        request = StudyRequest(trials, max_steps, budget_tokens, timeout, storage, study_name, sampler.value, confirm)
        with PreparationProgress() as progress:
            study = prepare_study(options, session.output_dir, request, progress)
        show_prepared(study.prepared, options.data)
        study = study if lr_find is False else centre_study(study, session.output_dir, run_missing=bool(lr_find))
        tune_view.show_search(study.space, study.prepared.plan, study.settings, study.tokens_per_trial)
        with tune_view.TrialsDisplay() as display:
            outcome = run_study(study.prepared, load_preset(options.preset or "quality"), study.hardware,
                                study.settings, on_update=display.update, warn=display.warn, say=display.say,
                                reporter_for=display.reporter)
    tune_view.show_study_outcome(outcome, options.data, options.model)
    if outcome.signum is not None:
        raise typer.Exit(128 + outcome.signum)  # 130 for Ctrl-C, 143 for SIGTERM


@app.command("lr-find", cls=flags.Command)
@takes_options("lr-find")
def lr_find(steps: flags.LrSteps = None, start_lr: flags.StartLr = 1e-7, end_lr: flags.EndLr = 1.0,
            env_file: flags.EnvFile = None, **values: Any) -> None:
    """Suggest a learning rate from a short range test.

    The lr rises from 1e-7 to 1 over the steps; the suggestion is where the loss falls fastest."""
    with ending():
        quiet_libraries()
        from llmcustoms.commands.lr_find import RangeTest, find_learning_rate

        session = _session(values, env_file)
        find_learning_rate(session.train_options(), session.output_dir, RangeTest(steps, start_lr, end_lr))


@app.command(cls=flags.Command)
def hardware() -> None:
    """Show this machine and which models and methods fit it."""
    with ending():
        from llmcustoms.models import hub_access
        from llmcustoms.planning.fitting import fit_table
        from llmcustoms.planning.presets import load_families
        from llmcustoms.training.preflight import usable_hardware
        from llmcustoms.ui.hardware_view import show_hardware

        fits = fit_table(machine := usable_hardware(), load_families())
        show_hardware(machine, fits, {m.hub_id: hub_access.availability(m.hub_id) for m in fits.models})


@app.command(cls=flags.Command)
def presets() -> None:
    """List the presets and the model families they choose from."""
    with ending():
        from llmcustoms.planning.presets import builtin_preset_names, load_families, load_preset

        ui().show_presets([load_preset(name) for name in builtin_preset_names()], load_families())


@app.command(cls=flags.Command)
def setup(data: flags.SetupData = None, env_file: flags.SetupEnvFile = Path(".env")) -> None:
    """Interactive set-up: data, goal and model; writes .env.

    Checks your data, picks a goal and a model that fits, and writes .env."""
    with ending():
        from llmcustoms.commands.setup import run_wizard
        from llmcustoms.training.preflight import usable_hardware

        try:
            command = run_wizard(usable_hardware(), env_file, data)
        except KeyboardInterrupt:
            ui().print_error("Setup cancelled; nothing was written.", None)
            raise typer.Exit(130) from None
    if command:
        ui().console.print("Next, train with:")
        ui().console.print("  " + ui().escape(" ".join(command)), soft_wrap=True)


@app.command(cls=flags.Command)
def settings(example: flags.Example = False, env_file: flags.EnvFile = None) -> None:
    """Show the LLMCUSTOMS_ settings in effect and where each is from.

    From the environment, then ./.env (or --env-file); --example prints every variable."""
    with ending():
        from llmcustoms.planning.settings import example_file, settings_in_effect

        found = [] if example else settings_in_effect(env_file)
    if example:
        print(example_file(), end="")
        return
    for name, value, where in found:
        print(f"{name}={value}  # {where}")
    if not found:
        print("No LLMCUSTOMS_ setting is set. `llmcustoms settings --example` lists them all.")


@app.command(cls=flags.Command)
@takes_options("runs")
def runs(env_file: flags.EnvFile = None, **values: Any) -> None:
    """List the runs: model, status, steps, perplexity, time, memory.

    The best eval perplexity and its change from the base model's (DPO: the eval loss)."""
    with ending():
        from llmcustoms.runs.run_directory import list_runs

        output_dir = _session(values, env_file).output_dir
        ui().show_runs(output_dir, list_runs(output_dir))


@app.command(cls=flags.Command)
def report(run: flags.RunArg, plot: flags.Plot = False, details: flags.Details = False) -> None:
    """Analyse a run and say what to change.

    Convergence, overfitting, learning rate, throughput and recoveries."""
    with ending():
        from llmcustoms.commands.report import analyse
        from llmcustoms.commands.report import plot as draw
        from llmcustoms.runs.run_directory import RunDirectory

        directory = RunDirectory.existing(run)
        ui().show_report(analyse(directory), details)
        if plot:
            ui().print_path("Wrote", draw(directory))


@app.command(cls=flags.Command)
@flags.takes_permissions
def generate(run: flags.RunArg, prompt: flags.PromptArg = None, prompt_option: flags.Prompt = None,
             checkpoint: flags.Checkpoint = None, max_new_tokens: flags.MaxNewTokens = 256,
             temperature: flags.GenerateTemperature = 0.0, seed: flags.Seed = None, allowed: Any = None) -> None:
    """Generate a reply to one prompt with the run's model.

    Greedy by default; the reply goes to stdout, what is being loaded to stderr."""
    with ending():
        from llmcustoms.models.generation import open_trained
        from llmcustoms.ui import dialog

        if (prompt is None) == (prompt_option is None):
            raise LlmcustomsError("Give one prompt.", f'For example: llmcustoms generate {run} "What do bees make?"')
        trained = open_trained(run, checkpoint, ui().waiting, ui().print_warning, seed, allowed)
        trained.reply([{"role": "user", "content": prompt or prompt_option or ""}], max_new_tokens, temperature,
                      on_text=dialog.write_piece)
        dialog.write_piece("\n")


@app.command(cls=flags.Command)
@flags.takes_permissions
def chat(run: flags.RunArg, checkpoint: flags.Checkpoint = None, max_new_tokens: flags.MaxNewTokens = 512,
         temperature: flags.ChatTemperature = 0.7, system: flags.System = None, allowed: Any = None) -> None:
    """Talk with the run's model. /exit or Ctrl-D ends it; /reset starts over.

    Ctrl-C stops a reply and keeps the conversation; at the prompt it ends the chat."""
    with ending():
        from llmcustoms.models.generation import open_trained
        from llmcustoms.ui import dialog

        trained = open_trained(run, checkpoint, ui().waiting, ui().print_warning, allowed=allowed)
        start = trained.conversation_start(system)  # a template that refuses a system turn: said now
        dialog.chat_loop(lambda messages, on_text: trained.reply(messages, max_new_tokens, temperature, on_text),
                         start, str(run), trained.description)


@app.command(cls=flags.Command)
@flags.takes_permissions
def export(run: flags.RunArg, output: flags.ExportOutput, merge: flags.Merge = False, dtype: flags.Dtype = "auto",
           format: flags.ExportFormat = "hf", quant: flags.Quant = "q8_0", verify: flags.Verify = True,
           overwrite: flags.ExportOverwrite = False, allowed: Any = None) -> None:
    """Copy the adapter, merge it, or write a GGUF (Ollama, llama.cpp)."""
    with ending():
        from llmcustoms.commands.export import export_run, gguf_options

        written = export_run(run, output, merge, dtype, overwrite, ui().waiting, allowed,
                             gguf_options(format, quant, verify))
        # Paths and the checks' lines are text, never markup: `out[/]x`, "llmcustoms[llama-cpp]".
        ui().print_path(f"Exported {written.what} to", written.path)  # whole on its own line, to copy
        for line in written.checks:
            ui().console.print(f"  {ui().escape(line)}")
        if written.failed:
            from llmcustoms.errors import CheckFailed

            raise CheckFailed(f"The export's check failed: {written.failed}.",
                              f"The files are kept in {written.path} for inspection; report the numbers above, "
                              "or try another --quant.")


def main() -> None:
    tolerant(sys.stdout), tolerant(sys.stderr)  # a file name of another encoding is echoed, not a traceback
    try:
        with guarded_output():
            app()
    except KeyboardInterrupt:
        ui().print_notice("Stopped (Ctrl-C).", None)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
