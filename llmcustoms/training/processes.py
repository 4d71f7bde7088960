"""`Processes`: this training process among the others of a run.

Everything in the loop that depends on how many processes there are, or on
whether the model is sharded, is a method here, so `FineTuner` reads as one
process would run it. With one process every method is trivially the identity:
`agree` returns the local failure, `share` returns every row, `sum` returns
what it is given. With several:

- Agreement: every rank learns whether any rank failed or was asked to stop
  before any collective that depends on it, so no rank waits for one that
  will not come (the model is not wrapped in DDP for this reason: with DDP's
  in-backward all-reduce, one rank's out-of-memory error would leave the
  others waiting forever). Gradients are then all-reduced here, in buckets.
- Shares: each rank trains on every world-th row of a step; under FSDP every
  forward and backward is a collective, so ranks pad to the same number of
  micro-batches with zero-weight ones.
- State: under FSDP weights and optimizer moments are gathered whole onto the
  main process to save, and handed out whole to restore (see `sharding`).
- Restarts: under FSDP a rank that fails inside forward or backward cannot
  tell the others; it asks for a restart (`RestartNeeded`) and the launcher
  restarts them all.

A signal (`stop_signals.StopSignals`) reaches one process; the stop is agreed here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch

from llmcustoms.models.loading import save_trained
from llmcustoms.planning.plan import Plan
from llmcustoms.recovery.recovery_system import RestartNeeded, TrainingFailed, create_failure_report
from llmcustoms.recovery.stop_signals import StopSignals
from llmcustoms.runs.checkpoint_content import (
    TensorInfo,
    Unusable,
    fit_problem,
    optimizer_fit_problem,
    rng_fit_problem,
    safetensors_header,
    torch_dtype_name,
)
from llmcustoms.runs.checkpoints import (
    Checkpoint,
    CheckpointManager,
    load_optimizer_state,
    optimizer_state,
    rng_state,
    set_rng_state,
)
from llmcustoms.runs.run_directory import RunDirectory
from llmcustoms.training import launching, preflight
from llmcustoms.training.sharding import gather_optimizer, gather_weights, load_optimizer, load_weights, shard
from llmcustoms.training.step import step_micro_batches

# Gradients are all-reduced this many bytes at a time (DDP's default bucket size).
ALL_REDUCE_BUCKET_BYTES = 25 * 1024 ** 2
FAILURE_CODES = {None: 0, "nan": 1, "oom": 2}


def buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype, grouped up to `limit` bytes (a larger
    tensor is a bucket of its own)."""
    grouped: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if not grouped or size + nbytes > limit or tensor.dtype != grouped[-1][0].dtype:
            grouped.append([])
            size = 0
        grouped[-1].append(tensor)
        size += nbytes
    return grouped


def accelerator_for(mixed_precision: str) -> Any:
    """An Accelerator of `mixed_precision`. accelerate keeps one precision per process and
    refuses another; a second run in the same process (an fp32 trial after a bf16 one, tests)
    gets its precision: the precision's state is dropped, the process group kept."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    current = AcceleratorState._shared_state.get("_mixed_precision")  # read without initialising it
    if current is not None and str(current) != mixed_precision:
        AcceleratorState._reset_state(reset_partial_state=False)
    # cpu=True without CUDA: it is what gives several CPU processes a gloo group.
    return Accelerator(mixed_precision=mixed_precision, cpu=not torch.cuda.is_available())


class Processes:
    def __init__(self, accelerator: Any, fsdp: bool, run_dir: RunDirectory, signals: StopSignals):
        self.accelerator = accelerator
        self.fsdp = fsdp
        self.run_dir = run_dir
        self.signals = signals
        self.world = accelerator.num_processes
        self.rank = accelerator.process_index
        self.is_main = accelerator.is_main_process
        self.device = accelerator.device
        self.agreed_stop: int | None = None  # the stop signal every rank knows of (see agree)
        self.trainable_names: list[str] = []  # under FSDP: names before sharding, for whole-tensor checkpoints
        # FSDP averages gradients over ranks; the step's gradient is their sum.
        self.backward_scale = self.world if fsdp else 1

    @classmethod
    def start(cls, plan: Plan, run_dir: RunDirectory, signals: StopSignals) -> Processes:
        """The accelerator and the process group: once per run."""
        processes = cls(accelerator_for(plan.mixed_precision), plan.distributed == "fsdp", run_dir, signals)
        processes.use_physical_cores(plan.cpu_threads)
        return processes

    def use_physical_cores(self, planned: int = 0) -> None:
        """CPU training: the plan's threads per process (`planning/cpu_share.py`: one per
        physical core, fewer on a machine busy with other work), never more than this
        machine's physical cores shared among the processes; without a planned number
        (`planned` 0: a plan written before it was chosen), one per physical core.
        Hyper-threads compete for the same matrix units and slow matmuls down.
        A thread count the user chose (OMP_NUM_THREADS) is kept: torch reads it itself."""
        if torch.cuda.is_available() or os.environ.get("OMP_NUM_THREADS", "").strip():
            return
        import psutil

        cores = psutil.cpu_count(logical=False) or torch.get_num_threads()
        per_process = max(1, cores // self.world)
        torch.set_num_threads(min(planned, per_process) if planned > 0 else per_process)

    # ------------------------------------------------------------ the model

    def place(self, model: Any, plan: Plan, say: Callable[[str], None]) -> Any:
        """The model on this process's device, or sharded over the processes."""
        if not self.fsdp:
            if plan.method != "qlora" or not torch.cuda.is_available():  # 4-bit models are placed by their device_map
                model = model.to(self.device)
            return model
        # Names before sharding: checkpoints keep whole tensors under these.
        self.trainable_names = [n for n, p in model.named_parameters() if p.requires_grad]
        total = sum(p.numel() for p in model.parameters())
        model = shard(model, plan.mixed_precision)
        held = sum(p.to_local().numel() for p in model.parameters())
        say(f"FSDP: the model is sharded over {self.world} processes; each holds about {held / total:.0%} "
            f"of its {total:,} weights")
        return model

    # ------------------------------------------------------- shares of work

    def share(self, rows: list[int], lengths: list[int], rank: int) -> list[int]:
        """A rank's share of a step: every world-th row by length, so ranks get
        similar lengths. With one process, all of them."""
        ordered = sorted(rows, key=lambda i: -lengths[i])
        return ordered[rank::self.world]

    def micro_batches(self, rows: list[int], lengths: list[int], size: int,
                      packed_to: int = 0) -> list[tuple[list[int], float]]:
        """This rank's micro-batches of a step, each with its weight in the loss.
        Packed (`packed_to`: the rows' length cap), a micro-batch is a budget of
        `size` x `packed_to` tokens rather than `size` rows.
        Under FSDP every rank runs as many as the busiest one (each forward and
        backward is a collective); the extra ones repeat rows with weight 0."""
        def split(rank: int) -> list[list[int]]:
            return step_micro_batches(self.share(rows, lengths, rank), lengths, size, packed_to)

        mine = [(batch, 1.0) for batch in split(self.rank)]
        if self.fsdp:
            most = max(len(split(rank)) for rank in range(self.world))
            filler = mine[0][0] if mine else rows[:1]
            mine += [(filler, 0.0)] * (most - len(mine))
        return mine

    def evaluation_share(self, batches: list[dict[str, torch.Tensor]]) -> list[tuple[dict[str, torch.Tensor], float]]:
        """This rank's evaluation micro-batches, with their weights."""
        mine = [(mb, 1.0) for mb in batches[self.rank::self.world]]
        if self.fsdp:  # the same number of forwards (collectives) on every rank, even one with no share
            most = -(-len(batches) // self.world)
            mine += [(batches[0], 0.0)] * (most - len(mine))
        return mine

    # ------------------------------------------------------------ agreement

    def agree(self, failure: str | None) -> str | None:
        """Every rank learns whether any rank failed or was asked to stop, before
        any gradient collective, so no rank waits for one that will not come."""
        if self.world == 1:
            return failure
        import torch.distributed as dist

        flags = torch.tensor([FAILURE_CODES[failure], self.signals.received or 0], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self.agreed_stop = int(flags[1]) or None
        if self.agreed_stop and self.signals.received is None:
            self.signals.received = self.agreed_stop  # another rank got the signal: stop together
        return {code: kind for kind, code in FAILURE_CODES.items()}[int(flags[0])]

    def main_decides(self, flag: bool) -> bool:
        """The main process's `flag`, on every process: for choices only the main
        one can make (what it found on disk, how long its work took)."""
        if self.world == 1:
            return flag
        import torch.distributed as dist

        value = torch.tensor([int(flag)], device=self.device)
        dist.broadcast(value, src=0)
        return bool(value.item())

    def stop_now(self) -> bool:
        """Stop inside a step, before its next micro-batch: with one process only,
        since with several the ranks would have to agree before every micro-batch."""
        return self.world == 1 and self.signals.received is not None

    def stopping(self) -> int | None:
        """The signal to stop for after this step. With several processes, only one
        that every rank agreed on in this step: checkpointing is collective, so a
        signal that reached one rank after the agreement waits for the next step."""
        return self.signals.received if self.world == 1 else self.agreed_stop

    def restart_if_sharded(self, failure: str, step: int) -> None:
        """Under FSDP a rank that failed inside forward or backward left the others
        waiting inside a collective: ask for a restart of every process."""
        if self.fsdp:
            self.run_dir.request_restart(failure, step, self.rank, launching.launch_token())
            raise RestartNeeded(failure, step, self.rank)

    def failure(self, error: Exception, run_dir: RunDirectory, plan: Plan, step: int) -> Exception:
        """What an unexpected error after `step` ends the run with, once status.json
        (`run_dir`, writable on the main process only) says so: the restart a
        process asked for, or a failure report (a bug)."""
        restart = self.restart_after(error, step + 1)
        if restart is not None:
            run_dir.write_status("failed", step=step, reason=restart.reason)
            return restart
        report = create_failure_report("error", plan, step + 1, f"{type(error).__name__}: {error}")
        run_dir.write_status("failed", step=step, reason=report["reason"], suggestions=report["suggestions"])
        return TrainingFailed(report)

    def restart_after(self, error: Exception, step: int) -> RestartNeeded | None:
        """After an unexpected error: the restart this process or another asked for, if any."""
        if self.fsdp and isinstance(error, torch.OutOfMemoryError):
            # Out of memory outside a step's forward and backward (evaluation,
            # the optimizer, a checkpoint's gathers): the others cannot learn of it either.
            self.run_dir.request_restart("oom", step, self.rank, launching.launch_token())
        restart = self.run_dir.pending_restart() if self.world > 1 else None
        if restart is None:
            return None
        return RestartNeeded(restart["kind"], restart["step"], restart.get("rank"))  # another process failed

    # ---------------------------------------------------------- collectives

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the ranks."""
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(value)
        return value

    def sum_gradients(self, params: list[torch.Tensor], loss_sum: torch.Tensor) -> torch.Tensor:
        """All-reduce the gradients (and the loss, with the first bucket): the sum over
        ranks of per-rank losses normalised by the global token count is the loss.

        In buckets of about ALL_REDUCE_BUCKET_BYTES, as DDP does: one flat
        buffer of every gradient would hold a second copy of all of them at
        once, which for full fine-tuning is as large as the weights."""
        if self.world == 1:
            return loss_sum
        if self.fsdp:  # FSDP has reduced the gradients in backward; only the loss is left
            return self.sum(loss_sum)
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        for param in params:
            if param.grad is None:  # a parameter this rank's rows did not reach
                param.grad = torch.zeros_like(param)
        grouped = buckets([p.grad for p in params], ALL_REDUCE_BUCKET_BYTES)
        loss = loss_sum.reshape(-1).to(grouped[0][0].dtype)  # the loss, and any sums it reports
        grouped[0].append(loss)  # one collective fewer
        for bucket in grouped:
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat)
            for tensor, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                tensor.copy_(synced)
        return loss.reshape(loss_sum.shape).to(loss_sum.dtype)

    def whole(self, tensor: torch.Tensor) -> torch.Tensor:
        """A plain tensor: under FSDP a gradient norm is a DTensor, the same on every rank."""
        if not self.fsdp:
            return tensor
        from torch.distributed.tensor import DTensor

        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    # ------------------------------------------------- saving and restoring

    def save_checkpoint(self, checkpoints: CheckpointManager, step: int, model: Any, optimizer: Any,
                        state: dict[str, Any], protect: int | None = None) -> None:
        """Trainable weights, optimizer and RNG, with the loop's `state`, as one
        checkpoint: whole (under FSDP gathered), written once, by the main process.
        Pruning spares the checkpoint of step `protect` (a full fine-tuning run's best).

        A full disk ends the run, on every rank (`TrainingFailed`, kind
        "disk_full"): before anything is written when the main process finds
        too little room for it (`preflight.checkpoint_shortfall`), or after a
        write that filled the disk, its files removed. Earlier checkpoints stay."""
        run_path = self.run_dir.path
        writing, needed = preflight.checkpoint_need(run_path, step)
        shortfall = preflight.checkpoint_shortfall(run_path, step, writing, needed) if self.is_main else None
        if not self.main_decides(shortfall is None):
            raise TrainingFailed(shortfall or preflight.disk_full_report(run_path, step, writing, needed))
        weights, optimizer_tensors, groups = self._training_state(model, optimizer)
        rng_tensors, rng_json = rng_state()
        full, cause = None, None
        if self.is_main:  # the same on every rank (or gathered here): one writer
            try:
                checkpoints.save(step, {"model.safetensors": weights, "optimizer.safetensors": optimizer_tensors,
                                        "rng.safetensors": rng_tensors},
                                 {**state, "optimizer_groups": groups, "rng": rng_json})
                checkpoints.prune(protect)
            except Exception as error:
                full, cause = preflight.disk_full_failure(error, run_path, step, writing, needed), error
                if full is None:
                    raise
        # No rank goes on (and might roll back to it) before the checkpoint is whole, or known lost.
        if not self.main_decides(full is None):
            raise TrainingFailed(full or preflight.disk_full_report(run_path, step, writing, needed)) from cause
        self.accelerator.wait_for_everyone()

    def _training_state(self, model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
        """(trainable weights, optimizer tensors, optimizer groups); under FSDP
        gathered onto the main process (empty elsewhere)."""
        if self.fsdp:
            return (self.trainable_weights(model), *gather_optimizer(model, optimizer.optimizer))
        return (self.trainable_weights(model), *optimizer_state(optimizer))

    def trainable_weights(self, model: Any) -> dict[str, Any]:
        """The trainable tensors by name, whole: under FSDP gathered onto the main
        process (every rank must call this; the others get an empty dict)."""
        if self.fsdp:
            return gather_weights(model, self.trainable_names)
        unwrapped = self.accelerator.unwrap_model(model)
        return {name: param for name, param in unwrapped.named_parameters() if param.requires_grad}

    def load_trainable(self, model: Any, weights: dict[str, Any]) -> None:
        """Put whole trainable tensors back (under FSDP the main process's, sharded to every rank).
        Callers check them first (`weights_problem`): a [1, n] tensor would broadcast into an [r, n] weight."""
        if self.fsdp:
            load_weights(model, weights if self.is_main else {})
            return
        given = {name: tensor_info(tensor) for name, tensor in weights.items()}
        problem = self.weights_problem(model, given, "the weights")
        if problem is not None:
            raise ValueError(f"the weights do not fit the model: {problem}")
        with torch.no_grad():
            for name, param in self.accelerator.unwrap_model(model).named_parameters():
                if param.requires_grad:
                    param.copy_(weights[name].to(param.device, param.dtype))

    def weights_problem(self, model: Any, tensors: dict[str, TensorInfo],
                        file: str = "model.safetensors") -> str | None:
        """Whether `tensors` (the header of `file`) are exactly the model's trainable weights."""
        trained = {name: tensor_info(param) for name, param in self.accelerator.unwrap_model(model).named_parameters()
                   if param.requires_grad}  # under FSDP a DTensor's shape is the whole tensor's
        return fit_problem(file, tensors, trained)

    def checkpoint_problem(self, checkpoint: Checkpoint, model: Any, optimizer: Any) -> str | None:
        """What keeps a verified checkpoint from being restored into `model` and
        `optimizer` (None: nothing): every tensor's name, shape and dtype, read
        from the headers before anything is loaded, against the trainable
        weights, the optimizer's parameters and this torch's generator; and the
        state a restore reads. The same files on every rank: the same answer."""
        state = checkpoint.state()
        lacking = [key for key in ("optimizer_groups", "scheduler", "rng") if key not in state]
        if lacking:
            return f"state.json lacks {', '.join(lacking)}"
        live = [[tensor_info(param) for param in group["params"]] for group in optimizer.param_groups]
        if len(state["scheduler"].get("base_lrs", live)) != len(live):
            return f"the scheduler has {len(state['scheduler']['base_lrs'])} learning rates for {len(live)} groups"
        try:
            return (self.weights_problem(model, safetensors_header(checkpoint.path / "model.safetensors"))
                    or optimizer_fit_problem(safetensors_header(checkpoint.path / "optimizer.safetensors"),
                                             state["optimizer_groups"], live)
                    or rng_fit_problem(safetensors_header(checkpoint.path / "rng.safetensors"),
                                       tensor_info(torch.get_rng_state())))
        except Unusable as unusable:  # changed since it was verified
            return str(unusable)

    def restore_checkpoint(self, checkpoint: Checkpoint, model: Any, optimizer: Any,
                           with_optimizer: bool = True) -> dict[str, Any]:
        """Weights, optimizer and RNG back from a checkpoint; returns the loop's state.
        Under FSDP the main process reads the whole tensors and every rank keeps its shard.
        `with_optimizer=False` (`resume --reset-optimizer`) leaves `optimizer` as
        it is: a new one, whose moments start from zero. `checkpoint` is one that
        `CheckpointManager.latest` or `verified` gave, checked by `checkpoint_problem`;
        checked again here, before anything is copied, whoever the caller."""
        problem = self.checkpoint_problem(checkpoint, model, optimizer)
        if problem is not None:
            raise ValueError(f"checkpoint {checkpoint.path.name} cannot be restored: {problem}")
        state = checkpoint.state()
        groups = state["optimizer_groups"]
        weights = checkpoint.tensors("model.safetensors") if self.is_main or not self.fsdp else {}
        self.load_trainable(model, weights)
        if with_optimizer and self.fsdp:
            load_optimizer(model, optimizer.optimizer,
                           checkpoint.tensors("optimizer.safetensors") if self.is_main else {}, groups)
        elif with_optimizer:
            load_optimizer_state(optimizer, checkpoint.tensors("optimizer.safetensors"), groups)
        set_rng_state(checkpoint.tensors("rng.safetensors"), state["rng"])
        return state

    def save_trained(self, model: Any, tokenizer: Any, output: Path) -> None:
        """The adapter (or full model), written once, by the main process. Under
        FSDP every entry of the state dict is gathered once (a tied head is the
        embedding, saved as such)."""
        weights = None
        if self.fsdp:
            keys = set(model.state_dict())
            names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers() if n in keys]
            weights = gather_weights(model, names)
        if self.is_main:
            save_trained(self.accelerator.unwrap_model(model), tokenizer, output, weights)
        self.accelerator.wait_for_everyone()


def tensor_info(tensor: Any) -> TensorInfo:
    """A tensor's dtype and shape as a safetensors header gives them."""
    return TensorInfo(torch_dtype_name(tensor.dtype), tuple(tensor.shape))
