"""`llmcustoms report` on short runs: it reads the evaluations a run has, withholds
the verdicts too few steps cannot support (saying so once), and never asks for
the same change twice. Run directories are written by hand from a pure plan."""

from __future__ import annotations

from dataclasses import replace

from typer.testing import CliRunner

from llmcustoms.cli import app
from llmcustoms.planning.hardware import Hardware
from llmcustoms.models.loading import choice_from_spec
from llmcustoms.planning.plan import DataStats, Plan
from llmcustoms.planning.planner import Planner
from llmcustoms.planning.presets import find_model_spec, load_families, load_preset
from llmcustoms.commands.report import MIN_EVALUATIONS_OVERFITTING, MIN_STEPS_LEARNING_RATE, analyse
from llmcustoms.runs.run_directory import RunDirectory
from tiny_models import WIDE

VERDICTS = ("convergence", "overfitting", "learning rate")
# Falls, spikes, falls, spikes: from these the old report called the rate "too high" after 6 steps.
SPIKY = [3.0, 2.6, 4.2, 2.5, 2.4, 3.9]


def plan_of(max_steps: int, eval_rows: int = 50, **overrides) -> Plan:
    families = load_families()
    model = choice_from_spec(find_model_spec("HuggingFaceTB/SmolLM2-135M-Instruct", families), families, "flag")
    stats = DataStats(lengths=tuple([100] * 500), first_loss_positions=tuple([20] * 500), eval_rows=eval_rows)
    plan = Planner(Hardware.cpu_only(), load_preset("quality"), None, ()).plan(
        model, stats, {k: (v, "flag") for k, v in {"max_steps": max_steps, **overrides}.items()})
    return replace(plan, eval_split=0.1 if eval_rows else 0.0)


def make_run(tmp_path, plan: Plan, losses: list[float], evals: dict[int, float], status: str = "completed",
             **fields) -> RunDirectory:
    """A run directory as `train` leaves it: eval rows after the step they follow, step 0 the base model's."""
    run = RunDirectory(tmp_path / "run")
    run.create()
    run.write_plan(plan)
    if 0 in evals:
        run.append_metrics({"step": 0, "eval_loss": evals[0], "eval_ppl": 1.0})
    for step, loss in enumerate(losses, start=1):
        run.append_metrics({"step": step, "epoch": 0.01 * step, "loss": loss, "lr": plan.lr, "grad_norm": 0.5,
                            "tokens_per_s": 1000.0})
        if step in evals:
            run.append_metrics({"step": step, "eval_loss": evals[step], "eval_ppl": 1.0})
    run.write_status(status, step=len(losses), **fields)
    return run


def everything_said(report) -> str:
    return " ".join([f"{f.topic} {f.verdict} {f.detail}" for f in report.findings] + report.recommendations)


def test_a_short_run_reads_its_evaluations_and_withholds_its_verdicts_once(tmp_path):
    plan = plan_of(6)
    assert plan.eval_rows == 50 and plan.eval_every == 2  # evaluations at steps 2, 4 and 6
    run = make_run(tmp_path, plan, SPIKY, {0: 3.2, 2: 3.0, 4: 2.9, 6: 2.8}, best_eval_loss=2.8, best_eval_step=6,
                   base_eval_loss=3.2, kept_step=6, kept="the last step's, which had the best eval loss (2.8000)")
    report = analyse(run)
    said = everything_said(report)
    assert "no evaluation rows" not in said and "--eval-split" not in said
    quality = next(f for f in report.findings if f.topic == "quality")
    assert quality.verdict == "better" and "50 held-out rows" in quality.detail and "step 6" in quality.detail
    assert not [f for f in report.findings if f.topic in VERDICTS]  # no "too high" from 6 steps
    assert "too high" not in said and "--lr" not in said
    assert said.count("too few steps") == 1
    assert "too few steps (6) to judge convergence, overfitting and learning rate" in said

    shown = CliRunner().invoke(app, ["report", str(run.path), "--details"], env={"COLUMNS": WIDE},
                               catch_exceptions=False)
    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.output.replace("│", " ").split())
    assert text.count("too few steps (6)") == 1 and "--eval-split" not in text and "50 held-out rows" in text


def test_a_run_stopped_before_its_first_evaluation_has_the_base_models_not_none(tmp_path):
    """The run a new user was told had "no evaluation rows": 50 held out, evaluated at step 0, stopped at 6 of 40."""
    plan = plan_of(40, eval_every=20)
    run = make_run(tmp_path, plan, SPIKY, {0: 3.2}, status="interrupted", reason="stopped by SIGINT")
    report = analyse(run)
    said = everything_said(report)
    assert "no evaluation rows" not in said and "--eval-split" not in said
    quality = next(f for f in report.findings if f.topic == "quality")
    assert quality.verdict == "not measured yet" and "3.2000 on 50 held-out rows" in quality.detail
    assert "too few steps (6) to judge convergence, overfitting and learning rate" in said
    assert report.recommendations[0].startswith("the run is interrupted: continue it")


def test_a_run_with_no_held_out_rows_still_says_so(tmp_path):
    plan = plan_of(30, eval_rows=0)
    assert plan.eval_every == 0
    run = make_run(tmp_path, plan, [3.0 - 0.05 * s for s in range(30)], {})
    overfitting = next(f for f in analyse(run).findings if f.topic == "overfitting")
    assert overfitting.verdict == "unknown" and "no held-out evaluation rows" in overfitting.detail


def test_overfitting_is_not_judged_from_two_evaluations(tmp_path):
    plan = plan_of(30, eval_every=15)
    run = make_run(tmp_path, plan, [3.0 - 0.05 * s for s in range(30)], {0: 3.0, 15: 2.0, 30: 2.5})
    overfitting = next(f for f in analyse(run).findings if f.topic == "overfitting")
    assert overfitting.verdict == "not judged"
    assert f"too few evaluations (2) to judge overfitting; it needs {MIN_EVALUATIONS_OVERFITTING}" in overfitting.detail


def test_the_same_change_is_recommended_once(tmp_path):
    # Falling, one spike, then rising over the last quarter: both the learning-rate
    # and the convergence verdicts ask for a lower --lr.
    losses = [3.0 - 0.05 * s for s in range(30)] + [3.0, 2.0, 2.1, 2.2, 2.3, 2.4, 2.5, 2.6, 2.7, 2.8]
    assert len(losses) >= MIN_STEPS_LEARNING_RATE
    plan = plan_of(len(losses))
    run = make_run(tmp_path, plan, losses, {0: 3.2, 10: 3.0, 20: 2.8, 30: 2.7, 40: 2.6}, best_eval_loss=2.6,
                   best_eval_step=40, base_eval_loss=3.2)
    report = analyse(run)
    verdicts = {f.topic: f.verdict for f in report.findings}
    assert verdicts["learning rate"] == "too high" and verdicts["convergence"] == "rising at the end"
    assert len([r for r in report.recommendations if "--lr" in r]) == 1
    assert len(set(report.recommendations)) == len(report.recommendations)


# ------------------------------------------------------------------- DPO runs

def dpo_run(tmp_path, evals: dict[int, tuple[float, float, float]], steps: int = 30, eval_rows: int = 50):
    """A DPO run: evals maps step -> (held-out accuracy, margin, chosen reward)."""
    plan = replace(plan_of(steps, eval_rows=eval_rows), objective="dpo", beta=0.1)
    run = RunDirectory(tmp_path / "run")
    run.create()
    run.write_plan(plan)

    def evaluation(step: int) -> dict:
        accuracy, margin, chosen = evals[step]
        return {"step": step, "eval_loss": 0.6931 - margin / 4, "eval_reward_accuracy": accuracy,
                "eval_reward_margin": margin, "eval_chosen_reward": chosen, "eval_rejected_reward": chosen - margin}

    run.append_metrics(evaluation(0))
    for step in range(1, steps + 1):
        run.append_metrics({"step": step, "loss": 0.69 - 0.005 * step, "lr": plan.lr, "grad_norm": 0.5,
                            "tokens_per_s": 1000.0, "reward_accuracy": 0.6, "reward_margin": 0.1,
                            "chosen_reward": 0.0, "rejected_reward": -0.1})
        if step in evals:
            run.append_metrics(evaluation(step))
    best = min((s for s in evals if s), key=lambda s: evaluation(s)["eval_loss"])
    run.write_status("completed", step=steps, best_eval_loss=evaluation(best)["eval_loss"], best_eval_step=best,
                     base_eval_loss=0.6931)
    return run


def test_a_dpo_report_speaks_of_reward_accuracy_not_perplexity(tmp_path):
    run = dpo_run(tmp_path, {0: (0.5, 0.0, 0.0), 10: (0.8, 0.9, 0.2), 20: (0.9, 1.4, 0.3), 30: (0.92, 1.5, 0.3)})
    report = analyse(run)
    [finding] = [f for f in report.findings if f.topic == "preference"]
    assert finding.verdict == "better"
    assert "0.92 of held-out pairs ranked right (chance: 0.50), margin +1.500 at step 30" in finding.detail
    assert "perplexity" not in everything_said(report)


def test_a_dpo_report_says_when_accuracy_stays_at_chance_margin_collapses_or_chosen_falls(tmp_path):
    stuck = analyse(dpo_run(tmp_path / "a", {0: (0.5, 0.0, 0.0), 15: (0.52, 0.01, 0.0), 30: (0.51, 0.02, 0.0)}))
    assert any("about chance" in r and "--lr" in r for r in stuck.recommendations)
    collapsing = analyse(dpo_run(tmp_path / "b", {0: (0.5, 0.0, 0.0), 10: (0.9, 2.0, 0.5), 30: (0.8, 0.6, 0.1)}))
    assert any("margin fell from +2.000 at step 10 to +0.600" in r for r in collapsing.recommendations)
    falling = analyse(dpo_run(tmp_path / "c", {0: (0.5, 0.0, 0.0), 15: (0.8, 1.0, -0.5), 30: (0.9, 2.0, -1.2)}))
    assert any("Raise --beta (now 0.1)" in r and "-1.200" in r for r in falling.recommendations)
    healthy = analyse(dpo_run(tmp_path / "d", {0: (0.5, 0.0, 0.0), 15: (0.8, 1.0, 0.2), 30: (0.9, 1.5, -0.01)}))
    assert not any("beta" in r or "chance" in r or "margin fell" in r for r in healthy.recommendations)


def test_a_dpo_ranking_of_too_few_held_out_pairs_is_withheld_and_says_why(tmp_path):
    """"1.00 of held-out pairs ranked right" was said of 2 pairs, while every other
    verdict waits for 20 steps: at chance, both come out right 1 time in 4."""
    from llmcustoms.runs.preference_report import MIN_HELD_OUT_PAIRS

    evals = {0: (0.5, 0.0, 0.0), 15: (1.0, 0.02, 0.0), 30: (1.0, 0.01, -0.5)}
    report = analyse(dpo_run(tmp_path / "two", evals, eval_rows=2))
    [finding] = [f for f in report.findings if f.topic == "preference"]
    assert finding.verdict == "withheld" and "ranked right" not in finding.detail
    assert finding.detail.startswith("2 held-out pairs are too few to judge the ranking (it needs 10; by chance "
                                     "alone all 2 come out right 1 time in 4); DPO loss")
    # Nor the advice drawn from the same pairs (the margin "fell", the chosen replies "lost probability").
    assert not any("margin fell" in r or "--beta" in r for r in report.recommendations)
    assert any(f"hold out at least {MIN_HELD_OUT_PAIRS} pairs" in r for r in report.recommendations)
    enough = analyse(dpo_run(tmp_path / "ten", evals, eval_rows=MIN_HELD_OUT_PAIRS))
    assert [f.verdict for f in enough.findings if f.topic == "preference"] == ["better"]


def test_the_summary_withholds_the_ranking_of_too_few_pairs_too(tmp_path, capsys):
    from llmcustoms.losses.dpo import PreferenceLoss
    from llmcustoms.training.position import TrainResult
    from llmcustoms.ui.console import show_summary

    row = {"step": 6, "eval_loss": 0.52, **PreferenceLoss(0.1).eval_metrics(0.52, [0.4, -0.2, 2.0], 2)}
    assert row["eval_pairs"] == 2 and row["eval_reward_accuracy"] == 1.0  # the evaluation row counts its pairs
    show_summary(TrainResult(status="completed", steps=6, final_loss=0.5, best_eval_loss=0.52, best_eval_step=6,
                             seconds=3.0, tokens_per_s=100.0, output_path=tmp_path, held_out=row))
    shown = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "preference withheld: 2 held-out pairs are too few to judge the ranking" in shown
    assert "ranked right (chance" not in shown


def test_evaluations_on_training_rows_are_never_called_held_out(tmp_path):
    """--eval-data naming the training file: the same rising eval loss that is overfitting on
    held-out rows is no verdict at all on rows the run trained on, and quality says which rows."""
    losses, evals = [3.0 - 0.05 * s for s in range(30)], {0: 3.0, 5: 2.0, 10: 1.8, 15: 1.9, 20: 2.2, 25: 2.4, 30: 2.6}
    held_out = analyse(make_run(tmp_path / "held", plan_of(30, eval_every=5), losses, evals))
    assert next(f for f in held_out.findings if f.topic == "overfitting").verdict == "yes"
    plan = replace(plan_of(30, eval_every=5), eval_overlap_rows=50)
    report = analyse(make_run(tmp_path / "trained", plan, losses, evals, best_eval_loss=1.8, best_eval_step=10,
                              base_eval_loss=3.0))
    overfitting = next(f for f in report.findings if f.topic == "overfitting")
    assert overfitting.verdict == "unknown" and "50 of them training rows too" in overfitting.detail
    quality = next(f for f in report.findings if f.topic == "quality")
    assert "not a held-out measure" in quality.detail and "50 held-out rows" not in quality.detail
    assert report.sample_prompts == "prompts of rows it trained on"
