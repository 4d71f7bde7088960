"""The numbers of the live training display, from the trainer's rows; no Rich.

The ETA is measured from step 1 on, whatever the step length: Rich's own
column averages over the last 30 s and stays blank when a step takes longer,
which is every real run on a CPU. It uses the wall time between steps (so
evaluations, checkpoints and sample replies are in it), smoothed, and adds
what the plan expects after the last step (the last evaluation, the trained
model's answers, saving: `duration.seconds_after_last_step`), which it counts
down once the last step is done: a minute of "eta 0:00:00" was not the end.

Other waits counted in items (the sample replies and general questions, a
tuning trial's steps, lr-find's steps) are a `Countdown`: a count and an ETA
from the first item on, the mean time of an item so far times those left.
"""

from __future__ import annotations

import time
from typing import Any, Callable

# Weight of the newest step in the smoothed step time and tokens/s: enough
# smoothing that one slow step (an evaluation's warm-up, a save) does not make
# the ETA jump, little enough that a real change shows within a few steps.
SMOOTHING = 0.3
# Evaluations in a row without a better eval loss before the display says the run is on a plateau.
PLATEAU_EVALUATIONS = 2
GIB = 1024 ** 3
# Between the parts of a line ("loss 1.2034", "eval 1.3012 @30"): the display
# breaks a line too long for the terminal only there, never inside a part.
PART_BREAK = "  "


def clock(seconds: float | None) -> str:
    """H:MM:SS, or - when unknown."""
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Countdown:
    """A wait counted in items (sample replies, a tuning trial's steps, lr-find's
    steps): `done` of `total`, and an ETA from the first item on; no Rich."""

    def __init__(self, what: str, total: int, now: float):
        self.what, self.total, self.done = what, total, 0
        self.started = self.last_at = now

    def update(self, done: int, now: float, seconds: float | None = None) -> None:
        """`done` items by `now`; `seconds`, the first item's own time when the
        caller knows it (the wait before it may hold loading the model)."""
        if done == self.done:
            return
        if self.done == 0 and seconds is not None:
            self.started = now - seconds
        self.done, self.last_at = done, now

    def eta(self, now: float) -> float | None:
        """The mean time of an item so far times the items left, less the time
        since the last one ended; None before the first has ended."""
        if self.done <= 0:
            return None
        each = (self.last_at - self.started) / self.done
        return max(0.0, each * max(0, self.total - self.done) - (now - self.last_at))

    def text(self, now: float) -> str:
        """"sample replies (base) 2/3, eta 0:00:40"; before the first item ends,
        the time spent so far, so the line never stands still."""
        eta = self.eta(now)
        count = f"{self.what} {self.done}/{self.total}"
        return f"{count} {clock(now - self.started)}" if eta is None else f"{count}, eta {clock(eta)}"


def counted(countdown: Countdown | None, what: str, done: int, total: int, now: float) -> Countdown:
    """`countdown` told of `done`, or a new one when it counts something else
    (another wait, or the same one begun again)."""
    if countdown is None or (countdown.what, countdown.total) != (what, total) or done < countdown.done:
        countdown = Countdown(what, total, now)
    countdown.update(done, now)
    return countdown


def counting(say: Callable[[str], None], what: str,
             clock_now: Callable[[], float] = time.monotonic) -> Callable[[int, int], None]:
    """A (done, total) callback for a stage of a `console.waiting` counted in items
    (the check prompts, a GGUF file's tensors): it tells `say` the count and, from
    the first item on, the ETA: "Answering the check prompts 3/8, eta 0:00:20"."""
    countdown: Countdown | None = None

    def told(done: int, total: int) -> None:
        nonlocal countdown
        now = clock_now()
        countdown = counted(countdown, what, done, total, now)
        say(countdown.text(now))
    return told


class TrainingProgress:
    """The numbers the display shows, kept from the trainer's rows; no Rich."""

    def __init__(self, total_steps: int, start_step: int, now: float, memory: dict[str, Any] | None = None,
                 after: float = 0.0):
        """`memory`: the plan's estimate (`MemoryEstimate.to_json()`), None if it has none;
        `after`: the seconds the plan expects after the last step."""
        self.total, self.start_step, self.done = total_steps, start_step, start_step
        self.after = after
        self.planned = memory or {}
        self.memory_bytes: int | None = None  # the last step row's
        self.grad_norm: float | None = None
        self.gpu_util: float | None = None
        self.gpu_memory_bytes: int | None = None
        self.best_eval: tuple[float, int] | None = None  # (eval loss, step) of the best evaluation after step 0
        self.evals_since_best = 0
        self.started = now
        self.step_seconds: float | None = None  # smoothed wall time per step
        self.last_step_at: float | None = None
        self.tokens_per_s: float | None = None  # smoothed
        self.loss = self.lr = self.epoch = None
        self.eval_loss: float | None = None
        self.eval_step: int | None = None
        # DPO: the share of pairs ranked right, smoothed over steps, and at the last evaluation.
        self.accuracy: float | None = None
        self.eval_accuracy: float | None = None
        self.activity = "first step" if start_step == 0 else f"step {start_step + 1}"
        self.activity_since = now
        self.countdown: Countdown | None = None  # a counted activity: shown with its count and ETA

    def step(self, row: dict[str, Any], now: float) -> None:
        # The first step's own time (the wall time before it holds the base model's
        # evaluation); then the wall time from the step before, evaluations and saves included.
        follows = self.last_step_at is not None and row["step"] == self.done + 1
        seconds = now - self.last_step_at if follows else row.get("seconds")
        if seconds:
            self.step_seconds = _smooth(self.step_seconds, seconds)
        self.last_step_at = now
        self.tokens_per_s = _smooth(self.tokens_per_s, row["tokens_per_s"])
        self.done, self.loss, self.lr, self.epoch = row["step"], row["loss"], row["lr"], row.get("epoch")
        self.memory_bytes, self.grad_norm = row.get("memory_bytes"), row.get("grad_norm")
        self.gpu_util, self.gpu_memory_bytes = row.get("gpu_util"), row.get("gpu_memory_bytes")
        if "reward_accuracy" in row:
            self.accuracy = _smooth(self.accuracy, row["reward_accuracy"])
        self.set_activity(None, now)

    def evaluated(self, row: dict[str, Any], now: float) -> None:
        self.eval_loss, self.eval_step = row["eval_loss"], row["step"]
        self.eval_accuracy = row.get("eval_reward_accuracy")
        if row["step"] > 0:  # the base model's is what training is measured against, not a best
            if self.best_eval is None or row["eval_loss"] < self.best_eval[0]:
                self.best_eval, self.evals_since_best = (row["eval_loss"], row["step"]), 0
            else:
                self.evals_since_best += 1
        self.set_activity(None, now)

    def counting(self, countdown: Countdown, now: float) -> None:
        """A counted activity (sample replies 2/3): shown with its ETA until the next activity."""
        self.set_activity(countdown.what, now)
        self.countdown = countdown

    def set_activity(self, text: str | None, now: float) -> None:
        """What is happening now; None: the next training step."""
        self.countdown = None
        if text is None:
            text = "first step" if self.done == self.start_step else f"step {self.done + 1}"
            text = text if self.done < self.total else "finishing"
        if _kind(text) != _kind(self.activity):
            self.activity_since = now
        self.activity = text

    def eta(self, now: float | None = None) -> float | None:
        """Measured: the smoothed step time times the steps left, less the time
        since the last step ended (never below nothing left of the next one),
        and the plan's time after the last step (counted down once it is done)."""
        if self.step_seconds is None:
            return None
        left = max(0, self.total - self.done)
        into = 0.0 if now is None or self.last_step_at is None else now - self.last_step_at
        if left == 0:
            return max(0.0, self.after - into)
        return max(0.0, self.step_seconds - into) + self.step_seconds * (left - 1) + self.after

    def lines(self, now: float) -> tuple[str, str]:
        """Two lines of at most about 78 characters: progress, then timing."""
        eval_accuracy = "" if self.eval_accuracy is None else f" acc {self.eval_accuracy:.2f}"
        eval_part = "" if self.eval_loss is None else f"  eval {self.eval_loss:.4f}{eval_accuracy} @{self.eval_step}"
        loss = "-" if self.loss is None else f"{self.loss:.4f}"
        loss += "" if self.accuracy is None else f" acc {self.accuracy:.2f}"
        # A DPO run shows its accuracies instead of the lr: the line stays within 80 columns with the bar.
        lr = "" if self.lr is None or self.accuracy is not None else f"  lr {self.lr:.1e}"
        first = f"{self.done}/{self.total}  loss {loss}{eval_part}{lr}"
        epoch = "" if self.epoch is None else f"epoch {self.epoch:.2f}  "
        speed = "" if self.tokens_per_s is None else f"{self.tokens_per_s:,.0f} tok/s  "
        eta = clock(self.eta(now)) if self.step_seconds is not None else "after step 1"
        doing = f"  {self.activity} {clock(now - self.activity_since)}"
        doing = doing if self.countdown is None else f"  {self.countdown.text(now)}"
        return first, f"{epoch}{speed}elapsed {clock(now - self.started)}  eta {eta}{doing}"


    def resources_line(self) -> str:
        """Memory used at the last step against the plan's estimate and the budget;
        gradient norm; GPU use where there is a GPU."""
        used = "-" if self.memory_bytes is None else f"{self.memory_bytes / GIB:.2f} GiB"
        plan = ""
        if self.planned.get("total_bytes"):
            plan = f" (plan {self.planned['total_bytes'] / GIB:.2f}, budget {self.planned['budget_bytes'] / GIB:.1f})"
        norm = "" if self.grad_norm is None else f"  grad norm {self.grad_norm:.3g}"
        gpu = "" if self.gpu_util is None else f"  gpu {self.gpu_util:.0f}%"
        gpu += "" if self.gpu_memory_bytes is None else f" {self.gpu_memory_bytes / GIB:.1f} GiB"
        return f"memory {used}{plan}{norm}{gpu}"

    def plateau_line(self) -> str | None:
        """Said once eval loss has not improved for PLATEAU_EVALUATIONS evaluations."""
        if self.best_eval is None or self.evals_since_best < PLATEAU_EVALUATIONS:
            return None
        loss, step = self.best_eval
        return (f"plateau: eval loss has not improved for {self.evals_since_best} evaluations "
                f"(best {loss:.4f} @{step})")


def _kind(activity: str) -> str:
    """An activity without its progress counter: "evaluating 3/7" is still the
    evaluation that began at "evaluating 0/7", and its time runs on."""
    words = activity.split(" ")
    return " ".join(words[:-1]) if "/" in words[-1] else activity


def _smooth(previous: float | None, value: float) -> float:
    return value if previous is None else SMOOTHING * value + (1 - SMOOTHING) * previous


