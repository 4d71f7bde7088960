"""How long a run has trained: its training time, kept in status.json.

A run trains in one or more segments: `train`, then each `resume` (and each
restart after a failure). A segment begins when the loop starts training
(the model loaded: the first status `running` written by a process that does
not already have one open) and ends when a status other than `running` is
written: `completed`, `failed`, `interrupted`. Its wall time, evaluations and
checkpoints included, is added to `training_seconds`; `training_since` is the
open segment's start. A process killed before it could record its end
(`kill -9`, a closed terminal) leaves its segment open: the next process to
write the status closes it at that process's last update (`updated_at`, every
few seconds while it trains). A run begun before the segments were kept
starts from its span so far, first start to last update.

The training time is the sum of the segments: the time between segments
(interrupted overnight, say) and the time before the loop starts (loading the
model and data) are not in it. `runs` shows it, up to now for a run training now.
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from typing import Any

from llmcustoms.runs.run_records import TIME_FORMAT


def seconds_between(start: str, end: str) -> float:
    """Seconds from one status.json time to another (never below 0: a clock set back)."""
    return max(0.0, (datetime.strptime(end, TIME_FORMAT) - datetime.strptime(start, TIME_FORMAT)).total_seconds())


def count_segment(status: dict[str, Any], new_status: str, now: str, begins: bool = True) -> None:
    """Update `status` (status.json as read, before it says `new_status` at `now`)
    for the segment this write begins, goes on with or ends. `begins=False`: a
    `running` that is not yet training (the run prepared, its model not loaded)."""
    if "training_seconds" not in status:  # a new run: 0; one begun before the segments were kept: its span
        started, updated = status.get("started_at"), status.get("updated_at")
        status["training_seconds"] = seconds_between(started, updated) if started and updated else 0.0
    since = status.get("training_since")
    if since is not None and status.get("pid") != os.getpid():  # left open by a process that is gone
        _close(status, since, status.get("updated_at", since))
        since = None
    if since is None and new_status == "running" and begins:
        status["training_since"] = now
    elif since is not None and new_status != "running":
        _close(status, since, now)


def _close(status: dict[str, Any], since: str, end: str) -> None:
    status["training_seconds"] = round(status["training_seconds"] + seconds_between(since, end), 1)
    status["training_since"] = None


def training_seconds(status: dict[str, Any], running: bool, now: float | None = None) -> float | None:
    """The run's training time: its segments summed, the open one up to `now` if
    a process is `running` it (else up to its last update). For a status.json
    written before the segments were kept: from its start to now (running) or to
    its last update; None without a start."""
    now_text = time.strftime(TIME_FORMAT, time.localtime(time.time() if now is None else now))
    since, updated = status.get("training_since"), status.get("updated_at")
    if "training_seconds" in status:
        open_part = 0.0 if since is None else seconds_between(since, now_text if running else updated or since)
        return status["training_seconds"] + open_part
    started = status.get("started_at")
    if started is None:
        return None
    return seconds_between(started, now_text if running else updated or started)
