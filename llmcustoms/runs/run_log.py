"""train.log: what the live display showed, as timestamped plain text, for after
the terminal is gone.

One line an event, `2026-11-23T15:40:02+0000 warning  step 4: out of memory; ...`
(time, level, text; a text's further lines are indented under it): the plan
when the run starts, every message and warning (recoveries among them), what
is being done (loading the model, saving a checkpoint; not the counters of an
evaluation), each step's and evaluation's numbers, and how the run ended
(`train.run_training`). A resumed run appends to the same file.

Each line is appended and closed at once, so a killed run keeps every line up
to its end; a line is whole or not there (a full disk cuts none short).
Only the main process writes: a `RunLog` without a path writes
nothing. Lines go through `failure_report.redact` (tokens and keys); nothing
here sees a data row, only the loop's numbers and its own messages.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Callable

from llmcustoms.reporting import Reporter
from llmcustoms.runs.disk_writes import DISK_FULL, append_lines
from llmcustoms.runs.failure_report import redact
from llmcustoms.runs.memory_use import memory_line

LEVELS = ("info", "warning", "error")
INDENT = " " * 4
GIB = 1024 ** 3
# "evaluating 3/7": a counter, ticking many times an evaluation; its row says how it ended.
COUNTER = re.compile(r"\s\d+/\d+$")
# How a step row's best-known values are written, in this order; other keys follow as `key value`.
STEP_FORMATS: dict[str, Callable[[Any], str]] = {
    "epoch": lambda v: f"epoch {v:.2f}",
    "loss": lambda v: f"loss {v:.4f}",
    "grad_norm": lambda v: f"grad_norm {v:.3g}",
    "lr": lambda v: f"lr {v:.2e}",
    "tokens_per_s": lambda v: f"tokens/s {v:,.0f}",
    "gpu_util": lambda v: f"gpu_util {v:.0f}%",  # NVML's percentage
}
UNLOGGED_KEYS = ("step", "seconds")  # the step leads the line; tokens/s says the time


class RunLog:
    """Appends timestamped lines to `path` (None: writes nothing). A write that
    fails is said once through `warn`, and the run goes on without its log; on a
    full disk the lines are left out only while there is no room (a failed
    checkpoint's files, once removed, leave room for how the run ended)."""

    def __init__(self, path: Path | None, warn: Callable[[str], None] = lambda text: None):
        self.path = path
        self.warn = warn
        self.problem: str | None = None
        self.stopped = False

    def write(self, level: str, text: str) -> None:
        assert level in LEVELS, level
        if self.path is None or self.stopped:
            return
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        body = redact(text.rstrip()).replace("\n", "\n" + INDENT)
        try:
            append_lines(self.path, [f"{stamp} {level:<8} {body}\n"])
        except OSError as exc:
            full = exc.errno in DISK_FULL
            if self.problem is None:
                self.warn(f"{self.path} could not be written ({exc.strerror or exc}); " +
                          ("its lines are left out while the disk is full." if full
                           else "the run goes on without its log."))
            self.problem = exc.strerror or str(exc)
            self.stopped = not full


def _number(key: str, value: Any) -> str:
    if key.endswith("_bytes") and isinstance(value, (int, float)):
        return f"{key[:-len('_bytes')]} {value / GIB:.2f} GiB"
    if isinstance(value, float):
        return f"{key} {value:.4g}"
    return f"{key} {value}"


def step_line(row: dict[str, Any], total_steps: int) -> str:
    """A step row as one line: `step 3/12  loss 2.3456  grad_norm 1.2  lr 1.00e-02  ...`."""
    parts = [f"step {row.get('step')}/{total_steps}"]
    parts += [show(row[key]) for key, show in STEP_FORMATS.items() if row.get(key) is not None]
    parts += [_number(key, value) for key, value in row.items()
              if key not in STEP_FORMATS and key not in UNLOGGED_KEYS and value is not None]
    return "  ".join(parts)


def evaluation_line(row: dict[str, Any]) -> str:
    """An evaluation row as one line: `evaluation at step 3: eval_loss 2.1234  eval_ppl 8.36`."""
    values = [f"{key} {value:.4f}" if key == "eval_loss" else _number(key, value)
              for key, value in row.items() if key != "step" and value is not None]
    return f"evaluation at step {row.get('step')}" + (": " + "  ".join(values) if values else "")


def plan_line(plan: Any) -> str:
    """The plan in one line: model, method, batch and length of the run."""
    processes = f" x {plan.world_size} processes" if plan.world_size > 1 else ""
    objective = f", {plan.objective}" if plan.objective_kind.pairs else ""  # supervised rows are the default
    return (f"{plan.model} ({plan.method}{objective}, preset {plan.preset}): micro-batch {plan.micro_batch_size} x "
            f"accumulation {plan.grad_accum}{processes} (batch {plan.effective_batch_size}), {plan.total_steps} steps, "
            f"lr {plan.lr:.2e}, sequences up to {plan.max_seq_len} tokens")


def completed_text(result: Any) -> str:
    """How a completed run ended (`position.TrainResult`), as the summary says it."""
    lines = [f"completed: {result.steps} steps, training time {result.seconds:.1f} s (resumes included), "
             f"{result.tokens_per_s:,.0f} tokens/s in training steps"]
    if result.final_loss is not None:
        lines.append(f"final train loss {result.final_loss:.4f}")
    if result.best_eval_loss is not None:
        on_training_rows = " (on rows it also trained on, not held out)" if result.eval_on_training_rows else ""
        lines.append(f"best eval loss {result.best_eval_loss:.4f} at step {result.best_eval_step}{on_training_rows}")
    if memory := memory_line(result.memory or {}):
        lines.append(f"memory: {memory}")
    if result.stop_reason:
        lines.append(f"stopped early: {result.stop_reason}")
    lines.append(f"weights saved to {result.output_path}" + (f" ({result.kept})" if result.kept else ""))
    return "\n".join(lines)


def failed_text(report: dict[str, Any], said: str | None) -> str:
    """How a failed run ended: the reason, what to try, where the failure report is."""
    lines = [f"failed: {report.get('reason')}"] + [f"try: {s}" for s in report.get("suggestions", [])]
    return "\n".join(lines + ([said] if said else []))


class LoggingReporter:
    """A Reporter that also writes what it is told to train.log (`log_path`; None:
    to nothing, as on every process but the main one)."""

    def __init__(self, inner: Reporter, log_path: Path | None):
        self.inner = inner
        self.log = RunLog(log_path, lambda text: inner.message(text, warning=True))
        self.total_steps = 0
        self.last_activity: str | None = None

    def message(self, text: str, warning: bool = False) -> None:
        self.inner.message(text, warning)
        self.log.write("warning" if warning else "info", text)

    def activity(self, text: str | None) -> None:
        self.inner.activity(text)
        if text is not None and text != self.last_activity and not COUNTER.search(text):
            self.log.write("info", text)
        self.last_activity = text

    def count(self, what: str, done: int, total: int) -> None:
        self.inner.count(what, done, total)  # not logged: the activity that names the wait is, once

    def training_started(self, total_steps: int, start_step: int = 0, memory: dict[str, Any] | None = None) -> None:
        self.inner.training_started(total_steps, start_step, memory)
        self.total_steps = total_steps
        planned = ""
        if memory and memory.get("total_bytes"):
            planned = f"; planned memory {memory['total_bytes'] / GIB:.2f} GiB"
            planned += f" of a {memory['budget_bytes'] / GIB:.1f} GiB budget" if memory.get("budget_bytes") else ""
        self.log.write("info", f"training started at step {start_step} of {total_steps}{planned}")

    def step(self, row: dict[str, Any]) -> None:
        self.inner.step(row)
        self.log.write("info", step_line(row, self.total_steps))

    def evaluated(self, row: dict[str, Any]) -> None:
        self.inner.evaluated(row)
        self.log.write("info", evaluation_line(row))

    def training_finished(self) -> None:
        self.inner.training_finished()
        self.log.write("info", "training loop ended")
