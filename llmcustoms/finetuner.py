"""`FineTuner`: executes a `Plan` with a small, explicit training loop on accelerate.

Read it top to bottom: set up (seed, model, optimizer, schedule), then for
each optimizer step take `grad_accum` micro-batches, normalise the loss by the
number of trained tokens in the whole window (so splitting a batch into more
micro-batches gives the same update), clip, step, log, and now and then
evaluate. Running on accelerate means `accelerate launch` gives data parallelism.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmcustoms.batching import collate, count_loss_tokens, epoch_steps, eval_batches, micro_batches
from llmcustoms.console import Reporter
from llmcustoms.modeling import load_model, save_trained
from llmcustoms.planning import Plan
from llmcustoms.rundir import RunDirectory
from llmcustoms.tokenization import TokenizedExample

# status.json is rewritten (with fsync) at most this often while training runs.
STATUS_INTERVAL_S = 5.0


@dataclass
class TrainResult:
    status: str
    steps: int
    final_loss: float | None
    best_eval_loss: float | None
    best_eval_step: int | None
    seconds: float
    tokens_per_s: float
    output_path: Path
    stop_reason: str | None = None


def lr_multiplier(step: int, plan: Plan) -> float:
    """Learning-rate factor for optimizer step `step` (0-based): linear warmup, then decay."""
    if step < plan.warmup_steps:
        # (step + 1): the first step already learns; HF's schedule wastes it at lr 0.
        return (step + 1) / (plan.warmup_steps + 1)
    if plan.lr_scheduler == "constant":
        return 1.0
    progress = (step - plan.warmup_steps) / max(1, plan.total_steps - plan.warmup_steps)
    if plan.lr_scheduler == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def parameter_groups(model: Any, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only: decaying biases and norm scales only hurts."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


class FineTuner:
    def __init__(self, plan: Plan, tokenizer: Any, train: list[TokenizedExample], evaluation: list[TokenizedExample],
                 run_dir: RunDirectory, reporter: Reporter):
        self.plan = plan
        self.tokenizer = tokenizer
        self.train_rows = train
        self.eval_rows = evaluation
        self.run_dir = run_dir
        self.reporter = reporter
        self.lengths = [len(e.input_ids) for e in train]
        self.model: Any = None

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        plan = self.plan
        self.accelerator = Accelerator(mixed_precision=plan.mixed_precision, cpu=not torch.cuda.is_available())
        set_seed(plan.seed)  # python, numpy, torch (and CUDA): LoRA init and dropout draw from these
        device_index = self.accelerator.local_process_index if torch.cuda.is_available() else None
        model = load_model(plan, device_index)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(parameter_groups(model, plan.weight_decay), lr=plan.lr,
                                      fused=torch.cuda.is_available())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(s, plan))
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.device = self.accelerator.device
        # Tensor cores work on multiples of 8; on CPU padding more only costs.
        self.pad_multiple = 8 if torch.cuda.is_available() else 1
        self.eval_micro_batches = [
            collate([self.eval_rows[i] for i in batch], self.tokenizer.pad_token_id, self.pad_multiple)
            for batch in eval_batches([len(e.input_ids) for e in self.eval_rows], plan.micro_batch_size)
        ]

    # ------------------------------------------------------------------- loop

    def _epoch_steps(self, epoch: int) -> list[list[int]]:
        """The optimizer steps of one epoch, each a list of row indices."""
        return epoch_steps(self.lengths, self.plan.effective_batch_size, self.plan.seed, epoch)

    def _train_step(self, rows: list[int]) -> dict[str, float]:
        """One optimizer step over `rows`, in micro-batches of the planned size."""
        started = time.perf_counter()
        batches = [collate([self.train_rows[i] for i in b], self.tokenizer.pad_token_id, self.pad_multiple)
                   for b in micro_batches(rows, self.lengths, self.plan.micro_batch_size)]
        loss_tokens = sum(count_loss_tokens(mb["labels"]) for mb in batches)
        input_tokens = sum(int(mb["attention_mask"].sum()) for mb in batches)
        normaliser = torch.tensor(loss_tokens, device=self.device)
        self.model.train()
        loss_sum = torch.zeros((), device=self.device)
        for j, mb in enumerate(batches):
            mb = {k: v.to(self.device, non_blocking=True) for k, v in mb.items()}
            # Gradients are only all-reduced on the last micro-batch of the step.
            sync = nullcontext() if j == len(batches) - 1 else self.accelerator.no_sync(self.model)
            with sync:
                # num_items_in_batch: the loss is summed over tokens and divided by
                # the step's token count, not averaged per micro-batch.
                loss = self.model(**mb, num_items_in_batch=normaliser, use_cache=False).loss
                self.accelerator.backward(loss)
            loss_sum += loss.detach()
        max_norm = self.plan.max_grad_norm if self.plan.max_grad_norm > 0 else float("inf")
        grad_norm = self.accelerator.clip_grad_norm_(self.trainable, max_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_value = loss_sum.item()  # the one host sync per step, needed for logging
        elapsed = time.perf_counter() - started
        return {"loss": loss_value, "lr": lr, "grad_norm": float(grad_norm),
                "tokens_per_s": input_tokens / elapsed, "tokens": input_tokens, "seconds": elapsed}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss per trained token over the whole evaluation set."""
        total_tokens = sum(count_loss_tokens(mb["labels"]) for mb in self.eval_micro_batches)
        normaliser = torch.tensor(total_tokens, device=self.device)
        self.model.eval()
        loss_sum = torch.zeros((), device=self.device)
        for mb in self.eval_micro_batches:
            mb = {k: v.to(self.device) for k, v in mb.items()}
            loss_sum += self.model(**mb, num_items_in_batch=normaliser, use_cache=False).loss
        self.model.train()
        return loss_sum.item()

    def run(self) -> TrainResult:
        plan = self.plan
        self._setup()
        self.run_dir.write_status("running", step=0, total_steps=plan.total_steps, reason=None)
        self._status_written = time.monotonic()
        self.reporter.training_started(plan.total_steps)
        started = time.perf_counter()
        step, tokens, final_loss = 0, 0, None
        best_eval, best_step, evals_since_best, stop_reason = None, None, 0, None
        epoch = 0
        while step < plan.total_steps and stop_reason is None:
            steps = self._epoch_steps(epoch)
            for index, rows in enumerate(steps):
                if step >= plan.total_steps or stop_reason is not None:
                    break
                metrics = self._train_step(rows)
                step += 1
                tokens += metrics["tokens"]
                final_loss = metrics["loss"]
                row = {"step": step, "epoch": round(epoch + (index + 1) / len(steps), 4),
                       **{k: metrics[k] for k in ("loss", "lr", "grad_norm", "tokens_per_s")}}
                self.run_dir.append_metrics(row)
                self.reporter.step(row)
                last_step = step == plan.total_steps
                if self.eval_micro_batches and plan.eval_every and (step % plan.eval_every == 0 or last_step):
                    eval_loss = self.evaluate()
                    eval_row = {"step": step, "eval_loss": eval_loss}
                    self.run_dir.append_metrics(eval_row)
                    self.reporter.evaluated(eval_row)
                    if best_eval is None or eval_loss < best_eval:
                        best_eval, best_step, evals_since_best = eval_loss, step, 0
                    else:
                        evals_since_best += 1
                        if plan.early_stopping_patience and evals_since_best >= plan.early_stopping_patience:
                            stop_reason = (f"early stopping: eval loss has not improved for {evals_since_best} "
                                           f"evaluations since step {best_step}")
                if time.monotonic() - self._status_written > STATUS_INTERVAL_S:
                    self.run_dir.write_status("running", step=step)
                    self._status_written = time.monotonic()
            epoch += 1
        self.reporter.training_finished()
        seconds = time.perf_counter() - started
        output = self.run_dir.output_path(plan.method)
        save_trained(self.accelerator.unwrap_model(self.model), self.tokenizer, output)
        self.run_dir.write_status("completed", step=step, reason=stop_reason, final_loss=final_loss,
                                  best_eval_loss=best_eval, best_eval_step=best_step)
        if stop_reason:
            self.reporter.message(stop_reason)
        return TrainResult(status="completed", steps=step, final_loss=final_loss, best_eval_loss=best_eval,
                           best_eval_step=best_step, seconds=seconds, tokens_per_s=tokens / max(seconds, 1e-9),
                           output_path=output, stop_reason=stop_reason)
