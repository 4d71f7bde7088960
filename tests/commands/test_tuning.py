"""`llmcustoms tune`: a resumable Optuna study over the same FineTuner as `train`."""

from __future__ import annotations

import csv
import json

import optuna
import pytest
import yaml
from typer.testing import CliRunner

from conftest import DATA_FILES
from llmcustoms.cli import app
from llmcustoms.planning.hardware import Hardware
from llmcustoms.planning.train_options import TrainOptions
from llmcustoms.preparation.preparing import prepare_run
from llmcustoms.planning.presets import load_preset
from llmcustoms.commands.tune import TuneSettings, run_study, search_space

runner = CliRunner()


def tune(tmp_path, model, *extra: str, env: dict | None = None):
    """A study of 6-step trials, without the full-length check (test_tune_search.py tests it)."""
    args = ["tune", str(DATA_FILES["alpaca"]), "--model", str(model), "--max-steps", "6", "--eval-split", "0.2",
            "--output-dir", str(tmp_path), "--study-name", "s", "--no-confirm", *extra]
    return runner.invoke(app, args, env=env, catch_exceptions=False)


def load(tmp_path) -> optuna.Study:
    return optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'tune-s' / 'study.db'}")


def test_a_study_continues_where_it_stopped_and_its_best_preset_trains(tmp_path, tiny_models):
    first = tune(tmp_path, tiny_models["llama"], "--trials", "3")
    assert first.exit_code == 0, first.output
    # The search space and the budget are shown before any trial runs.
    output = first.output
    assert output.index("Search space") < output.index("Trials") and "budget per trial" in output
    first_trials = load(tmp_path).trials
    assert len(first_trials) == 3 and first_trials[0].user_attrs["preset"]  # the preset's own point first
    second = tune(tmp_path, tiny_models["llama"], "--trials", "2")
    assert second.exit_code == 0, second.output
    study = load(tmp_path)
    assert [t.number for t in study.trials] == [0, 1, 2, 3, 4]
    assert all(t.params not in [f.params for f in first_trials] for t in study.trials[3:])  # new points
    assert "5 trials in all" in " ".join(second.output.split())

    rows = list(csv.DictReader(open(tmp_path / "tune-s" / "trials.csv")))
    assert [int(r["trial"]) for r in rows] == [0, 1, 2, 3, 4]
    preset_path = tmp_path / "tune-s" / "best_preset.yaml"
    preset = yaml.safe_load(preset_path.read_text())
    # --no-confirm: the pick is written (the lowest held-out loss among the trials forgetting no more than the preset's).
    best = study.trials[json.loads((tmp_path / "tune-s" / "pareto.json").read_text())["pick"]["trial"]]
    assert preset["lr"] == pytest.approx(best.params["lr"]) and preset["lora_r"] == best.params["lora_r"]
    assert f"llmcustoms train {DATA_FILES['alpaca']} --preset {preset_path} --model" in second.output

    trained = runner.invoke(app, ["train", str(DATA_FILES["alpaca"]), "--preset", str(preset_path), "--model",
                                  str(tiny_models["llama"]), "--max-steps", "2", "--yes", "--quiet",
                                  "--output-dir", str(tmp_path), "--run-name", "tuned"], catch_exceptions=False)
    assert trained.exit_code == 0, trained.output
    plan = json.loads((tmp_path / "tuned" / "plan.json").read_text())
    assert plan["preset"] == "tuned-s" and plan["lr"] == pytest.approx(best.params["lr"])
    assert plan["lora"]["r"] == best.params["lora_r"]


def test_successive_halving_stops_a_bad_trial(tmp_path, tiny_models):
    options = TrainOptions(data=str(DATA_FILES["alpaca"]), model=str(tiny_models["llama"]),
                           overrides={"eval_split": (0.2, "flag"), "lr": (1e-3, "flag")})
    hardware = Hardware.cpu_only()
    prepared = prepare_run(options, hardware)
    settings = TuneSettings(trials=3, steps=10, study_name="prune", study_dir=tmp_path / "prune", confirm=False)
    settings.study_dir.mkdir()
    study = optuna.create_study(study_name="prune", storage=f"sqlite:///{settings.study_dir / 'study.db'}",
                                directions=["minimize", "minimize"])  # as `tune` makes it: loss and forgetting
    good = {"lr": 1e-2, "warmup_ratio": 0.0, "lora_r": 16, "alpha_ratio": 2.0, "lora_dropout": 0.0}
    for params in (good, good, {**good, "lr": 1e-4}):  # the third barely learns: built to be bad
        study.enqueue_trial(params)
    outcome = run_study(prepared, load_preset("quality"), hardware, settings)
    states = [t.state.name for t in load_study(settings)]
    assert states[:2] == ["COMPLETE", "COMPLETE"] and states[2] == "PRUNED"
    assert outcome.steps_run < outcome.steps_budgeted  # pruning saved steps
    assert "pruned at step 2 of 10" in outcome.rows[2]["reason"]  # the first rung: a ninth of the trial


def load_study(settings):
    return optuna.load_study(study_name=settings.study_name, storage=f"sqlite:///{settings.study_dir / 'study.db'}").trials


def test_an_out_of_memory_trial_recovers_and_the_study_goes_on(tmp_path, tiny_models):
    result = tune(tmp_path, tiny_models["llama"], "--trials", "2", "--batch-size", "8", "--grad-accum", "1",
                  env={"LLMCUSTOMS_FAULT_INJECT": "oom@3"})
    assert result.exit_code == 0, result.output
    trials = load(tmp_path).trials
    assert len(trials) == 2 and all(t.state.name in ("COMPLETE", "PRUNED") for t in trials)
    assert "oom at step 3: halved micro-batch" in trials[0].user_attrs["recoveries"][0]


def test_a_trial_that_cannot_recover_is_recorded_as_failed_and_the_study_goes_on(tmp_path, tiny_models):
    # NaN four times in the first trial exhausts its recoveries; the second trial is unaffected.
    result = tune(tmp_path, tiny_models["llama"], "--trials", "2",
                  env={"LLMCUSTOMS_FAULT_INJECT": "nan@2,nan@2,nan@2,nan@2"})
    assert result.exit_code == 0, result.output
    first, second = load(tmp_path).trials
    assert first.state.name == "FAIL" and "NaN" in first.user_attrs["reason"]
    assert second.state.name == "COMPLETE"


def test_ranks_that_do_not_fit_are_left_out_of_the_search():
    from test_planning import plan_for

    hardware = Hardware.with_gpu(8)
    base = plan_for(hardware, "mistralai/Mistral-7B-Instruct-v0.3")
    space = search_space(base, hardware)
    assert 4 in space.ranks and 64 in space.excluded_ranks
    assert "left out" in dict(space.describe())["LoRA rank"]


def test_a_journal_storage_works_for_sharing_a_study(tmp_path, tiny_models):
    journal = tmp_path / "study.journal"
    result = tune(tmp_path, tiny_models["llama"], "--trials", "1", "--storage", f"journal:{journal}")
    assert result.exit_code == 0, result.output
    assert journal.exists() and not (tmp_path / "tune-s" / "study.db").exists()


def test_a_study_refuses_other_data(tmp_path, tiny_models):
    assert tune(tmp_path, tiny_models["llama"], "--trials", "1").exit_code == 0
    other = runner.invoke(app, ["tune", str(DATA_FILES["messages"]), "--model", str(tiny_models["llama"]),
                                "--max-steps", "4", "--eval-split", "0.2", "--output-dir", str(tmp_path),
                                "--study-name", "s", "--trials", "1"])
    assert other.exit_code == 2 and "started on other data" in " ".join(other.output.split())


def test_ctrl_c_in_a_trial_is_acknowledged_and_the_study_is_summed_up(tmp_path, tiny_models):
    result = tune(tmp_path, tiny_models["llama"], "--trials", "3", env={"LLMCUSTOMS_FAULT_INJECT": "sigint@2"})
    assert result.exit_code == 130, result.output
    shown = " ".join(result.output.split())
    assert "warning: stopping after this micro-batch" in shown  # said in the study's display, not swallowed
    assert "Interrupted. The study is saved" in shown
    assert (tmp_path / "tune-s" / "trials.csv").is_file()
