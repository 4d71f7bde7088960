"""Eval loss: the mean loss per trained token (per pair, for DPO) over the held-out rows, as `FineTuner` measures it.

Out of memory while evaluating is caught here, not in the training step, and
recovered like there (the caller lowers the micro-batch), but nothing rolls
back: the weights are fine. With several processes they agree on it before the
loss is summed; under FSDP the forwards are collectives, so the process asks
for a restart instead.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from llmcustoms.batching import TrainingRows
from llmcustoms.measures import perplexity
from llmcustoms.preferenceloss import SUMS, preference_metrics
from llmcustoms.stopsignals import StopRequested

# loss(batch, normaliser): the run's loss of one micro-batch and its sums (FineTuner's, under autocast).
BatchLoss = Callable[[dict[str, torch.Tensor], torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


class Evaluation:
    def __init__(self, data: TrainingRows, processes: Any, loss: BatchLoss, free_memory: Callable[[], None],
                 activity: Callable[[str | None], None] = lambda text: None):
        """`activity(text)` is told how far an evaluation is, and None when it is done."""
        self.activity = activity
        self.data = data
        self.processes = processes
        self.batch_loss = loss
        self.free_memory = free_memory
        self.micro_batches: list[dict[str, torch.Tensor]] = []
        self.metrics: dict[str, float] = {}  # the last evaluation's besides the loss (DPO's eval_reward_accuracy, ...)

    def __bool__(self) -> bool:
        """Whether there is anything to evaluate."""
        return bool(self.micro_batches)

    def row(self, eval_loss: float) -> dict[str, float]:
        """An evaluation's row of metrics.jsonl: the loss, and its perplexity or DPO's metrics."""
        return {"eval_loss": eval_loss, **(self.metrics if self.data.pairs else {"eval_ppl": perplexity(eval_loss)})}

    def untrained(self) -> float | None:
        """The untrained model's eval loss when it is known without a forward:
        under DPO it is its own reference, so every reward is 0, each pair's
        loss log 2 and the accuracy chance (ties count half). None otherwise."""
        if not self.data.pairs:
            return None
        self.metrics = preference_metrics([0.0, 0.0, 0.5], 1, "eval_")
        return math.log(2)

    def use_micro_batch(self, size: int) -> None:
        """Evaluation micro-batches, built once (and again when recovery changes their size)."""
        self.micro_batches = self.data.evaluation_batches(size)

    def loss(self, model: Any, step: int, lower_micro_batch: Callable[[], None], stoppable: bool = False) -> float:
        """The eval loss after `step`; `lower_micro_batch()` is called (and
        evaluation starts again) each time memory runs out. `stoppable`: a stop
        asked for (Ctrl-C) ends it between micro-batches with StopRequested."""
        while True:
            failure = None
            try:
                loss_sum = self._share(model, stoppable)
            except torch.OutOfMemoryError:
                failure = "oom"
            if failure is not None:
                self.free_memory()
                self.processes.restart_if_sharded(failure, step + 1)
            if self.processes.agree(failure) is None:
                loss, *sums = self.processes.sum(loss_sum).tolist()
                self.metrics = preference_metrics(sums, self._units(), "eval_") if sums else {}
                return loss
            lower_micro_batch()

    def _units(self) -> int:
        return max(1, sum(self.data.batch_units(mb) for mb in self.micro_batches))

    @torch.no_grad()
    def _share(self, model: Any, stoppable: bool) -> torch.Tensor:
        """This rank's share of the loss (and of its sums), normalised by the
        trained tokens (pairs) of the whole set."""
        device = self.processes.device
        normaliser = torch.tensor(self._units(), device=device)
        model.eval()
        share = self.processes.evaluation_share(self.micro_batches)
        total = torch.zeros(1 + (len(SUMS) if self.data.pairs else 0), device=device)
        try:
            for done, (mb, weight) in enumerate(share):
                if stoppable and self.processes.stop_now():
                    raise StopRequested
                self.activity(f"evaluating {done}/{len(share)}")
                loss, sums = self.batch_loss({k: v.to(device) for k, v in mb.items()}, normaliser)
                total += torch.cat([loss.reshape(1)] + ([sums] if sums is not None else [])) * weight
            return total
        finally:
            model.train()
            self.activity(None)
