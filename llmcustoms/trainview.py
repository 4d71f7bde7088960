"""What a user watches while a run trains: the live display, or warnings only.

Waits are never silent: before the display starts (loading the model) a
spinner says what is happening and for how long; in the display a status line
does (the first step, an evaluation with its progress, a checkpoint being
written). The ETA comes from the measured step time from step 1 on,
whatever the step length: Rich's own column averages over the last 30 s and
stays blank when a step takes longer, which is every real run on a CPU.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from llmcustoms.reporting import Reporter

# Weight of the newest step in the smoothed step time and tokens/s: enough
# smoothing that one slow step (an evaluation's warm-up, a save) does not make
# the ETA jump, little enough that a real change shows within a few steps.
SMOOTHING = 0.3


def clock(seconds: float | None) -> str:
    """H:MM:SS, or - when unknown."""
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class QuietReporter:
    """For scripts (--quiet): only warnings, on stderr."""

    def __init__(self, console: Console):
        self.console = console

    def message(self, text: str, warning: bool = False) -> None:
        if warning:
            self.console.print(f"[yellow]warning:[/] {text}")

    def activity(self, text: str | None) -> None:
        pass  # scripts want the result, not the waits

    def training_started(self, total_steps: int, start_step: int = 0) -> None:
        pass  # nothing to draw

    def step(self, row: dict[str, Any]) -> None:
        pass  # scripts want the result, not the steps

    def evaluated(self, row: dict[str, Any]) -> None:
        pass  # scripts want the result, not the steps

    def training_finished(self) -> None:
        pass  # nothing to tear down


class TrainingProgress:
    """The numbers the display shows, kept from the trainer's rows; no Rich."""

    def __init__(self, total_steps: int, start_step: int, now: float):
        self.total, self.start_step, self.done = total_steps, start_step, start_step
        self.started = now
        self.step_seconds: float | None = None  # smoothed
        self.tokens_per_s: float | None = None  # smoothed
        self.loss = self.lr = self.epoch = None
        self.eval_loss: float | None = None
        self.eval_step: int | None = None
        self.activity = "first step" if start_step == 0 else f"step {start_step + 1}"
        self.activity_since = now

    def step(self, row: dict[str, Any], now: float) -> None:
        seconds = row.get("seconds")
        if seconds:
            self.step_seconds = _smooth(self.step_seconds, seconds)
        self.tokens_per_s = _smooth(self.tokens_per_s, row["tokens_per_s"])
        self.done, self.loss, self.lr, self.epoch = row["step"], row["loss"], row["lr"], row.get("epoch")
        self.set_activity(None, now)

    def evaluated(self, row: dict[str, Any], now: float) -> None:
        self.eval_loss, self.eval_step = row["eval_loss"], row["step"]
        self.set_activity(None, now)

    def set_activity(self, text: str | None, now: float) -> None:
        """What is happening now; None: the next training step."""
        if text is None:
            text = "first step" if self.done == self.start_step else f"step {self.done + 1}"
            text = text if self.done < self.total else "finishing"
        if _kind(text) != _kind(self.activity):
            self.activity_since = now
        self.activity = text

    def eta(self, now: float | None = None) -> float | None:
        """Measured: the smoothed step time times the steps left, less what the
        running step has had already (never below nothing left of it)."""
        if self.step_seconds is None:
            return None
        into = 0.0 if now is None or not self.activity.startswith("step") else now - self.activity_since
        return max(0.0, self.step_seconds - into) + self.step_seconds * max(0, self.total - self.done - 1)

    def lines(self, now: float) -> tuple[str, str]:
        """Two lines of at most about 78 characters: progress, then timing."""
        eval_part = "" if self.eval_loss is None else f"  eval {self.eval_loss:.4f} @{self.eval_step}"
        loss = "-" if self.loss is None else f"{self.loss:.4f}"
        lr = "" if self.lr is None else f"  lr {self.lr:.1e}"
        first = f"{self.done}/{self.total}  loss {loss}{eval_part}{lr}"
        epoch = "" if self.epoch is None else f"epoch {self.epoch:.2f}  "
        speed = "" if self.tokens_per_s is None else f"{self.tokens_per_s:,.0f} tok/s  "
        eta = clock(self.eta(now)) if self.step_seconds is not None else "after step 1"
        doing = f"  {self.activity} {clock(now - self.activity_since)}"
        return first, f"{epoch}{speed}elapsed {clock(now - self.started)}  eta {eta}{doing}"


def _kind(activity: str) -> str:
    """An activity without its progress counter: "evaluating 3/7" is still the
    evaluation that began at "evaluating 0/7", and its time runs on."""
    words = activity.split(" ")
    return " ".join(words[:-1]) if "/" in words[-1] else activity


def _smooth(previous: float | None, value: float) -> float:
    return value if previous is None else SMOOTHING * value + (1 - SMOOTHING) * previous


class RichReporter:
    """A spinner while setting up, then a live display: bar, step, loss, eval
    loss with its step, lr; epoch, tokens/s, elapsed, ETA and what is happening."""

    def __init__(self, console: Console):
        self.console = console
        self.progress: TrainingProgress | None = None
        self.live: Live | None = None
        self.status: Live | None = None  # the spinner

    def message(self, text: str, warning: bool = False) -> None:
        self.console.print(f"[yellow]warning:[/] {text}" if warning else text)

    def activity(self, text: str | None) -> None:
        if self.progress is not None:
            self.progress.set_activity(text, time.monotonic())
        elif text is None:
            self._stop_status()
        else:  # before or after the display: a spinner with the time spent
            self._stop_status()
            self.status = spinner(self.console, text)

    def training_started(self, total_steps: int, start_step: int = 0) -> None:
        self._stop_status()
        self.progress = TrainingProgress(total_steps, start_step, time.monotonic())
        self.live = Live(get_renderable=self.render, console=self.console, refresh_per_second=2, transient=False)
        self.live.start()

    def render(self) -> Group:
        """The display as it is now (a frame of the live display)."""
        assert self.progress is not None
        first, second = self.progress.lines(time.monotonic())
        bar = ProgressBar(total=max(1, self.progress.total), completed=self.progress.done, width=20)
        row = Table.grid(padding=(0, 1))
        row.add_row(bar, Text(first))
        return Group(row, Text(second, style="dim", no_wrap=True, overflow="ellipsis"))

    def step(self, row: dict[str, Any]) -> None:
        if self.progress is not None:
            self.progress.step(row, time.monotonic())

    def evaluated(self, row: dict[str, Any]) -> None:
        if self.progress is not None:
            self.progress.evaluated(row, time.monotonic())

    def training_finished(self) -> None:
        if self.live is not None:
            self.live.stop()
        self.live, self.progress = None, None
        self._stop_status()

    def _stop_status(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None


def spinner(console: Console, text: str) -> Live:
    """A started spinner with `text` and the time spent on it; gone when stopped."""
    started, spin = time.monotonic(), Spinner("dots")

    def render() -> Spinner:
        spin.update(text=f"{text} ({clock(time.monotonic() - started)})")
        return spin

    live = Live(get_renderable=render, console=console, refresh_per_second=4, transient=True)
    live.start()
    return live


def make_reporter(quiet: bool, console: Console, err_console: Console) -> Reporter:
    return QuietReporter(err_console) if quiet else RichReporter(console)
