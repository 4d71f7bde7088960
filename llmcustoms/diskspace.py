"""How much a run writes to disk, from its plan, and whether that fits.

A run directory is fullest at the end of the run, when it holds:

  checkpoints    keep_checkpoints + 1 of them: a new one is written whole
                 before the oldest is pruned (`CheckpointManager.save`, then
                 `prune`); fewer in a run with fewer saves (every save_every
                 steps, and the last). Full fine-tuning keeps one more, the best
                 evaluation's, which pruning spares (`best_weights.py`).
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
checkpoint holds and within 10% of them (`tests/test_preflight.py`); for real
models, whose trained weights are megabytes, the small files are under 1%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from llmcustoms.errors import ConfigError
from llmcustoms.plan import Plan

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


def check_export_fits(needed: int, free_bytes: int, where: str, what: str, dtype: str = "") -> None:
    """Refuse (`ConfigError`, exit 2) an export of `needed` bytes (`what`: "the
    merged model") that the disk of `where` cannot take; `dtype`: the merged weights'."""
    if needed <= free_bytes:
        return
    smaller = ", or merge into 16-bit weights (--dtype bfloat16 writes half as much)" if dtype == "float32" else ""
    raise ConfigError(f"Not enough disk space to write {what}: it needs about {size(needed)}, and the disk of "
                      f"{where} has {size(free_bytes)} free.",
                      f"Free some space there, or pass --output on a disk with more room{smaller}.")
