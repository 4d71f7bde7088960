"""Which lines of a run's metrics.jsonl and samples.jsonl, and which fields of
its status.json, can be read; the rest is skipped and counted.

These files are the run's, but they live on the user's disk: an editor, a
copy cut short or a bad disk can leave a line that is a bare number, `null`,
a row without its step, or a timestamp that is not one. Every reader
(`report`, `runs`, `resume`) indexes the rows and formats the fields, so one
such line used to crash it, and `resume` then marked the run failed. Here a
line is whole or skipped, and a field of the wrong type is left out; the
reader shows what is left and says how much was skipped.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Callable

TIME_FORMAT = "%Y-%m-%dT%H:%M:%S%z"  # as `RunDirectory.write_status` writes it
# The fields every step row has (the run directory contract) and every reader may index.
STEP_FIELDS = ("loss", "lr", "grad_norm", "tokens_per_s")
# A DPO evaluation row's fields (`preference_report` reads them together).
PREFERENCE_FIELDS = ("eval_loss", "eval_reward_accuracy", "eval_reward_margin", "eval_chosen_reward")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _text(value: Any) -> bool:
    return isinstance(value, str)


def _time(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        datetime.strptime(value, TIME_FORMAT)
    except ValueError:
        return False
    return True


def metrics_row(row: Any) -> bool:
    """A row of metrics.jsonl: its step, numbers only, and a step row's fields."""
    if not isinstance(row, dict) or not _count(row.get("step")):
        return False
    if not all(value is None or _number(value) for value in row.values()):
        return False
    if "loss" in row and not all(_number(row.get(key)) for key in STEP_FIELDS):
        return False
    if "eval_reward_accuracy" in row and not all(_number(row.get(key)) for key in PREFERENCE_FIELDS):
        return False
    return "eval_loss" not in row or _number(row["eval_loss"])


def samples_row(row: Any) -> bool:
    """A row of samples.jsonl: which prompt, when, and the texts `samples.side_by_side` shows."""
    return (isinstance(row, dict) and _count(row.get("step")) and _count(row.get("row"))
            and all(_text(row.get(key)) for key in ("label", "prompt", "reply"))
            and _text(row.get("reference", "")))


def read_lines(text: str, whole: Callable[[Any], bool]) -> tuple[list[dict[str, Any]], int]:
    """The rows of a JSON-lines text that are `whole`, and how many lines were not."""
    rows, skipped = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # cut short by a kill, or damaged
            skipped += 1
            continue
        if whole(row):
            rows.append(row)
        else:
            skipped += 1
    return rows, skipped


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _recovery(entry: Any) -> bool:
    return isinstance(entry, dict) and _count(entry.get("step")) and _text(entry.get("kind")) \
        and _text(entry.get("action"))


STATUS_FIELDS: dict[str, Callable[[Any], bool]] = {
    "status": _text, "reason": _optional(_text), "stop_cause": _optional(_text), "kept": _optional(_text),
    "last_output": _optional(_text), "step": _count, "total_steps": _optional(_count), "pid": _optional(_count),
    "best_eval_step": _optional(_count), "kept_step": _optional(_count), "best_eval_loss": _optional(_number),
    "base_eval_loss": _optional(_number), "final_loss": _optional(_number), "started_at": _time,
    "updated_at": _time, "training_since": _optional(_time), "training_seconds": _number,
    "data": _optional(lambda value: isinstance(value, dict)),
    "suggestions": _optional(lambda value: isinstance(value, list) and all(_text(s) for s in value)),
    "recoveries": lambda value: isinstance(value, list) and all(_recovery(r) for r in value),
    "memory": _optional(lambda value: isinstance(value, dict) and all(v is None or _number(v) for v in value.values())),
}


def readable_status(status: Any) -> tuple[dict[str, Any], list[str]]:
    """status.json's fields that hold what they should, and the names of those
    left out (all of it, "status.json", when it is not an object)."""
    if not isinstance(status, dict):
        return {}, ["status.json"]
    kept = {key: value for key, value in status.items() if STATUS_FIELDS.get(key, lambda v: True)(value)}
    return kept, [key for key in status if key not in kept]
