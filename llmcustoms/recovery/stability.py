"""Whether a finished step says the run is diverging, before its update is applied.

A step's loss and gradient norm are judged against the steps before it:

  nan         the loss or the gradient norm is NaN or infinite
  divergence  finite, but far outside the recent range:
                loss > LOSS_FACTOR x the median of the last WINDOW losses and
                      more than LOSS_MARGIN above it, or
                gradient norm > NORM_FACTOR x the median of the last WINDOW norms

Either way the trainer skips the update, rolls back to the last checkpoint and
lowers the learning rate (`recovery/recovery_system.py`), as for NaN.

Why these numbers: per-step losses are means over a whole step's trained
tokens, so between neighbouring steps they move by tens of percent, not by
3x; the margin keeps a loss that is small (late in a DPO run, a few hundredths)
from counting a normal wobble as a spike. Gradient norms vary more (a step of
long replies against one of short ones), hence 10x. Nothing is judged before
MIN_HISTORY steps: the first steps of a run move fast by design (warmup, a
LoRA adapter leaving zero). The thresholds were checked against the per-step
losses and norms of real runs on the shared datasets
(tests/fixtures/traces/, `tests/recovery/test_stability.py`): none of their steps
counts as a spike.

A step that spiked once and spikes again when it is retried after the
rollback, at the lower learning rate, is taken as it is: its rows give a high
loss whatever the weights, which is the data, not divergence.
"""

from __future__ import annotations

import math
from statistics import median

WINDOW = 20
MIN_HISTORY = 8
LOSS_FACTOR = 3.0
LOSS_MARGIN = 1.0
NORM_FACTOR = 10.0
# Accepted steps kept: a rollback drops the newest, and a window must remain.
KEPT = 100


class StabilityCheck:
    def __init__(self) -> None:
        self.history: list[tuple[int, float, float]] = []  # (step, loss, gradient norm) of accepted steps
        self.spiked: set[int] = set()  # steps rolled back for a spike: taken as they are when they come again
        self.last_spike = ""  # what made the last spike one, for the message and the recovery record

    def judge(self, step: int, loss: float, grad_norm: float) -> str | None:
        """"nan", "divergence" or None for step `step`'s loss and norm. A step found
        fine is applied and recorded at once, so it joins the history here."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return "nan"
        if step in self.spiked or len(self.history) < MIN_HISTORY:
            self.accept(step, loss, grad_norm)
            return None
        recent = self.history[-WINDOW:]
        typical_loss = median(entry[1] for entry in recent)
        typical_norm = median(entry[2] for entry in recent)
        loss_spike = loss > LOSS_FACTOR * typical_loss and loss > typical_loss + LOSS_MARGIN
        norm_spike = typical_norm > 0 and grad_norm > NORM_FACTOR * typical_norm
        if loss_spike or norm_spike:
            self.spiked.add(step)
            self.last_spike = (f"loss {loss:.4g} against a recent median of {typical_loss:.4g}, gradient norm "
                               f"{grad_norm:.4g} against {typical_norm:.4g}")
            return "divergence"
        self.accept(step, loss, grad_norm)
        return None

    def accept(self, step: int, loss: float, grad_norm: float) -> None:
        self.history.append((step, loss, grad_norm))
        del self.history[:-KEPT]

    def went_back_to(self, step: int) -> None:
        """A rollback or resume to `step`: the steps after it are trained again."""
        self.history = [entry for entry in self.history if entry[0] <= step]

    def seed(self, rows: list[dict]) -> None:
        """The recent steps of a resumed run, from its metrics.jsonl rows."""
        for row in rows:
            if "loss" in row and "grad_norm" in row:
                self.accept(row["step"], row["loss"], row["grad_norm"])
