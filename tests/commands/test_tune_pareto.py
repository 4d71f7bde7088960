"""`tune` with two objectives: held-out loss and forgetting. The Pareto front
of a study's trials, the pick (the lowest held-out loss among the trials
forgetting no more than the preset's own trial, or than --forgetting-limit),
pareto.json, the table's two numbers, a study of an older version (one
objective), and a real tiny study that records both values per trial.

The rigged studies use `test_tune_search.Rigged`, which trains nothing."""

from __future__ import annotations

import csv
import json
import math

import optuna
import pytest
import yaml
from typer.testing import CliRunner

from conftest import DATA_FILES
from llmcustoms.cli import app
from llmcustoms.commands.tune_identity import check_identity, study_identity
from llmcustoms.commands.tune_pareto import UNMEASURED, Point, dominates, pareto_front, pick
from llmcustoms.commands.tune_space import preset_point
from llmcustoms.commands.tune_studies import default_name
from llmcustoms.errors import ConfigError
from llmcustoms.ui.tune_view import trials_table
from test_narrow_screens import render
from test_tune_search import Rigged, prepared, rigged, settings_for, study_of, tune  # noqa: F401 (fixtures)

runner = CliRunner()


def point(trial: int, loss: float, forgetting: float | None, preset: bool = False) -> Point:
    return Point(trial, loss, forgetting, {"lr": 1e-4 * (trial + 1), "warmup_ratio": 0.0}, preset)


# ------------------------------------------------------------ the front


def test_the_front_leaves_out_dominated_points_and_keeps_ties():
    found = [point(0, 0.90, 0.02, preset=True), point(1, 0.80, 0.05), point(2, 0.85, 0.05),  # 2: beaten by 1
             point(3, 0.80, 0.05),  # the same values as 1: neither beats the other
             point(4, 0.95, 0.01), point(5, 0.95, 0.03),  # 5: beaten by 4 (and by 0)
             point(6, 0.70, None),  # forgetting unknown: nothing to compare it by
             point(7, 0.90, 0.02)]  # the same values as the preset's
    assert [p.trial for p in pareto_front(found)] == [1, 3, 0, 7, 4]
    assert dominates(found[1], found[2]) and dominates(found[4], found[5]) and dominates(found[0], found[5])
    assert not dominates(found[1], found[3]) and not dominates(found[3], found[1])  # a tie
    assert not dominates(found[6], found[1]) and not dominates(found[1], found[6])  # unknown: no order
    assert pareto_front([]) == [] and pareto_front([point(0, 1.0, None)]) == []


# ------------------------------------------------------------ the pick


POINTS = [point(0, 1.00, 0.03, preset=True),
          point(1, 0.80, 0.08),  # the lowest loss measured, but it forgets more than the preset
          point(2, 0.90, 0.03),  # as much as the preset: it qualifies
          point(3, 0.95, 0.01),
          point(4, 0.70, None)]  # unknown: it cannot show it forgets no more


def test_the_pick_forgets_no_more_than_the_presets_own_trial():
    chosen = pick(POINTS, None)
    assert chosen.point.trial == 2 and chosen.rule == "preset" and chosen.bound == 0.03 and chosen.qualifying == 3
    assert chosen.said == ("trial 2: the lowest held-out loss, 0.9000, among the 3 trials forgetting no more than "
                           "the preset's own trial (+3.00%).")
    # Equal held-out losses: the one that forgets less.
    tied = pick([*POINTS, point(5, 0.90, 0.02)], None)
    assert tied.point.trial == 5
    # Only the preset's own trial qualifies: it is the pick.
    alone = pick([POINTS[0], POINTS[1]], None)
    assert alone.point.trial == 0 and "trial 0 (the preset's own values)" in alone.said and "the 1 trial" in alone.said


def test_the_users_forgetting_limit_replaces_the_presets_bound():
    assert pick(POINTS, 0.1).point.trial == 1 and pick(POINTS, 0.1).rule == "limit"  # 8% is within 10%
    assert pick(POINTS, 0.02).point.trial == 3
    none = pick(POINTS, 0.005)
    assert none.point is None and none.qualifying == 0
    assert none.said == "No trial stays within --forgetting-limit (+0.50%): the preset's own values stay."
    unlimited = pick(POINTS, 0.0)  # 0: no limit, as for `train`
    assert unlimited.point.trial == 4 and unlimited.rule == "unlimited" and unlimited.bound is None


def test_without_forgetting_measured_the_pick_is_the_lowest_loss():
    measured_by_none = [point(0, 1.0, None, preset=True), point(1, 0.8, None)]  # preference pairs
    for limit in (None, 0.05):
        chosen = pick(measured_by_none, limit)
        assert chosen.point.trial == 1 and chosen.rule == "unmeasured"
        assert "forgetting was measured in none of them" in chosen.said
    # The preset's trial measured none (it failed, say), the others did: the default limit stands in.
    chosen = pick([point(0, 1.0, None, preset=True), point(1, 0.8, 0.2), point(2, 0.9, 0.05)], None)
    assert chosen.point.trial == 2 and chosen.rule == "default" and chosen.bound == pytest.approx(0.1)


# ------------------------------------------------------------ a rigged study


def forgetting_curve(prepared, by_lr: dict[float, tuple[float, float | None]]):
    """Trials at each lr: a held-out loss and a forgetting (None: not measured), at every evaluation."""
    def curve(plan, step):
        loss, rise = by_lr[plan.lr]
        return loss, None if rise is None else Rigged.base_general * (1 + rise)
    return curve


def test_a_trial_that_forgets_more_than_the_preset_is_not_picked(tmp_path, prepared, rigged):
    base_lr = prepared.plan.lr
    rigged.curve = forgetting_curve(prepared, {base_lr: (1.0, 0.03),  # the preset's own point
                                               3 * base_lr: (0.8, 0.08),  # lower loss, forgets more
                                               2 * base_lr: (0.9, 0.02),  # better on both
                                               4 * base_lr: (0.85, None)})  # forgetting unknown
    # Trials of one step: no rung, so none is pruned for its held-out loss alone.
    settings = settings_for(tmp_path, 1, confirm=False, steps=1)
    tune(prepared, settings)  # the preset's trial
    for lr in (3 * base_lr, 2 * base_lr, 4 * base_lr):
        study_of(settings).enqueue_trial({**preset_point(prepared.plan), "lr": lr})
    outcome = tune(prepared, settings_for(tmp_path, 3, confirm=False, steps=1))
    assert rigged.baselines == [True, True, False, False]  # the base model measured once per `tune`

    trials = study_of(settings).trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * 4
    assert [t.values[0] for t in trials] == pytest.approx([1.0, 0.8, 0.9, 0.85])
    assert [t.values[1] for t in trials] == pytest.approx([0.03, 0.08, 0.02, UNMEASURED])  # Optuna's number
    assert outcome.pick.point.trial == 2 and outcome.pick.bound == pytest.approx(0.03)
    assert outcome.pick.said.startswith("trial 2: the lowest held-out loss, 0.9000, among the 2 trials")
    assert [r["trial"] for r in outcome.rows if r["best"]] == [2]
    written = yaml.safe_load((settings.study_dir / "best_preset.yaml").read_text())
    assert written["lr"] == pytest.approx(2 * base_lr) and "not checked at full length" in written["description"]

    pareto = json.loads((settings.study_dir / "pareto.json").read_text())
    assert [(p["trial"], p["eval_loss"]) for p in pareto["front"]] == [(1, 0.8), (2, 0.9)]  # the preset's: beaten by 2
    assert pareto["front"][0]["forgetting"] == pytest.approx(0.08) and pareto["front"][1]["params"]["lr"] == 2 * base_lr
    assert pareto["not_measured"] == [3] and pareto["pick"]["trial"] == 2 and pareto["pick"]["rule"] == "preset"
    rows = list(csv.DictReader(open(settings.study_dir / "trials.csv")))
    assert [r["forgetting"] for r in rows] == [str(v) for v in (trials[0].values[1], trials[1].values[1],
                                                                   trials[2].values[1])] + [""]

    # The user's limit, given to `tune`, allows the trial that forgets 8%: it is picked instead.
    limited = tune(prepared, settings_for(tmp_path, 0, confirm=False, steps=1, forgetting_limit=0.1))
    assert limited.pick.point.trial == 1 and limited.pick.rule == "limit"
    assert yaml.safe_load((settings.study_dir / "best_preset.yaml").read_text())["lr"] == pytest.approx(3 * base_lr)
    # A limit no trial meets: the preset's own values stay.
    strict = tune(prepared, settings_for(tmp_path, 0, confirm=False, steps=1, forgetting_limit=0.01))
    assert strict.pick.point is None and not strict.search_won
    assert yaml.safe_load((settings.study_dir / "best_preset.yaml").read_text())["lr"] == pytest.approx(base_lr)
    assert json.loads((settings.study_dir / "pareto.json").read_text())["pick"]["trial"] is None


def test_the_table_shows_both_numbers_and_says_when_forgetting_is_unknown():
    rows = [{"trial": 0, "state": "complete", "eval_loss": 1.0, "forgetting": 0.0312, "best": False, "lr": 2e-4,
             "lora_r": 16, "alpha_ratio": 2.0, "lora_dropout": 0.05, "warmup_ratio": 0.0, "steps": 9, "budget": 9,
             "seconds": 3.0, "reason": "", "preset": True},
            {"trial": 1, "state": "complete", "eval_loss": 0.85, "forgetting": None, "best": True, "lr": 4e-4,
             "lora_r": 8, "alpha_ratio": 1.0, "lora_dropout": 0.0, "warmup_ratio": 0.1, "steps": 9, "budget": 9,
             "seconds": 3.0, "reason": ""},
            {"trial": 2, "state": "pruned", "eval_loss": 1.5, "forgetting": None, "best": False, "lr": 1e-3,
             "lora_r": 8, "alpha_ratio": 1.0, "lora_dropout": 0.0, "warmup_ratio": 0.1, "steps": 1, "budget": 9,
             "seconds": 1.0, "reason": "pruned at step 1 of 9: not in the best third at step 1"}]
    for width in (80, 200):
        text = render(trials_table(rows), width)
        lines = [" ".join(line.replace("│", " ").replace("┃", " ").split()) for line in text.splitlines()]
        assert any(line.startswith("0 complete 1.0000 +3.12% 2.00e-04") for line in lines), text
        assert any(line.startswith("1 complete 0.8500 unknown 4.00e-04") for line in lines), text
        assert any(line.startswith("2 pruned 1.5000 1.00e-03") for line in lines), text  # no forgetting yet
        assert ("forgetting" if width == 200 else "forgot") in text


def test_the_summary_prints_the_front_and_explains_the_pick(tmp_path, tiny_models, prepared, rigged):
    base_lr = prepared.plan.lr
    rigged.curve = lambda plan, step: (1.0, 2.06) if plan.lr == base_lr else (0.9, 2.02)  # the preset forgets +3%
    args = ["tune", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["llama"]), "--max-steps", "9",
            "--eval-split", "0.2", "--output-dir", str(tmp_path), "--study-name", "s", "--trials", "2", "--no-confirm"]
    result = runner.invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "the pick: the lowest held-out loss among the trials forgetting no more than the preset's own trial" in text
    assert "Pareto front: held-out loss against forgetting" in text and "+1.00% " in text
    assert ("Pick: trial 1: the lowest held-out loss, 0.9000, among the 2 trials forgetting no more than the "
            "preset's own trial (+3.00%).") in text
    assert "pareto.json" in text
    limited = runner.invoke(app, [*args, "--trials", "1", "--forgetting-limit", "0.005"], catch_exceptions=False)
    assert limited.exit_code == 0, limited.output
    text = " ".join(limited.output.split())
    assert "forgetting no more than --forgetting-limit (+0.50%)" in text  # in the search space's table
    assert "Pick: No trial stays within --forgetting-limit (+0.50%): the preset's own values stay." in text


# ------------------------------------------------------------ a study of an older version


def older_study(path, name: str) -> optuna.Study:
    """A study as an older llmcustoms made it: one objective, held-out loss."""
    path.mkdir(parents=True)
    study = optuna.create_study(study_name=name, storage=f"sqlite:///{path / 'study.db'}", direction="minimize")
    trial = study.ask()
    trial.suggest_float("lr", 1e-5, 1e-3, log=True), trial.suggest_categorical("warmup_ratio", [0.0])
    study.tell(trial, 1.0)
    return study


def test_a_study_of_one_objective_is_refused_by_name_and_kept_beside_a_new_one(tmp_path, tiny_models, rigged):
    model = tiny_models["llama"]
    args = ["tune", str(DATA_FILES["alpaca"]), "--model", str(model), "--max-steps", "9", "--eval-split", "0.2",
            "--output-dir", str(tmp_path), "--trials", "1", "--no-confirm"]
    older_study(tmp_path / "tune-s", "s")
    named = runner.invoke(app, [*args, "--study-name", "s"])
    text = " ".join(named.output.split())
    assert named.exit_code == 2 and "held-out loss alone, by an older llmcustoms" in text, named.output
    assert "Traceback" not in named.output and "data and flags it was started with" not in text
    assert len(optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'tune-s' / 'study.db'}").trials) == 1

    name = default_name(str(DATA_FILES["alpaca"]), str(model))
    older_study(tmp_path / f"tune-{name}", name)
    beside = runner.invoke(app, args, catch_exceptions=False)
    text = " ".join(beside.output.split())
    assert beside.exit_code == 0, beside.output
    assert f"The study '{name}' was started on held-out loss alone" in text and "a new study" in text
    [new] = [p for p in tmp_path.glob(f"tune-{name}-*")]
    assert len(optuna.load_study(study_name=new.name[len("tune-"):], storage=f"sqlite:///{new / 'study.db'}")
               .directions) == 2


def test_check_identity_refuses_a_study_of_one_objective(prepared):
    study = optuna.create_study(study_name="old", direction="minimize")
    with pytest.raises(ConfigError, match="held-out loss alone"):
        check_identity(study, study_identity(prepared.plan, 9))
    check_identity(optuna.create_study(directions=["minimize", "minimize"]), study_identity(prepared.plan, 9))


# ------------------------------------------------------------ for real


def test_a_real_tiny_study_records_both_values_per_trial(tmp_path, tiny_models):
    args = ["tune", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["llama"]), "--max-steps", "1",
            "--eval-split", "0.2", "--output-dir", str(tmp_path), "--study-name", "s", "--trials", "3"]
    # Trials of 1 step have no rung (none is pruned); whole runs of 2 steps for the check.
    result = runner.invoke(app, args, env={"LLMCUSTOMS_MAX_STEPS": "2"}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    study_path = tmp_path / "tune-s"
    trials = optuna.load_study(study_name="s", storage=f"sqlite:///{study_path / 'study.db'}").trials
    assert len(trials) == 3 and all(t.state.name == "COMPLETE" for t in trials)
    for t in trials:
        loss, forgetting = t.values
        assert 0 < loss < 20 and math.isfinite(forgetting) and forgetting < UNMEASURED, t.values  # measured
    # The base model's general loss was measured once, by the first trial; the others started from it.
    def step0(run):
        return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["step"] == 0]
    assert step0(study_path / "trial-0000") and not step0(study_path / "trial-0001")
    evaluations = [r for r in map(json.loads, (study_path / "trial-0002" / "metrics.jsonl").read_text().splitlines())
                   if "eval_loss" in r]
    assert evaluations and all("general_loss" in r for r in evaluations)
    pareto = json.loads((study_path / "pareto.json").read_text())
    assert pareto["front"] and pareto["pick"]["rule"] == "preset" and pareto["not_measured"] == []
    assert {p["trial"] for p in pareto["front"]} <= {0, 1, 2}
    rows = list(csv.DictReader(open(study_path / "trials.csv")))
    assert all(float(r["forgetting"]) == pytest.approx(t.values[1]) for r, t in zip(rows, trials))
    text = " ".join(result.output.split())
    assert "Pareto front" in text and "Pick: trial" in text
