"""Eval loss: the mean loss per trained token (per pair, for DPO) over the held-out rows, as `FineTuner` measures it.

Out of memory while evaluating is caught here, not in the training step, and
recovered like there (the caller lowers the micro-batch), but nothing rolls
back: the weights are fine. With several processes they agree on it before the
loss is summed; under FSDP the forwards are collectives, so the process asks
for a restart instead.

A stop (SIGINT, SIGTERM) ends an evaluation before its next micro-batch, with
any number of processes: they agree before each one (`stop_signals.stop_agreed`),
which also tells them at once of another's out-of-memory. The step before it is
finished: the caller saves its checkpoint and ends the run, and a resumed run
evaluates again (`cut_short`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from llmcustoms.losses.objective import Loss
from llmcustoms.recovery.stop_signals import StopRequested, stop_agreed
from llmcustoms.training.batching import TrainingRows

# loss(batch, normaliser): the run's loss of one micro-batch and its sums (FineTuner's, under autocast).
BatchLoss = Callable[[dict[str, torch.Tensor], torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


class FailedElsewhere(Exception):
    """Another process ran out of memory, learnt between micro-batches: agreed on already."""


class Evaluation:
    def __init__(self, data: TrainingRows, processes: Any, objective: Loss, loss: BatchLoss,
                 free_memory: Callable[[], None], activity: Callable[[str | None], None] = lambda text: None):
        """`objective` says what the sums of `loss` (the objective under the run's autocast) mean;
        `activity(text)` is told how far an evaluation is, and None when it is done."""
        self.activity = activity
        self.data = data
        self.processes = processes
        self.objective = objective
        self.batch_loss = loss
        self.free_memory = free_memory
        self.micro_batches: list[dict[str, torch.Tensor]] = []
        self.general_batches: list[dict[str, torch.Tensor]] = []  # forgetting's (`general_text.py`), after the others
        self.metrics: dict[str, float] = {}  # the last evaluation's besides the loss (eval_ppl, ...)

    def __bool__(self) -> bool:
        """Whether there is anything to evaluate."""
        return bool(self.micro_batches)

    def row(self, eval_loss: float) -> dict[str, float]:
        """An evaluation's row of metrics.jsonl: the loss, and what the objective adds (perplexity, rewards)."""
        return {"eval_loss": eval_loss, **self.metrics}

    def untrained(self) -> float | None:
        """The untrained model's eval loss when the objective knows it without a
        forward (DPO's: the model is its own reference); None otherwise."""
        known = self.objective.untrained()
        if known is None:
            return None
        loss, self.metrics = known
        return loss

    def use_micro_batch(self, size: int) -> None:
        """Evaluation micro-batches, built once (and again when recovery changes their size)."""
        self.micro_batches = self.data.evaluation_batches(size)
        self.general_batches = self.data.general_batches(size)

    def due(self, step: int, plan: Any) -> bool:
        """Whether an evaluation follows `step`: every `plan.eval_every` steps, and after the last."""
        return bool(self) and bool(plan.eval_every) and (step % plan.eval_every == 0 or step == plan.total_steps)

    def cut_short(self, step: int, plan: Any, run_dir: Any) -> bool:
        """Whether the evaluation after `step` (a resumed run's first) is due and
        not in metrics.jsonl: a stop cut it short, after its step's checkpoint
        was saved. The main process decides, from its file."""
        missing = step > 0 and self.due(step, plan) and not any(
            row.get("step") == step and "eval_loss" in row for row in run_dir.read_metrics())
        return self.processes.main_decides(missing)

    def loss(self, model: Any, step: int, lower_micro_batch: Callable[[], None],
             stop: Callable[[], None] | None = None) -> float:
        """The eval loss after `step`; `lower_micro_batch()` is called (and
        evaluation starts again) each time memory runs out. `stop()`, if given,
        is called when a stop (SIGINT, SIGTERM) is agreed between micro-batches:
        it ends the run (raises)."""
        while True:
            failure = agreed = None
            try:
                loss_sum = self._share(model, stop is not None)
            except torch.OutOfMemoryError:
                failure = "oom"
            except FailedElsewhere:
                agreed = "oom"
            except StopRequested:
                agreed = "stop"
            if agreed == "stop" and stop is not None:
                stop()
                raise StopRequested  # only if `stop` did not end the run: no loss to give
            if failure is not None:
                self.free_memory()
                self.processes.restart_if_sharded(failure, step + 1)
            if agreed is None and self.processes.agree(failure) is None:
                loss, *sums = self.processes.sum(loss_sum).tolist()
                general = sums.pop() if self.general_batches else None
                self.metrics = self.objective.eval_metrics(loss, sums, self._units())
                if general is not None:
                    self.metrics["general_loss"] = general
                return loss
            lower_micro_batch()

    def _units(self) -> int:
        return max(1, sum(self.data.batch_units(mb) for mb in self.micro_batches))

    @torch.no_grad()
    def _share(self, model: Any, stoppable: bool) -> torch.Tensor:
        """This rank's share of the loss (and of its sums), normalised by the
        trained tokens (pairs) of the whole set, then of the general rows' loss
        when there are any. `stoppable`: every process asks before each
        micro-batch whether to stop (StopRequested) or another ran out of memory
        (FailedElsewhere), as often as the one with the most."""
        device = self.processes.device
        model.eval()
        total = torch.zeros(1 + len(self.objective.sums), device=device)
        try:
            total = self._add_batches(total, self.micro_batches, self._units(), stoppable, "evaluating")
            if not self.general_batches:
                return total
            general = self._add_batches(torch.zeros(1, device=device), self.general_batches,
                                        sum(self.data.batch_units(mb) for mb in self.general_batches), stoppable,
                                        "measuring forgetting")
            return torch.cat([total, general])
        finally:
            model.train()
            self.activity(None)

    def _add_batches(self, total: torch.Tensor, batches: list[dict[str, torch.Tensor]], units: int, stoppable: bool,
                     doing: str) -> torch.Tensor:
        """`total` plus this rank's share of the loss (and sums) of `batches`, normalised by `units`."""
        device = self.processes.device
        normaliser = torch.tensor(max(1, units), device=device)
        share = self.processes.evaluation_share(batches)
        rounds = -(-len(batches) // self.processes.world) if stoppable else len(share)
        for done in range(rounds):
            agreed = stop_agreed(self.processes) if stoppable else None
            if agreed is not None:
                raise StopRequested if agreed == "stop" else FailedElsewhere
            if done >= len(share):  # one fewer than another process's share
                continue
            mb, weight = share[done]
            self.activity(f"{doing} {done}/{len(share)}")
            loss, sums = self.batch_loss({k: v.to(device) for k, v in mb.items()}, normaliser)
            parts = [loss.reshape(1)] + ([sums] if sums is not None and len(total) > 1 else [])
            total = total + torch.cat(parts) * weight
        return total
