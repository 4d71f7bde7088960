"""What this machine has: GPUs (via nvidia-ml-py's `pynvml`), CPU cores and RAM,
and how busy its CPU is with other work (the load average).

`detect()` reads the machine once into a frozen `Hardware`. Nothing here
imports torch, so `llmcustoms plan` and `hardware` stay fast, and planning is
tested by constructing `Hardware` values for machines we do not have.
NVML finds GPUs whatever torch was built for: `usable_by_torch` turns what
was found into what training will use, from facts about torch that the
running layer reads (`preflight.usable_hardware`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
import time
from dataclasses import asdict, dataclass, replace

import psutil

GIB = 1024 ** 3


@dataclass(frozen=True)
class Gpu:
    name: str
    total_bytes: int
    free_bytes: int
    compute_capability: tuple[int, int]

    @property
    def supports_bf16(self) -> bool:
        # bf16 tensor-core math arrived with Ampere (compute capability 8.0).
        return self.compute_capability >= (8, 0)


# Dense bf16/fp16 tensor-core peak, TFLOP/s, by a substring of the GPU's name
# (vendor datasheets). Used only to estimate how long a run takes.
PEAK_TFLOPS = (
    ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0), ("L40", 181.0),
    ("L4", 121.0), ("A10G", 70.0), ("A10", 125.0), ("A6000", 155.0), ("4090", 165.0), ("4080", 97.0),
    ("4070", 58.0), ("3090", 71.0), ("3080", 60.0), ("3070", 40.0), ("3060", 25.0), ("T4", 65.0),
    ("V100", 125.0), ("P100", 19.0),
)
DEFAULT_GPU_TFLOPS = 30.0


@dataclass(frozen=True)
class Hardware:
    gpus: tuple[Gpu, ...]
    cpu_cores: int
    ram_bytes: int
    ram_free_bytes: int
    driver_note: str = ""
    # Training tokens/s measured on a machine like this one, per "model|method" (`runs/speeds.py`).
    speeds: tuple[tuple[str, float], ...] = ()
    # Why the NVIDIA GPUs found are not used, and how to fix it (`usable_by_torch`); "" when they are.
    torch_note: str = ""
    # The CPU's native bf16 instructions ("AMX", "AVX512-BF16"); "" when it has none (`cpu_bf16`).
    cpu_bf16: str = ""
    # What runs attention over packed rows on this machine's GPUs: "flash-attn" (the
    # package), "torch" (torch's own varlen FlashAttention, torch >= 2.11), "" for none.
    varlen_attention: str = ""
    # Other work on the CPU when detected: the 1-minute load average (threads running or
    # waiting for a core) less this process's own share (`other_load`); None where the OS
    # has no load average. Planning chooses the threads and scales the estimate by it.
    cpu_load: float | None = None
    # The threads the user set in OMP_NUM_THREADS (torch obeys it); None when unset.
    omp_threads: int | None = None
    # A GPU planned for (`plan --vram`), not this machine's: its speed is a nominal one.
    assumed: bool = False

    def measured_speed(self, model: str, method: str) -> float | None:
        return dict(self.speeds).get(f"{model}|{method}")

    @property
    def machine_key(self) -> str:
        """Which measured speeds apply here: the same GPUs, or a CPU with as many cores."""
        if self.gpus:
            return f"{self.gpus[0].name} x{len(self.gpus)}"
        # A CPU with bf16 trains in it, about 1.5x as fast: its speeds are not an fp32 CPU's.
        return f"cpu x{self.cpu_cores}" + (" bf16" if self.cpu_bf16 else "")

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    @property
    def supports_bf16(self) -> bool:
        return self.has_gpu and all(g.supports_bf16 for g in self.gpus)

    @property
    def mixed_precision(self) -> str:
        """What autocast to use: bf16 where supported (GPUs since Ampere, CPUs with
        AVX512-BF16 or AMX), fp16 on older GPUs, none ("no": fp32) on other CPUs."""
        if not self.has_gpu:
            return "bf16" if self.cpu_bf16 else "no"
        return "bf16" if self.supports_bf16 else "fp16"

    def as_used(self, mixed_precision: str) -> "Hardware":
        """This machine as a plan of `mixed_precision` uses it: a CPU trained in fp32
        has the speed of one without bf16 (its estimate and its measured speeds)."""
        return self if self.has_gpu or mixed_precision == "bf16" else replace(self, cpu_bf16="")

    @property
    def precision_reason(self) -> str:
        """Why `mixed_precision` is what it is, for the plan."""
        if self.has_gpu:
            return ("precision bf16: bf16 autocast, supported by this GPU" if self.supports_bf16
                    else "precision fp16: fp16 autocast, this GPU has no bf16")
        if self.cpu_bf16:
            return (f"precision bf16 (CPU supports it: {self.cpu_bf16}): bf16 autocast, about 1.5x the speed of fp32 "
                    "with the same loss; the trained weights stay fp32 (--mixed-precision no keeps fp32)")
        return ("precision fp32: no GPU, and this CPU has no native bf16 (AVX512-BF16 or AMX), where bf16 would be "
                "emulated and slower than fp32")

    @property
    def peak_tflops(self) -> float:
        """Tensor-core peak of the first GPU, from its name (a conservative default if unknown)."""
        if not self.gpus:
            return 0.0
        name = self.gpus[0].name
        return next((tflops for key, tflops in PEAK_TFLOPS if key.lower() in name.lower()), DEFAULT_GPU_TFLOPS)

    @property
    def memory_budget_bytes(self) -> int:
        """What one training process may use: the smallest GPU's free memory (every
        data-parallel rank holds a whole model), or the available RAM on a CPU."""
        if self.gpus:
            return min(g.free_bytes for g in self.gpus)
        return self.ram_free_bytes

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def cpu_only(cls, ram_gib: float = 16, cores: int = 8) -> "Hardware":
        return cls(gpus=(), cpu_cores=cores, ram_bytes=int(ram_gib * GIB), ram_free_bytes=int(ram_gib * GIB * 0.8))

    @classmethod
    def with_gpu(cls, vram_gib: float, name: str = "GPU", compute_capability: tuple[int, int] = (8, 6),
                 ram_gib: float = 32, cores: int = 8) -> "Hardware":
        vram = int(vram_gib * GIB)
        return cls(gpus=(Gpu(name, vram, vram, compute_capability),), cpu_cores=cores,
                   ram_bytes=int(ram_gib * GIB), ram_free_bytes=int(ram_gib * GIB * 0.8), assumed=True)


def _detect_gpus() -> tuple[tuple[Gpu, ...], str]:
    try:
        import pynvml
    except ImportError:
        return (), "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return (), f"no NVIDIA driver found ({exc})"
    try:
        gpus = []
        visible = _visible_device_indices(pynvml.nvmlDeviceGetCount())
        for index in visible:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            gpus.append(Gpu(name.decode() if isinstance(name, bytes) else name,
                            int(memory.total), int(memory.free), (int(major), int(minor))))
        return tuple(gpus), ""
    except pynvml.NVMLError as exc:
        return (), f"the NVIDIA driver did not answer ({exc})"
    finally:
        pynvml.nvmlShutdown()


def _visible_device_indices(count: int) -> list[int]:
    """Honour CUDA_VISIBLE_DEVICES when it lists plain indices."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    indices = []
    for part in visible.split(","):
        part = part.strip()
        if part.isdigit() and int(part) < count:
            indices.append(int(part))
    return indices


# Where to get a torch that can use NVIDIA GPUs; the wheel index names its CUDA version.
TORCH_GUIDE = "https://pytorch.org/get-started/locally/"
TORCH_CUDA_EXAMPLE = "pip install torch --index-url https://download.pytorch.org/whl/cu124"


def usable_by_torch(hardware: Hardware, cuda_available: bool, torch_version: str,
                    torch_cuda: str | None = None) -> Hardware:
    """The hardware training will really run on, given the installed torch:
    `cuda_available` (`torch.cuda.is_available()`), `torch_version`
    (`torch.__version__`, "2.13.0+cpu") and `torch_cuda` (`torch.version.cuda`,
    None for a build without CUDA). NVML sees the GPUs whatever torch was built
    for, and a torch that cannot use them trains on the CPU, so the plan must
    be the CPU's: the GPUs are dropped and `torch_note` says why and what to do
    (the plan carries it as a warning)."""
    if not hardware.gpus or cuda_available:
        return hardware
    names = [g.name for g in hardware.gpus]
    listed = ", ".join(f"{n} x{names.count(n)}" if names.count(n) > 1 else n for n in dict.fromkeys(names))
    gpus = f"{len(names)} NVIDIA GPU{'s' if len(names) > 1 else ''}"
    if torch_cuda or "+cu" in torch_version:
        # A CUDA build that still finds no GPU: its CUDA is newer than the
        # driver supports (or CUDA_VISIBLE_DEVICES hides the cards from it).
        built = f" (built for CUDA {torch_cuda})" if torch_cuda else ""
        message = (f"This machine has {gpus} ({listed}) but the installed torch {torch_version}{built} cannot use "
                   f"{'them' if len(names) > 1 else 'it'}, so training would run on the CPU. The NVIDIA driver is "
                   "probably older than that CUDA needs (`nvidia-smi` shows the newest CUDA it supports): update "
                   f"the driver, or install a torch built for an older CUDA ({TORCH_GUIDE}); planning for the CPU "
                   "until then.")
    else:
        kind = "a ROCm build, for AMD GPUs" if "+rocm" in torch_version else "a CPU-only build"
        message = (f"This machine has {gpus} ({listed}) but the installed torch {torch_version} is {kind}, so "
                   f"training would run on the CPU. Install a CUDA build of torch ({TORCH_GUIDE}, e.g. "
                   f"{TORCH_CUDA_EXAMPLE}); planning for the CPU until then.")
    return replace(hardware, gpus=(), torch_note=message,
                   driver_note=f"the installed torch {torch_version} cannot use the {gpus} found")


# CPU flags (Linux /proc/cpuinfo) of native bf16 matrix math, best first. Without
# them torch still runs bf16 on a CPU, but converts in software: slower than fp32.
CPU_BF16_FLAGS = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"))


def cpu_bf16(cpuinfo: str) -> str:
    """The native bf16 instructions that `cpuinfo` (the text of /proc/cpuinfo) lists, or ""."""
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                  if line.startswith("flags") and ":" in line), [])
    return next((name for flag, name in CPU_BF16_FLAGS if flag in flags), "")


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""  # not Linux: no bf16 assumed (fp32 is always right, only slower)


def varlen_attention() -> str:
    """Which varlen attention is installed, read from package metadata (no import of
    torch): "flash-attn", "torch" (torch >= 2.11: `torch.nn.attention.varlen` with
    `window_size`, which 2.10's lacks), or ""."""
    if importlib.util.find_spec("flash_attn") is not None:
        return "flash-attn"
    try:
        major, minor = (int(part) for part in importlib.metadata.version("torch").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return ""
    return "torch" if (major, minor) >= (2, 11) else ""


def _load_average() -> float | None:
    """The 1-minute load average, or None where the OS has none (Windows). Tests replace it."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def other_load(load: float | None, own_cpu_s: float, own_age_s: float) -> float | None:
    """`load` (the 1-minute load average) less what this process added to it: its CPU
    time over its life as a rate, weighted as the kernel's exponential average weighs the
    last minute. Reading a large file before the plan must not look like someone else's work."""
    if load is None:
        return None
    age = max(own_age_s, 1.0)
    own = own_cpu_s / age * (1 - math.exp(-age / 60))
    return round(max(0.0, load - own), 2)


def cpu_seconds() -> tuple[float, float, float] | None:
    """(wall clock, the machine's busy CPU seconds, this process's CPU seconds), or None."""
    try:
        machine, own = psutil.cpu_times(), psutil.Process().cpu_times()
    except (psutil.Error, OSError):
        return None
    idle = sum(getattr(machine, name, 0.0) for name in ("idle", "iowait", "guest", "guest_nice"))
    return time.monotonic(), sum(machine) - idle, own.user + own.system


# Read when planning is first imported: the window `_busy_now` measures over is the
# time since, which the command's own imports and data reading fill; no wait added.
_SINCE = cpu_seconds()
MIN_WINDOW_S = 0.3


def _busy_now() -> float | None:
    """Other processes' CPU use since this process started planning, in cores:
    the machine's busy CPU time less this process's, over the wall time; None
    where it cannot be read. Tests replace it."""
    if _SINCE is None:
        return None
    waited = time.monotonic() - _SINCE[0]
    if waited < MIN_WINDOW_S:
        time.sleep(MIN_WINDOW_S - waited)
    now = cpu_seconds()
    if now is None:
        return None
    wall = now[0] - _SINCE[0]
    return round(max(0.0, ((now[1] - _SINCE[1]) - (now[2] - _SINCE[2])) / wall), 2)


def _cpu_load() -> float | None:
    """Other work on the CPU: measured over the seconds this command has run, else
    the 1-minute load average less this process's share. The load average lags: a
    minute after a test suite or another run ends it still says "busy" (a plan on
    an idle machine chose 1 thread of 2)."""
    now = _busy_now()
    if now is not None:
        return now
    load = _load_average()
    try:
        me = psutil.Process()
        times = me.cpu_times()
        return other_load(load, times.user + times.system, time.time() - me.create_time())
    except (psutil.Error, OSError):
        return None if load is None else round(load, 2)


def omp_threads(value: str | None) -> int | None:
    """The threads OMP_NUM_THREADS asks for ("4", or "4,2" for nested levels: the first), or None."""
    first = (value or "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def detect() -> Hardware:
    gpus, note = _detect_gpus()
    memory = psutil.virtual_memory()
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    return Hardware(gpus=gpus, cpu_cores=cores, ram_bytes=int(memory.total),
                    ram_free_bytes=int(memory.available), driver_note=note, cpu_bf16=cpu_bf16(_read_cpuinfo()),
                    varlen_attention=varlen_attention() if gpus else "", cpu_load=_cpu_load(),
                    omp_threads=omp_threads(os.environ.get("OMP_NUM_THREADS")))
