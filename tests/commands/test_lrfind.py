"""`llmcustoms lr-find`: the learning-rate range test, and `tune --lr-find` centring on it."""

from __future__ import annotations

import json
import math

import numpy as np
import optuna
import pytest
from typer.testing import CliRunner

from conftest import DATA_FILES
from llmcustoms.commands import lr_find as lrfind
from llmcustoms.cli import app
from llmcustoms.commands.lr_find import lr_sequence, sample_rows, smooth, stop_reason, suggest
from llmcustoms.commands.tune import LR_FIND_SPAN as LR_SPAN  # the span around a suggestion

runner = CliRunner()


# ------------------------------------------------------------- pure pieces


def synthetic_curve(lrs: list[float], noise: float = 0.0, seed: int = 0) -> list[float]:
    """A range test's typical shape: flat at low lrs, a fall around 1e-3, a
    minimum near 3e-2, then a blow-up."""
    rng = np.random.default_rng(seed)
    losses = []
    for lr in lrs:
        x = math.log10(lr)
        fall = 2.0 / (1 + math.exp(-3 * (x + 3)))  # half-way down at 1e-3
        blow_up = math.exp(8 * max(0.0, x + 1.5)) - 1  # from 3e-2 on
        losses.append(5.0 - fall + blow_up + noise * rng.standard_normal())
    return losses


def test_the_lrs_rise_exponentially_from_start_to_end():
    lrs = lr_sequence(1e-7, 1.0, 100)
    assert len(lrs) == 100 and lrs[0] == pytest.approx(1e-7) and lrs[-1] == pytest.approx(1.0)
    ratios = [b / a for a, b in zip(lrs, lrs[1:])]
    assert all(r == pytest.approx(ratios[0]) for r in ratios) and ratios[0] > 1


def test_smoothing_is_bias_corrected():
    assert smooth([4.0, 4.0, 4.0]) == pytest.approx([4.0, 4.0, 4.0])  # no pull towards 0 at the start
    smoothed = smooth([4.0, 0.0])
    assert smoothed[0] == 4.0 and 0.0 < smoothed[1] < 4.0


def test_the_suggestion_lies_in_the_steep_part_below_the_minimum():
    lrs = lr_sequence(1e-7, 1.0, 100)
    losses = synthetic_curve(lrs, noise=0.05)
    smoothed = smooth(losses)
    stop = next(i for i in range(len(smoothed)) if stop_reason(smoothed[:i + 1]))
    s = suggest(lrs[:stop + 1], smoothed[:stop + 1])
    assert s.lr is not None and s.rule == lrfind.RULE
    assert 1e-4 <= s.lr <= 1e-2  # where the curve falls
    assert s.lr < s.min_loss_lr and s.min_loss_lr_over_10 == pytest.approx(s.min_loss_lr / 10)
    # The EMA lags: the minimum of the smoothed curve sits at or after the raw one.
    assert s.min_loss_lr >= lrs[int(np.argmin(losses[:stop + 1]))]


def test_a_flat_curve_gives_no_suggestion():
    lrs = lr_sequence(1e-7, 1.0, 100)
    flat = [5.0 + 0.2 * x for x in np.random.default_rng(1).standard_normal(100)]
    s = suggest(lrs, smooth(flat))
    assert s.lr is None and "did not fall" in s.reason
    assert suggest(lrs[:3], smooth(flat[:3])).lr is None  # too few points to be a curve


def test_divergence_and_a_non_finite_loss_stop_the_range_test():
    lrs = lr_sequence(1e-7, 1.0, 100)
    losses = synthetic_curve(lrs)
    smoothed = []
    for i in range(len(losses)):
        smoothed = smooth(losses[:i + 1])
        if stop_reason(smoothed):
            break
    assert len(smoothed) < 100 and "4x its minimum" in stop_reason(smoothed)
    assert smoothed[-1] > 4 * min(smoothed)
    assert stop_reason(smooth([5.0, 4.0, float("nan")])) == "the loss is not finite"
    assert stop_reason(smooth([5.0, 4.0, 4.5])) is None


def test_the_table_shows_the_suggested_and_minimum_rows():
    lrs = lr_sequence(1e-7, 1.0, 60)
    smoothed = smooth(synthetic_curve(lrs)[:50])
    curve = [{"step": i + 1, "lr": lr, "loss": v, "smoothed": v} for i, (lr, v) in enumerate(zip(lrs, smoothed))]
    s = suggest(lrs[:50], smoothed)
    rows = sample_rows(curve, s)
    assert 8 <= len(rows) <= 10 and rows[0]["step"] == 1 and rows[-1]["step"] == 50
    assert [r["lr"] for r in rows if r["note"] == "suggested"] == [s.lr]
    assert [r["lr"] for r in rows if r["note"] == "smoothed minimum"] == [s.min_loss_lr]


# The 10-step range test: one high batch at step 2, then a dip to step 4.
FEW_STEPS = [2.0, 3.2, 2.0, 2.0, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0]


def test_a_curve_of_few_steps_gets_no_suggestion_and_says_what_to_do():
    """It was read as a curve: 6.0e-07 suggested, 800 times below the preset's lr."""
    lrs = lr_sequence(1e-7, 1.0, 10)
    s = suggest(lrs, smooth(FEW_STEPS))
    assert s.lr is None and s.steepest_lr is None and "only 10 steps" in s.reason and "too few" in s.reason
    error = lrfind.no_suggestion_error(s, 10)
    assert "--steps 100" in error.hint and f"at least {lrfind.MIN_POINTS}" in error.hint
    # A default range test is never too short to read, even for a training run of 5 steps.
    assert lrfind.RangeTest().steps_for(5) == lrfind.MIN_POINTS and lrfind.RangeTest(steps=10).steps_for(5) == 10


def test_the_minimum_marked_is_the_lowest_smoothed_loss_even_at_step_1():
    """It once left out the first tenth of the points: step 4 was marked the minimum where step 1 was lower."""
    lrs = lr_sequence(1e-7, 1.0, 10)
    smoothed = smooth(FEW_STEPS)
    s = suggest(lrs, smoothed)
    assert s.min_loss_lr == lrs[0] and smoothed[0] == min(smoothed)
    curve = [{"step": i + 1, "lr": lr, "loss": x, "smoothed": v} for i, (lr, x, v) in enumerate(zip(lrs, FEW_STEPS, smoothed))]
    assert [r["step"] for r in sample_rows(curve, s) if r["note"]] == [1]
    # A long curve that is lowest at its start has not fallen: no suggestion, the minimum at step 1.
    rising = [3.0 + 0.02 * i for i in range(40)]
    long = suggest(lr_sequence(1e-7, 1.0, 40), smooth(rising))
    assert long.lr is None and long.min_loss_lr == 1e-7 and "did not fall" in long.reason


# ------------------------------------------------------------- end to end


def lr_find(tmp_path, model, *extra: str):
    args = ["lr-find", str(DATA_FILES["alpaca"]), "--model", str(model), "--output-dir", str(tmp_path), *extra]
    return runner.invoke(app, args, catch_exceptions=False)


def saved(tmp_path, model) -> tuple[dict, object]:
    path = tmp_path / f"lr-find-alpaca-{model.name}.json"
    return json.loads(path.read_text()), path


@pytest.fixture(scope="module")
def found(tmp_path_factory, tiny_models):
    """`lr-find` run once on the tiny Llama: (output directory, the CLI's result)."""
    output_dir = tmp_path_factory.mktemp("lr-find")
    return output_dir, lr_find(output_dir, tiny_models["llama"], "--steps", "30")


def test_lr_find_saves_a_curve_and_a_suggestion(found, tiny_models):
    output_dir, result = found
    model = tiny_models["llama"]
    assert result.exit_code == 0, result.output
    data, _ = saved(output_dir, model)
    lrs = [row["lr"] for row in data["curve"]]
    assert len(lrs) >= 10 and all(b > a for a, b in zip(lrs, lrs[1:])) and lrs[0] == pytest.approx(1e-7)
    suggestion = data["suggestion"]["lr"]
    assert suggestion is not None and math.isfinite(suggestion) and 1e-7 < suggestion < data["suggestion"]["min_loss_lr"]
    assert data["model"] == str(model) and len(data["data_sha256"]) == 64 and data["method"] == "lora"
    output = " ".join(result.output.split())
    assert f"Suggested learning rate: {suggestion:.1e}" in output and "minimum" in output
    assert f"--lr {suggestion:.1e}" in output and "llmcustoms tune" in output and "--lr-find" in output


def test_tune_centres_its_lr_range_on_the_saved_suggestion(found, tiny_models, tmp_path):
    model = tiny_models["llama"]
    data, _ = saved(found[0], model)
    # An edited suggestion proves tune reads the saved result rather than running a range test.
    data["suggestion"]["lr"] = 2e-3
    (tmp_path / f"lr-find-alpaca-{model.name}.json").write_text(json.dumps(data))
    tuned = runner.invoke(app, ["tune", str(DATA_FILES["alpaca"]), "--model", str(model), "--lr-find", "--trials",
                                "2", "--max-steps", "2", "--eval-split", "0.2", "--output-dir", str(tmp_path),
                                "--study-name", "s"], catch_exceptions=False)
    assert tuned.exit_code == 0, tuned.output
    text = " ".join(tuned.output.split())
    assert "centring the search on 2.0e-03, from the saved range test" in text
    assert "lr centred on" in text and f"{2e-3 / LR_SPAN:.1e} .. {2e-3 * LR_SPAN:.1e}" in text
    trials = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'tune-s' / 'study.db'}").trials
    assert len(trials) == 2
    for trial in trials:
        assert trial.distributions["lr"].low == pytest.approx(2e-3 / LR_SPAN)
        assert trial.distributions["lr"].high == pytest.approx(2e-3 * LR_SPAN)
        assert 2e-3 / LR_SPAN <= trial.params["lr"] <= 2e-3 * LR_SPAN


def test_a_loss_that_never_falls_gives_no_suggestion_and_exit_2(tmp_path, tiny_models):
    model = tiny_models["llama"]
    result = lr_find(tmp_path, model, "--steps", "20", "--start-lr", "1e-9", "--end-lr", "1e-8")
    assert result.exit_code == 2
    output = " ".join(result.output.split())
    assert "No learning rate to suggest" in output and "--steps" in output and "Traceback" not in output
    assert "Suggested learning rate" not in output
    data, _ = saved(tmp_path, model)
    assert data["suggestion"]["lr"] is None and len(data["curve"]) == 20 and "did not fall" in data["suggestion"]["reason"]
    # tune --lr-find refuses to centre on nothing, and says what to do.
    tuned = runner.invoke(app, ["tune", str(DATA_FILES["alpaca"]), "--model", str(model), "--lr-find",
                                "--trials", "1", "--max-steps", "2", "--output-dir", str(tmp_path)])
    assert tuned.exit_code == 2 and "No learning rate to suggest" in " ".join(tuned.output.split())


def test_divergence_stops_the_range_test(tmp_path, tiny_models, monkeypatch):
    from llmcustoms.losses import sft
    from llmcustoms.planning.hardware import Hardware
    from llmcustoms.planning.train_options import TrainOptions
    from llmcustoms.preparation.preparing import prepare_run

    real, calls = sft.token_cross_entropy, []

    def blowing_up(model, batch, normaliser):  # after 8 forward passes, 50 times the loss
        calls.append(1)
        loss, sums = real(model, batch, normaliser)
        return loss * (50.0 if len(calls) > 8 else 1.0), sums

    monkeypatch.setattr(sft, "token_cross_entropy", blowing_up)
    prepared = prepare_run(TrainOptions(data=str(DATA_FILES["alpaca"]), model=str(tiny_models["llama"])),
                           Hardware.cpu_only())
    result = lrfind.run_range_test(prepared, lrfind.RangeTest(steps=30))
    assert len(result.curve) < 30 and "passed 4x its minimum" in result.stopped


def test_bad_lr_range_is_a_clear_error(tmp_path, tiny_models):
    result = lr_find(tmp_path, tiny_models["llama"], "--start-lr", "1e-2", "--end-lr", "1e-3")
    assert result.exit_code == 2 and "--start-lr" in result.output and "Traceback" not in result.output
