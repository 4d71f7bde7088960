"""The forgetting check's scores in the summary, `report` and the model card
(issue 36, item 3), read from run directories written by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmcustoms.commands.model_card import model_card
from llmcustoms.planning.train_options import TrainOptions
from llmcustoms.preparation.preparing import prepare_run
from llmcustoms.commands.report import analyse
from llmcustoms.planning.hardware import Hardware
from llmcustoms.runs.forgetting import Score, clearly_fewer, forgetting_findings, general_line, general_scores
from llmcustoms.training.general_knowledge import GENERAL_FILE
from test_stop_rates import reported, samples, written_run
from tiny_models import FIXTURES, build_model


def scores(base: int | None, trained: int | None, asked: int = 67) -> dict:
    """status.json's general_knowledge: how many of `asked` each model answered right (None: not asked)."""
    return {label: {"right": right, "asked": asked, "seconds": 2.5}
            for label, right in (("base", base), ("trained", trained)) if right is not None}


def test_the_scores_are_read_and_said_and_damaged_ones_left_out():
    assert general_scores(scores(41, 40)) == {"base": Score(41, 67), "trained": Score(40, 67)}
    assert general_line(scores(41, 40)) == "41/67 base -> 40/67 trained"
    assert general_line(scores(41, None)) == "41/67 base"  # stopped before its end
    for damaged in ({"right": "41", "asked": 67}, {"right": 41}, {"right": 70, "asked": 67}, {"right": 0, "asked": 0},
                    {"right": True, "asked": 67}, [41, 67], None):
        assert general_scores({"base": damaged, "trained": {"right": 3, "asked": 67}}) == {"trained": Score(3, 67)}
    assert general_scores(None) == general_scores([]) == general_scores({}) == {} and general_line({}) is None


def test_clearly_fewer_is_three_questions_and_five_percent_of_the_set():
    assert clearly_fewer(Score(44, 60), Score(41, 60)) == 3  # 3 and 5%
    assert clearly_fewer(Score(44, 60), Score(42, 60)) is None  # 2: the wobble of any change
    assert clearly_fewer(Score(44, 67), Score(41, 67)) is None  # 3 of 67 is under 5%
    assert clearly_fewer(Score(44, 67), Score(40, 67)) == 4
    assert clearly_fewer(Score(50, 200), Score(45, 200)) is None  # 5 of 200 is under 5%
    assert clearly_fewer(Score(40, 60), Score(50, 60)) is None  # more is never forgetting
    assert clearly_fewer(Score(36, 60), Score(35, 67)) == 5  # sets of another size: by shares (60% against 52%)


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("forgetting-plan")
    options = TrainOptions(data=str(FIXTURES / "alpaca.jsonl"), model=str(build_model("llama", root / "llama")),
                           cache_dir=str(root / "cache"), overrides={"max_steps": (8, "flag"), "replay": (0.0, "flag")})
    return prepare_run(options, Hardware.cpu_only()).plan


def test_report_flags_a_trained_model_that_answers_clearly_fewer_and_says_what_to_do(tmp_path, plan):
    run = written_run(tmp_path, plan, samples([True] * 3, [True] * 3), {"general_knowledge": scores(44, 38)})
    report = analyse(run)
    [finding] = [f for f in report.findings if f.topic == "general questions"]
    assert finding.verdict == "fewer than the base model"
    assert finding.detail.startswith("44/67 base -> 38/67 trained of llmcustoms' general questions")
    [advice] = [r for r in report.recommendations if "general questions" in r]
    assert advice.startswith("the trained model answers 6 fewer of the general questions than the base model "
                             "(38/67 against 44/67)")
    assert f"--lr {plan.lr / 2:.1e}" in advice and f"--epochs {plan.epochs / 2:g}" in advice
    assert f"--lora-r {plan.lora.r // 2}" in advice and "(--replay 0.25)" in advice
    said = reported(run)
    assert "general questions fewer than the base model 44/67 base -> 38/67 trained" in said
    assert "answers 6 fewer of the general questions" in said
    full = written_run(tmp_path / "full", replace(plan, method="full", lora=None), samples([True] * 3, [True] * 3),
                       {"general_knowledge": scores(44, 38)})
    assert any("LoRA instead of full fine-tuning (--method lora)" in r for r in analyse(full).recommendations)


def test_report_never_asks_for_more_epochs_and_fewer_epochs_at_once(tmp_path, plan):
    """A loss still falling at the end and a model that forgot: "try --epochs 8" beside "fewer
    epochs" was the identity benchmark's report; more epochs would forget more."""
    run = written_run(tmp_path, plan, samples([True] * 3, [True] * 3), {"general_knowledge": scores(49, 31)})
    for step in range(9, 41):  # a loss that keeps falling, past the steps a convergence verdict needs
        run.append_metrics({"step": step, "loss": 3.0 - step * 0.05, "lr": 1e-4, "grad_norm": 0.5, "tokens_per_s": 900})
    report = analyse(run)
    assert {f.topic: f.verdict for f in report.findings}["convergence"] == "still falling"
    said = " ".join(report.recommendations)
    assert f"--epochs {plan.epochs / 2:g}" in said and f"--epochs {plan.epochs * 2:g}" not in said
    assert "add rows of it rather than epochs" in said
    alone = written_run(tmp_path / "kept", plan, samples([True] * 3, [True] * 3), {"general_knowledge": scores(49, 48)})
    for step in range(9, 41):
        alone.append_metrics({"step": step, "loss": 3.0 - step * 0.05, "lr": 1e-4, "grad_norm": 0.5, "tokens_per_s": 900})
    assert f"--epochs {plan.epochs * 2:g}" in " ".join(analyse(alone).recommendations)  # nothing forgotten: longer


def test_stopping_advice_asks_for_rows_not_epochs_when_the_model_forgot(tmp_path, plan):
    """Replies that no longer stop call for more training; a model that forgot must not get more epochs for it."""
    forgot = written_run(tmp_path, plan, samples([True] * 3, [False] * 3), {"general_knowledge": scores(49, 31)})
    said = " ".join(analyse(forgot).recommendations)
    assert "ends fewer sample replies" in said and "more rows rather than more epochs" in said
    assert f"--epochs {plan.epochs * 2:g}" not in said and f"--epochs {plan.epochs / 2:g}" in said
    kept = written_run(tmp_path / "kept", plan, samples([True] * 3, [False] * 3), {"general_knowledge": scores(49, 48)})
    assert f"train longer (--epochs {plan.epochs * 2:g})" in " ".join(analyse(kept).recommendations)


@pytest.mark.parametrize("base, trained, verdict", [(44, 42, "about as many as the base model"), (44, 44, "kept"),
                                                    (40, 47, "kept"), (44, None, "44/67 right")])
def test_report_says_the_scores_without_advice_when_they_are_close(tmp_path, plan, base, trained, verdict):
    run = written_run(tmp_path, plan, samples([True] * 3, [True] * 3), {"general_knowledge": scores(base, trained)})
    report = analyse(run)
    assert [f.verdict for f in report.findings if f.topic == "general questions"] == [verdict]
    assert not [r for r in report.recommendations if "general questions" in r]
    assert forgetting_findings(scores(base, trained), plan)[1] == []


def test_report_of_a_run_without_the_scores_says_nothing_of_them(tmp_path, plan):
    run = written_run(tmp_path, plan, samples([True] * 3, [True] * 3), {})
    assert not [f for f in analyse(run).findings if f.topic == "general questions"]
    assert "general questions" not in reported(run)
    assert forgetting_findings(None, plan) == ([], [])


def test_the_model_card_shows_the_numbers_and_never_a_reply(tmp_path, plan):
    run = written_run(tmp_path, plan, samples([True] * 3, [True] * 3), {"general_knowledge": scores(41, 40)})
    (run.path / GENERAL_FILE).write_text("".join(
        f'{{"step": 0, "label": "{label}", "question": "What is 7 times 8?", "reply": "private general reply", '
        f'"right": false}}\n' for label in ("base", "trained")))
    card = model_card(run, run.read_plan(), merged=False)
    assert "| general questions | 41/67 base -> 40/67 trained answered right (llmcustoms' general questions, " \
           "greedy) |" in card
    assert "private general reply" not in card and "7 times 8" not in card
    old = written_run(tmp_path / "old", plan, samples([True] * 3, [True] * 3), {})
    assert "general questions" not in model_card(old, old.read_plan(), merged=False)


def test_the_summary_shows_the_scores_and_an_old_run_nothing(tmp_path):
    from llmcustoms.training.position import TrainResult
    from llmcustoms.ui import console

    result = TrainResult(status="completed", steps=8, final_loss=2.1, best_eval_loss=None, best_eval_step=None,
                         seconds=3.0, tokens_per_s=100.0, output_path=tmp_path / "adapter", general=scores(41, 40))
    with console.console.capture() as captured:
        console.show_summary(result)
    assert "general questions 41/67 base -> 40/67 trained" in " ".join(captured.get().replace("│", " ").split())
    with console.console.capture() as captured:
        console.show_summary(replace(result, general={}))
    assert "general questions" not in captured.get()


def test_report_names_the_measured_forgetting_and_first_advises_the_setting_that_reduced_it(tmp_path, plan):
    """A run that forgot: its report says the number (the questions and the general text's loss
    rise) and its first advice is replay, which on the benchmark's sentiment data kept 42 of 67
    general questions instead of 10; then a lower learning rate; a forgetting limit after, with its cost."""
    run = written_run(tmp_path, plan, samples([True] * 3, [True] * 3),
                      {"general_knowledge": scores(47, 31), "forgetting": 0.159})
    report = analyse(run)
    [finding] = [f for f in report.findings if f.topic == "general questions"]
    assert "the loss on general text +15.9% against the base model's" in finding.detail
    [advice] = [r for r in report.recommendations if "general questions" in r]
    assert advice.startswith("the trained model answers 16 fewer of the general questions than the base model "
                             "(31/67 against 47/67; the loss on general text +15.9% against the base model's)")
    ways = advice.split("try ", 1)[1]
    assert ways.startswith("replaying the base model's own replies to general prompts while training (--replay "
                           f"0.25), a lower learning rate (--lr {plan.lr / 2:.1e}), weights kept within a forgetting "
                           "limit (--forgetting-limit 0.08; it may stop before your data is learned)"), ways
    # A run that replayed already is told to replay more.
    more = written_run(tmp_path / "more", replace(plan, replay=0.25), samples([True] * 3, [True] * 3),
                       {"general_knowledge": scores(47, 31), "forgetting": 0.159})
    [advice] = [r for r in analyse(more).recommendations if "general questions" in r]
    assert advice.split("try ", 1)[1].startswith("replaying more of the base model's own replies (--replay 0.5)")
    # Where the general loss did not rise (code data: -10%), a limit would keep nothing earlier: not advised.
    fell = written_run(tmp_path / "fell", plan, samples([True] * 3, [True] * 3),
                       {"general_knowledge": scores(47, 41), "forgetting": -0.1})
    [advice] = [r for r in analyse(fell).recommendations if "general questions" in r]
    assert "--forgetting-limit" not in advice and f"--lr {plan.lr / 2:.1e}" in advice
