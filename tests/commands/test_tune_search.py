"""`tune` never loses to the preset: the preset's point is the first trial, a
continued study draws new points, successive halving stops poor trials at its
rungs, lr-find's suggestion centres the lr range, and the best is written only
if it beats the preset at full length.

Most tests swap the trainer for `Rigged`, which trains nothing and reports
the eval losses a test chose, so a study of several trials takes a second;
`test_a_real_tiny_study_...` trains for real."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import optuna
import pytest
import yaml
from typer.testing import CliRunner

from conftest import DATA_FILES
from llmcustoms.cli import app
from llmcustoms.commands import lr_find as lrfind
from llmcustoms.planning.train_options import TrainOptions
from llmcustoms.preparation.preparing import prepare_run
from llmcustoms.commands.tune import PreparedStudy, TuneSettings, run_study
from llmcustoms.commands.tune_space import (LR_FIND_SPAN, LR_SPAN, RUNG_ATTR, preset_point, rungs, search_space,
                                            trial_patience, trial_plan)
from llmcustoms.planning.hardware import Hardware
from llmcustoms.planning.presets import load_preset
from llmcustoms.training import finetuner
from llmcustoms.training.position import Position, StopCause, StopReason

runner = CliRunner()
STEPS = 9  # a trial's steps: judged at steps 1 and 3
HARDWARE = Hardware.cpu_only()


class Rigged:
    """A FineTuner that trains nothing. At each evaluation the plan would make it
    reports `Rigged.curve(plan, step)`, as the real one does through `on_evaluate`:
    an eval loss, or an eval loss and a general-text loss (forgetting's, against
    `Rigged.base_general`, which a run with `baseline` measures; `tune` gives the
    others the number, as it does real ones). Its position keeps, by the real
    rule, what `train` would keep."""

    curve = staticmethod(lambda plan, step: 1.0)
    base_general = 2.0
    runs: list = []  # the plans run, in order
    baselines: list = []  # whether each run evaluated the base model itself

    def __init__(self, plan, tokenizer, train, evaluation, run_dir, reporter, faults=None, on_evaluate=None,
                 save_artifacts=True, baseline=True, **_):
        self.plan, self.on_evaluate, self.baseline = plan, on_evaluate, baseline
        self.position = Position()  # its early_stop is the real rule
        self.signals = SimpleNamespace(received=None)

    def run(self):
        Rigged.runs.append(self.plan)
        Rigged.baselines.append(self.baseline)
        if self.baseline:
            self.position.base_eval, self.position.base_general = 10.0, Rigged.base_general
        for step in range(1, self.plan.total_steps + 1):
            self.position.step = step
            if step % self.plan.eval_every == 0 or step == self.plan.total_steps:
                value = Rigged.curve(self.plan, step)
                loss, general = value if isinstance(value, tuple) else (value, Rigged.base_general)
                if self.on_evaluate is not None and self.on_evaluate(step, loss):
                    return self._result(StopReason(StopCause.CALLER, step, ""))
                stop = self.position.early_stop(loss, self.plan.early_stopping_patience, general,
                                                self.plan.forgetting_limit)
                if stop is not None:
                    return self._result(stop)
        return self._result(None)

    def _result(self, stop):
        return SimpleNamespace(stop=stop, best_eval_loss=self.position.best_eval, forgetting=self.position.forgetting())


@pytest.fixture
def rigged(monkeypatch):
    """Trials and full-length runs go to `Rigged`; set `rigged.curve` to choose their losses."""
    monkeypatch.setattr(finetuner, "FineTuner", Rigged)
    monkeypatch.setattr(Rigged, "runs", [])
    monkeypatch.setattr(Rigged, "baselines", [])
    return Rigged


def distance(lr: float, best_lr: float) -> float:
    return abs(math.log10(lr / best_lr))


@pytest.fixture(scope="module")
def prepared(tiny_models):
    options = TrainOptions(data=str(DATA_FILES["alpaca"]), model=str(tiny_models["llama"]),
                           overrides={"eval_split": (0.2, "flag")})
    return prepare_run(options, HARDWARE)


def settings_for(tmp_path, trials: int, **changes) -> TuneSettings:
    return TuneSettings(**{"trials": trials, "steps": STEPS, "study_name": "s", "study_dir": tmp_path / "tune-s",
                           "sampler": "random", **changes})


def study_of(settings) -> optuna.Study:
    return optuna.load_study(study_name=settings.study_name, storage=f"sqlite:///{settings.study_dir / 'study.db'}")


def new_study(settings) -> optuna.Study:
    """The study `tune` would make (two objectives), made before it runs, to queue trials in."""
    settings.study_dir.mkdir(parents=True)
    return optuna.create_study(study_name=settings.study_name, storage=f"sqlite:///{settings.study_dir / 'study.db'}",
                               directions=["minimize", "minimize"])


def tune(prepared, settings, **kwargs):
    return run_study(prepared, load_preset("quality"), HARDWARE, settings, **kwargs)


# ------------------------------------------------------------ the preset first


def test_the_first_trial_is_the_presets_own_point_in_the_same_space(tmp_path, prepared, rigged):
    settings = settings_for(tmp_path, 3, confirm=False)
    tune(prepared, settings)
    trials = study_of(settings).trials
    base = prepared.plan
    point = preset_point(base)
    assert trials[0].params == point and trials[0].user_attrs["preset"]
    assert point == {"lr": base.lr, "warmup_ratio": 0.0, "lora_r": base.lora.r,
                     "alpha_ratio": base.lora.alpha / base.lora.r, "lora_dropout": base.lora.dropout}
    # The same names and distributions as the sampled trials: a point the space can draw.
    assert trials[0].distributions == trials[1].distributions == trials[2].distributions
    first = rigged.runs[0]  # trained as the preset does, shortened
    assert (first.lr, first.lora, first.total_steps) == (base.lr, base.lora, STEPS)
    assert sum(bool(t.user_attrs.get("preset")) for t in trials) == 1


def test_the_presets_values_are_choices_of_the_space_and_its_lr_in_range(prepared):
    from dataclasses import replace

    from llmcustoms.planning.plan import LoraSettings

    odd = replace(prepared.plan, lr=3.3e-4, warmup_steps=1, total_steps=20,
                  lora=LoraSettings(r=12, alpha=36, dropout=0.07, target_modules=prepared.plan.lora.target_modules))
    space = search_space(odd, HARDWARE)
    point = space.preset
    assert point == {"lr": 3.3e-4, "warmup_ratio": 0.05, "lora_r": 12, "alpha_ratio": 3.0, "lora_dropout": 0.07}
    assert space.holds(point) and 12 in space.ranks and 3.0 in space.alpha_ratios and 0.05 in space.warmups
    assert (space.lr_low, space.lr_high) == pytest.approx((3.3e-4 / LR_SPAN, 3.3e-4 * LR_SPAN))
    assert trial_plan(odd, point, 20).lora == odd.lora


# ------------------------------------------------------- a continued study


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_a_second_invocation_of_a_study_tries_new_points(tmp_path, prepared, rigged, sampler):
    first = settings_for(tmp_path, 3, sampler=sampler, confirm=False)
    tune(prepared, first)
    tune(prepared, settings_for(tmp_path, 3, sampler=sampler, confirm=False))
    trials = study_of(first).trials
    assert len(trials) == 6
    before = [t.params for t in trials[:3]]
    assert all(t.params not in before for t in trials[3:])  # none repeated
    assert [bool(t.user_attrs.get("preset")) for t in trials] == [True] + [False] * 5  # the preset once


def test_an_interrupted_preset_trial_is_tried_again(tmp_path, prepared, rigged):
    settings = settings_for(tmp_path, 1, confirm=False)
    study = new_study(settings)
    study.enqueue_trial(preset_point(prepared.plan), user_attrs={"preset": True})
    trial = study.ask()
    search_space(prepared.plan, HARDWARE).suggest(trial)  # the enqueued values
    trial.set_user_attr("interrupted", "SIGINT")  # as a Ctrl-C in it leaves it
    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    tune(prepared, settings)
    trials = study_of(settings).trials
    assert len(trials) == 2 and trials[1].params == trials[0].params and trials[1].state.name == "COMPLETE"


@pytest.mark.parametrize("state, attrs, again", [
    ("COMPLETE", {}, False), ("PRUNED", {}, False), ("FAIL", {}, False),  # tried: diverged is a result too
    ("PRUNED", {"interrupted": "SIGINT"}, True), ("FAIL", {"killed": True}, True)])  # cut short: tried again
def test_the_presets_point_is_queued_again_only_if_its_trial_was_cut_short(state, attrs, again):
    from llmcustoms.commands.tune_confirm import enqueue_preset

    point = {"lr": 1e-3, "warmup_ratio": 0.0}
    study = optuna.create_study()
    assert enqueue_preset(study, point) and not enqueue_preset(study, point)  # waiting: queued once
    trial = study.ask()
    trial.suggest_float("lr", 1e-4, 1e-2, log=True), trial.suggest_categorical("warmup_ratio", [0.0])
    for key, value in attrs.items():
        trial.set_user_attr(key, value)
    study.tell(trial, 1.0 if state == "COMPLETE" else None, state=optuna.trial.TrialState[state])
    assert enqueue_preset(study, point) is again


# ------------------------------------------------------- successive halving


def test_rungs_are_a_ninth_and_a_third_of_a_trial():
    assert rungs(100) == (12, 36) and rungs(9) == (1, 3) and rungs(6) == (1, 3)
    assert rungs(2) == (1,) and rungs(1) == ()


def test_successive_halving_stops_a_poor_trial_at_its_first_rung(tmp_path, prepared, rigged):
    base_lr = prepared.plan.lr
    rigged.curve = lambda plan, step: 1.0 + distance(plan.lr, 2 * base_lr) - 0.01 * step  # best at 2x the preset's
    settings = settings_for(tmp_path, 1, confirm=False)
    tune(prepared, settings)  # the preset's trial
    study = study_of(settings)
    for lr in (8 * base_lr, 2 * base_lr):  # far off, then better than the preset
        study.enqueue_trial({**preset_point(prepared.plan), "lr": lr})
    outcome = tune(prepared, settings_for(tmp_path, 2, confirm=False))
    trials = study_of(settings).trials
    assert [t.state.name for t in trials] == ["COMPLETE", "PRUNED", "COMPLETE"]
    assert trials[1].user_attrs["steps"] == 1 and trials[1].user_attrs["budget"] == STEPS
    assert "pruned at step 1 of 9" in outcome.rows[1]["reason"]
    assert outcome.steps_run == 1 + STEPS < outcome.steps_budgeted == 2 * STEPS


def test_trials_are_judged_by_the_eval_loss_train_would_keep_not_the_latest(tmp_path, prepared, rigged):
    """Both overfit after their best step; the other point's best (0.80 at step 1) beats the
    preset's (0.90 at step 3), though its latest loss at the second rung (1.2 at step 3)
    does not. `train` keeps the best evaluation: that is what a trial is worth, at its rungs
    and at its end."""
    base_lr = prepared.plan.lr
    best_at = {base_lr: (3, 0.90), 3 * base_lr: (1, 0.80)}  # step of the lowest loss, and that loss
    rigged.curve = lambda plan, step: best_at[plan.lr][1] + 0.2 * abs(step - best_at[plan.lr][0])
    settings = settings_for(tmp_path, 1, confirm=False)
    tune(prepared, settings)  # the preset's trial
    study_of(settings).enqueue_trial({**preset_point(prepared.plan), "lr": 3 * base_lr})
    live = []  # the running trial's row, as the live table shows it at each evaluation
    outcome = tune(prepared, settings_for(tmp_path, 1, confirm=False),
                   on_update=lambda rows: live.extend(r["eval_loss"] for r in rows if r["state"] == "running"))
    preset, other = study_of(settings).trials
    assert live and max(live) == pytest.approx(0.80)  # its score, never the latest (1.0 at step 2, 1.2 at 3)
    assert preset.values[0] == pytest.approx(0.90) and other.values[0] == pytest.approx(0.80)
    assert other.state.name == "COMPLETE" and other.user_attrs["steps"] > 3  # 1.2 at step 3: not pruned
    assert other.user_attrs[RUNG_ATTR] == pytest.approx({"1": 0.80, "3": 0.80})  # the rungs saw its best, not 1.2
    assert preset.user_attrs[RUNG_ATTR] == pytest.approx({"1": 1.30, "3": 0.90})
    assert [r["best"] for r in outcome.rows] == [False, True]


def test_a_trial_stops_early_where_train_would_and_keeps_its_score(tmp_path, prepared, rigged):
    """Best at its first evaluation, worse after: `train` would wait its patience in
    steps (its patience times its interval) and stop; the trial waits as many
    steps, counted in its own evaluations (a ninth of its 40 steps apart), and is a
    complete trial worth its first evaluation."""
    plan, every = prepared.plan, rungs(40)[0]
    assert plan.early_stopping_patience and plan.eval_every  # the preset's: train stops early
    waits = trial_patience(plan, every)
    assert waits == math.ceil(plan.early_stopping_patience * plan.eval_every / every)
    stops_at = every * (1 + waits)
    assert stops_at < 40
    rigged.curve = lambda plan, step: 0.5 + 0.1 * abs(step - every)
    settings = settings_for(tmp_path, 1, confirm=False, steps=40)
    outcome = tune(prepared, settings)
    [trial] = study_of(settings).trials
    assert trial_plan(plan, trial.params, 40).early_stopping_patience == waits
    assert trial.state.name == "COMPLETE" and trial.values[0] == pytest.approx(0.5)
    assert trial.user_attrs["steps"] == stops_at and outcome.steps_run == stops_at
    assert "as `train` would" in outcome.rows[0]["reason"]


def test_a_trial_never_stops_early_when_train_would_not(prepared):
    from dataclasses import replace

    assert trial_plan(replace(prepared.plan, early_stopping_patience=0), {"lr": 1e-3, "warmup_ratio": 0.0},
                      40).early_stopping_patience == 0


def test_the_presets_trial_is_never_stopped(tmp_path, prepared, rigged):
    base_lr = prepared.plan.lr
    # the preset is the worst, and still improving (an early stop is not a pruning)
    rigged.curve = lambda plan, step: 1.0 + distance(plan.lr, 4 * base_lr) - 0.01 * step
    settings = settings_for(tmp_path, 3, confirm=False)
    study = new_study(settings)
    for lr in (4 * base_lr, 3 * base_lr):  # an older study: two good trials before the preset's
        study.enqueue_trial({**preset_point(prepared.plan), "lr": lr})
    tune(prepared, settings)
    trials = study_of(settings).trials
    assert trials[2].user_attrs["preset"] and trials[2].state.name == "COMPLETE"
    assert trials[2].user_attrs["steps"] == STEPS


def test_a_trial_that_failed_after_a_good_start_sets_no_bar(tmp_path, prepared, rigged):
    from llmcustoms.recovery.recovery_system import TrainingFailed

    base_lr = prepared.plan.lr

    def curve(plan, step):
        if plan.lr == 8 * base_lr and step > 3:
            raise TrainingFailed({"reason": "the loss diverged"})
        return 0.5 if plan.lr == 8 * base_lr else 1.0 + distance(plan.lr, base_lr)  # a high lr: fast, then gone

    rigged.curve = curve
    settings = settings_for(tmp_path, 3, confirm=False)
    study = new_study(settings)
    for lr in (8 * base_lr, 2 * base_lr):
        study.enqueue_trial({**preset_point(prepared.plan), "lr": lr})
    tune(prepared, settings)
    trials = study_of(settings).trials
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE", "COMPLETE"]  # judged against each other only


# ------------------------------------------------------------ lr-find's centre


def saved_suggestion(output_dir, plan, lr: float) -> None:
    result = lrfind.RangeTestResult(model=plan.model, method=plan.method, data=plan.data,
                                    data_sha256=plan.data_sha256, start_lr=1e-7, end_lr=1.0, steps=30, curve=[],
                                    stopped=None, suggestion=lrfind.Suggestion(lr, steepest_lr=lr))
    lrfind.save(result, lrfind.result_path(output_dir, plan))


def test_a_saved_lr_find_suggestion_centres_the_lr_range(tmp_path, prepared):
    base = prepared.plan
    settings = settings_for(tmp_path, 1)
    study = PreparedStudy(prepared, HARDWARE, settings, search_space(base, HARDWARE), 1000)
    assert lrfind.centre_study(study, tmp_path, run_missing=False) is study  # none saved: around the preset's lr
    suggestion = 2 * base.lr
    saved_suggestion(tmp_path, base, suggestion)
    centred = lrfind.centre_study(study, tmp_path, run_missing=False)
    space = centred.space
    assert centred.settings.lr_centre == suggestion and space.lr_centre == suggestion
    assert (space.lr_low, space.lr_high) == pytest.approx((suggestion / LR_FIND_SPAN, suggestion * LR_FIND_SPAN))
    assert dict(space.describe())["lr centred on"].startswith(f"{suggestion:.1e}, lr-find's suggestion")
    assert search_space(base, HARDWARE, suggestion) == space  # what the study runs with

    far = search_space(base, HARDWARE, 40 * base.lr)  # the preset's lr is below the range: it is widened to it
    assert (far.lr_low, far.lr_high) == pytest.approx((base.lr, 40 * base.lr * LR_FIND_SPAN))
    assert "widened to the preset's lr" in dict(far.describe())["lr centred on"]


def test_tune_centres_on_a_saved_suggestion_by_itself_and_says_so(tmp_path, tiny_models, prepared, rigged):
    saved_suggestion(tmp_path, prepared.plan, 2e-3)
    args = ["tune", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["llama"]), "--max-steps", str(STEPS),
            "--eval-split", "0.2", "--output-dir", str(tmp_path), "--study-name", "s", "--trials", "2", "--no-confirm"]
    result = runner.invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "centring the search on 2.0e-03, from the saved range test" in text
    assert "searched around lr-find's suggestion, 2.0e-03" in text
    trial = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'tune-s' / 'study.db'}").trials[1]
    assert (trial.distributions["lr"].low, trial.distributions["lr"].high) == pytest.approx((5e-4, 8e-3))
    ignored = runner.invoke(app, [*args, "--no-lr-find"], catch_exceptions=False)
    assert ignored.exit_code == 0 and "centring" not in ignored.output


# ------------------------------------------------------------ full length


def full_curve(prepared, trial_lr: float, full_lr: float):
    """Trials (short plans) are best at `trial_lr`; whole runs at `full_lr`."""
    total = prepared.plan.total_steps

    def curve(plan, step):
        best = full_lr if plan.total_steps == total else trial_lr
        return 1.0 + distance(plan.lr, best)
    return curve


def test_the_preset_stays_when_the_searchs_best_is_worse_at_full_length(tmp_path, prepared, rigged):
    base = prepared.plan
    rigged.curve = full_curve(prepared, trial_lr=3 * base.lr, full_lr=base.lr)  # high lr: good short, bad long
    settings = settings_for(tmp_path, 1)
    tune(prepared, settings)  # the preset's trial: it is the best so far, nothing to check
    optuna_study = study_of(settings)
    optuna_study.enqueue_trial({**preset_point(base), "lr": 3 * base.lr})
    saying: list[str] = []
    outcome = tune(prepared, settings_for(tmp_path, 1), say=saying.append)
    check = outcome.confirmation
    assert outcome.best_row()["trial"] == 1 and not check.search_won and check.runs == 2
    assert check.preset == pytest.approx(1.0) and check.best == pytest.approx(1.0 + math.log10(3))
    assert [p.total_steps for p in rigged.runs[-2:]] == [base.total_steps] * 2
    assert rigged.runs[-2] == base  # the preset's whole run is the plan `train` would run
    written = yaml.safe_load(outcome.best_preset_path.read_text())
    assert written["lr"] == pytest.approx(base.lr)
    assert any("Training the preset at full length" in line for line in saying)


def test_the_searchs_best_is_written_when_it_wins_at_full_length_and_kept_for_later(tmp_path, prepared, rigged):
    base = prepared.plan
    rigged.curve = full_curve(prepared, trial_lr=3 * base.lr, full_lr=2 * base.lr)
    settings = settings_for(tmp_path, 1)
    tune(prepared, settings)
    study_of(settings).enqueue_trial({**preset_point(base), "lr": 3 * base.lr})
    outcome = tune(prepared, settings_for(tmp_path, 1))
    check = outcome.confirmation
    assert check.search_won and check.best < check.preset and check.change == pytest.approx(check.best / check.preset - 1)
    assert yaml.safe_load(outcome.best_preset_path.read_text())["lr"] == pytest.approx(3 * base.lr)
    assert "beat the preset's" in outcome.best_preset_path.read_text()
    # A continued study whose best did not change trains nothing again at full length.
    rigged.curve = lambda plan, step: 5.0 if plan.total_steps != base.total_steps else full_curve(
        prepared, 3 * base.lr, 2 * base.lr)(plan, step)
    runs = len(rigged.runs)
    again = tune(prepared, settings_for(tmp_path, 1))
    assert len(rigged.runs) == runs + 1 and again.confirmation.runs == 0  # the new trial only
    assert again.confirmation.search_won and len(again.confirmation.notes) == 2


def test_no_confirm_writes_the_best_trial_unchecked(tmp_path, prepared, rigged):
    base = prepared.plan
    rigged.curve = full_curve(prepared, trial_lr=3 * base.lr, full_lr=base.lr)
    tune(prepared, settings_for(tmp_path, 1, confirm=False))
    study_of(settings_for(tmp_path, 1)).enqueue_trial({**preset_point(base), "lr": 3 * base.lr})
    outcome = tune(prepared, settings_for(tmp_path, 1, confirm=False))
    assert outcome.confirmation is None and len(rigged.runs) == 2  # trials only
    assert yaml.safe_load(outcome.best_preset_path.read_text())["lr"] == pytest.approx(3 * base.lr)


def test_whole_run_trials_decide_without_training_again(tmp_path, prepared, rigged):
    base = prepared.plan
    rigged.curve = lambda plan, step: 1.0 + distance(plan.lr, 3 * base.lr)
    settings = settings_for(tmp_path, 1, steps=base.total_steps)
    tune(prepared, settings)
    study_of(settings).enqueue_trial({**preset_point(base), "lr": 3 * base.lr})
    outcome = tune(prepared, settings_for(tmp_path, 1, steps=base.total_steps))
    assert outcome.confirmation.from_trials and outcome.confirmation.search_won and outcome.confirmation.runs == 0
    assert len(rigged.runs) == 2


def test_the_summary_says_which_won_and_by_how_much(tmp_path, tiny_models, prepared, rigged):
    base = prepared.plan
    args = ["tune", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["llama"]), "--max-steps", str(STEPS),
            "--eval-split", "0.2", "--output-dir", str(tmp_path), "--study-name", "s", "--sampler", "random"]
    rigged.curve = lambda plan, step: 1.234 if plan.lr == base.lr else (
        1.198 if plan.total_steps == base.total_steps else 1.0)  # every other point: better short, 2.9% better long
    result = runner.invoke(app, [*args, "--trials", "2"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert f"each trained for a whole run ({base.total_steps} steps; {2 * base.total_steps} steps in all" in text
    assert "successive halving: at steps 1 and 3 of 9" in text
    assert "The search's best lowered validation loss 1.2340 -> 1.1980 (-2.9%) vs the preset" in text
    assert "The check trained 2 whole run(s)" in text and "--preset" in text

    rigged.curve = lambda plan, step: 1.234 if plan.lr == base.lr else (1.3 if plan.total_steps == base.total_steps
                                                                         else 0.9)
    result = runner.invoke(app, [*args, "--trials", "1", "--study-name", "t"], catch_exceptions=False)
    assert "no trial beat the preset's own values" in " ".join(result.output.split())  # only the preset ran
    result = runner.invoke(app, [*args, "--trials", "1", "--study-name", "t"], catch_exceptions=False)
    text = " ".join(result.output.split())
    assert "The preset stays: the search's best did not beat it at full length (1.3000 vs 1.2340, +5.3%)" in text


# ------------------------------------------------------------- for real


def test_a_real_tiny_study_starts_from_the_preset_and_checks_its_best(tmp_path, tiny_models):
    args = ["tune", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["llama"]), "--max-steps", "3",
            "--eval-split", "0.2", "--output-dir", str(tmp_path), "--study-name", "s", "--trials", "2"]
    # A low preset lr, so the search finds better; whole runs of 4 steps.
    result = runner.invoke(app, args, env={"LLMCUSTOMS_MAX_STEPS": "4", "LLMCUSTOMS_LR": "1e-4"}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'tune-s' / 'study.db'}")
    assert study.trials[0].params["lr"] == pytest.approx(1e-4) and study.trials[0].user_attrs["preset"]
    text = " ".join(result.output.split())
    assert ("The search's best lowered validation loss" in text or "The preset stays" in text), text
    written = yaml.safe_load((tmp_path / "tune-s" / "best_preset.yaml").read_text())
    assert written["lr"] in [pytest.approx(t.params["lr"]) for t in study.trials]
    full = [json.loads((d / "plan.json").read_text()) for d in (tmp_path / "tune-s").glob("full-*")]
    assert all(plan["total_steps"] == 4 for plan in full)
