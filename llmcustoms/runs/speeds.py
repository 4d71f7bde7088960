"""Training speeds measured on this machine, kept between runs.

A plan's duration from nominal FLOP/s was off by 20x for short runs on a CPU
(a user saw "about 35 s" for 13 minutes). Once a model has trained here, its
measured tokens/s per model and method is kept in the cache directory and the
next plan for it uses that (`Hardware.measured_speed`), and says so.

One run is not the machine's speed: a run beside other work is slower. Each
key keeps its last `KEEP` measurements, each with what it ran beside (`load`:
the cores other processes kept busy, the median of its step rows' `cpu_others`)
and its `threads`. A plan uses the median of their idle-machine speeds (each
scaled by the slow-down of its own load and threads, `cpu_share.slowdown_for`)
and applies today's slow-down to it: one run measured under heavy load moves
the median little, and made an estimate of 23 hours before. A GPU's rows carry
no load (the CPU only feeds it). speeds.json:

    {"cpu x2": {"MODEL|lora": [{"tokens_per_s": 512.3, "load": 0.1, "threads": 2}, ...]}}

Files written before kept one number per key: it reads as one measurement of
unknown load, taken as an idle machine's.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable

from llmcustoms.planning.cpu_share import slowdown_for
from llmcustoms.planning.hardware import Hardware

FILE_NAME = "speeds.json"
# Fewer measured steps than this say little (the first steps warm up).
MIN_STEPS = 3
# Measurements kept per model and method: enough for a median to outvote one odd run.
KEEP = 5


def _read(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or damaged: the plan falls back to the nominal rate
    return data if isinstance(data, dict) else {}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def measurements(value: Any) -> list[dict[str, Any]]:
    """A key's measurements, oldest first: a list of them, or an older file's one number."""
    found = value if isinstance(value, list) else [{"tokens_per_s": value}]
    return [m for m in found if isinstance(m, dict) and (_number(m.get("tokens_per_s")) or 0) > 0]


def idle_speed(measurement: dict[str, Any], cores: int) -> float:
    """A measurement's tokens/s as an idle machine with a thread per core would train."""
    threads = _number(measurement.get("threads"))
    factor = slowdown_for(cores, _number(measurement.get("load")), int(threads) if threads else None)
    return float(measurement["tokens_per_s"]) * factor


def typical_speed(value: Any, cores: int, has_gpu: bool) -> float | None:
    """The median idle-machine speed of a key's measurements (on a GPU, of their speeds as measured)."""
    found = measurements(value)
    if not found:
        return None
    return statistics.median(float(m["tokens_per_s"]) if has_gpu else idle_speed(m, cores) for m in found)


def with_measured_speeds(hardware: Hardware, cache: Path, world_size: int = 1) -> Hardware:
    """`hardware` with the speeds measured on a machine like it: by one process,
    so for a plan of one process only."""
    measured = _read(cache / FILE_NAME).get(hardware.machine_key)
    if not isinstance(measured, dict) or world_size != 1:
        return hardware
    speeds = ((key, typical_speed(value, hardware.cpu_cores, hardware.has_gpu)) for key, value in measured.items())
    return replace(hardware, speeds=tuple((key, speed) for key, speed in speeds if speed))


def _steps(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "loss" in r and r.get("seconds")][1:]  # the first step (warm-up) left out


def measured_tokens_per_s(rows: Iterable[dict[str, Any]]) -> float | None:
    """Input tokens over step time, the first step (warm-up) left out: the
    machine's speed, for the next plan; None from too few steps or rows
    written before steps were timed."""
    steps = _steps(rows)
    return _tokens_per_s(steps) if len(steps) >= MIN_STEPS else None


def run_tokens_per_s(rows: Iterable[dict[str, Any]]) -> float | None:
    """The run's speed, as the summary and `report` give it: the input tokens
    of every step row (a resumed run's too) over the time spent in those steps.
    Evaluations, checkpoints and sample replies are not in it (they are in
    the training time), so it is the live display's tok/s over the whole run.
    None from rows written before steps were timed."""
    return _tokens_per_s([r for r in rows if "loss" in r and r.get("seconds")])


def _tokens_per_s(steps: list[dict[str, Any]]) -> float | None:
    seconds = sum(r["seconds"] for r in steps)
    return sum(r["tokens_per_s"] * r["seconds"] for r in steps) / seconds if seconds > 0 else None


def measured_beside(rows: Iterable[dict[str, Any]]) -> dict[str, float | int]:
    """What the steps ran beside: the median of the rows' other work (`load`) and their
    threads (`threads`), from a CPU's rows (`training/resource_use.py`); {} from a GPU's."""
    steps = _steps(rows)
    loads = [r["cpu_others"] for r in steps if _number(r.get("cpu_others")) is not None]
    threads = [r["cpu_threads"] for r in steps if _number(r.get("cpu_threads"))]
    found: dict[str, float | int] = {"load": round(statistics.median(loads), 2)} if loads else {}
    return {**found, "threads": int(statistics.median(threads))} if threads else found


def record_speed(cache: Path, hardware: Hardware, model: str, method: str, rows: Iterable[dict[str, Any]]) -> None:
    """Keep this run's speed, with what it ran beside, for the next plan; never fails
    a run (the cache may be read-only)."""
    rows = list(rows)
    speed = measured_tokens_per_s(rows)
    if speed is None:
        return
    beside = {} if hardware.has_gpu else measured_beside(rows)
    path = cache / FILE_NAME
    data = _read(path)
    if not isinstance(data.get(hardware.machine_key), dict):
        data[hardware.machine_key] = {}
    key = f"{model}|{method}"
    kept = measurements(data[hardware.machine_key].get(key, []))
    data[hardware.machine_key][key] = (kept + [{"tokens_per_s": round(speed, 2), **beside}])[-KEEP:]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(data, indent=1))
        partial.replace(path)
    except OSError:
        return
