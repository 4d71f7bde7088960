"""The share of a CPU a run gets: the threads it trains with, and how much
longer a machine busy with other work makes it.

Pure, like the rest of planning: the machine's load comes in `Hardware`
(`cpu_load`, the 1-minute load average less this process's own share, and
`omp_threads`, the user's OMP_NUM_THREADS).

Threads: OMP_NUM_THREADS when the user set it; otherwise one per physical
core, less the cores other work keeps busy. A core counts as taken when the
load keeps it busy at least half the time (the load, rounded). More threads
than free cores do not just share them: torch's threads meet at the end of
every operation, so each one waits for the thread the scheduler left out, and
a user saw 2 threads take 67.6 s where 1 took 7.1 s beside other work on 2
cores.

Slow-down: the run's threads get the cores in proportion to everything
runnable, so a thread runs at min(1, cores / (other load + threads)) of a
core. Against an idle machine with a thread per core (what the nominal rate
and every measured speed are converted to, `runs/speeds.py`) that is
max(cores / threads, (other load + threads) / threads) times longer.
"""

from __future__ import annotations

from llmcustoms.planning.hardware import Hardware
from llmcustoms.planning.resolver import Resolver

# A core is taken when other work keeps it busy at least this share of the time.
TAKEN_SHARE = 0.5


def cores_taken(cores: int, load: float | None) -> int:
    """Cores other work keeps busy: the load rounded (at `TAKEN_SHARE`), at most all of them."""
    return min(cores, int(load + 1 - TAKEN_SHARE)) if load else 0


def is_busy(hardware: Hardware) -> bool:
    return not hardware.has_gpu and cores_taken(hardware.cpu_cores, hardware.cpu_load) > 0


def slowdown_for(cores: int, load: float | None, threads: int | None) -> float:
    """How many times longer than on an idle machine of `cores` with a thread per
    core, for `threads` threads (all the run's processes') beside `load` of other
    work. `threads` None: those the planner would choose for that load."""
    load = load or 0.0
    threads = threads or max(1, cores - cores_taken(cores, load))
    share = min(1.0, cores / (load + threads))
    return max(1.0, cores / (threads * share))


def slowdown(hardware: Hardware, threads: int) -> float:
    """`slowdown_for` this machine as detected; 1 on a GPU (the CPU only feeds it)."""
    return 1.0 if hardware.has_gpu or threads <= 0 else slowdown_for(hardware.cpu_cores, hardware.cpu_load, threads)


def times(factor: float) -> str:
    """3.9 -> "3.9x", 2.0 -> "2x"."""
    return f"{factor:.1f}".removesuffix(".0") + "x"


def load_text(hardware: Hardware) -> str:
    return f"load {hardware.cpu_load:.1f} on {hardware.cpu_cores} core{'s' if hardware.cpu_cores > 1 else ''}"


def choose_threads(r: Resolver, hardware: Hardware, world_size: int = 1) -> int:
    """The CPU threads of each process, noted with a reason on `r` (the planner's
    resolver); 0 on a GPU, where torch's own default stands."""
    if hardware.has_gpu:
        return 0
    cores, world = hardware.cpu_cores, max(1, world_size)
    free = max(1, cores - cores_taken(cores, hardware.cpu_load))
    per = " per process" if world > 1 else ""
    if hardware.omp_threads:
        threads = hardware.omp_threads
        r.record("cpu_threads", "env OMP_NUM_THREADS")
        r.note(f"threads {threads}{per}: OMP_NUM_THREADS")
        if is_busy(hardware) and threads * world > free:
            r.warn(f"OMP_NUM_THREADS={threads} on a busy machine ({load_text(hardware)}): more threads "
                              f"than the {free} free core{'s' if free > 1 else ''} wait for each other at every "
                              f"step and can be many times slower; {max(1, free // world)} would be faster")
        return threads
    threads, idle = max(1, free // world), max(1, cores // world)
    if threads < idle:  # a busy machine
        return r.chose("cpu_threads", threads, f"threads {threads}{per}: the machine is busy ({load_text(hardware)}), "
                                               f"so {threads} thread{'s' if threads > 1 else ''}{per}, not {idle} "
                                               "(OMP_NUM_THREADS sets it)")
    shared = f", shared by {world} processes" if world > 1 else ""
    return r.chose("cpu_threads", threads, f"threads {threads}{per}: one per physical core{shared}")


def busy_text(hardware: Hardware, threads: int) -> str:
    """What the load does to the estimate, for its reason; "" when it does nothing to speak of."""
    factor = slowdown(hardware, threads)
    if factor < 1.1:
        return ""
    if is_busy(hardware):
        return (f"the machine is busy ({load_text(hardware)}): the estimate assumes it stays this busy; "
                f"about {times(factor)} longer than on an idle machine")
    if threads < hardware.cpu_cores:
        return (f"{threads} thread{'s' if threads > 1 else ''} on {hardware.cpu_cores} cores: about {times(factor)} "
                "longer than with one per core")
    return ""
