"""Eval loss: the mean loss per trained token over the held-out rows, as `FineTuner` measures it.

Out of memory while evaluating is caught here, not in the training step, and
recovered like there (the caller lowers the micro-batch), but nothing rolls
back: the weights are fine. With several processes they agree on it before the
loss is summed; under FSDP the forwards are collectives, so the process asks
for a restart instead.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from llmcustoms.batching import TrainingRows, count_loss_tokens
from llmcustoms.stopsignals import StopRequested

# loss(batch, normaliser): the run's loss of one micro-batch (FineTuner's, under autocast).
BatchLoss = Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]


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

    def __bool__(self) -> bool:
        """Whether there is anything to evaluate."""
        return bool(self.micro_batches)

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
                return self.processes.sum(loss_sum).item()
            lower_micro_batch()

    @torch.no_grad()
    def _share(self, model: Any, stoppable: bool) -> torch.Tensor:
        """This rank's share of the loss, normalised by the trained tokens of the whole set."""
        device = self.processes.device
        normaliser = torch.tensor(max(1, sum(count_loss_tokens(mb["labels"]) for mb in self.micro_batches)),
                                  device=device)
        model.eval()
        share = self.processes.evaluation_share(self.micro_batches)
        total = torch.zeros((), device=device)
        try:
            for done, (mb, weight) in enumerate(share):
                if stoppable and self.processes.stop_now():
                    raise StopRequested
                self.activity(f"evaluating {done}/{len(share)}")
                total += self.batch_loss({k: v.to(device) for k, v in mb.items()}, normaliser) * weight
            return total
        finally:
            model.train()
            self.activity(None)
