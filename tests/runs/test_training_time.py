"""A run's training time, as `runs` shows it: the segments it trained in
(`train`, each `resume`) summed, up to now for a run training now; not the
time from its first start to its last status update."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Callable

from typer.testing import CliRunner

from llmcustoms.cli import app
from llmcustoms.runs.run_directory import list_runs
from llmcustoms.runs.run_records import TIME_FORMAT
from llmcustoms.runs.training_time import count_segment
from test_runlock import hold_in_another_process
from tiny_models import WIDE


def clock() -> Callable[[float], str]:
    """at(seconds): status.json's time that many seconds before now, now fixed when asked for."""
    now = time.time()
    return lambda seconds_ago: time.strftime(TIME_FORMAT, time.localtime(now - seconds_ago))


def run_directory(root: Path, name: str, status: dict) -> Path:
    """A run as `train` leaves it, written by hand: plan.json and status.json."""
    run = root / name
    run.mkdir(parents=True)
    (run / "plan.json").write_text(json.dumps({"model": "/models/tiny", "method": "lora", "total_steps": 100}))
    (run / "status.json").write_text(json.dumps({"step": 40, "pid": 1, "recoveries": [], **status}))
    return run


def test_a_resumed_run_counts_every_segment_and_not_the_time_between(tmp_path):
    at = clock()
    # Trained 38 min, interrupted for a day, resumed for 39 min: 77 min of training.
    run_directory(tmp_path, "resumed", {"status": "completed", "started_at": at(86400 + 4620),
                                        "updated_at": at(0), "training_seconds": 4620.0, "training_since": None})
    [run] = list_runs(tmp_path)
    assert run.seconds == 4620
    shown = CliRunner().invoke(app, ["runs", "--output-dir", str(tmp_path)], env={"COLUMNS": WIDE}, terminal_width=int(WIDE))
    assert shown.exit_code == 0, shown.output
    assert "1h 17m 00s" in shown.output


def test_a_run_training_now_counts_to_now_and_a_killed_one_to_its_last_update(tmp_path):
    at = clock()
    # The case: status.json last written 9 s after the start, 8 minutes ago.
    since = {"status": "running", "started_at": at(480), "updated_at": at(471), "training_since": at(480),
             "training_seconds": 0.0}
    live = run_directory(tmp_path, "live", since)
    run_directory(tmp_path, "killed", {**since, "training_seconds": 60.0})
    holder = hold_in_another_process(live)
    try:
        runs = {run.name: run for run in list_runs(tmp_path)}
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert runs["live"].status == "running" and 480 <= runs["live"].seconds < 480 + 60
    assert runs["killed"].status == "stopped" and runs["killed"].seconds == 60 + 9


def test_a_status_without_segments_counts_from_its_start(tmp_path):
    at = clock()
    run_directory(tmp_path, "old", {"status": "interrupted", "started_at": at(300), "updated_at": at(100)})
    run_directory(tmp_path, "never", {"status": "failed"})
    runs = {run.name: run for run in list_runs(tmp_path)}
    assert runs["old"].seconds == 200 and runs["never"].seconds is None


def test_segments_begin_when_training_does_and_end_with_the_run_or_its_process():
    at = clock()
    status: dict = {}
    count_segment(status, "running", at(1000), begins=False)  # `train` prepared the run: the model loads
    assert status.get("training_since") is None
    count_segment(status, "running", at(990))  # the loop starts
    status.update(status="running", pid=os.getpid(), updated_at=at(990))
    count_segment(status, "running", at(900))  # a periodic update: the same segment
    status.update(updated_at=at(900))
    count_segment(status, "interrupted", at(890))
    assert (status["training_seconds"], status["training_since"]) == (100, None)
    # Resumed, then killed: the next process closes that segment at its last update.
    count_segment(status, "running", at(500))
    status.update(status="running", pid=os.getpid() + 1, updated_at=at(450))
    count_segment(status, "running", at(100))
    assert (status["training_seconds"], status["training_since"]) == (150, at(100))
    status.update(pid=os.getpid())
    count_segment(status, "completed", at(40))
    assert (status["training_seconds"], status["training_since"]) == (210, None)


def test_a_run_begun_before_segments_were_kept_goes_on_from_its_span():
    at = clock()
    status = {"status": "interrupted", "pid": 1, "started_at": at(300), "updated_at": at(100)}
    count_segment(status, "running", at(50))
    assert (status["training_seconds"], status["training_since"]) == (200, at(50))
