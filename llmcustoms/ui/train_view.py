"""What a user watches while a run trains: the live display, or warnings only.

Waits are never silent: before the display starts (loading the model) a
spinner says what is happening and for how long; in the display a status line
does (the first step, an evaluation with its progress, a checkpoint being
written). The numbers, the ETA among them, are worked out in `train_progress`, without Rich.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from llmcustoms.planning.duration import seconds_after_last_step
from llmcustoms.reporting import Reporter
from llmcustoms.ui.layout import Parts
from llmcustoms.ui.train_progress import PART_BREAK, Countdown, TrainingProgress, clock, counted


class QuietReporter:
    """For scripts (--quiet): only warnings, on stderr."""

    def __init__(self, console: Console):
        self.console = console

    def message(self, text: str, warning: bool = False) -> None:
        if warning:
            self.console.print(warning_text(text))

    def activity(self, text: str | None) -> None:
        pass  # scripts want the result, not the waits

    def count(self, what: str, done: int, total: int) -> None:
        pass  # scripts want the result, not the waits

    def training_started(self, total_steps: int, start_step: int = 0, memory: dict[str, Any] | None = None) -> None:
        pass  # nothing to draw

    def step(self, row: dict[str, Any]) -> None:
        pass  # scripts want the result, not the steps

    def evaluated(self, row: dict[str, Any]) -> None:
        pass  # scripts want the result, not the steps

    def training_finished(self) -> None:
        pass  # nothing to tear down


class RichReporter:
    """A spinner while setting up, then a live display: bar, step, loss, eval
    loss with its step, lr; epoch, tokens/s, elapsed, ETA and what is happening."""

    def __init__(self, console: Console, after_seconds: float = 0.0):
        """`after_seconds`: the plan's estimate of the time after the last step (`duration.seconds_after_last_step`)."""
        self.console, self.after_seconds = console, after_seconds
        self.progress: TrainingProgress | None = None
        self.live: Live | None = None
        self.status: Live | None = None  # the spinner
        self.countdown: Countdown | None = None  # the counted wait going on, if any

    def message(self, text: str, warning: bool = False) -> None:
        self.console.print(warning_text(text) if warning else Text(text))

    def activity(self, text: str | None) -> None:
        self.countdown = None
        if self.progress is not None:
            self.progress.set_activity(text, time.monotonic())
        elif text is None:
            self._stop_status()
        else:  # before or after the display: a spinner with the time spent
            self._stop_status()
            self.status = spinner(self.console, text)

    def count(self, what: str, done: int, total: int) -> None:
        now, before = time.monotonic(), self.countdown
        self.countdown = counted(before, what, done, total, now)
        if self.progress is not None:
            self.progress.counting(self.countdown, now)
        elif self.countdown is not before:  # before or after the display: a spinner with the count
            self._stop_status()
            self.status = spinner(self.console, self.countdown.text)

    def training_started(self, total_steps: int, start_step: int = 0, memory: dict[str, Any] | None = None) -> None:
        self._stop_status()
        self.progress = TrainingProgress(total_steps, start_step, time.monotonic(), memory, self.after_seconds)
        self.live = Live(get_renderable=self.render, console=self.console, refresh_per_second=2, transient=False)
        self.live.start()

    def render(self) -> Group:
        """The display as it is now (a frame of the live display)."""
        assert self.progress is not None
        first, second = self.progress.lines(time.monotonic())
        bar = ProgressBar(total=max(1, self.progress.total), completed=self.progress.done, width=20)
        row = Table.grid(padding=(0, 1))
        row.add_row(bar, Parts(first.split(PART_BREAK)))
        # A line too long for the terminal goes on at the next, broken between its
        # parts: cut short, it would lose the numbers at its end (the ETA, the GPU's memory).
        lines = [row, Parts(second.split(PART_BREAK), style="dim"),
                 Parts(self.progress.resources_line().split(PART_BREAK), style="dim")]
        plateau = self.progress.plateau_line()
        lines += [Text(plateau, style="yellow")] if plateau else []  # a sentence: broken at its spaces
        return Group(*lines)

    def step(self, row: dict[str, Any]) -> None:
        if self.progress is not None:
            self.progress.step(row, time.monotonic())

    def evaluated(self, row: dict[str, Any]) -> None:
        if self.progress is not None:
            self.progress.evaluated(row, time.monotonic())

    def training_finished(self) -> None:
        if self.live is not None:
            self.live.stop()
            if not self.console.is_terminal:  # Rich ends the display's last line only on a terminal
                self.console.line()
        self.live, self.progress, self.countdown = None, None, None
        self._stop_status()

    def _stop_status(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None


def spinner(console: Console, text: str | Callable[[float], str]) -> Live:
    """A started spinner with `text` and the time spent on it, or with what
    `text(now)` says (a `Countdown`'s count and ETA); gone when stopped."""
    started, spin = time.monotonic(), Spinner("dots")

    def render() -> Spinner:
        now = time.monotonic()
        spin.update(text=Text(text(now) if callable(text) else f"{text} ({clock(now - started)})"))  # never markup
        return spin

    live = Live(get_renderable=render, console=console, refresh_per_second=4, transient=True)
    live.start()
    return live


def warning_text(text: str) -> Text:
    """A warning as the user reads it: `text` as written (a path with [brackets], a token such
    as [/INST]), never taken for Rich markup."""
    return Text.assemble(("warning:", "yellow"), " ", text)


def make_reporter(quiet: bool, console: Console, err_console: Console, plan: Any = None) -> Reporter:
    """`plan`: the run's, whose estimate of what follows the last step the ETA counts."""
    return QuietReporter(err_console) if quiet else RichReporter(console, seconds_after_last_step(plan) if plan else 0)
