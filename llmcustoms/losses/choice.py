"""Which loss a plan trains with: the one place that names every objective."""

from __future__ import annotations

from typing import Any

from llmcustoms.losses.dpo import PreferenceLoss
from llmcustoms.losses.objective import Loss
from llmcustoms.losses.sft import TokenCrossEntropy


def loss_for(plan: Any) -> Loss:
    """The loss a plan trains with."""
    if plan.objective == "dpo":
        return PreferenceLoss(plan.beta)
    return TokenCrossEntropy()
