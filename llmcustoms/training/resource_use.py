"""What a run uses while it trains: memory on every step row, GPU utilisation.

Each step row gets the memory the process used since the row before:

  on a GPU   `torch.cuda.max_memory_allocated` (and `_reserved`) since the
             last row; the peak counters are reset after each row. Reading
             them asks the allocator, not the device: no host sync.
  on a CPU   the peak resident set size since the last row, less the resident
             size before the model loaded, garbage collected and freed heap
             handed back first (what the plan's estimate counts:
             the model, its training state and its activations, not Python,
             torch's libraries or the tokenizer). On Linux the kernel keeps the
             peak (VmHWM) and /proc/self/clear_refs resets it, so a short spike
             between two rows is not missed; elsewhere the resident size at the
             row stands in for the peak. glibc keeps freed blocks in its heap,
             where they count as resident: before the peak is reset they are
             handed back (`malloc_trim`), or one large evaluation would look
             like the peak of every step after it.

An evaluation row gets the memory of the evaluation since the step before;
only step rows count towards the run's peak, which is what the plan's estimate
predicts. Generating (sample replies, the forgetting check's general questions,
all at once on a CPU) is in no row: the peak counters start again after it
(`restart`), or the first step of every first run would carry the base
model's answers (1.8x the plan where training itself used 1.1x).

The estimate is made for the longest micro-batch the run can see (its
max_seq_len, full rows). A run meets its longest rows whenever the shuffle
brings them, maybe never in a short run, so the peak is compared with the
estimate for the largest micro-batch it did train: the parts that grow with
the batch (activations, logits) scaled to its padded tokens.

On an NVIDIA GPU a background thread also asks NVML, twice a second, how busy
the device is and how much of its memory is in use (by every process, the CUDA
context included); a row gets the mean utilisation and the most memory since
the row before. The thread never touches the training's tensors.

On a CPU a row also gets the threads torch trains with (`cpu_threads`) and
the other work since the row before (`cpu_others`), in the load average's
unit (threads wanting a core): the machine's busy CPU time less this
process's, over the wall time; and when every CPU was busy, over the share of
a core this run's threads got, since the others then got no more each (the
scheduler's fair share). It is what the run's speed was measured beside, kept
with it (`runs/speeds.py`); the load average cannot tell, as it counts this
run's own threads.

The run's measured peak is compared with the plan's predicted one in
`comparison`; status.json, the summary, `runs` and `report` show it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading
from pathlib import Path
from typing import Any, Callable

import psutil

from llmcustoms.planning.hardware import cpu_seconds
from llmcustoms.planning.memory import CUDA_CONTEXT_BYTES

# How often the GPU thread samples: often enough to see a step's busy and idle
# parts on a GPU (steps take a fraction of a second to seconds), rare enough to
# cost nothing.
GPU_SAMPLE_S = 0.5
STATUS_FILE = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
# Every CPU counts as busy from this share of the time on (a little is lost to switching).
SATURATED = 0.9
# Shorter intervals than this say little of other work (CPU time is counted in 10 ms ticks).
MIN_INTERVAL_S = 0.1


def _resident_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


def _peak_resident_bytes() -> int | None:
    """The kernel's high-water mark of this process's resident size (Linux), or None."""
    try:
        for line in STATUS_FILE.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and getattr(libc, "malloc_trim", None) is not None else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to hand back
        return None


LIBC = _libc()


def _live_resident_bytes() -> int:
    """The resident size of what is alive: earlier work's garbage (reference cycles the
    collector has not reached yet, freed heap blocks glibc keeps) handed back first. Read
    without that, a long-lived process (a test suite's, or one that has just tokenized a
    dataset) counts the training's memory from a size it later falls below when the
    garbage goes, and a small run measures a peak near 0."""
    gc.collect()
    if LIBC is not None:
        LIBC.malloc_trim(0)
    return _resident_bytes()


def _reset_peak_resident() -> bool:
    """Start a new high-water mark ("5" resets it: Documentation/filesystems/proc.rst),
    from the memory in use: freed heap blocks are handed back first."""
    if LIBC is not None:
        LIBC.malloc_trim(0)
    try:
        CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


class GpuSampler:
    """A daemon thread reading (utilisation %, memory used bytes) every `interval` seconds."""

    def __init__(self, read: Callable[[], tuple[float, int]], interval: float = GPU_SAMPLE_S):
        self.read, self.interval = read, interval
        self.lock = threading.Lock()
        self.utilisation: list[float] = []
        self.memory_used = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="llmcustoms-gpu-sampler", daemon=True)

    def start(self) -> "GpuSampler":
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                utilisation, used = self.read()
            except Exception:  # a driver that stops answering must not end the run; the rows go without
                return
            with self.lock:
                self.utilisation.append(float(utilisation))
                self.memory_used = max(self.memory_used, int(used))
            self.stopped.wait(self.interval)

    def take(self) -> dict[str, float | int]:
        """The samples since the last call: mean utilisation and most memory used."""
        with self.lock:
            samples, used = self.utilisation, self.memory_used
            self.utilisation, self.memory_used = [], 0
        if not samples:
            return {}
        return {"gpu_util": round(sum(samples) / len(samples), 1), "gpu_memory_bytes": used}

    def stop(self) -> None:
        self.stopped.set()


def nvml_reader(device: int) -> Callable[[], tuple[float, int]] | None:
    """Reads `device`'s utilisation and memory used through torch's NVML calls
    (they map torch's device index to NVML's, CUDA_VISIBLE_DEVICES included);
    None where NVML does not answer."""
    import torch

    def read() -> tuple[float, int]:
        return float(torch.cuda.utilization(device)), int(torch.cuda.device_memory_used(device))

    try:
        read()
    except Exception:  # no pynvml, or a driver without NVML: rows carry the allocator's numbers only
        return None
    return read


class OtherWork:
    """Other processes' work between readings, in threads wanting a core."""

    def __init__(self, cpus: int | None = None) -> None:
        self.cpus = cpus or psutil.cpu_count() or 1  # what /proc/stat's busy time is summed over
        self.last = cpu_seconds()

    def take(self, threads: int) -> float | None:
        """Since the last reading, beside this process's `threads`; None when unreadable, or
        too soon to say (the kernel counts CPU time in ticks: the next call measures from the last reading)."""
        now, last = cpu_seconds(), self.last
        if now is not None and last is not None and now[0] - last[0] < MIN_INTERVAL_S:
            return None
        self.last = now
        if now is None or last is None:
            return None
        wall = now[0] - last[0]
        busy, own = (now[1] - last[1]) / wall, (now[2] - last[2]) / wall
        others = max(0.0, busy - own)
        if busy >= SATURATED * self.cpus and own > 0:
            # No CPU to spare: the others wanted more than they got, and got each what ours did.
            others /= min(1.0, own / max(1, threads))
        return round(others, 2)


class ResourceUse:
    """Memory per step row, and the run's peak. Made before the model loads:
    on a CPU that is the resident size the training's memory is counted from."""

    def __init__(self, device: int | None, sampler: GpuSampler | None = None, earlier_peak: int = 0,
                 plan: Any = None):
        """`plan`: the plan whose estimate the peak is compared with (its micro-batch
        and sequence length are what the estimate was made for)."""
        self.device = device  # the CUDA device index, None on a CPU
        self.sampler = sampler
        self.plan = plan
        self.earlier_peak = earlier_peak  # what a resumed run measured before
        self.baseline = 0 if device is not None else _live_resident_bytes()
        self.kernel_peak = device is None and _peak_resident_bytes() is not None and _reset_peak_resident()
        self.peak = 0
        self.batch_tokens = 0  # the largest micro-batch trained, in padded tokens
        self.gpu_util: list[float] = []
        self.others = OtherWork() if device is None else None

    @classmethod
    def start(cls, device: Any, plan: Any, status: dict[str, Any]) -> "ResourceUse":
        """Measuring on `device` (a torch.device) for a run of `plan` whose status.json
        holds `status` (a resumed run's earlier peak)."""
        index = device.index or 0 if device.type == "cuda" else None
        reader = nvml_reader(index) if index is not None else None
        earlier = (status.get("memory") or {}).get("peak_bytes") or 0
        return cls(index, GpuSampler(reader).start() if reader is not None else None, int(earlier), plan)

    def restart(self) -> None:
        """Peaks from now on: what came before (loading the model, generating) is not training."""
        if self.device is not None:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.kernel_peak:
            _reset_peak_resident()
        elif LIBC is not None:  # no peak to reset: the next row reads the resident size, without the freed heap
            LIBC.malloc_trim(0)
        if self.sampler is not None:
            self.sampler.take()
        if self.others is not None:
            self.others.take(1)

    def row(self, batch_tokens: int | None = None) -> dict[str, float | int]:
        """The memory since the last row (and GPU use); starts the next interval.
        `batch_tokens`: a step row's largest micro-batch (padded tokens); None for an evaluation row."""
        values: dict[str, float | int] = {}
        if self.device is not None:
            import torch

            values["memory_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
            values["memory_reserved_bytes"] = int(torch.cuda.max_memory_reserved(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            peak = _peak_resident_bytes() if self.kernel_peak else None
            resident = _resident_bytes()
            used = peak if peak is not None else resident
            # Memory that was alive before training and freed since: the training's is
            # counted from the lowest point, or a small run would measure no peak at all.
            # (Garbage is handed back before the baseline is read, so this is rare: the
            # lowest point holds the model, and counted from it the peak is too low.)
            self.baseline = min(self.baseline, resident)
            values["memory_bytes"] = max(0, used - self.baseline)
            if self.kernel_peak:
                _reset_peak_resident()
            values.update(self._cpu_share())
        if self.sampler is not None:
            values.update(self.sampler.take())
            if "gpu_util" in values:
                self.gpu_util.append(float(values["gpu_util"]))
        if batch_tokens is not None:
            self.peak = max(self.peak, int(values["memory_bytes"]))
            self.batch_tokens = max(self.batch_tokens, batch_tokens)
        return values

    def _cpu_share(self) -> dict[str, float | int]:
        """A CPU row's threads and the cores other work kept busy since the row before."""
        import torch

        threads = torch.get_num_threads()
        others = self.others.take(threads) if self.others is not None else None
        return {"cpu_threads": threads, **({"cpu_others": others} if others is not None else {})}

    def comparison(self) -> dict[str, Any]:
        """Measured peak (a resumed run's included) against the plan's prediction,
        for status.json and the summary."""
        plan = self.plan
        planned_tokens = plan.micro_batch_size * plan.objective_kind.sequences_per_row * plan.max_seq_len
        return compare(max(self.peak, self.earlier_peak), plan.memory, self.device is not None,
                       sum(self.gpu_util) / len(self.gpu_util) if self.gpu_util else None,
                       self.batch_tokens, planned_tokens)

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()


def predicted_at(estimate: dict[str, int], tokens: int, planned_tokens: int) -> int:
    """The estimate's peak for a micro-batch of `tokens` padded tokens instead of
    `planned_tokens`: activations and logits grow with the tokens (planning/memory.py),
    the rest does not (as `MemoryEstimate.total_bytes` adds them up)."""
    scale = min(1.0, tokens / planned_tokens) if tokens and planned_tokens else 1.0
    batch = estimate["activations_bytes"] + estimate["logits_bytes"] + estimate.get("heap_bytes", 0)
    in_backward = max(estimate["gradients_bytes"], batch * scale)
    return int(estimate["total_bytes"] - max(estimate["gradients_bytes"], batch) + in_backward)


def compare(peak: int, estimate: dict[str, int] | None, on_gpu: bool, gpu_util: float | None,
            batch_tokens: int = 0, planned_tokens: int = 0) -> dict[str, Any]:
    """{peak_bytes, predicted_bytes (for the largest micro-batch trained), ratio,
    plan_peak_bytes (the plan's total, as its memory table and the live display
    give it: one number for the plan everywhere, `runs/memory_use.py`),
    budget_bytes, gpu_util}. On a GPU the allocator does not see the CUDA
    context, which the estimate counts: it is left out of the prediction compared."""
    predicted = planned = budget = None
    if estimate:
        context = CUDA_CONTEXT_BYTES if on_gpu else 0
        predicted = predicted_at(estimate, batch_tokens, planned_tokens) - context
        planned, budget = int(estimate["total_bytes"]), int(estimate["budget_bytes"])
    ratio = round(peak / predicted, 3) if predicted and peak else None
    result: dict[str, Any] = {"peak_bytes": peak, "predicted_bytes": predicted, "ratio": ratio,
                              "plan_peak_bytes": planned, "budget_bytes": budget, "batch_tokens": batch_tokens}
    if gpu_util is not None:
        result["gpu_util"] = round(gpu_util, 1)
    return result
