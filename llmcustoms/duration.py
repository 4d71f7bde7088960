"""How long a run will take: compute per token over the machine's rate.

A rough figure for the plan (shown, never acted on), so the constants are
measured once and rounded, not tuned per model.
"""

from __future__ import annotations

from llmcustoms.hardware import Hardware
from llmcustoms.memory import parameter_counts
from llmcustoms.presets import ModelSpec

# Share of the GPU's tensor-core peak a fine-tuning step reaches (model FLOPs utilisation).
GPU_MFU = 0.35
# Effective FLOP/s per CPU core in fp32 training steps: 42-44 GFLOP/s measured
# on the reference machine (2 AVX-512 cores; LoRA and full fine-tuning of a
# 45M-parameter Llama at 512 tokens). Rounded down for smaller machines.
CPU_FLOPS_PER_CORE = 40e9
# Extra time QLoRA spends dequantising 4-bit weights in every forward and backward.
QLORA_SLOWDOWN = 1.3
# Without a GPU the preset's CPU models are planned best first and the first
# expected to finish within this is trained: half an hour is a wait a first
# try can afford, and it still leaves time to change something and run again.
CPU_TIME_LIMIT_S = 30 * 60


def flops_per_token(arch: ModelSpec, method: str, gradient_checkpointing: bool) -> float:
    """Forward 2N; backward 4N when every weight gets a gradient, about 2N when
    the base is frozen (only activation gradients); checkpointing adds a forward."""
    linear, other = parameter_counts(arch)
    n = linear + arch.vocab_size * arch.hidden_size  # the embedding lookup is free, the head is not
    backward = 4 * n if method == "full" else 2 * n
    return 2 * n + backward + (2 * n if gradient_checkpointing else 0)


def estimate_seconds(arch: ModelSpec, method: str, gradient_checkpointing: bool, tokens: float, hardware: Hardware) -> float:
    if hardware.has_gpu:
        rate = hardware.peak_tflops * 1e12 * GPU_MFU
    else:
        rate = CPU_FLOPS_PER_CORE * hardware.cpu_cores
    seconds = tokens * flops_per_token(arch, method, gradient_checkpointing) / rate
    return seconds * (QLORA_SLOWDOWN if method == "qlora" else 1.0)


def duration_reason(seconds: float, hardware: Hardware) -> str:
    hours = seconds / 3600
    text = f"estimated duration {_human_duration(seconds)}"
    if not hardware.has_gpu and hours >= 1:
        return (text + ": long, because there is no GPU. A single consumer GPU (e.g. 16-24 GB) would take "
                "minutes to an hour; on this machine try --preset highspeed, a smaller model or --max-steps")
    return text


def _human_duration(seconds: float) -> str:
    if seconds < 90:
        return f"about {max(1, round(seconds))} s"
    if seconds < 5400:
        return f"about {round(seconds / 60)} min"
    return f"about {seconds / 3600:.1f} h"


def cpu_choice(estimates: list[tuple[str, float]], smallest: str) -> tuple[str, str]:
    """Which CPU model to train, and why: the first of `estimates` (name and
    estimated seconds, best model first) within `CPU_TIME_LIMIT_S`, else `smallest`."""
    if not estimates:
        return smallest, "the preset's smallest CPU model"
    names, seconds = [name for name, _ in estimates], dict(estimates)
    limit = f"{CPU_TIME_LIMIT_S // 60} min"
    chosen = next((name for name in names if seconds[name] <= CPU_TIME_LIMIT_S), None)
    if chosen is None:
        others = "; ".join(f"{name.split('/')[-1]} {_human_duration(seconds[name])}" for name in names if name != smallest)
        return smallest, (f"the smallest CPU model, estimated {_human_duration(seconds[smallest])}; none is expected "
                          f"to finish within {limit}" + (f" ({others})" if others else ""))
    estimate = f"estimated {_human_duration(seconds[chosen])}"
    skipped = names[:names.index(chosen)]  # the better models, all over the limit
    if not skipped:
        return chosen, f"the preset's first CPU model, {estimate}, within {limit}"
    slower = "; ".join(f"{name.split('/')[-1]} would take {_human_duration(seconds[name])}" for name in skipped)
    return chosen, f"{estimate} ({slower}, over {limit})"
