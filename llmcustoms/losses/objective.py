"""What a run learns, as the training loop sees it: a `Loss`.

The loop (`training/finetuner.py`), its evaluation (`training/evaluation.py`)
and `lr-find` know nothing of SFT or DPO: they call a `Loss`, which owns
everything that differs between objectives. That is, in the order the loop
meets them:

- `setup(model, loop)`: what the model needs before the first step (which
  logits the head computes; DPO's reference log-probabilities when no adapter
  can be switched off to get them);
- `__call__(model, batch, normaliser)`: one micro-batch's summed loss divided
  by `normaliser` (the count of what it sums over in the whole step or
  evaluation, so that any split of a step gives the same update), and a 1-D
  tensor of further sums named by `sums` (DPO's rewards), or None;
- `step_metrics` and `eval_metrics`: the metrics.jsonl fields those sums give;
- `untrained()`: the eval loss and metrics of the untrained model when they are
  known without a forward (DPO: the model is its own reference);
- `held_out(rows, step)`: what the result shows of the best evaluation.

SFT (`losses/sft.py`) and DPO (`losses/dpo.py`) are the two implementations;
`losses/choice.py` picks the plan's. Each names its `Objective`
(`planning/objective_kinds.py`): what the rest of the tool asks of it (pairs or
single rows, perplexity, a reference, its share of a step's work). A new
objective is a class in this folder with these members, its `Objective` in
`OBJECTIVES` and its loss in `choice.LOSSES` (CONTRIBUTING.md, "A loss or
objective"). A pair objective's evaluation rows carry DPO's reward fields
(`eval_reward_accuracy`, `eval_reward_margin`, `eval_chosen_reward`,
`eval_rejected_reward`): `report` and the result judge pairs by them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Protocol

import torch


@dataclass(frozen=True)
class LoopParts:
    """What a loss may use of the loop while it sets up: the plan, the rows
    (`training.batching.TrainingRows`), the run directory, the processes
    (`training.processes.Processes`), the precision's autocast and a way to say
    what it is doing."""
    plan: Any
    data: Any
    run_dir: Any
    processes: Any
    autocast: Callable[[], ContextManager]
    activity: Callable[[str | None], None]


class Loss(Protocol):
    objective: Any  # its `planning.objective_kinds.Objective`
    sums: tuple[str, ...]  # the names of the sums `__call__` returns beside the loss; () for none

    def setup(self, model: Any, loop: LoopParts) -> None:
        """Prepare `model` (the unwrapped one) before the first step and after a rollback."""

    def __call__(self, model: Any, batch: dict[str, torch.Tensor],
                 normaliser: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(summed loss of `batch` / `normaliser`, its sums or None)."""

    def step_metrics(self, sums: list[float], count: int) -> dict[str, float]:
        """A step row's fields from its sums over `count` rows."""

    def eval_metrics(self, eval_loss: float, sums: list[float], count: int) -> dict[str, float]:
        """An evaluation row's fields beside `eval_loss`, from its sums over `count` rows."""

    def untrained(self) -> tuple[float, dict[str, float]] | None:
        """The untrained model's eval loss and metrics when known without a forward; None otherwise."""

    def held_out(self, rows: list[dict[str, Any]], step: int | None) -> dict[str, Any]:
        """What the run's result shows of the evaluation at `step` (metrics.jsonl `rows`); {} for nothing."""
