"""train.log: what the display showed, as timestamped plain text. The reporter
that writes it is tested directly; one short run with an out-of-memory
recovery (`oom@2`) is run end to end through the CLI."""

from __future__ import annotations

import json
import re

import pytest

from conftest import DATA_FILES
from llmcustoms.reporting import SilentReporter
from llmcustoms.runs.run_log import LoggingReporter, RunLog

HF_TOKEN = "hf_" + "Zq3xK9LmP2vR7tY1wE5uI8oA4sD6fG0hJk"
# A record's first line: time with its offset, level, text.
RECORD = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4} (info|warning|error) +\S")


def records(text: str) -> list[str]:
    """The log's records, each line checked: a timestamped first line or an indented continuation."""
    lines = text.splitlines()
    assert lines and all(RECORD.match(line) or line.startswith("    ") for line in lines), text
    return [line for line in lines if RECORD.match(line)]


def test_the_reporter_logs_what_the_display_showed_and_passes_everything_on(tmp_path):
    inner = SilentReporter()
    reporter = LoggingReporter(inner, tmp_path / "train.log")
    reporter.activity("loading the model")
    reporter.training_started(12, 0, {"total_bytes": 3 * 2 ** 30, "budget_bytes": 20 * 2 ** 30})
    reporter.step({"step": 1, "epoch": 0.25, "loss": 2.34567, "grad_norm": 1.5, "lr": 1e-3, "tokens_per_s": 12345.6,
                   "seconds": 0.5, "memory_bytes": 3 * 2 ** 29, "gpu_util": 87.0})
    for done in range(4):
        reporter.activity(f"evaluating {done}/3")
    reporter.evaluated({"step": 1, "eval_loss": 2.0, "eval_ppl": 7.389})
    reporter.activity("saving checkpoint 1")
    reporter.activity(None)
    reporter.message(f"step 2: out of memory; halved micro-batch\nnote: token {HF_TOKEN}", warning=True)
    reporter.message("stopped early: no improvement")
    reporter.training_finished()
    lines = records((tmp_path / "train.log").read_text())
    texts = [re.sub(r"^\S+ (\w+) +", r"\1 ", line) for line in lines]
    assert texts == [
        "info loading the model",
        "info training started at step 0 of 12; planned memory 3.00 GiB of a 20.0 GiB budget",
        "info step 1/12  epoch 0.25  loss 2.3457  grad_norm 1.5  lr 1.00e-03  tokens/s 12,346  gpu_util 87%  "
        "memory 1.50 GiB",
        "info evaluation at step 1: eval_loss 2.0000  eval_ppl 7.389",
        "info saving checkpoint 1",
        "warning step 2: out of memory; halved micro-batch",
        "info stopped early: no improvement",
        "info training loop ended",
    ]
    log = (tmp_path / "train.log").read_text()
    assert "    note: token [redacted]" in log and HF_TOKEN not in log
    # The display lost nothing to the log.
    assert len(inner.steps) == 1 and len(inner.evals) == 1 and inner.activities[-1] is None
    assert inner.messages[0].endswith(HF_TOKEN)


def test_without_a_path_nothing_is_written(tmp_path):
    reporter = LoggingReporter(SilentReporter(), None)
    reporter.message("hello")
    reporter.step({"step": 1, "loss": 1.0})
    assert list(tmp_path.iterdir()) == []


def test_a_log_that_cannot_be_written_is_said_once_and_the_run_goes_on(tmp_path):
    warnings = []
    log = RunLog(tmp_path / "missing" / "train.log", warnings.append)
    for _ in range(3):
        log.write("info", "a line")
    assert len(warnings) == 1 and "could not be written" in warnings[0]
    inner = SilentReporter()
    reporter = LoggingReporter(inner, tmp_path / "missing" / "train.log")
    reporter.message("first")
    reporter.message("second")
    assert inner.messages == ["first", inner.messages[1], "second"] and "could not be written" in inner.messages[1]


@pytest.mark.slow
def test_a_run_logs_its_plan_steps_evaluations_recovery_and_summary(tmp_path, tiny_models, cli):
    run = tmp_path / "run"
    result = cli("train", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["llama"]), "--max-steps", "4",
                 "--batch-size", "4", "--grad-accum", "1", "--output-dir", str(tmp_path), "--run-name", "run",
                 "--yes", "--quiet", env={"LLMCUSTOMS_FAULT_INJECT": "oom@2"})
    assert result.returncode == 0, result.stderr
    lines = records((run / "train.log").read_text())
    assert "info     starting: " in lines[0] and "micro-batch 4 x accumulation 1" in lines[0]
    assert any("training started at step 0 of 4" in line for line in lines)
    logged_steps = {int(m[1]) for line in lines if (m := re.search(r"info     step (\d+)/4  epoch", line))}
    assert logged_steps == {1, 2, 3, 4}
    evaluated = [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines() if "eval_loss" in r]
    assert evaluated and all(any(f"evaluation at step {s}: eval_loss" in line for line in lines) for s in evaluated)
    assert any(re.search(r"warning  step 2: out of memory; halved micro-batch", line) for line in lines)
    text = (run / "train.log").read_text()
    assert re.search(r"info     completed: 4 steps, training time [\d.]+ s \(resumes included\)", text)
    assert "final train loss" in text and f"weights saved to {run / 'adapter'}" in text
    assert text.rstrip().splitlines()[-1].strip().startswith("weights saved to")
    assert not (run / "failure.json").exists()
