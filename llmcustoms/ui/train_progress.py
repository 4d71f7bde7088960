"""The numbers of the live training display, from the trainer's rows; no Rich.

The ETA is measured from step 1 on, whatever the step length: Rich's own
column averages over the last 30 s and stays blank when a step takes longer,
which is every real run on a CPU. It uses the wall time between steps (so
evaluations, checkpoints and sample replies are in it), smoothed.
"""

from __future__ import annotations

from typing import Any

# Weight of the newest step in the smoothed step time and tokens/s: enough
# smoothing that one slow step (an evaluation's warm-up, a save) does not make
# the ETA jump, little enough that a real change shows within a few steps.
SMOOTHING = 0.3
# Evaluations in a row without a better eval loss before the display says the run is on a plateau.
PLATEAU_EVALUATIONS = 2
GIB = 1024 ** 3


def clock(seconds: float | None) -> str:
    """H:MM:SS, or - when unknown."""
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class TrainingProgress:
    """The numbers the display shows, kept from the trainer's rows; no Rich."""

    def __init__(self, total_steps: int, start_step: int, now: float, memory: dict[str, Any] | None = None):
        """`memory`: the plan's estimate (`MemoryEstimate.to_json()`), None if it has none."""
        self.total, self.start_step, self.done = total_steps, start_step, start_step
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

    def set_activity(self, text: str | None, now: float) -> None:
        """What is happening now; None: the next training step."""
        if text is None:
            text = "first step" if self.done == self.start_step else f"step {self.done + 1}"
            text = text if self.done < self.total else "finishing"
        if _kind(text) != _kind(self.activity):
            self.activity_since = now
        self.activity = text

    def eta(self, now: float | None = None) -> float | None:
        """Measured: the smoothed step time times the steps left, less the time
        since the last step ended (never below nothing left of the next one)."""
        if self.step_seconds is None:
            return None
        left = max(0, self.total - self.done)
        if left == 0:
            return 0.0
        into = 0.0 if now is None or self.last_step_at is None else now - self.last_step_at
        return max(0.0, self.step_seconds - into) + self.step_seconds * (left - 1)

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


