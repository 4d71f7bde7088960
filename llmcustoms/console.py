"""Everything the user sees: progress, tables, panels and error messages.

The trainer talks to the `Reporter` protocol (`reporting.py`) and never to
Rich directly; this module holds the Rich implementations. Rich appears here
and in `dialog.py` (what llmcustoms asks) only, and neither computes: what
they show comes worked out (`fitting.fit_table`, `rundir.list_runs`).
"""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from llmcustoms.presets import MEDIUM_DATASET_ROWS, SMALL_DATASET_ROWS
from llmcustoms.reporting import Reporter

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


class QuietReporter:
    """For scripts (--quiet): only warnings, on stderr."""

    def message(self, text: str, warning: bool = False) -> None:
        if warning:
            err_console.print(f"[yellow]warning:[/] {text}")

    def training_started(self, total_steps: int, start_step: int = 0) -> None:
        pass  # nothing to draw

    def step(self, row: dict[str, Any]) -> None:
        pass  # scripts want the result, not the steps

    def evaluated(self, row: dict[str, Any]) -> None:
        pass  # scripts want the result, not the steps

    def training_finished(self) -> None:
        pass  # nothing to tear down


class RichReporter:
    """A live progress bar with loss, learning rate, tokens/s and ETA."""

    def __init__(self) -> None:
        self.progress: Progress | None = None
        self.task: Any = None
        self.last_eval = ""

    def message(self, text: str, warning: bool = False) -> None:
        target = self.progress.console if self.progress else console
        target.print(f"[yellow]warning:[/] {text}" if warning else text)

    def training_started(self, total_steps: int, start_step: int = 0) -> None:
        self.progress = Progress(
            BarColumn(bar_width=20), MofNCompleteColumn(),
            TextColumn("loss [cyan]{task.fields[loss]}"), TextColumn("lr {task.fields[lr]}"),
            TextColumn("{task.fields[tps]} tok/s"), TextColumn("{task.fields[eval]}"),
            TextColumn("eta"), TimeRemainingColumn(),
            console=console, transient=False,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step,
                                           loss="-", lr="-", tps="-", eval="")

    def step(self, row: dict[str, Any]) -> None:
        if self.progress is None:
            return
        self.progress.update(self.task, completed=row["step"], loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}",
                             tps=f"{row['tokens_per_s']:,.0f}", eval=self.last_eval)

    def evaluated(self, row: dict[str, Any]) -> None:
        self.last_eval = f"eval [magenta]{row['eval_loss']:.4f}[/]"
        if self.progress is not None:
            self.progress.update(self.task, eval=self.last_eval)

    def training_finished(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def make_reporter(quiet: bool) -> Reporter:
    return QuietReporter() if quiet else RichReporter()


def print_warning(message: str) -> None:
    err_console.print(f"[yellow]warning:[/] {escape(message)}")


def print_error(message: str, hint: str | None) -> None:
    text = f"[bold red]Error:[/] {escape(message)}"
    if hint:
        text += f"\n{escape(hint)}"
    err_console.print(text)


def escape(text: str) -> str:
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def show_prepared(prepared: Any, data_path: str) -> None:
    """What was found in the data, before the plan."""
    dataset = prepared.dataset
    line = (f"Data: [bold]{escape(data_path)}[/] - detected format [bold]{escape(dataset.format_description)}[/], "
            f"{len(dataset.examples):,} rows")
    if dataset.skipped:
        line += f" ([yellow]{dataset.skipped:,} bad rows skipped[/])"
    console.print(line)
    if prepared.plan.eval_rows:
        console.print(f"Evaluation: {prepared.plan.eval_rows:,} rows held out ({escape(prepared.eval_source)})")
    if prepared.used_fallback_template:
        console.print("The tokenizer has no chat template: using the llmcustoms fallback template (see README).")
    if prepared.truncated:
        console.print(f"{prepared.truncated} rows truncated to {prepared.plan.max_seq_len} tokens"
                      + (f", {prepared.dropped} dropped (no response left)" if prepared.dropped else "") + ".")
    if prepared.seconds:
        console.print(f"Data prepared in {prepared.seconds:.1f} s (tokenized rows are cached for the next run).")


MEMORY_PARTS = (("weights", "weights_bytes"), ("LoRA adapters", "trainable_bytes"), ("gradients", "gradients_bytes"),
                ("optimizer state", "optimizer_bytes"), ("activations", "activations_bytes"),
                ("logits", "logits_bytes"), ("gathered from other shards", "gathered_bytes"),
                ("overhead", "overhead_bytes"))


def memory_table(memory: dict[str, int], where: str) -> Table:
    total, budget = memory["total_bytes"], memory["budget_bytes"]
    table = Table(title=f"Estimated peak memory ({escape(where)})", show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(justify="right")
    table.add_column()
    for label, key in MEMORY_PARTS:
        if memory.get(key):
            table.add_row(label, _gib(memory[key]), "")
    share = total / budget if budget else 0
    colour = "green" if share <= 0.9 else "red"
    width = 30
    filled = min(width, round(share * width))
    table.add_row("[bold]total", f"[bold]{_gib(total)}",
                  f"[{colour}]{'#' * filled}[/]{'.' * (width - filled)} {share:.0%} of {_gib(budget)}")
    return table


def _gib(n: int) -> str:
    return f"{n / 1024 ** 3:.2f} GiB"


DISTRIBUTED_LABELS = {"ddp": "data-parallel (each holds the whole model)",
                      "fsdp": "FSDP (weights, gradients and optimizer state sharded)"}


def plan_table(plan: Any) -> Table:
    table = Table(title="Training plan", show_header=True, header_style="bold")
    table.add_column("setting", no_wrap=True)
    table.add_column("value")
    table.add_column("source", style="dim", no_wrap=True)
    src = plan.sources
    rows = [
        ("model", plan.model, "model"),
        ("family", plan.family, None),
        ("method", plan.method, "method"),
        ("preset", plan.preset, "preset"),
        ("micro-batch x accumulation", f"{plan.micro_batch_size} x {plan.grad_accum} = {plan.effective_batch_size}", "micro_batch_size")
        if plan.world_size == 1 else
        ("micro-batch x accumulation x processes", f"{plan.micro_batch_size} per process x {plan.grad_accum} x "
                                                    f"{plan.world_size} = {plan.effective_batch_size}", "micro_batch_size"),
        ("max sequence length", str(plan.max_seq_len), "max_seq_len"),
        ("learning rate", f"{plan.lr:.2e} ({plan.lr_scheduler}, {plan.warmup_steps} warmup steps)", "lr"),
        ("steps", f"{plan.total_steps} ({plan.steps_per_epoch}/epoch)", "total_steps"),
        ("precision", plan.mixed_precision, "mixed_precision"),
        ("gradient checkpointing", "on" if plan.gradient_checkpointing else "off", "gradient_checkpointing"),
        ("evaluate every", f"{plan.eval_every} steps" if plan.eval_every else "never (no eval rows)", "eval_every"),
        ("checkpoint every", f"{plan.save_every} steps", "save_every"),
        ("seed", str(plan.seed), "seed"),
    ]
    if plan.world_size > 1:
        rows.insert(3, ("processes", f"{plan.world_size}, " + DISTRIBUTED_LABELS.get(plan.distributed, plan.distributed),
                        "distributed"))
    if plan.lora is not None:
        rows.insert(3, ("LoRA", f"r={plan.lora.r} alpha={plan.lora.alpha} dropout={plan.lora.dropout}", "lora.r"))
        rows.insert(4, ("LoRA targets", " ".join(plan.lora.target_modules), None))
    for name, value, key in rows:
        table.add_row(name, escape(str(value)), _short_source(src.get(key, "")) if key else "")
    return table


def _short_source(source: str) -> str:
    """'preset quality (small dataset)' -> 'preset'; plan.json keeps the detail."""
    return source.split(" ")[0]


def show_plan(plan: Any, hardware: Any = None) -> None:
    console.print(plan_table(plan))
    if plan.memory:
        where = "RAM" if hardware is None or not hardware.has_gpu else f"GPU: {hardware.gpus[0].name}"
        console.print(memory_table(plan.memory, where + (", per process" if plan.world_size > 1 else "")))
    lines = [f"- {escape(r)}" for r in plan.reasons] + [f"- [yellow]warning:[/] {escape(w)}" for w in plan.warnings]
    if lines:
        console.print(Panel("\n".join(lines), title="Why", expand=False))


def show_summary(result: Any) -> None:
    table = Table(title="Training finished" if result.status == "completed" else f"Training {result.status}",
                  show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("steps", f"{result.steps}")
    if result.final_loss is not None:
        table.add_row("final train loss", f"{result.final_loss:.4f}")
    if result.best_eval_loss is not None:
        table.add_row("best eval loss", f"{result.best_eval_loss:.4f} (step {result.best_eval_step})")
    table.add_row("time", _duration(result.seconds))
    table.add_row("tokens/s", f"{result.tokens_per_s:,.0f}")
    if result.stop_reason:
        table.add_row("stopped", escape(result.stop_reason))
    table.add_row("saved to", escape(str(result.output_path)))
    console.print(table)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def confirm(question: str) -> bool:
    """Ask yes/no on an interactive terminal; say yes when there is no one to ask."""
    if not sys.stdin.isatty():
        return True
    from rich.prompt import Confirm

    return Confirm.ask(question, default=True, console=console)


def show_hardware(hardware: Any, fits: Any) -> None:
    """The machine, and `fitting.FitTable`: which models and methods fit it."""
    console.print(machine_table(hardware))
    console.print(fits_table(fits))
    if not hardware.has_gpu:
        console.print("No GPU: training runs on the CPU, which fits in memory but takes hours for real models. "
                      "`llmcustoms plan DATA --vram 24` shows what a 24 GB GPU would run.")
    elif len(hardware.gpus) > 1:
        n = len(hardware.gpus)
        console.print(f"{n} GPUs: the table is for one of them. Train on all with `--num-processes {n}`; "
                      f"full fine-tuning of a model one card cannot hold shards with `--distributed fsdp` "
                      f"(`llmcustoms plan DATA --num-processes {n} --distributed fsdp` shows the fit).")


def machine_table(hardware: Any) -> Table:
    table = Table(title="This machine", show_header=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    for i, gpu in enumerate(hardware.gpus):
        table.add_row(f"GPU {i}", f"{escape(gpu.name)}: {_gib(gpu.total_bytes)} ({_gib(gpu.free_bytes)} free), "
                                  f"compute capability {gpu.compute_capability[0]}.{gpu.compute_capability[1]}, "
                                  f"bf16 {'yes' if gpu.supports_bf16 else 'no'}")
    if not hardware.gpus:
        table.add_row("GPU", "none" + (f" ({escape(hardware.driver_note)})" if hardware.driver_note else ""))
    table.add_row("CPU cores", str(hardware.cpu_cores))
    table.add_row("RAM", f"{_gib(hardware.ram_bytes)} ({_gib(hardware.ram_free_bytes)} available)")
    table.add_row("precision", hardware.mixed_precision)
    return table


def fits_table(fits: Any) -> Table:
    """`fitting.FitTable` as a table: per model and method, yes with the largest micro-batch, or why not."""
    table = Table(title=f"What fits in {_gib(fits.budget_bytes)} of {'GPU memory' if fits.on_gpu else 'RAM'} "
                        f"({fits.seq_len}-token sequences; largest micro-batch)")
    for column in ("model", "params", *fits.methods):
        table.add_column(column, no_wrap=column == "model")
    for model in fits.models:
        table.add_row(model.hub_id, f"{model.params / 1e9:.1f}B", *(_fit_cell(model.methods[m]) for m in fits.methods))
    return table


def _fit_cell(fit: Any) -> str:
    if fit.micro_batch:
        return f"[green]yes[/], {fit.micro_batch}"
    if fit.needs_checkpointing:
        return "[yellow]with checkpointing[/]"
    return f"[red]no[/] ({fit.need_bytes / 1024 ** 3:.1f} GiB)"


def show_presets(presets: list[Any], families: dict[str, Any]) -> None:
    table = Table(title="Presets (llmcustoms train DATA --preset NAME)")
    for column in ("preset", "LoRA r", "epochs", "lr", "batch", "length"):
        table.add_column(column, no_wrap=True)
    table.add_column("what for")
    for p in presets:
        table.add_row(f"[bold]{p.name}", str(p.lora_r), f"{p.epochs:g}", f"{p.lr:.0e}", str(p.effective_batch_size),
                      str(p.max_seq_len), escape(p.description))
    console.print(table)
    for p in presets:
        console.print(f"[bold]{p.name}[/] uses the first that fits: " + escape(", ".join(m.split("/")[-1] for m in p.models)))
    console.print("Presets adjust epochs, batch and learning rate by dataset size (small < "
                  f"{SMALL_DATASET_ROWS:,} rows, medium < {MEDIUM_DATASET_ROWS:,}, large). "
                  "`--preset FILE.yaml` takes your own preset of the same shape.\n")
    table = Table(title="Model families")
    table.add_column("family", no_wrap=True)
    table.add_column("models")
    table.add_column("LoRA targets")
    for family in families.values():
        models = "\n".join(f"{m.hub_id.split('/')[-1]} ({m.params / 1e9:.1f}B)" for m in family.models)
        targets = "\n".join(f"{mt}: {' '.join(t)}" for mt, t in family.lora_target_modules.items())
        table.add_row(f"[bold]{family.name}", escape(models), escape(targets))
    console.print(table)


def show_failure(report: dict[str, Any], run_path: Any) -> None:
    text = f"[bold red]Training stopped:[/] {escape(report['reason'])}\n"
    text += "\n".join(f"- {escape(s)}" for s in report["suggestions"])
    text += f"\nThe run directory is {escape(str(run_path))}; status.json holds this report."
    err_console.print(Panel(text, expand=False))


def show_search(space: Any, base: Any, settings: Any, tokens_per_trial: int) -> None:
    table = Table(title=f"Search space (study {escape(settings.study_name)})", show_header=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    for name, values in space.describe():
        table.add_row(name, escape(values))
    table.add_row("fixed", escape(f"{base.model}, {base.method}, micro-batch {base.micro_batch_size} x "
                                  f"{base.grad_accum}, {base.max_seq_len} tokens"))
    table.add_row("budget per trial", f"{settings.steps} optimizer steps (about {tokens_per_trial:,} tokens), "
                                      f"eval loss on {base.eval_rows} held-out rows")
    table.add_row("trials", f"{settings.trials} now, sampler {settings.sampler}, median pruner"
                            + (f", timeout {settings.timeout:g} s" if settings.timeout else ""))
    table.add_row("stored in", escape(settings.storage or str(settings.study_dir / "study.db")))
    console.print(table)


def trials_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Trials")
    for column in ("#", "state", "eval loss", "lr", "r", "alpha/r", "dropout", "warmup", "steps", "time", "note"):
        table.add_column(column, no_wrap=column != "note")
    colours = {"complete": "green", "pruned": "yellow", "fail": "red", "running": "cyan"}
    for r in rows[-30:]:  # the newest, so a long study still fits the screen
        loss = "" if r["eval_loss"] is None else f"{r['eval_loss']:.4f}"
        if r["best"]:
            loss = f"[bold green]{loss}[/]"
        table.add_row(str(r["trial"]), f"[{colours.get(r['state'], 'white')}]{r['state']}[/]", loss,
                      "" if r["lr"] is None else f"{r['lr']:.2e}", _blank(r["lora_r"]), _blank(r["alpha_ratio"]),
                      _blank(r["lora_dropout"]), _blank(r["warmup_ratio"]), _blank(r["steps"]),
                      "" if r["seconds"] is None else f"{r['seconds']:.0f}s", escape(r["reason"] or ""))
    return table


def _blank(value: Any) -> str:
    return "" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


class TrialsDisplay:
    """A live table of the study's trials, redrawn as trials report."""

    def __enter__(self) -> "TrialsDisplay":
        from rich.live import Live

        self.live = Live(Table(title="Trials"), console=console, refresh_per_second=4, transient=False)
        self.live.__enter__()
        return self

    def update(self, rows: list[dict[str, Any]]) -> None:
        self.live.update(trials_table(rows))

    def __exit__(self, *exc: Any) -> None:
        self.live.__exit__(*exc)
        console.print()


def show_study_outcome(outcome: Any, data_path: str, model: str | None) -> None:
    counts = outcome.counts()
    console.print(f"Study: {len(outcome.rows)} trials in all ({counts['complete']} complete, {counts['pruned']} pruned, "
                  f"{counts['fail']} failed); {outcome.trials_this_run} ran now.")
    if outcome.steps_budgeted:
        saved = 1 - outcome.steps_run / outcome.steps_budgeted
        console.print(f"Pruning: {outcome.steps_run:,} of {outcome.steps_budgeted:,} budgeted steps ran "
                      f"({saved:.0%} saved).")
    if outcome.interrupted:
        console.print("[yellow]Interrupted.[/] The study is saved; run the same command again to continue it.")
    best = outcome.best_row()
    if outcome.best_preset_path is None or best is None:
        console.print("No trial completed yet, so there is no best preset.")
        return
    console.print(f"Best: trial {best['trial']}, eval loss {best['eval_loss']:.4f} (lr {best['lr']:.2e}"
                  + (f", r {best['lora_r']}, alpha/r {best['alpha_ratio']:g}, dropout {best['lora_dropout']:g}"
                     if best["lora_r"] is not None else "") + f", warmup {best['warmup_ratio']:g}).")
    console.print(f"Wrote {escape(str(outcome.best_preset_path))} and "
                  f"{escape(str(outcome.best_preset_path.parent / 'trials.csv'))}.")
    command = f"llmcustoms train {data_path} --preset {outcome.best_preset_path}" + (f" --model {model}" if model else "")
    console.print("Train with the best settings:")
    console.print("  " + escape(command), soft_wrap=True)  # never broken: it is meant to be copied


def show_runs(output_dir: Any, runs: list[Any]) -> None:
    """`rundir.list_runs(output_dir)` as a table."""
    if not runs:
        console.print(f"No runs under {escape(str(output_dir))}. Start one with `llmcustoms train DATA`.")
        return
    console.print(runs_table(output_dir, runs))


RUN_COLOURS = {"completed": "green", "running": "cyan", "interrupted": "yellow", "failed": "red"}


def runs_table(output_dir: Any, runs: list[Any]) -> Table:
    """`rundir.RunSummary` rows as a table."""
    from pathlib import Path

    from rich import box

    # No vertical rules: eight columns must fit an 80-column terminal.
    table = Table(title=f"Runs in {escape(str(output_dir))}", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("run", no_wrap=True)
    table.add_column("model", max_width=28, overflow="fold")  # the column that gives way on narrow terminals
    for column in ("method", "status", "steps", "best eval", "started", "duration"):
        table.add_column(column, no_wrap=True)
    for run in runs:
        table.add_row(escape(run.name), escape(Path(run.model).name), run.method,
                      f"[{RUN_COLOURS.get(run.status, 'white')}]{run.status}[/]",
                      f"{run.step}/{'?' if run.total_steps is None else run.total_steps}",
                      "" if run.best_eval_loss is None else f"{run.best_eval_loss:.4f}",
                      (run.started_at or "")[5:16].replace("T", " "),
                      "" if run.seconds is None else _duration(run.seconds))
    return table


def show_report(report: Any) -> None:
    table = Table(title=f"Report: {escape(report.name)} ({report.status}, {report.steps}/{report.total_steps} steps)",
                  show_header=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(no_wrap=True)
    table.add_column()
    for finding in report.findings:
        table.add_row(finding.topic, finding.verdict, escape(finding.detail))
    console.print(table)
    console.print(Panel("\n".join(f"- {escape(r)}" for r in report.recommendations), title="Recommendations",
                        expand=False))
