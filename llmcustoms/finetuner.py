"""`FineTuner`: executes a `Plan` with a small, explicit training loop on accelerate.

Read it top to bottom: set up (seed, model, optimizer, schedule), then for
each optimizer step take the step's rows in micro-batches, normalise the loss
by the number of trained tokens in the whole step (so splitting a batch into
more micro-batches gives the same update), check the result is finite, clip,
step, log, evaluate now and then, checkpoint every `save_every` steps.

Failures are caught in exactly one place (`_attempt`): out of memory and
non-finite losses go to the `TrainingRecoverySystem`, which returns a changed
plan; the loop rolls back to the last checkpoint and carries on. SIGINT and
SIGTERM finish the current step, checkpoint, and stop.

With several processes, every rank agrees on a step's outcome before any
collective that depends on it. Under FSDP the collectives are inside forward
and backward, so a rank that runs out of memory there cannot tell the others:
it asks for a restart (`RestartNeeded`) and the launcher restarts them all.
"""

from __future__ import annotations

import gc
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from llmcustoms.batching import collate, count_loss_tokens, epoch_steps, eval_batches, micro_batches
from llmcustoms.checkpoints import (Checkpoint, CheckpointManager, load_optimizer_state, optimizer_state, rng_state,
                                    set_rng_state)
from llmcustoms.reporting import Reporter, SilentReporter
from llmcustoms.faults import FaultInjector
from llmcustoms.modeling import load_model, save_trained
from llmcustoms.planning import Plan
from llmcustoms.recovery import (RestartNeeded, TrainingFailed, TrainingInterrupted, TrainingRecoverySystem,
                                 create_failure_report)
from llmcustoms.rundir import RunDirectory
from llmcustoms.sharding import gather_optimizer, gather_weights, load_optimizer, load_weights, shard
from llmcustoms.tokenization import IGNORE_INDEX, TokenizedExample

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


def _use_physical_cores(processes: int) -> None:
    """CPU training: one thread per physical core, shared among the processes.
    Hyper-threads compete for the same matrix units and slow matmuls down."""
    import psutil

    cores = psutil.cpu_count(logical=False) or torch.get_num_threads()
    torch.set_num_threads(max(1, cores // processes))


def _restart_reason(restart: dict[str, Any]) -> str:
    kind = {"oom": "out of memory"}.get(restart["kind"], restart["kind"])
    return f"process {restart.get('rank')}: {kind} at step {restart['step']}; restart requested (resume recovers)"


# Gradients are all-reduced this many bytes at a time (DDP's default bucket size).
ALL_REDUCE_BUCKET_BYTES = 25 * 1024 ** 2


def _buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype, grouped up to `limit` bytes (a larger
    tensor is a bucket of its own)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or size + nbytes > limit or tensor.dtype != buckets[-1][0].dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += nbytes
    return buckets


class FineTuner:
    def __init__(self, plan: Plan, tokenizer: Any, train: list[TokenizedExample], evaluation: list[TokenizedExample],
                 run_dir: RunDirectory, reporter: Reporter, faults: FaultInjector | None = None,
                 on_evaluate: Callable[[int, float], bool] | None = None, save_artifacts: bool = True):
        """`on_evaluate(step, eval_loss)` may return True to stop (tuning prunes this
        way); `save_artifacts=False` writes no checkpoints and no adapter."""
        self.plan = plan
        self.on_evaluate = on_evaluate
        self.save_artifacts = save_artifacts
        self.tokenizer = tokenizer
        self.train_rows = train
        self.eval_rows = evaluation
        self.run_dir = run_dir
        self.reporter = reporter
        self.faults = faults or FaultInjector.from_env()
        # Step composition depends on these lengths; they stay fixed even if
        # recovery later shortens the rows, so no row is seen twice in an epoch.
        self.lengths = [len(e.input_ids) for e in train]
        self._cut_rows(plan.max_seq_len)  # a resumed run whose recovery shortened sequences
        self.recovery = TrainingRecoverySystem()
        self.checkpoints = CheckpointManager(run_dir.checkpoints_path, plan.keep_checkpoints,
                                             warn=lambda text: reporter.message(text, warning=True))
        self.model: Any = None
        self.stop_signal: int | None = None
        self.agreed_stop: int | None = None  # the stop signal every rank knows of (see _agree)
        self._reset_position()

    def _reset_position(self) -> None:
        self.step = 0  # optimizer steps done
        self.epoch = 0
        self.index = 0  # next step within the epoch
        self.best_eval: float | None = None
        self.best_step: int | None = None
        self.last_eval: float | None = None
        self.evals_since_best = 0
        self.tokens = 0
        self.final_loss: float | None = None

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        plan = self.plan
        if not hasattr(self, "accelerator"):
            self.fsdp = plan.distributed == "fsdp"
            # cpu=True without CUDA: it is what gives several CPU processes a gloo group.
            self.accelerator = Accelerator(mixed_precision=plan.mixed_precision, cpu=not torch.cuda.is_available())
            self.world = self.accelerator.num_processes
            self.rank = self.accelerator.process_index
            self.is_main = self.accelerator.is_main_process
            if self.world > 1:
                self.faults.rank = self.rank
            if not self.is_main:
                self.run_dir = RunDirectory(self.run_dir.path, writable=False)
                self.reporter = SilentReporter()  # one progress display, from the main process
        if not torch.cuda.is_available():
            _use_physical_cores(self.world)
        set_seed(plan.seed)  # the same LoRA init on every rank; dropout draws from these too
        device_index = self.accelerator.local_process_index if torch.cuda.is_available() else None
        model = load_model(plan, device_index)
        if self.fsdp:
            # Names before sharding: checkpoints keep whole tensors under these.
            self.trainable_names = [n for n, p in model.named_parameters() if p.requires_grad]
            total = sum(p.numel() for p in model.parameters())
            self.model = shard(model, plan.mixed_precision)
            held = sum(p.to_local().numel() for p in self.model.parameters())
            self.reporter.message(f"FSDP: the model is sharded over {self.world} processes; each holds about "
                                  f"{held / total:.0%} of its {total:,} weights")
        else:
            if plan.method != "qlora" or device_index is None:  # 4-bit models are placed by their device_map
                model = model.to(self.accelerator.device)
            # The model is not wrapped in DDP: ranks first agree that the step
            # succeeded everywhere, then all-reduce gradients themselves (see
            # _attempt). With DDP's in-backward all-reduce, one rank's out-of-memory
            # error would leave the others waiting in a collective forever.
            self.model = model
        # Under FSDP the optimizer is made after sharding, so it holds the shards.
        optimizer = torch.optim.AdamW(parameter_groups(self.model, plan.weight_decay), lr=plan.lr,
                                      fused=torch.cuda.is_available())
        self.optimizer = self.accelerator.prepare_optimizer(optimizer)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer.optimizer, lambda s: lr_multiplier(s, self.plan))
        self.device = self.accelerator.device
        self._install_selective_head()
        # Out-of-memory injection happens inside a forward pass, after the
        # embeddings: `oom` in a training step's, `eval_oom` in an evaluation's.
        self.accelerator.unwrap_model(self.model).get_input_embeddings().register_forward_hook(
            lambda module, *_: self.faults.raise_oom_if_due(self.step + 1) if module.training
            else self.faults.raise_oom_if_due(self.step, "eval_oom"))
        # Tensor cores work on multiples of 8; on CPU padding more only costs.
        self.pad_multiple = 8 if torch.cuda.is_available() else 1
        self._build_eval_batches()

    def _install_selective_head(self) -> None:
        """Make the LM head compute logits only where the loss needs them.

        The loss uses the logits of positions whose next token is trained: the
        replies, not prompts or padding. For a big vocabulary the head is a
        large share of the compute, and its fp32 logits a large share of the
        memory. The head's forward is patched (not replaced) so every call
        still goes through the top-level model (as DDP requires) and the state
        dict is unchanged; with no selection set it behaves as before.
        """
        self._selection: torch.Tensor | None = None
        head = self.accelerator.unwrap_model(self.model).get_output_embeddings()
        original = head.forward

        def selective_forward(hidden: torch.Tensor) -> torch.Tensor:
            if self._selection is not None:
                hidden = hidden[self._selection]
            return original(hidden)

        head.forward = selective_forward

    def _loss(self, batch: dict[str, torch.Tensor], normaliser: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy over the trained tokens of `batch`, divided by
        `normaliser` (the token count of the whole step or evaluation)."""
        labels = batch["labels"]
        selection = torch.zeros_like(labels, dtype=torch.bool)
        selection[:, :-1] = labels[:, 1:] != IGNORE_INDEX  # position i predicts token i + 1
        self._selection = selection
        try:
            with self.accelerator.autocast():
                logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                    use_cache=False).logits
        finally:
            self._selection = None
        targets = labels[:, 1:][selection[:, :-1]]
        return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum") / normaliser

    def _build_eval_batches(self) -> None:
        self.eval_micro_batches = [
            collate([self.eval_rows[i] for i in batch], self.tokenizer.pad_token_id, self.pad_multiple)
            for batch in eval_batches([len(e.input_ids) for e in self.eval_rows], self.plan.micro_batch_size)
        ]

    # ----------------------------------------------------------- one step

    def _epoch_steps(self, epoch: int) -> list[list[int]]:
        """The optimizer steps of one epoch, each a list of row indices."""
        return epoch_steps(self.lengths, self.plan.effective_batch_size, self.plan.seed, epoch)

    def _local_rows(self, rows: list[int], rank: int) -> list[int]:
        """A rank's share of a step: every world-th row by length, so ranks get
        similar lengths. With one process, all of them."""
        ordered = sorted(rows, key=lambda i: -self.lengths[i])
        return ordered[rank::self.world]

    def _micro_batches(self, rows: list[int]) -> list[tuple[list[int], float]]:
        """This rank's micro-batches of a step, each with its weight in the loss.
        Under FSDP every rank runs as many as the busiest one (each forward and
        backward is a collective); the extra ones repeat rows with weight 0."""
        def split(rank: int) -> list[list[int]]:
            return micro_batches(self._local_rows(rows, rank), self.lengths, self.plan.micro_batch_size)

        mine = [(batch, 1.0) for batch in split(self.rank)]
        if self.fsdp:
            most = max(len(split(rank)) for rank in range(self.world))
            filler = mine[0][0] if mine else rows[:1]
            mine += [(filler, 0.0)] * (most - len(mine))
        return mine

    def _forward_backward(self, rows: list[int]) -> tuple[torch.Tensor, int]:
        """Local gradients of this rank's share of a step; (summed loss, input tokens of the whole step)."""
        parts = self._micro_batches(rows)
        batches = [(collate([self.train_rows[i] for i in b], self.tokenizer.pad_token_id, self.pad_multiple), weight)
                   for b, weight in parts]
        # The whole step's trained tokens, over every rank: each rank knows all rows.
        loss_tokens = max(1, sum(self.train_rows[i].trainable_tokens for i in rows))
        input_tokens = sum(len(self.train_rows[i].input_ids) for i in rows)
        normaliser = torch.tensor(loss_tokens, device=self.device)
        self.model.train()
        loss_sum = torch.zeros((), device=self.device)
        # FSDP averages gradients over ranks; the step's gradient is their sum.
        backward_scale = self.world if self.fsdp else 1
        for mb, weight in batches:
            mb = {k: v.to(self.device, non_blocking=True) for k, v in mb.items()}
            # Summed over tokens and divided by the step's token count, not
            # averaged per micro-batch: any split, over micro-batches or ranks,
            # gives the same update.
            loss = self._loss(mb, normaliser) * weight
            if self.faults.due("nan", self.step + 1):
                loss = loss * float("nan")
            self.accelerator.backward(loss * backward_scale)
            loss_sum += loss.detach()
        return loss_sum, input_tokens

    def _agree(self, failure: str | None) -> str | None:
        """Every rank learns whether any rank failed or was asked to stop, before
        any gradient collective, so no rank waits for one that will not come."""
        if self.world == 1:
            return failure
        import torch.distributed as dist

        codes = {None: 0, "nan": 1, "oom": 2}
        flags = torch.tensor([codes[failure], self.stop_signal or 0], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self.agreed_stop = int(flags[1]) or None
        if self.agreed_stop and self.stop_signal is None:
            self.stop_signal = self.agreed_stop  # another rank got the signal: stop together
        return {v: k for k, v in codes.items()}[int(flags[0])]

    def _stopping(self) -> int | None:
        """The signal to stop for after this step. With several processes, only one
        that every rank agreed on in this step: checkpointing is collective, so a
        signal that reached one rank after the agreement waits for the next step."""
        return self.stop_signal if self.world == 1 else self.agreed_stop

    def _sum_over_ranks(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """All-reduce the gradients (and the loss, with the first bucket): the sum over
        ranks of per-rank losses normalised by the global token count is the loss.

        In buckets of about ALL_REDUCE_BUCKET_BYTES, as DDP does: one flat
        buffer of every gradient would hold a second copy of all of them at
        once, which for full fine-tuning is as large as the weights."""
        if self.world == 1:
            return loss_sum
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        if self.fsdp:  # FSDP has reduced the gradients in backward; only the loss is left
            dist.all_reduce(loss_sum)
            return loss_sum

        for param in self.trainable:
            if param.grad is None:  # a parameter this rank's rows did not reach
                param.grad = torch.zeros_like(param)
        buckets = _buckets([p.grad for p in self.trainable], ALL_REDUCE_BUCKET_BYTES)
        loss = loss_sum.reshape(1).to(buckets[0][0].dtype)
        buckets[0].append(loss)  # one collective fewer
        for bucket in buckets:
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat)
            for tensor, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                tensor.copy_(synced)
        return loss.reshape(()).to(loss_sum.dtype)

    def _attempt(self, rows: list[int]) -> tuple[dict[str, float] | None, str | None]:
        """One optimizer step, or the kind of failure that prevented it.

        The only place a step's failure is caught. The exception is dropped
        before memory is freed: its traceback holds the step's tensors.
        """
        started = time.perf_counter()
        failure = None
        try:
            loss_sum, tokens = self._forward_backward(rows)
        except torch.OutOfMemoryError:
            failure = "oom"
        if failure is not None:
            self._free_memory()
            if self.fsdp:  # the other ranks wait inside a collective this rank left
                self.run_dir.request_restart(failure, self.step + 1, self.rank)
                raise RestartNeeded(failure, self.step + 1, self.rank)
        failure = self._agree(failure)
        if failure == "oom":
            self._free_memory()  # also on the ranks that did not run out themselves
            return None, failure
        loss_sum = self._sum_over_ranks(loss_sum)
        max_norm = self.plan.max_grad_norm if self.plan.max_grad_norm > 0 else float("inf")
        grad_norm = self.accelerator.clip_grad_norm_(self.trainable, max_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor, the same on every rank
            grad_norm = grad_norm.full_tensor()
        # The one host sync per step: loss and gradient norm come back together.
        # Both are the same on every rank, so every rank takes the same decision.
        loss_value, norm_value = torch.stack([loss_sum.float(), grad_norm.float().to(loss_sum.device)]).tolist()
        if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
            self.optimizer.zero_grad(set_to_none=True)  # skip the update
            return None, "nan"
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - started
        return {"loss": loss_value, "grad_norm": norm_value, "lr": lr, "tokens": tokens,
                "tokens_per_s": tokens / elapsed}, None

    def _free_memory(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def evaluate(self) -> float:
        """Mean loss per trained token over the whole evaluation set.

        Out of memory here is recovered like in a training step (smaller
        micro-batches), but nothing rolls back: the weights are fine. With
        several processes they agree on it before the loss is all-reduced.
        Under FSDP the forwards are collectives: it propagates (a restart).
        """
        while True:
            failure = None
            try:
                loss_sum = self._evaluation_share()
            except torch.OutOfMemoryError:
                if self.fsdp:
                    raise
                failure = "oom"
            if failure is not None:
                self._free_memory()
            if self._agree(failure) is None:
                break
            plan, recovery = self.recovery.after_oom(self.plan, self.step)
            self._apply_plan(plan)
            self.run_dir.add_recovery({**recovery.to_json(), "during": "evaluation"})
            self.reporter.message(f"evaluation after step {self.step}: out of memory; {recovery.action}; "
                                  "evaluating again", warning=True)
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(loss_sum)
        return loss_sum.item()

    @torch.no_grad()
    def _evaluation_share(self) -> torch.Tensor:
        """This rank's share of the evaluation loss, summed and normalised by the
        trained tokens of the whole evaluation set."""
        total_tokens = max(1, sum(count_loss_tokens(mb["labels"]) for mb in self.eval_micro_batches))
        normaliser = torch.tensor(total_tokens, device=self.device)
        loss_sum = torch.zeros((), device=self.device)
        mine = [(mb, 1.0) for mb in self.eval_micro_batches[self.rank::self.world]]  # each rank a share
        if self.fsdp:  # the same number of forwards (collectives) on every rank, even one with no share
            most = -(-len(self.eval_micro_batches) // self.world)
            mine += [(self.eval_micro_batches[0], 0.0)] * (most - len(mine))
        self.model.eval()
        try:
            for mb, weight in mine:
                mb = {k: v.to(self.device) for k, v in mb.items()}
                loss_sum += self._loss(mb, normaliser) * weight
        finally:
            self.model.train()
        return loss_sum

    # ------------------------------------------------------- checkpoints

    def _save_checkpoint(self) -> None:
        if self.fsdp:  # gathered whole onto the main process
            weights = gather_weights(self.model, self.trainable_names)
            optimizer_tensors, groups = gather_optimizer(self.model, self.optimizer.optimizer)
        else:
            model = self.accelerator.unwrap_model(self.model)
            weights = {name: param for name, param in model.named_parameters() if param.requires_grad}
            optimizer_tensors, groups = optimizer_state(self.optimizer)
        rng_tensors, rng_json = rng_state()
        state = {
            "step": self.step, "epoch": self.epoch, "index": self.index, "tokens": self.tokens,
            "final_loss": self.final_loss, "best_eval": self.best_eval, "best_step": self.best_step,
            "last_eval": self.last_eval, "evals_since_best": self.evals_since_best,
            "scheduler": self.scheduler.state_dict(), "optimizer_groups": groups, "rng": rng_json,
            "micro_batch_size": self.plan.micro_batch_size,
        }
        if self.is_main:  # the weights and optimizer are the same on every rank (or gathered here): one writer
            self.checkpoints.save(self.step, {"model.safetensors": weights, "optimizer.safetensors": optimizer_tensors,
                                              "rng.safetensors": rng_tensors}, state)
            self.checkpoints.prune(self._best_checkpoint_step())
        # No rank goes on (and might roll back to it) before the checkpoint is whole.
        self.accelerator.wait_for_everyone()

    def _best_checkpoint_step(self) -> int | None:
        """The checkpoint saved with the lowest eval loss so far; pruning keeps it."""
        scored = [(c.state().get("last_eval"), c.step) for c in self.checkpoints.all()]
        scored = [pair for pair in scored if pair[0] is not None]
        return min(scored)[1] if scored else None

    def _restore(self, checkpoint: Checkpoint) -> None:
        """Put model, optimizer, schedule, RNG and data position back as they were."""
        state = checkpoint.state()
        if self.fsdp:  # the main process reads the whole tensors, every rank keeps its shard
            load_weights(self.model, checkpoint.tensors("model.safetensors") if self.is_main else {})
            load_optimizer(self.model, self.optimizer.optimizer,
                           checkpoint.tensors("optimizer.safetensors") if self.is_main else {}, state["optimizer_groups"])
        else:
            weights = checkpoint.tensors("model.safetensors")
            model = self.accelerator.unwrap_model(self.model)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if param.requires_grad:
                        param.copy_(weights[name].to(param.device, param.dtype))
            load_optimizer_state(self.optimizer, checkpoint.tensors("optimizer.safetensors"), state["optimizer_groups"])
        for key in ("step", "epoch", "index", "tokens", "final_loss", "best_eval", "best_step", "last_eval",
                    "evals_since_best"):
            setattr(self, key, state[key])
        self.scheduler.load_state_dict(state["scheduler"])
        self._apply_learning_rate()  # needs the restored step
        set_rng_state(checkpoint.tensors("rng.safetensors"), state["rng"])
        self.run_dir.truncate_metrics(self.step)

    def _rollback(self) -> None:
        """Back to the last good checkpoint, or to a fresh start if there is none."""
        self.accelerator.wait_for_everyone()
        checkpoint = self.checkpoints.latest()
        if checkpoint is not None:
            self._restore(checkpoint)
            return
        self.model = self.optimizer = None
        self.accelerator.free_memory()  # drops accelerate's references to the old model
        self._free_memory()
        self._reset_position()
        self._setup()
        self.run_dir.truncate_metrics(0)

    def _apply_learning_rate(self) -> None:
        """Make the optimizer follow the plan's peak lr (recovery may have lowered it)."""
        self.scheduler.base_lrs = [self.plan.lr for _ in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["initial_lr"] = self.plan.lr
            group["lr"] = self.plan.lr * lr_multiplier(self.step, self.plan)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def _apply_plan(self, plan: Plan) -> None:
        old, self.plan = self.plan, plan
        if plan.gradient_checkpointing and not old.gradient_checkpointing:
            model = self.accelerator.unwrap_model(self.model)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        if plan.max_seq_len < old.max_seq_len:
            self._cut_rows(plan.max_seq_len)
        if plan.lr != old.lr:
            self._apply_learning_rate()
        if plan.micro_batch_size != old.micro_batch_size or plan.max_seq_len != old.max_seq_len:
            self._build_eval_batches()
        self.run_dir.write_plan(plan)

    def _cut_rows(self, max_len: int) -> None:
        """Shorten rows to max_len without dropping any: step composition (self.lengths)
        stays as it was, so no row is skipped or seen twice in an epoch."""
        def cut(rows: list[TokenizedExample]) -> list[TokenizedExample]:
            return [e if len(e.input_ids) <= max_len else replace(e, input_ids=e.input_ids[:max_len], labels=e.labels[:max_len])
                    for e in rows]

        self.train_rows, self.eval_rows = cut(self.train_rows), cut(self.eval_rows)

    def _recover(self, failure: str) -> None:
        attempted = self.step + 1
        if failure == "oom":
            plan, recovery = self.recovery.after_oom(self.plan, attempted)
        else:
            plan, recovery = self.recovery.after_nan(self.plan, attempted)
        self._rollback()
        self._apply_plan(plan)
        self.run_dir.add_recovery(recovery.to_json())
        self.reporter.message(f"step {attempted}: {'out of memory' if failure == 'oom' else 'NaN loss'}; "
                              f"{recovery.action}; continuing from step {self.step}", warning=True)

    # ------------------------------------------------------------ signals

    def _install_signal_handlers(self) -> dict[int, Any]:
        self.stop_signal = None
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum: int, frame: Any) -> None:
            if self.stop_signal is not None:  # a second signal: stop at once
                if signum == signal.SIGINT:
                    raise KeyboardInterrupt
                os._exit(128 + signum)
            self.stop_signal = signum
            self.reporter.message("stopping after this step and saving a checkpoint "
                                  "(press Ctrl-C again to quit at once)", warning=True)

        return {signum: signal.signal(signum, handler) for signum in (signal.SIGINT, signal.SIGTERM)}

    # ---------------------------------------------------------------- run

    def run(self, resume: bool = False) -> TrainResult:
        plan = self.plan
        self._setup()
        if resume:
            checkpoint = self.checkpoints.latest()
            if checkpoint is not None:
                self._restore(checkpoint)
                self.reporter.message(f"resuming from checkpoint {checkpoint.path.name} (step {self.step})")
            else:
                self.reporter.message("no usable checkpoint: starting from step 0", warning=True)
                self.run_dir.truncate_metrics(0)
        self.run_dir.write_status("running", step=self.step, total_steps=plan.total_steps, reason=None, suggestions=None)
        previous_handlers = self._install_signal_handlers()
        self.reporter.training_started(plan.total_steps, self.step)
        started = time.perf_counter()
        tokens_at_start = self.tokens
        status_written = time.monotonic()
        stop_reason = None
        try:
            while self.step < self.plan.total_steps and stop_reason is None:
                steps = self._epoch_steps(self.epoch)
                if self.index >= len(steps):
                    self.epoch, self.index = self.epoch + 1, 0
                    continue
                metrics, failure = self._attempt(steps[self.index])
                if failure is not None:
                    self._recover(failure)
                    continue
                self.index += 1
                self.step += 1
                self.tokens += metrics["tokens"]
                self.final_loss = metrics["loss"]
                row = {"step": self.step, "epoch": round(self.epoch + self.index / len(steps), 4),
                       **{k: metrics[k] for k in ("loss", "lr", "grad_norm", "tokens_per_s")}}
                self.run_dir.append_metrics(row)
                self.reporter.step(row)
                stop_reason = self._maybe_evaluate()
                last = self.step == self.plan.total_steps or stop_reason is not None
                saved = self.save_artifacts and (self.step % self.plan.save_every == 0 or last)
                if saved:
                    self._save_checkpoint()
                self.faults.send_signal_if_due(self.step)
                stop = self._stopping()
                if stop is not None and not last:
                    if not saved and self.save_artifacts:
                        self._save_checkpoint()
                    self.run_dir.write_status("interrupted", step=self.step,
                                              reason=f"stopped by {signal.Signals(stop).name}")
                    raise TrainingInterrupted(stop, self.step)
                if time.monotonic() - status_written > STATUS_INTERVAL_S:
                    self.run_dir.write_status("running", step=self.step)
                    status_written = time.monotonic()
        except TrainingFailed as failed:
            self.run_dir.write_status("failed", step=self.step, reason=failed.report["reason"],
                                      suggestions=failed.report["suggestions"])
            raise
        except RestartNeeded as restart:
            self.run_dir.write_status("failed", step=self.step, reason=_restart_reason(vars(restart)))
            raise
        except (TrainingInterrupted, KeyboardInterrupt):
            raise
        except Exception as error:
            if self.fsdp and isinstance(error, torch.OutOfMemoryError):
                # Out of memory outside a step's forward and backward (evaluation,
                # the optimizer, a checkpoint's gathers): the others cannot learn of it either.
                self.run_dir.request_restart("oom", self.step + 1, self.rank)
            restart = self.run_dir.pending_restart() if self.world > 1 else None
            if restart is not None:  # another process failed, leaving this one's collective
                self.run_dir.write_status("failed", step=self.step, reason=_restart_reason(restart))
                raise RestartNeeded(restart["kind"], restart["step"], restart.get("rank")) from error
            # A bug: keep what can be kept, then report.
            report = create_failure_report("error", self.plan, self.step + 1, f"{type(error).__name__}: {error}")
            self.run_dir.write_status("failed", step=self.step, reason=report["reason"], suggestions=report["suggestions"])
            raise TrainingFailed(report) from error
        finally:
            self.reporter.training_finished()
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)

        seconds = time.perf_counter() - started
        output = self.run_dir.output_path(self.plan.method)
        if self.save_artifacts:
            self._save_output(output)
        self.run_dir.write_status("completed", step=self.step, reason=stop_reason, final_loss=self.final_loss,
                                  best_eval_loss=self.best_eval, best_eval_step=self.best_step)
        if stop_reason:
            self.reporter.message(stop_reason)
        return TrainResult(status="completed", steps=self.step, final_loss=self.final_loss,
                           best_eval_loss=self.best_eval, best_eval_step=self.best_step, seconds=seconds,
                           tokens_per_s=(self.tokens - tokens_at_start) / max(seconds, 1e-9), output_path=output,
                           stop_reason=stop_reason)

    def _save_output(self, output: Path) -> None:
        """The adapter (or full model), written once, by the main process."""
        model = self.accelerator.unwrap_model(self.model)
        weights = None
        if self.fsdp:  # every entry of the state dict once: a tied head is the embedding, saved as such
            keys = set(self.model.state_dict())
            names = [n for n, _ in self.model.named_parameters()] + [n for n, _ in self.model.named_buffers() if n in keys]
            weights = gather_weights(self.model, names)
        if self.is_main:
            save_trained(model, self.tokenizer, output, weights)
        self.accelerator.wait_for_everyone()

    def _maybe_evaluate(self) -> str | None:
        """Evaluate when due; returns an early-stopping reason when it is time to stop."""
        plan = self.plan
        due = plan.eval_every and (self.step % plan.eval_every == 0 or self.step == plan.total_steps)
        if not (self.eval_micro_batches and due):
            return None
        eval_loss = self.evaluate()
        self.last_eval = eval_loss
        row = {"step": self.step, "eval_loss": eval_loss}
        self.run_dir.append_metrics(row)
        self.reporter.evaluated(row)
        if self.on_evaluate is not None and self.on_evaluate(self.step, eval_loss):
            return f"stopped at step {self.step} by the caller (eval loss {eval_loss:.4f})"
        if self.best_eval is None or eval_loss < self.best_eval:
            self.best_eval, self.best_step, self.evals_since_best = eval_loss, self.step, 0
            return None
        self.evals_since_best += 1
        if plan.early_stopping_patience and self.evals_since_best >= plan.early_stopping_patience:
            return (f"early stopping: eval loss has not improved for {self.evals_since_best} "
                    f"evaluations since step {self.best_step}")
        return None
