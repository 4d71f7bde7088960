"""Which loss a plan trains with: the one place that names every objective's loss."""

from __future__ import annotations

from typing import Any, Callable

from llmcustoms.losses.dpo import PreferenceLoss
from llmcustoms.losses.objective import Loss
from llmcustoms.losses.sft import TokenCrossEntropy

# Each objective's loss (by `Objective.name`), made for a plan. A new objective adds
# its `Objective` to `planning/objective_kinds.OBJECTIVES` and its loss here.
LOSSES: dict[str, Callable[[Any], Loss]] = {
    TokenCrossEntropy.objective.name: lambda plan: TokenCrossEntropy(),
    PreferenceLoss.objective.name: lambda plan: PreferenceLoss(plan.beta),
}


def loss_for(plan: Any) -> Loss:
    """The loss a plan trains with."""
    return LOSSES[plan.objective_kind.name](plan)
