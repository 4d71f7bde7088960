"""Training speeds measured on this machine, kept between runs.

A plan's duration from nominal FLOP/s was off by 20x for short runs on a CPU
(a user saw "about 35 s" for 13 minutes). Once a model has trained here, its
measured tokens/s per model and method is kept in the cache directory and the
next plan for it uses that (`Hardware.measured_speed`), and says so.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable

from llmcustoms.planning.hardware import Hardware

FILE_NAME = "speeds.json"
# Fewer measured steps than this say little (the first steps warm up).
MIN_STEPS = 3


def _read(path: Path) -> dict[str, dict[str, float]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or damaged: the plan falls back to the nominal rate
    return data if isinstance(data, dict) else {}


def with_measured_speeds(hardware: Hardware, cache: Path, world_size: int = 1) -> Hardware:
    """`hardware` with the speeds measured on a machine like it: by one process,
    so for a plan of one process only."""
    measured = _read(cache / FILE_NAME).get(hardware.machine_key)
    if not isinstance(measured, dict) or world_size != 1:
        return hardware
    speeds = tuple((key, float(value)) for key, value in measured.items() if isinstance(value, (int, float)) and value > 0)
    return replace(hardware, speeds=speeds)


def measured_tokens_per_s(rows: Iterable[dict[str, Any]]) -> float | None:
    """Input tokens over step time, the first step (warm-up) left out; None
    from too few steps or rows written before steps were timed."""
    steps = [r for r in rows if "loss" in r and r.get("seconds")][1:]
    if len(steps) < MIN_STEPS:
        return None
    seconds = sum(r["seconds"] for r in steps)
    return sum(r["tokens_per_s"] * r["seconds"] for r in steps) / seconds if seconds > 0 else None


def record_speed(cache: Path, hardware: Hardware, model: str, method: str, rows: Iterable[dict[str, Any]]) -> None:
    """Keep this run's speed for the next plan; never fails a run (the cache may be read-only)."""
    speed = measured_tokens_per_s(rows)
    if speed is None:
        return
    path = cache / FILE_NAME
    data = _read(path)
    if not isinstance(data.get(hardware.machine_key), dict):
        data[hardware.machine_key] = {}
    data[hardware.machine_key][f"{model}|{method}"] = round(speed, 2)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(data, indent=1))
        partial.replace(path)
    except OSError:
        return
