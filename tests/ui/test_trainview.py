"""The live training display: an ETA from the first step on, however long a
step takes, and every wait named with its time."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest
from rich.console import Console

from conftest import DATA_FILES
from llmcustoms.ui.train_progress import TrainingProgress
from llmcustoms.ui.train_view import RichReporter


def shown(reporter: RichReporter) -> list[str]:
    out = Console(file=io.StringIO(), width=80, color_system=None)
    out.print(reporter.render())
    return out.file.getvalue().splitlines()


def row(step: int, seconds: float, loss: float = 2.0) -> dict:
    return {"step": step, "epoch": step / 10, "loss": loss, "lr": 1e-4, "grad_norm": 1.0, "tokens_per_s": 50.0,
            "seconds": seconds}


def test_the_eta_comes_from_the_first_measured_step_even_when_steps_are_slow():
    progress = TrainingProgress(total_steps=100, start_step=0, now=0.0)
    assert progress.eta() is None and progress.activity == "first step"
    progress.step(row(1, 45.0), now=60.0)  # a 45 s step (after 15 s of evaluating the base model)
    assert progress.eta() == pytest.approx(45.0 * 99)  # Rich's own ETA column would stay blank
    assert progress.eta(now=70.0) == pytest.approx(35.0 + 45.0 * 98)  # 10 s into step 2
    progress.step(row(2, 40.0), now=150.0)  # 40 s of training and a 50 s evaluation: the wall time counts
    assert 45.0 * 98 < progress.eta() < 90.0 * 98  # smoothed
    progress.done = 100
    assert progress.eta() == 0.0


def test_the_display_fits_80_columns_and_shows_everything_from_step_1(monkeypatch):
    reporter = RichReporter(Console(file=io.StringIO(), width=80))
    reporter.training_started(360, 0)
    try:
        before = " ".join(shown(reporter))
        assert "0/360" in before and "eta after step 1" in before and "first step" in before
        reporter.step(row(1, 41.0))
        reporter.evaluated({"step": 1, "eval_loss": 1.8765, "eval_ppl": 6.5})
        reporter.activity("evaluating 2/7")
        reporter.progress.activity_since -= 4  # the evaluation began 4 s ago
        reporter.activity("evaluating 3/7")
        lines = shown(reporter)
        text = " ".join(lines)
        assert len(lines) == 3 and all(len(line) <= 80 for line in lines)
        assert "1/360" in text and "loss 2.0000" in text and "eval 1.8765 @1" in text and "epoch 0.10" in text
        assert re.search(r"eta 4:05:\d\d", text)  # 359 steps of 41 s: 4:05:19
        assert re.search(r"elapsed \d:\d\d:\d\d", text) and "evaluating 3/7 0:00:04" in text
    finally:
        reporter.training_finished()


@pytest.mark.slow
def test_a_captured_terminal_shows_the_eta_while_the_second_step_runs(tmp_path, tiny_models):
    """As tmux would see it: the live display's frames, with step 2 slowed to
    8 s (`slow@2`); frames during step 2 show an ETA measured from step 1."""
    env = {**os.environ, "COLUMNS": "80", "FORCE_COLOR": "1", "LLMCUSTOMS_FAULT_INJECT": "slow@2"}
    result = subprocess.run([sys.executable, "-m", "llmcustoms", "train", str(DATA_FILES["alpaca"]), "--model",
                             str(tiny_models["llama"]), "--max-steps", "3", "--batch-size", "4", "--grad-accum", "2",
                             "--output-dir", str(tmp_path), "--yes"], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    frames = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "\n", result.stdout)
    during_step_2 = [line for line in frames.splitlines() if "step 2 0:00:0" in line]
    assert during_step_2, frames[-3000:]
    assert all(re.search(r"eta 0:00:\d\d", line) for line in during_step_2)
    assert "loading the model" in frames


def test_a_dpo_run_shows_its_reward_accuracy_beside_the_losses():
    from llmcustoms.ui.train_progress import TrainingProgress

    progress = TrainingProgress(total_steps=30, start_step=0, now=0.0)
    progress.evaluated({"step": 0, "eval_loss": 0.6931, "eval_reward_accuracy": 0.5}, now=1.0)
    progress.step({"step": 1, "loss": 0.6931, "lr": 5e-5, "tokens_per_s": 100.0, "seconds": 50.0,
                   "reward_accuracy": 0.625}, now=51.0)
    first, _ = progress.lines(now=52.0)
    assert first == "1/30  loss 0.6931 acc 0.62  eval 0.6931 acc 0.50 @0"
    assert len(first) + 21 <= 80  # after the bar, within 80 columns


def test_written_to_a_file_the_last_line_of_the_display_ends_before_what_follows():
    """Rich ends a live display's last line only on a terminal: in a file the summary's
    title ran on after "grad norm"."""
    out = io.StringIO()
    console = Console(file=out, width=80)
    reporter = RichReporter(console)
    reporter.training_started(2, 0)
    reporter.step(row(1, 1.0))
    reporter.training_finished()
    console.print("Training finished")
    assert out.getvalue().splitlines()[-1] == "Training finished"
