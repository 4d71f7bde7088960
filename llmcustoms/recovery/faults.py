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
    slow_eval@4 every forward pass in eval mode after step 4 (its evaluation's
                micro-batches, sample replies' tokens) takes SLOW_MICRO_BATCH_S
                longer (a long evaluation to interrupt; not spent by firing)
    diskfull@9  from step 9 on, the free-space check before each checkpoint
                reads the disk as full, and so does `resume`'s check before it
                starts while the variable is still set (the disk is still
                full); not spent by firing (`disk_full_from`). In `tune`, from
                step 9 on (counted over the trials) every write to the
                study's SQLite file fails as SQLite does on a full disk
    kill_saving@5  SIGKILL at a random point of step 5's checkpoint write or
                of the pruning after it (benchmarks/kill_anywhere.py)
    kill_pruning@5 SIGKILL in the first pruning from step 5's checkpoint on,
                after the checkpoints to delete were renamed, before they go

Two act on preparing the data, not on a step (`data/token_cache.py`), in `plan` too:

    edit_data@2       as the first data file this process tokenizes starts to
                      be tokenized (after its cache key was taken), its lines 2
                      and 3 change places, once: a file edited while it is
                      tokenized, with as many rows as before
    kill_tokenizing@1 SIGKILL once 1 row (or more) of a file has been
                      tokenized: a temporary store left behind

Two act on `export` (`commands/export.py`, `commands/export_gguf.py`):

    slow_export@20     the export waits 20 seconds once its partial folder is
                       started: a second export to the same --output meets it
    diskfull_export@1  the first small file the export writes after its
                       weights (a GGUF export's Modelfile, then README.md) and
                       every one after it fail as on a full disk

An optional `:rank=R` suffix limits a fault to one process of a distributed run.
A fault fires once per run: processes restarted after a failure at step N
(see launching.relaunch) do not fire the faults of steps up to N again.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from llmcustoms.errors import ConfigError

ENV_VAR = "LLMCUSTOMS_FAULT_INJECT"
KINDS = ("oom", "eval_oom", "nan", "spike", "bug", "sigint", "sigterm", "sigkill", "slow", "slow_eval", "diskfull",
         "kill_saving", "kill_pruning", "edit_data", "kill_tokenizing", "slow_export", "diskfull_export")
# kill_saving@N kills at one of the first KILL_POINTS points from the start of step N's checkpoint write, chosen at
# random (CheckpointManager's `point`: 7 in a write, then one per checkpoint the pruning after it deletes).
KILL_POINTS = 8
SLOW_MICRO_BATCH_S = 4.0
# What `spike` multiplies a step's loss (and so its gradients) by: far beyond
# the stability check's thresholds (recovery/stability.py), yet finite.
SPIKE_FACTOR = 100.0
SPEC = re.compile(r"^(?P<kind>[a-z_]+)@(?P<step>\d+)(?::rank=(?P<rank>\d+))?$")
SIGNALS = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}
# The data faults fired in this process (each fires once).
_fired_data_faults: set[str] = set()
# The small files an export of this process has written (`diskfull_export` counts them).
_export_files = {"written": 0}


@dataclass
class Fault:
    kind: str
    step: int
    rank: int | None


class FaultInjector:
    def __init__(self, spec: str | None, rank: int = 0, spent_through: int = 0):
        self.rank = rank
        self.pending: list[Fault] = []
        self._kill_in: int | None = None  # points of a save left before kill_saving kills
        self._kill_pruning = False  # kill_pruning fired: kill at the next delete
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
            self._slow_if_due("slow_eval", step)
            return
        self.raise_oom_if_due(step + 1)
        if self.due("bug", step + 1):
            raise RuntimeError(f"injected bug ({ENV_VAR}=bug@{step + 1})")
        self._slow_if_due("slow", step + 1)

    def _slow_if_due(self, kind: str, step: int) -> None:
        if any(f.kind == kind and f.step == step and f.rank in (None, self.rank) for f in self.pending):
            time.sleep(SLOW_MICRO_BATCH_S)

    def raise_oom_if_due(self, step: int, kind: str = "oom") -> None:
        if self.due(kind, step):
            import torch

            raise torch.OutOfMemoryError(f"out of memory (injected by {ENV_VAR}={kind}@{step})")

    def kill_saving(self, step: int | None, where: str) -> None:
        """CheckpointManager's `point`: SIGKILL at a random point of step N's
        checkpoint write or of the pruning after it (`kill_saving@N`). The
        point is drawn from the OS, not from `random`, whose state is the run's."""
        if step is not None and self.due("kill_pruning", step):
            self._kill_pruning = True
        if where == "deleting" and self._kill_pruning:
            os.kill(os.getpid(), signal.SIGKILL)
        if step is not None and self.due("kill_saving", step):
            self._kill_in = secrets.randbelow(KILL_POINTS)
        elif self._kill_in is None:
            return
        if self._kill_in == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        self._kill_in -= 1

    def send_signal_if_due(self, step: int) -> None:
        for kind, signum in SIGNALS.items():
            if self.due(kind, step):
                os.kill(os.getpid(), signum)


def disk_full_from(spec: str | None = None) -> int | None:
    """The first step of a `diskfull@N` in `spec` (default: the variable's
    value), from which the disk reads as full; None without one. Not a
    `FaultInjector`'s: the disk stays full, for the checks of every later
    checkpoint and of `resume` (training/preflight.py)."""
    return _first_step("diskfull", spec)


def _first_step(kind: str, spec: str | None = None) -> int | None:
    spec = os.environ.get(ENV_VAR) if spec is None else spec
    steps = [int(match["step"]) for match in map(SPEC.match, (p.strip() for p in (spec or "").split(",")))
             if match and match["kind"] == kind]
    return min(steps) if steps else None


def edit_data_if_due(path: Path) -> None:
    """`edit_data@N`: swap lines N and N + 1 of the data file about to be tokenized, once."""
    line = _first_step("edit_data")
    if line is None or "edit_data" in _fired_data_faults or not path.is_file():
        return
    _fired_data_faults.add("edit_data")
    lines = path.read_bytes().splitlines(keepends=True)
    lines[line - 1:line + 1] = lines[line - 1:line + 1][::-1]
    path.write_bytes(b"".join(lines))


def kill_tokenizing_if_due(rows_done: int) -> None:
    """`kill_tokenizing@N`: SIGKILL once N rows of a file have been tokenized."""
    rows = _first_step("kill_tokenizing")
    if rows is not None and rows_done >= rows:
        os.kill(os.getpid(), signal.SIGKILL)


def hold_export_if_due() -> None:
    """`slow_export@N`: the export waits N seconds, its partial folder started."""
    seconds = _first_step("slow_export")
    if seconds:
        time.sleep(seconds)


def fail_export_write_if_due(path: Path) -> None:
    """`diskfull_export@N`: the Nth small file an export writes, and every later
    one, fails as the disk would when full (ENOSPC, naming the file)."""
    first = _first_step("diskfull_export")
    if first is None:
        return
    _export_files["written"] += 1
    if _export_files["written"] >= first:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
