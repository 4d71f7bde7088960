"""What the trainer tells the user, as a protocol with no Rich in it.

`FineTuner` and tuning talk to a `Reporter`; `ui/train_view.py` implements it
(`RichReporter`, the live display; `QuietReporter`, warnings only), and tests
pass `SilentReporter`, which records what would have been shown. Keeping the
protocol here means the loop, like every folder before ui/, never imports the UI.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol


class Reporter(Protocol):
    def message(self, text: str, warning: bool = False) -> None: ...
    def activity(self, text: str | None) -> None: ...  # what is happening now; None: training steps
    # A wait counted in items (sample replies, the tokens of the general questions): `done` of `total`,
    # 0 when it begins; the display shows the count and an ETA from the first item on. Ends at the next `activity`.
    def count(self, what: str, done: int, total: int) -> None: ...
    # `memory`: the plan's estimate (`MemoryEstimate.to_json()`), which the display measures against.
    def training_started(self, total_steps: int, start_step: int = 0, memory: dict[str, Any] | None = None) -> None: ...
    def step(self, row: dict[str, Any]) -> None: ...
    def evaluated(self, row: dict[str, Any]) -> None: ...
    def training_finished(self) -> None: ...


class SilentReporter:
    """Shows nothing but warnings, to `on_warning` if given (a tuning trial's, in
    the study's display); keeps everything for tests to inspect."""

    def __init__(self, on_warning: Callable[[str], None] = lambda text: None) -> None:
        self.on_warning = on_warning
        self.messages: list[str] = []
        self.steps: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.activities: list[str | None] = []
        self.counts: list[tuple[str, int, int]] = []  # (what, done, total), each `count` call

    def message(self, text: str, warning: bool = False) -> None:
        self.messages.append(text)
        if warning:
            self.on_warning(text)

    def activity(self, text: str | None) -> None:
        self.activities.append(text)

    def count(self, what: str, done: int, total: int) -> None:
        self.counts.append((what, done, total))

    def training_started(self, total_steps: int, start_step: int = 0, memory: dict[str, Any] | None = None) -> None:
        pass  # nothing to draw

    def step(self, row: dict[str, Any]) -> None:
        self.steps.append(row)

    def evaluated(self, row: dict[str, Any]) -> None:
        self.evals.append(row)

    def training_finished(self) -> None:
        pass  # nothing to tear down
