"""`TrainingRecoverySystem`: what to do when a training step fails.

The trainer catches failures in one place around the step and asks this
module for an action, which is a changed plan to continue with, or a report
to stop with:

  out of memory   halve the micro-batch and double accumulation (the effective
                  batch, and with per-token loss normalisation the update,
                  stay the same); at micro-batch 1 turn on gradient
                  checkpointing; then halve the sequence length; then stop
  NaN / inf       lower the learning rate; stop after a few repeats
  divergence      a finite loss or gradient norm far above the recent ones
                  (`recovery/stability.py`): the same as NaN, with its own count

Either way the trainer rolls back to the last good checkpoint first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from llmcustoms.planning.plan import Plan

MAX_NAN_RECOVERIES = 3
NAN_LR_FACTOR = 0.5
MIN_SEQ_LEN = 64


@dataclass(frozen=True)
class Recovery:
    kind: str  # oom | nan | divergence
    step: int
    action: str
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def what(self) -> str:
        """The failure, for the message that says what was done."""
        spike = self.details.get("spike")
        return {"oom": "out of memory", "nan": "NaN loss"}.get(self.kind, f"loss spike ({spike})")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class TrainingFailed(Exception):
    """Training cannot go on; `report` says why and what to try."""

    def __init__(self, report: dict[str, Any]):
        super().__init__(report["reason"])
        self.report = report


class RestartNeeded(Exception):
    """This process failed where the others cannot learn of it (inside FSDP's
    collectives); it asked for a restart of every process and must exit."""

    def __init__(self, kind: str, step: int, rank: int | None):
        super().__init__(f"{kind} at step {step} in process {rank}")
        self.kind = kind
        self.step = step
        self.rank = rank

    @property
    def reason(self) -> str:
        """For status.json."""
        kind = {"oom": "out of memory"}.get(self.kind, self.kind)
        return f"process {self.rank}: {kind} at step {self.step}; restart requested (resume recovers)"


class TrainingInterrupted(Exception):
    """Stopped by SIGINT / SIGTERM after writing a checkpoint."""

    def __init__(self, signum: int, step: int):
        super().__init__(f"interrupted by signal {signum} at step {step}")
        self.signum = signum
        self.step = step


def create_failure_report(kind: str, plan: Plan, step: int, detail: str = "") -> dict[str, Any]:
    """Why the run stopped, and concrete things to try next."""
    if kind == "oom":
        reason = (f"out of memory at step {step} even with micro-batch 1, gradient checkpointing and "
                  f"{plan.max_seq_len}-token sequences")
        suggestions = ["use --method qlora (a 4-bit base needs about a quarter of the weight memory)",
                       "use a smaller model (`llmcustoms hardware` lists what fits)",
                       f"lower --max-seq-len below {plan.max_seq_len}",
                       "close other programs that use the GPU"]
    elif kind == "nan":
        reason = f"the loss became NaN or infinite at step {step}, {MAX_NAN_RECOVERIES} times, even at lr {plan.lr:.2e}"
        suggestions = [f"lower --lr (for example --lr {plan.lr / 10:.1e})",
                       "check the data for empty or garbled rows",
                       "use --mixed-precision bf16 or no instead of fp16"]
    elif kind == "divergence":
        reason = (f"the loss spiked far above its recent values at step {step}, {MAX_NAN_RECOVERIES} times, "
                  f"even at lr {plan.lr:.2e}{': ' + detail if detail else ''}")
        suggestions = [f"lower --lr (for example --lr {plan.lr / 10:.1e})",
                       f"lower --max-grad-norm (now {plan.max_grad_norm:g})",
                       "check the data for rows unlike the others (another language, very long replies)"]
    else:
        reason = f"unexpected error at step {step}: {detail}"
        suggestions = ["resume with `llmcustoms resume` (the last checkpoint is kept)",
                       "if it happens again, report it with the run directory's failure.json (it holds no tokens "
                       "and no data rows)"]
    return {"kind": kind, "step": step, "reason": reason, "suggestions": suggestions}


class TrainingRecoverySystem:
    def __init__(self) -> None:
        self.nan_recoveries = 0
        self.divergence_recoveries = 0

    def after(self, failure: str, plan: Plan, step: int, detail: str = "") -> tuple[Plan, Recovery]:
        """The plan to continue with after `failure` ("oom", "nan" or "divergence") at `step`."""
        if failure == "oom":
            return self.after_oom(plan, step)
        if failure == "divergence":
            return self.after_divergence(plan, step, detail)
        return self.after_nan(plan, step)

    def after_oom(self, plan: Plan, step: int) -> tuple[Plan, Recovery]:
        if plan.micro_batch_size > 1:
            micro = plan.micro_batch_size // 2
            accum = -(-plan.effective_batch_size // (micro * plan.world_size))
            new = plan.with_changes(f"out of memory at step {step}: micro-batch {plan.micro_batch_size} -> {micro}, "
                                    f"accumulation {plan.grad_accum} -> {accum}",
                                    micro_batch_size=micro, grad_accum=accum)
            return new, Recovery("oom", step, "halved micro-batch",
                                 {"micro_batch_size": [plan.micro_batch_size, micro], "grad_accum": [plan.grad_accum, accum]})
        if not plan.gradient_checkpointing:
            new = plan.with_changes(f"out of memory at step {step} at micro-batch 1: gradient checkpointing on",
                                    gradient_checkpointing=True)
            return new, Recovery("oom", step, "enabled gradient checkpointing", {})
        if plan.max_seq_len // 2 >= MIN_SEQ_LEN:
            shorter = plan.max_seq_len // 2
            new = plan.with_changes(f"out of memory at step {step} with checkpointing: sequences {plan.max_seq_len} "
                                    f"-> {shorter} tokens", max_seq_len=shorter)
            return new, Recovery("oom", step, "shortened sequences", {"max_seq_len": [plan.max_seq_len, shorter]})
        raise TrainingFailed(create_failure_report("oom", plan, step))

    def after_nan(self, plan: Plan, step: int) -> tuple[Plan, Recovery]:
        if self.nan_recoveries >= MAX_NAN_RECOVERIES:
            raise TrainingFailed(create_failure_report("nan", plan, step))
        self.nan_recoveries += 1
        lr = plan.lr * NAN_LR_FACTOR
        new = plan.with_changes(f"NaN loss at step {step}: learning rate {plan.lr:.2e} -> {lr:.2e}", lr=lr)
        return new, Recovery("nan", step, "lowered learning rate",
                             {"lr": [plan.lr, lr], "factor": NAN_LR_FACTOR})

    def after_divergence(self, plan: Plan, step: int, detail: str) -> tuple[Plan, Recovery]:
        """A finite spike (`recovery/stability.py`): like NaN, the learning rate is lowered."""
        if self.divergence_recoveries >= MAX_NAN_RECOVERIES:
            raise TrainingFailed(create_failure_report("divergence", plan, step, detail))
        self.divergence_recoveries += 1
        lr = plan.lr * NAN_LR_FACTOR
        new = plan.with_changes(f"loss spike at step {step}: learning rate {plan.lr:.2e} -> {lr:.2e}", lr=lr)
        return new, Recovery("divergence", step, "lowered learning rate",
                             {"lr": [plan.lr, lr], "factor": NAN_LR_FACTOR, "spike": detail})
