"""Stability while a run trains: a finite loss spike is caught before its update,
rolled back and retried at a lower learning rate, like NaN; a normal run is
never taken for a diverging one (real runs' losses and gradient norms on the
shared datasets, kept in tests/fixtures/traces/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import DATA_FILES
from llmcustoms.recovery.stability import LOSS_FACTOR, MIN_HISTORY, NORM_FACTOR, StabilityCheck
from llmcustoms.ui.train_progress import TrainingProgress

TRACES = Path(__file__).parent.parent / "fixtures" / "traces"


def steady(check: StabilityCheck, steps: int = MIN_HISTORY, loss: float = 2.0, norm: float = 1.0) -> None:
    for step in range(1, steps + 1):
        assert check.judge(step, loss, norm) is None  # and joins the history


def test_nothing_is_judged_a_spike_before_the_run_has_a_history():
    check = StabilityCheck()
    steady(check, MIN_HISTORY - 1)
    assert check.judge(MIN_HISTORY, 100.0, 100.0) is None  # early steps move fast by design
    assert check.judge(MIN_HISTORY, float("nan"), 1.0) == "nan"  # NaN is NaN from the first step


def test_a_loss_or_gradient_norm_far_above_the_recent_ones_is_divergence():
    check = StabilityCheck()
    steady(check)
    assert check.judge(9, 2.0 * LOSS_FACTOR * 0.9, 1.0) is None  # high, but within the range
    assert check.judge(9, 2.0 * LOSS_FACTOR * 1.1, 1.0) == "divergence"
    assert "loss 6.6" in check.last_spike and "median of 2" in check.last_spike
    check = StabilityCheck()
    steady(check)
    assert check.judge(9, 2.0, NORM_FACTOR * 0.9) is None
    assert check.judge(9, 2.0, NORM_FACTOR * 1.1) == "divergence"
    assert check.judge(9, 2.0, float("inf")) == "nan"


def test_a_small_loss_that_triples_by_a_few_hundredths_is_not_a_spike():
    """Late in a DPO run the loss is a few hundredths: tripling it is noise, not divergence."""
    check = StabilityCheck()
    steady(check, loss=0.05)
    assert check.judge(9, 0.4, 1.0) is None
    assert check.judge(9, 1.2, 1.0) == "divergence"  # more than LOSS_MARGIN above


def test_the_same_step_spiking_again_after_its_rollback_is_taken_as_the_data():
    check = StabilityCheck()
    steady(check, 12)
    assert check.judge(13, 50.0, 1.0) == "divergence"
    check.went_back_to(9)  # rolled back to the checkpoint of step 9
    assert [entry[0] for entry in check.history] == list(range(1, 10))
    for step in (10, 11, 12):
        assert check.judge(step, 2.0, 1.0) is None
    assert check.judge(13, 50.0, 1.0) is None  # its rows give that loss whatever the weights


def test_a_resumed_run_judges_against_the_steps_before_it():
    check = StabilityCheck()
    check.seed([{"step": s, "loss": 2.0, "grad_norm": 1.0} for s in range(1, 11)] + [{"step": 10, "eval_loss": 9.0}])
    assert check.judge(11, 20.0, 1.0) == "divergence"


@pytest.mark.parametrize("trace", sorted(TRACES.glob("*.jsonl")), ids=lambda p: p.stem)
def test_real_runs_on_the_shared_datasets_raise_no_false_spike(trace):
    """Per-step losses and gradient norms of SmolLM2-135M-Instruct trained on the
    shared datasets (see tests/fixtures/traces/README.md): none is a spike."""
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(rows) >= 40
    check = StabilityCheck()
    for row in rows:
        assert check.judge(row["step"], row["loss"], row["grad_norm"]) is None, (row, check.last_spike)


def test_the_display_says_when_eval_loss_has_stopped_improving():
    progress = TrainingProgress(total_steps=100, start_step=0, now=0.0)
    for step, loss in ((0, 3.0), (10, 2.0), (20, 2.1)):
        progress.evaluated({"step": step, "eval_loss": loss}, now=float(step))
    assert progress.plateau_line() is None  # one evaluation without a better loss is not a plateau
    progress.evaluated({"step": 30, "eval_loss": 2.05}, now=30.0)
    assert progress.plateau_line() == "plateau: eval loss has not improved for 2 evaluations (best 2.0000 @10)"
    progress.evaluated({"step": 40, "eval_loss": 1.9}, now=40.0)
    assert progress.plateau_line() is None


@pytest.mark.slow
def test_an_injected_spike_is_rolled_back_and_retried_at_a_lower_learning_rate(tmp_path, tiny_models, cli):
    args = ["train", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["llama"]), "--max-steps", "14",
            "--save-every", "3", "--batch-size", "4", "--grad-accum", "2", "--lr", "2e-3",
            "--output-dir", str(tmp_path), "--yes", "--quiet"]
    plain = cli(*args, "--run-name", "plain")
    assert plain.returncode == 0, plain.stderr
    assert json.loads((tmp_path / "plain" / "status.json").read_text())["recoveries"] == []  # no false spike
    result = cli(*args, "--run-name", "spiked", env={"LLMCUSTOMS_FAULT_INJECT": "spike@11"})
    assert result.returncode == 0, result.stderr
    run = tmp_path / "spiked"
    status = json.loads((run / "status.json").read_text())
    [recovery] = status["recoveries"]
    assert recovery["kind"] == "divergence" and recovery["step"] == 11 and recovery["details"]["lr"] == [2e-3, 1e-3]
    assert "loss spike" in result.stderr and "continuing from step 9" in result.stderr
    assert status["status"] == "completed" and status["step"] == 14
    plan = json.loads((run / "plan.json").read_text())
    assert plan["lr"] == 1e-3 and any("loss spike at step 11" in r for r in plan["reasons"])
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 15))  # one row a step: the rolled-back ones were replaced
    assert max(r["loss"] for r in steps) < 50  # the spiked loss itself was never taken
    plain_steps = [r for r in map(json.loads, (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines())
                   if "loss" in r]
    assert [r["loss"] for r in steps[:9]] == [r["loss"] for r in plain_steps[:9]]  # the same run up to the rollback
