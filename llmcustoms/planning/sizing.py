"""Sizing a run to a memory budget: the method and micro-batch with the most
rows per step (gradient checkpointing only where it helps), and, when nothing
fits, how much is missing and what would fit instead.

Pure, like the rest of planning: `MemoryEstimator` estimates only, no torch.
"""

from __future__ import annotations

import math
from typing import Any

from llmcustoms.errors import ConfigError
from llmcustoms.planning.hardware import GIB
from llmcustoms.planning.memory import SAFETY_MARGIN, MemoryEstimator, parameter_counts
from llmcustoms.planning.plan import ModelChoice
from llmcustoms.planning.presets import ModelSpec

# Shorter sequence lengths a refusal tries, longest first.
SHORTER_LENGTHS = (1024, 512, 256)


def micro_batch(memory: MemoryEstimator, method: str, seq_len: int, precision: str, cap: int,
                checkpointing: bool | None, shape: dict[str, Any]) -> tuple[int, bool]:
    """(micro-batch, gradient checkpointing) for one method; micro-batch 0 if nothing fits.

    Checkpointing is used only when the micro-batch could not reach `cap`
    without it. Both options grow with the budget, so the result does too.
    """
    def largest(ckpt: bool) -> int:
        return memory.largest_micro_batch(method, seq_len, precision, ckpt, cap, **shape)

    if checkpointing is not None:
        return largest(checkpointing), checkpointing
    plain = largest(False)
    if plain >= cap:
        return plain, False
    with_ckpt = largest(True)
    return (with_ckpt, True) if with_ckpt > plain else (plain, False)


def best_fit(memory: MemoryEstimator, methods: list[str], seq_len: int, precision: str, cap: int,
             checkpointing: bool | None, shape: dict[str, Any]) -> tuple[str, int, bool, dict[str, int]] | None:
    """The method and micro-batch to use: the largest micro-batch over the allowed
    methods (the preferred, first, method wins ties), and each method's micro-batch.
    None if no method fits."""
    options = []
    for method in methods:
        micro, ckpt = micro_batch(memory, method, seq_len, precision, cap, checkpointing, shape)
        options.append((micro, method, ckpt))
    micro, method, ckpt = max(options, key=lambda o: o[0])  # max keeps the first (preferred) on ties
    if micro == 0:
        return None
    return method, micro, ckpt, {m: mb for mb, m, _ in options}


def does_not_fit(memory: MemoryEstimator, model: ModelChoice, methods: list[str], seq_len: int, precision: str,
                 shape: dict[str, Any], catalog: tuple[ModelSpec, ...]) -> ConfigError:
    """The refusal: how much the cheapest allowed method needs, and what would fit
    instead. `memory` is the model's estimate on this machine; `catalog` the known
    models, smallest first."""
    smallest = min(methods, key=lambda m: memory.estimate(m, 1, seq_len, precision, True, **shape).total_bytes)
    need = memory.estimate(smallest, 1, seq_len, precision, True, **shape)
    usable = memory.budget_bytes * (1 - SAFETY_MARGIN)
    where = "GPU memory" if memory.on_gpu else "RAM"
    suggestions = []
    shards = shape.get("shards", 1)
    if shards == 1 and "qlora" not in methods and memory.estimate("qlora", 1, seq_len, precision, True, **shape).fits:
        suggestions.append("--method qlora")
    if "full" in methods and memory.on_gpu:  # sharded over more GPUs
        for more in (2 * shards, 4 * shards, 8 * shards):
            if memory.estimate("full", 1, seq_len, precision, True, **{**shape, "shards": more}).fits:
                suggestions.append(f"--num-processes {more} --distributed fsdp (full fine-tuning sharded "
                                   f"over {more} GPUs)")
                break
    for shorter in SHORTER_LENGTHS:
        if shorter < seq_len and memory.estimate(smallest, 1, shorter, precision, True, **shape).fits:
            suggestions.append(f"--max-seq-len {shorter}")
            break
    smaller = _largest_smaller_model(memory, seq_len, precision, catalog)
    if smaller:
        spec, length = smaller
        suggestions.append(f"a smaller model such as --model {spec.hub_id}"
                           + (f" with --max-seq-len {length}" if length < seq_len else ""))
    gib_needed = math.ceil(need.total_bytes / (1 - SAFETY_MARGIN) / GIB)
    suggestions.append(f"a machine with at least {gib_needed} GiB of {where}")
    return ConfigError(
        f"{model.name} does not fit in {memory.budget_bytes / GIB:.1f} GiB of {where}: even {smallest} with "
        f"micro-batch 1, gradient checkpointing and {seq_len}-token sequences needs about "
        f"{need.total_bytes / GIB:.1f} GiB ({max(0.0, need.total_bytes - usable) / GIB:.1f} GiB more than can be used).",
        "What would fit: " + "; or ".join(suggestions) + ".",
    )


def _largest_smaller_model(memory: MemoryEstimator, seq_len: int, precision: str,
                           catalog: tuple[ModelSpec, ...]) -> tuple[ModelSpec, int] | None:
    """The largest known model smaller than `memory`'s that fits with QLoRA, at
    this sequence length or the longest shorter one that works."""
    size = sum(parameter_counts(memory.arch))
    for spec in reversed(catalog):
        if sum(parameter_counts(spec)) >= size:
            continue
        smaller = MemoryEstimator(spec, memory.on_gpu, memory.budget_bytes)
        for length in [seq_len] + [n for n in SHORTER_LENGTHS if n < seq_len]:
            if smaller.estimate("qlora", 1, length, precision, True).fits:
                return spec, length
    return None


# The planner's memory-saving optimizer: bitsandbytes' 8-bit AdamW.
EIGHT_BIT_OPTIMIZER = "adamw_8bit"


def fit_with_optimizer(memory: MemoryEstimator, methods: list[str], seq_len: int, precision: str, cap: int,
                       checkpointing: bool | None, shape: dict[str, Any], given: str | None,
                       on_gpu: bool) -> tuple[tuple[str, int, bool, dict[str, int]] | None, str | None]:
    """`best_fit` with the optimizer given, else with AdamW, or with 8-bit AdamW
    where, on a GPU, its smaller state lets a larger micro-batch fit (or the
    preferred method, or no gradient checkpointing); and the reason for 8-bit.
    Sets `shape["optimizer"]` to the one chosen."""
    shape["optimizer"] = given or "adamw"
    fit = best_fit(memory, methods, seq_len, precision, cap, checkpointing, shape)
    if given or not on_gpu or shape.get("shards", 1) > 1:  # bitsandbytes' optimizers take no FSDP shards
        return fit, None
    cheaper = {**shape, "optimizer": EIGHT_BIT_OPTIMIZER}
    fit8 = best_fit(memory, methods, seq_len, precision, cap, checkpointing, cheaper)
    if fit8 is None or (fit is not None and _goodness(fit8, methods[0]) <= _goodness(fit, methods[0])):
        return fit, None
    shape["optimizer"] = EIGHT_BIT_OPTIMIZER
    instead = "with AdamW nothing fits" if fit is None else f"with AdamW: {_described(fit)}; --optimizer adamw keeps it"
    return fit8, (f"optimizer adamw_8bit (bitsandbytes): 2 bytes of state per trained weight instead of AdamW's 8, "
                  f"so {_described(fit8)} fits ({instead})")


def _goodness(fit: tuple[str, int, bool, dict[str, int]], preferred: str) -> tuple[int, bool, bool]:
    method, micro, checkpointing, _ = fit
    return micro, not checkpointing, method == preferred


def _described(fit: tuple[str, int, bool, dict[str, int]]) -> str:
    method, micro, checkpointing, _ = fit
    return f"{method} micro-batch {micro}" + (" with gradient checkpointing" if checkpointing else "")
