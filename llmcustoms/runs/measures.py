"""How good a model is, from its eval loss: perplexity, and the change from the base model.

Eval loss is the mean cross-entropy per trained token (natural log), so
perplexity is exp of it: the number of equally likely tokens the model is, on
average, choosing between. Lower is better for both; perplexity makes a
change easier to read (2.30 -> 2.08 in loss is 10.0 -> 8.0 in perplexity).
Pure functions: the running layer, reports and the model card share them.
"""

from __future__ import annotations

import math

# exp() of more than this is no number anyone reads; it also keeps JSON finite.
LOSS_CAP = 50.0


def perplexity(eval_loss: float) -> float:
    return math.exp(min(eval_loss, LOSS_CAP))


def improvement(base_loss: float | None, loss: float | None) -> float | None:
    """The share by which perplexity fell from the base model's (0.2: 20% lower); None if either is unknown."""
    if base_loss is None or loss is None:
        return None
    return 1.0 - perplexity(loss) / perplexity(base_loss)


def describe(base_loss: float | None, loss: float | None) -> str:
    """One line for people, e.g. 'perplexity 10.02 -> 8.01 (20% lower than the base model)'."""
    if loss is None:
        return "no evaluation"
    if base_loss is None:
        return f"perplexity {perplexity(loss):.2f}"
    change = improvement(base_loss, loss)
    direction = "lower" if change >= 0 else "higher"
    return (f"perplexity {perplexity(base_loss):.2f} -> {perplexity(loss):.2f} "
            f"({abs(change):.0%} {direction} than the base model)")
