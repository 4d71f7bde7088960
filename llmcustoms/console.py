"""Everything the user sees: progress, tables, panels and error messages.

The trainer talks to a small `Reporter` protocol and never to Rich directly;
tests pass `SilentReporter`, which records what would have been shown.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


class Reporter(Protocol):
    def message(self, text: str, warning: bool = False) -> None: ...
    def training_started(self, total_steps: int, start_step: int = 0) -> None: ...
    def step(self, row: dict[str, Any]) -> None: ...
    def evaluated(self, row: dict[str, Any]) -> None: ...
    def training_finished(self) -> None: ...


class SilentReporter:
    """Shows nothing; keeps everything for tests to inspect."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.steps: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []

    def message(self, text: str, warning: bool = False) -> None:
        self.messages.append(text)

    def training_started(self, total_steps: int, start_step: int = 0) -> None:
        pass  # nothing to draw

    def step(self, row: dict[str, Any]) -> None:
        self.steps.append(row)

    def evaluated(self, row: dict[str, Any]) -> None:
        self.evals.append(row)

    def training_finished(self) -> None:
        pass  # nothing to tear down


class QuietReporter(SilentReporter):
    """For scripts (--quiet): only warnings, on stderr."""

    def message(self, text: str, warning: bool = False) -> None:
        super().message(text, warning)
        if warning:
            err_console.print(f"[yellow]warning:[/] {text}")


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


def print_error(message: str, hint: str | None) -> None:
    text = f"[bold red]Error:[/] {escape(message)}"
    if hint:
        text += f"\n{escape(hint)}"
    err_console.print(text)


def escape(text: str) -> str:
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def show_data_summary(path: str, format_description: str, rows: int, skipped: int, eval_rows: int, eval_source: str) -> None:
    line = f"Data: [bold]{escape(path)}[/] - detected format [bold]{escape(format_description)}[/], {rows:,} rows"
    if skipped:
        line += f" ([yellow]{skipped:,} bad rows skipped[/])"
    console.print(line)
    if eval_rows:
        console.print(f"Evaluation: {eval_rows:,} rows held out ({escape(eval_source)})")


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
        ("micro-batch x accumulation", f"{plan.micro_batch_size} x {plan.grad_accum} = {plan.effective_batch_size}", "micro_batch_size"),
        ("max sequence length", str(plan.max_seq_len), "max_seq_len"),
        ("learning rate", f"{plan.lr:.2e} ({plan.lr_scheduler}, {plan.warmup_steps} warmup steps)", "lr"),
        ("steps", f"{plan.total_steps} ({plan.steps_per_epoch}/epoch)", "total_steps"),
        ("precision", plan.mixed_precision, "mixed_precision"),
        ("gradient checkpointing", "on" if plan.gradient_checkpointing else "off", "gradient_checkpointing"),
        ("evaluate every", f"{plan.eval_every} steps" if plan.eval_every else "never (no eval rows)", "eval_every"),
        ("checkpoint every", f"{plan.save_every} steps", "save_every"),
        ("seed", str(plan.seed), "seed"),
    ]
    if plan.lora is not None:
        rows.insert(3, ("LoRA", f"r={plan.lora.r} alpha={plan.lora.alpha} dropout={plan.lora.dropout}", "lora.r"))
        rows.insert(4, ("LoRA targets", " ".join(plan.lora.target_modules), None))
    for name, value, key in rows:
        table.add_row(name, escape(str(value)), _short_source(src.get(key, "")) if key else "")
    return table


def _short_source(source: str) -> str:
    """'preset quality (small dataset)' -> 'preset'; plan.json keeps the detail."""
    return source.split(" ")[0]


def show_plan(plan: Any) -> None:
    console.print(plan_table(plan))
    if plan.reasons:
        console.print(Panel("\n".join(f"- {escape(r)}" for r in plan.reasons), title="Why", expand=False))


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
