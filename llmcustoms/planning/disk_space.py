"""How much a run writes to disk, from its plan, and whether that fits.

A run directory is fullest at the end of the run, when it holds:

  checkpoints    keep_checkpoints + 1 of them: a new one is written whole
                 before the oldest is pruned (`CheckpointManager.save`, then
                 `prune`); fewer in a run with fewer saves (every save_every
                 steps, and the last). Full fine-tuning keeps one more, the best
                 evaluation's, which pruning spares (`runs/best_weights.py`).
  a checkpoint   the trained weights in fp32, 4 bytes per trained parameter
                 (the LoRA adapters, or every weight: as large as their
                 gradients in the memory estimate), AdamW's two fp32 moments
                 (the estimate's optimizer state) and small files: the RNG
                 states, the loop's state, the manifest, safetensors headers.
  best/          adapters only: the trained weights of best evaluations, one
                 file for the current best and one for the best step each
                 remaining checkpoint names, so up to keep_checkpoints + 2.
  adapter/       the final weights in fp32 (model/ for full fine-tuning: every
                 weight) with the tokenizer; once more in adapter-last/ when
                 the best evaluation was not the last step.
  logs           metrics.jsonl, train.log, samples.jsonl: small.

`export --merge` later writes every weight of the model again, in the dtype it
exports (16-bit for the models in the presets).

Under FSDP the memory estimate is per process (1/world_size of the trained
weights) while a checkpoint holds whole tensors: the sizes are scaled back up.
The estimate of one checkpoint is at least the bytes a tiny test model's
checkpoint holds and within 10% of them (`tests/training/test_preflight.py`); for real
models, whose trained weights are megabytes, the small files are under 1%.

While a run trains, the disk may fill up for reasons of its own (other
programs, another run). Before each checkpoint the free space is checked
against the last checkpoint's size (`checkpoint_room`), and a run that cannot
write the next one stops cleanly with the last good one named; a write that
fills the disk anyway ends the same way (`DiskFull.report`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from llmcustoms.errors import ConfigError
from llmcustoms.planning.plan import Plan

KIB, MIB, GIB = 1024, 1024 ** 2, 1024 ** 3
# Per checkpoint: rng.safetensors (10 KB), state.json (about 9 KB, most of it
# Python's RNG state), the manifest and the safetensors headers (~100 bytes a
# tensor: a few KB for a tiny model, 100-200 KB for a real one, which the
# allowances below for the tokenizer and logs more than cover).
CHECKPOINT_SMALL_FILES_BYTES = 48 * KIB
# Per written model: the tokenizer files (Qwen2's are about 11 MB), its config and model card.
TOKENIZER_BYTES = 16 * MIB
# metrics.jsonl, train.log, samples.jsonl, plan.json and status.json.
LOG_BYTES = 16 * MIB
# What `export --merge` writes per weight unless told otherwise: the dtype the preset models are saved in (bf16).
MERGED_BYTES_PER_PARAM = 2
# Asked to be free beyond a checkpoint's size before writing one: the next
# one may be a little larger (headers, state.json), and status.json, the
# metrics and the log go on being written until the next check.
CHECKPOINT_MARGIN = 0.1
CHECKPOINT_MARGIN_BYTES = 16 * MIB


def size(n: int) -> str:
    """"1.2 GiB", "300 MiB", "420 KiB": a size as a message says it."""
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    return f"{n / MIB:.0f} MiB" if n >= MIB else f"{math.ceil(n / KIB)} KiB"


@dataclass(frozen=True)
class DiskNeed:
    """The most a run's files take at once (see the module docstring)."""

    checkpoint_bytes: int  # one checkpoint
    checkpoints: int  # on disk at once, at most
    best_bytes: int  # best/: the adapters of best evaluations (full fine-tuning: among the checkpoints)
    output_bytes: int  # the final adapter (or model), and adapter-last/ when there are evaluations
    merged_bytes: int  # what `export --merge` would write; 0 for full fine-tuning, or when not known
    what: str  # "adapter" or "model"

    @property
    def total_bytes(self) -> int:
        return self.checkpoint_bytes * self.checkpoints + self.best_bytes + self.output_bytes + LOG_BYTES

    def parts(self) -> str:
        """"4 checkpoints of 57 MiB, the best weights and the adapter"."""
        count = f"{self.checkpoints} checkpoint{'s' if self.checkpoints != 1 else ''}"
        best = ", the best weights" if self.best_bytes else ""
        return f"{count} of {size(self.checkpoint_bytes)}{best} and the {self.what}"

    def reason(self) -> str:
        """The plan's line about the disk."""
        return f"disk: about {size(self.total_bytes)} for {self.parts()}"


def disk_need(plan: Plan, model_params: int = 0) -> DiskNeed | None:
    """The most `plan`'s run writes at once; None for a plan without a memory
    estimate (none to work from). `model_params`: every parameter of the model,
    for what `export --merge` writes (0: not known, not counted)."""
    memory = plan.memory
    if not memory:
        return None
    shards = plan.world_size if plan.distributed == "fsdp" else 1
    weights = memory["gradients_bytes"] * shards  # the trained weights in fp32, like their gradients
    full = plan.method == "full"
    evaluates = plan.eval_every > 0 and plan.eval_rows > 0
    saves = math.ceil(plan.total_steps / max(1, plan.save_every))
    checkpoints = min(plan.keep_checkpoints + 1, saves) + (1 if full and evaluates else 0)
    evaluations = math.ceil(plan.total_steps / plan.eval_every) if evaluates else 0
    best = 0 if full else min(plan.keep_checkpoints + 2, evaluations) * weights
    merged = 0 if full or not model_params else model_params * MERGED_BYTES_PER_PARAM + TOKENIZER_BYTES
    return DiskNeed(checkpoint_bytes=weights + memory["optimizer_bytes"] * shards + CHECKPOINT_SMALL_FILES_BYTES,
                    checkpoints=checkpoints, best_bytes=best,
                    output_bytes=(2 if evaluates else 1) * (weights + TOKENIZER_BYTES), merged_bytes=merged,
                    what="model" if full else "adapter")


def check_run_fits(plan: Plan, free_bytes: int, present_bytes: int, where: str, model_params: int = 0,
                   resuming: bool = False) -> str | None:
    """Refuse (`ConfigError`, exit 2) a run whose files cannot fit in the
    `free_bytes` of the disk of `where` (the run directory) and the
    `present_bytes` already in it (a resumed run's own checkpoints; a run that
    --overwrite replaces). When they fit but a later `export --merge` would not,
    a warning for the plan; else None."""
    need = disk_need(plan, model_params)
    if need is None:
        return None
    needed = max(0, need.total_bytes - present_bytes)
    if needed > free_bytes:
        fewer = disk_need(replace(plan, keep_checkpoints=1))
        keep = (f", or keep fewer checkpoints (--keep 1 needs about {size(max(0, fewer.total_bytes - present_bytes))})"
                if fewer and fewer.total_bytes < need.total_bytes else "")
        more = " more" if present_bytes else ""
        raise ConfigError(f"Not enough disk space {'to finish' if resuming else 'for'} this run: it needs about "
                          f"{size(needed)}{more} ({need.parts()}), and the disk of {where} has {size(free_bytes)} free.",
                          "Free some space on that disk, then resume the run again." if resuming else
                          f"Free some space there, or pass --output-dir on a disk with more room{keep}.")
    if need.merged_bytes and needed + need.merged_bytes > free_bytes:
        return (f"the run fits on the disk of {where} (about {size(needed)} of {size(free_bytes)} free), but a merged "
                f"model from `export --merge` (about {size(need.merged_bytes)} more, in 16-bit) would not fit beside "
                "it; free some space before exporting, or export to another disk")
    return None


def check_checkpoint_fits(needed: int, free_bytes: int, where: str) -> None:
    """Refuse (`ConfigError`, exit 2) to resume a run whose next checkpoint
    (`needed`: `checkpoint_room`) cannot fit in the `free_bytes` of the disk of `where`."""
    if needed > free_bytes:
        raise ConfigError(f"Not enough disk space to resume this run: its next checkpoint needs about {size(needed)} "
                          f"free, and the disk of {where} has {size(free_bytes)} free.",
                          "Free some space on that disk, then resume the run again.")


def check_export_fits(needed: int, free_bytes: int, where: str, what: str, dtype: str = "") -> None:
    """Refuse (`ConfigError`, exit 2) an export of `needed` bytes (`what`: "the
    merged model") that the disk of `where` cannot take; `dtype`: the merged weights'."""
    if needed <= free_bytes:
        return
    smaller = ", or merge into 16-bit weights (--dtype bfloat16 writes half as much)" if dtype == "float32" else ""
    raise ConfigError(f"Not enough disk space to write {what}: it needs about {size(needed)}, and the disk of "
                      f"{where} has {size(free_bytes)} free.",
                      f"Free some space there, or pass --output on a disk with more room{smaller}.")


def checkpoint_room(last_bytes: int | None, plan: Plan | None) -> int:
    """What must be free before a checkpoint is written: the size of the last
    one (`last_bytes`), or the plan's estimate before the first, with a margin."""
    need = disk_need(plan) if plan is not None and last_bytes is None else None
    size_bytes = last_bytes if last_bytes is not None else need.checkpoint_bytes if need else 0
    return math.ceil(size_bytes * (1 + CHECKPOINT_MARGIN)) + CHECKPOINT_MARGIN_BYTES


def rest_of_run(plan: Plan | None, present_bytes: int) -> int:
    """What the rest of a run needs beyond the `present_bytes` in its directory,
    as `resume`'s check counts it (`check_run_fits`); 0 when not known."""
    need = disk_need(plan) if plan is not None else None
    return max(0, need.total_bytes - present_bytes) if need else 0


@dataclass(frozen=True)
class DiskFull:
    """Where a run found its disk full, for the report that ends it."""

    step: int  # the last finished step
    writing: str  # what could not be written: "checkpoint step-000009", "best/step-000006.safetensors"
    needed: int  # bytes it needed (`whole_run`: the rest of the run needs)
    free: int  # bytes free when it was found
    where: str  # the run directory
    filesystem: str  # the mount point of its disk
    last_checkpoint: int | None  # the step of the newest checkpoint that verifies
    to_finish: int = 0  # what the rest of the run needs (`rest_of_run`)
    error: str = ""  # the system's words ("No space left on device"); "" when found before writing
    quota: bool = False  # a disk quota (EDQUOT), not the disk itself
    whole_run: bool = False  # what `writing` needs is not known: `needed` is the rest of the run's need

    def report(self) -> dict[str, Any]:
        """TrainingFailed's report: kind "disk_full", the step, the reason and what to do."""
        found = (f"the disk{' quota' if self.quota else ''} filled up after step {self.step} while writing "
                 f"{self.writing} ({self.error})" if self.error
                 else f"not enough disk space after step {self.step} for {self.writing}")
        kept = (f"the last good checkpoint is step-{self.last_checkpoint:06d}" if self.last_checkpoint is not None
                else "there is no checkpoint yet (resuming starts from step 0)")
        # A quota is not the disk's free space, which may be plenty: what is left of it is not known here.
        room = (f"your disk quota on {self.filesystem} is used up" if self.quota
                else f"the disk of {self.where} has {size(self.free)} free")
        needs = "the rest of the run needs about" if self.whole_run else "it needs"
        needs = f"{needs} {size(self.needed)} free and " if self.needed else ""  # 0: not known (no estimate)
        reason = f"{found}: {needs}{room}; {kept}"
        # Enough for `resume`'s own check too, which wants room for the rest of the run.
        to_free = max(self.needed, self.to_finish) - (0 if self.quota else self.free)
        whole = " (what the rest of the run needs)" if self.to_finish > self.needed and not self.whole_run else ""
        amount = f"at least {size(max(to_free, MIB))}{whole}" if self.needed or self.to_finish else "some space"
        suggestions = [f"free {amount} on {self.filesystem} (the file system of {self.where}), then "
                       f"`llmcustoms resume {self.where}`"]
        if self.quota:
            suggestions.append("`quota -s` shows your quota: delete files of yours on that file system, or ask "
                               "for a larger quota")
        suggestions.append("`llmcustoms runs` lists your runs: deleting one you no longer need frees its checkpoints")
        return {"kind": "disk_full", "step": self.step, "reason": reason, "suggestions": suggestions}
