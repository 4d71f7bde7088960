"""Fault injection for black-box tests: `LLMCUSTOMS_FAULT_INJECT`.

A testing aid, off unless the variable is set. A comma-separated list of
`KIND@STEP`, each firing once, at optimizer step STEP (1-based):

    oom@5       a real torch.OutOfMemoryError inside step 5's forward pass
    eval_oom@4  the same inside the evaluation after step 4
    nan@7       step 7's loss becomes NaN (so do its gradients)
    spike@6     step 6's loss is multiplied by SPIKE_FACTOR: finite, but far
                above the recent losses (the stability check's divergence)
    bug@3       a RuntimeError inside step 3's forward pass: an unexpected
                error, as a bug in the code would raise (failure.json)
    sigint@4    SIGINT to this process after step 4 (and its checkpoint, if any)
    sigterm@4   SIGTERM, likewise
    sigkill@4   SIGKILL, likewise: the process dies on the spot
    slow@4      every micro-batch of step 4 takes SLOW_MICRO_BATCH_S longer (a
                long step to interrupt; not spent by firing)

An optional `:rank=R` suffix limits a fault to one process of a distributed run.
A fault fires once per run: processes restarted after a failure at step N
(see launching.relaunch) do not fire the faults of steps up to N again.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

from llmcustoms.errors import ConfigError

ENV_VAR = "LLMCUSTOMS_FAULT_INJECT"
KINDS = ("oom", "eval_oom", "nan", "spike", "bug", "sigint", "sigterm", "sigkill", "slow")
SLOW_MICRO_BATCH_S = 4.0
# What `spike` multiplies a step's loss (and so its gradients) by: far beyond
# the stability check's thresholds (stability.py), yet finite.
SPIKE_FACTOR = 100.0
SPEC = re.compile(r"^(?P<kind>[a-z_]+)@(?P<step>\d+)(?::rank=(?P<rank>\d+))?$")
SIGNALS = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}


@dataclass
class Fault:
    kind: str
    step: int
    rank: int | None


class FaultInjector:
    def __init__(self, spec: str | None, rank: int = 0, spent_through: int = 0):
        self.rank = rank
        self.pending: list[Fault] = []
        for part in filter(None, (p.strip() for p in (spec or "").split(","))):
            match = SPEC.match(part)
            if not match or match["kind"] not in KINDS:
                raise ConfigError(f"{ENV_VAR} has an invalid entry '{part}'.",
                                  f"Use KIND@STEP[:rank=R] with KIND one of {', '.join(KINDS)}, e.g. oom@5.")
            if int(match["step"]) > spent_through:
                self.pending.append(Fault(match["kind"], int(match["step"]), int(match["rank"]) if match["rank"] else None))

    @classmethod
    def from_env(cls, rank: int = 0, spent_through: int = 0) -> "FaultInjector":
        return cls(os.environ.get(ENV_VAR), rank, spent_through)

    def due(self, kind: str, step: int) -> bool:
        """True once for each matching fault; it is then spent."""
        for fault in self.pending:
            if fault.kind == kind and fault.step == step and fault.rank in (None, self.rank):
                self.pending.remove(fault)
                return True
        return False

    def in_forward(self, step: int, training: bool) -> None:
        """Inside a forward pass, after the embeddings: `step` is the last finished one."""
        if not training:
            self.raise_oom_if_due(step, "eval_oom")
            return
        self.raise_oom_if_due(step + 1)
        if self.due("bug", step + 1):
            raise RuntimeError(f"injected bug ({ENV_VAR}=bug@{step + 1})")
        if any(f.kind == "slow" and f.step == step + 1 and f.rank in (None, self.rank) for f in self.pending):
            time.sleep(SLOW_MICRO_BATCH_S)

    def raise_oom_if_due(self, step: int, kind: str = "oom") -> None:
        if self.due(kind, step):
            import torch

            raise torch.OutOfMemoryError(f"out of memory (injected by {ENV_VAR}={kind}@{step})")

    def send_signal_if_due(self, step: int) -> None:
        for kind, signum in SIGNALS.items():
            if self.due(kind, step):
                os.kill(os.getpid(), signum)
