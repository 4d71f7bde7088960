"""One number per fact, named the same wherever a run's numbers are shown: the
plan's memory (the plan table, the live display, train.log, the summary,
`report`), the training time (the summary, `runs`; a resume's included) and
the tokens/s (the summary, `report`: input tokens over the time in training
steps). A user saw "plan 1.77 GiB" live and "plan 1.61 GiB" in the summary,
39 min in the summary and 1 h 17 min in `runs`, 3 tokens/s and 6."""

from __future__ import annotations

import json
import re

from typer.testing import CliRunner

from conftest import DATA_FILES
from llmcustoms.cli import app
from llmcustoms.ui.train_progress import TrainingProgress

runner = CliRunner()
GIB = 1024 ** 3


def invoke(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def flat(text: str) -> str:
    """Table text on one line, without its rules."""
    return " ".join(text.replace("│", " ").replace("┃", " ").split())


def train_args(model, output, *extra: str) -> list[str]:
    return ["train", str(DATA_FILES["alpaca"]), "--model", str(model), "--batch-size", "4", "--grad-accum", "1",
            "--yes", "--output-dir", str(output), "--run-name", "run", *extra]


def test_the_plan_live_display_log_summary_and_report_give_one_memory_plan_and_one_speed(tmp_path, tiny_models):
    result = invoke(*train_args(tiny_models["llama"], tmp_path, "--max-steps", "4"))
    assert result.exit_code == 0, result.output
    run = tmp_path / "run"
    memory = json.loads((run / "plan.json").read_text())["memory"]
    planned = f"{memory['total_bytes'] / GIB:.2f} GiB"
    shown_plan, summary = result.output.split("Training finished")
    assert re.search(rf"total\s*│\s*{planned}", shown_plan)  # the plan table's total
    assert f"(plan {planned[:-4]}, budget" in TrainingProgress(4, 0, 0.0, memory).resources_line()  # live
    assert f"planned memory {planned}" in (run / "train.log").read_text()
    summary = flat(summary)
    report = flat(invoke("report", str(run), "--details").output)
    assert f"memory peak " in summary and f"; plan {planned}" in summary
    assert f"; plan {planned}" in report and "predicted" not in report
    # The tokens/s: every step's input tokens over the time in steps (evaluations and saves not in it).
    steps = [row for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in row]
    speed = sum(r["tokens_per_s"] * r["seconds"] for r in steps) / sum(r["seconds"] for r in steps)
    assert f"tokens/s {speed:,.0f} (input tokens over the time in training steps)" in summary
    assert f"throughput {speed:,.0f} tokens/s input tokens over the time in training steps, 4 steps" in report


def test_after_a_stop_and_a_resume_the_summary_times_the_whole_run_as_runs_does(tmp_path, tiny_models,
                                                                                 monkeypatch):
    monkeypatch.setenv("LLMCUSTOMS_FAULT_INJECT", "sigint@3")
    stopped = invoke(*train_args(tiny_models["llama"], tmp_path, "--max-steps", "6", "--save-every", "2", "--quiet"))
    assert stopped.exit_code == 130, stopped.output
    monkeypatch.delenv("LLMCUSTOMS_FAULT_INJECT")
    status_path = tmp_path / "run" / "status.json"
    status = json.loads(status_path.read_text())
    # As if the first segment had trained for an hour (a tiny model's take a second or two):
    # status.json keeps each segment's time, and the summary is to count them all.
    status["training_seconds"] += 3600
    status_path.write_text(json.dumps(status))
    resumed = invoke("resume", str(tmp_path / "run"))
    assert resumed.exit_code == 0, resumed.output
    summary = flat(resumed.output.split("Training finished")[1])
    time = re.search(r" time ((\d+)h (\d\d)m (\d\d)s) ", summary)
    assert time, summary
    shown = int(time[2]) * 3600 + int(time[3]) * 60 + int(time[4])
    whole = json.loads(status_path.read_text())["training_seconds"]  # both segments, however slow the machine
    assert whole >= status["training_seconds"] >= 3600 and abs(shown - whole) <= 1, summary
    listed = flat(runner.invoke(app, ["runs", "--output-dir", str(tmp_path)]).output)
    assert f"completed 6/6 {time[1]}" in listed or f" {time[1]} " in listed, listed
