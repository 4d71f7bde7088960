"""One optimizer step's gradients, as `train`, `tune` and `lr-find` all take them.

A step's rows are split into micro-batches (`step_micro_batches`: rows of
similar length, or packed into token budgets); each goes forward and backward
with the run's `Loss`, summed over the step's learned tokens (pairs, for DPO)
and divided by their count, so that any split of a step, over micro-batches
or processes, gives the same update. What happens around it (agreeing with
other processes, judging the loss, recovering, updating) is the caller's:
`FineTuner._attempt` recovers, `lr-find` lets a run diverge on purpose.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager

import torch

from llmcustoms.losses.objective import Loss
from llmcustoms.models.packing import packed_micro_batches
from llmcustoms.training.batching import micro_batches


def step_micro_batches(rows: list[int], lengths: list[int], size: int, packed_to: int = 0) -> list[list[int]]:
    """A step's `rows` as micro-batches of `size` rows, or, packed (`packed_to`:
    the rows' length cap), of `size` x `packed_to` tokens each."""
    if packed_to:
        return packed_micro_batches(rows, lengths, size * packed_to, packed_to)
    return micro_batches(rows, lengths, size)


def accumulate_gradients(model: Any, loss: Loss, batches: list[tuple[dict[str, torch.Tensor], float]],
                         normaliser: torch.Tensor, device: torch.device, autocast: Callable[[], ContextManager],
                         backward: Callable[[torch.Tensor], None],
                         before: Callable[[], None] = lambda: None,
                         alter: Callable[[torch.Tensor], torch.Tensor] = lambda value: value) -> torch.Tensor:
    """Forward and backward over `batches` (each with its weight in the loss);
    returns [the summed loss, the loss's sums...] on `device`, still there (the
    caller decides when to synchronise). `before()` runs before each
    micro-batch (it may raise to stop); `alter(loss)` may change a
    micro-batch's loss before its backward (fault injection)."""
    model.train()
    totals = torch.zeros(1 + len(loss.sums), device=device)
    for batch, weight in batches:
        before()
        batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        with autocast():
            value, sums = loss(model, batch, normaliser)
        value = alter(value * weight)
        backward(value)
        totals = totals + torch.cat([value.detach().reshape(1)] + ([sums * weight] if sums is not None else []))
    return totals
