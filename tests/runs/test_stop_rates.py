"""The stop rate of the sample replies, before and after training, in the
summary, `report` and the model card (issue 35, item 4), read from run
directories written by hand."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from llmcustoms.cli import app
from llmcustoms.commands.model_card import model_card
from llmcustoms.planning.train_options import TrainOptions
from llmcustoms.preparation.preparing import prepare_run
from llmcustoms.commands.report import analyse
from llmcustoms.planning.hardware import Hardware
from llmcustoms.runs.run_directory import RunDirectory
from llmcustoms.runs.stop_rates import StopRate, stop_findings, stop_rate_line, stop_rates
from llmcustoms.training.samples import side_by_side
from tiny_models import FIXTURES, WIDE, build_model

UNTRAINED = ("The base model's end-of-turn token <|eot_id|> looks untrained: its input embedding is near zero (0.0% of "
             "a typical token's). Every reply has to end with it, and a model that never learned it may never stop.")
PRIVATE = ("secret prompt 1", "secret prompt 2", "secret prompt 3", "private reply", "private reference")


def samples(base: list[bool | None], trained: list[bool | None]) -> list[dict]:
    """samples.jsonl's rows: one prompt per row, its base and trained replies (`stopped` left out where None)."""
    rows = []
    for label, step, stops in (("base", 0, base), ("eval", 4, [True] * len(base)), ("trained", 8, trained)):
        for row, stopped in enumerate(stops):
            rows.append({"step": step, "label": label, "row": row, "prompt": f"secret prompt {row + 1}",
                         "reply": "private reply", "reference": "private reference",
                         **({} if stopped is None else {"stopped": stopped})})
    return rows


def test_the_stop_rate_counts_the_replies_that_say_whether_they_stopped():
    entries = side_by_side(samples([True, False, True], [True, True, False]))
    assert entries[0] == {"prompt": "secret prompt 1", "reference": "private reference", "base": "private reply",
                          "trained": "private reply", "base_stopped": True, "trained_stopped": True}
    assert stop_rates(entries) == {"base": StopRate(2, 3), "trained": StopRate(2, 3)}
    assert stop_rate_line(entries) == "base model 2/3, trained 2/3 stopped before the token limit"
    # Evaluations' replies are not counted; a row without `stopped` (or a damaged one) is left out.
    damaged = samples([True, None, False], [None, None, None])
    damaged[0]["stopped"] = "yes"
    assert stop_rates(side_by_side(damaged)) == {"base": StopRate(0, 1)}
    # Rows from before `stopped` existed: no stop rate, and entries as they always were.
    old = side_by_side(samples([None] * 3, [None] * 3))
    assert stop_rates(old) == {} and stop_rate_line(old) is None
    assert set(old[0]) == {"prompt", "reference", "base", "trained"}
    # Answered again (a resumed run answers the base model again): the last answer counts.
    again = samples([False] * 3, [True] * 3) + [{**r, "stopped": True} for r in samples([False] * 3, [])]
    assert stop_rates(side_by_side(again))["base"] == StopRate(3, 3)


def test_a_trained_model_that_stops_less_than_its_base_is_flagged_with_what_to_do():
    status = {"stop_tokens": {"end_of_turn": "<|eot_id|>", "untrained": [UNTRAINED]}}
    data = {"replies_without_end_token": {"rows": 12, "of": 40, "token": "<|eot_id|>", "template_ends_reply": True}}
    findings, advice = stop_findings(side_by_side(samples([True] * 3, [False, True, False])), status, data, 2.0)
    topics = {topic: (verdict, detail) for topic, verdict, detail in findings}
    assert topics["stopping"] == ("stops less than the base model", "base model 3/3, trained 1/3 sample replies "
                                  "ended with <|eot_id|> (or EOS) before the token limit")
    assert [f for f in findings if f[1] == "looks untrained"] == [("end token", "looks untrained", UNTRAINED)]
    assert [f[1] for f in findings if f[0] == "end token"] == ["not learned by 12 rows", "looks untrained"]
    (change, text), _ = advice
    assert change == "stopping"
    assert text.startswith("the trained model ends fewer sample replies with <|eot_id|> than the base model did "
                           "(1/3 against 3/3): it has not learned where a reply ends")
    assert "12 training rows have a reply whose learned tokens do not include <|eot_id|>" in text
    assert "a stop token of the base model looks untrained" in text
    assert "--max-seq-len" in text and "--epochs 4" in text and "llmcustoms plan DATA" in text

    # As often as the base, or more: said, not flagged. Without a recorded token: words for it.
    findings, advice = stop_findings(side_by_side(samples([False] * 3, [True] * 3)), {}, {}, 2.0)
    assert findings == [("stopping", "3/3 stopped", "base model 0/3, trained 3/3 sample replies ended with the "
                         "end-of-turn token (or EOS) before the token limit")] and advice == []
    # A run stopped before its trained replies: the base model's alone.
    findings, advice = stop_findings(side_by_side(samples([False] * 3, [])), {}, {}, 2.0)
    assert findings[0][1] == "0/3 stopped" and advice == []
    # An old run: nothing about stopping.
    assert stop_findings(side_by_side(samples([None] * 3, [None] * 3)), {}, {}, 2.0) == ([], [])


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("stop-plan")
    options = TrainOptions(data=str(FIXTURES / "alpaca.jsonl"), model=str(build_model("llama", root / "llama")),
                           cache_dir=str(root / "cache"), overrides={"max_steps": (8, "flag")})
    return prepare_run(options, Hardware.cpu_only()).plan


def written_run(tmp_path, plan, rows: list[dict], status: dict) -> RunDirectory:
    run = RunDirectory(tmp_path / "run")
    run.create()
    run.write_plan(plan)
    run.write_status("completed", step=8, base_eval_loss=3.2, best_eval_loss=2.9, best_eval_step=8, **status)
    for step in range(1, 9):
        run.append_metrics({"step": step, "loss": 3.0 - step * 0.1, "lr": 1e-4, "grad_norm": 0.5, "tokens_per_s": 900})
    run.append_samples(rows)
    return run


def reported(run: RunDirectory) -> str:
    result = CliRunner().invoke(app, ["report", str(run.path), "--details"], env={"COLUMNS": WIDE},
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return " ".join(result.output.replace("│", " ").split())


def test_report_shows_the_stop_rate_and_flags_a_model_that_stops_less(tmp_path, plan):
    run = written_run(tmp_path, plan, samples([True, True, False], [False, False, False]),
                      {"stop_tokens": {"end_of_turn": "</s>", "untrained": []}})
    report = analyse(run)
    verdicts = {f.topic: f.verdict for f in report.findings}
    assert verdicts["stopping"] == "stops less than the base model"
    assert any(r.startswith("the trained model ends fewer sample replies with </s> than the base model did (0/3 "
                            "against 2/3)") for r in report.recommendations)
    said = reported(run)
    assert "stops less than the base model" in said and "base model 2/3, trained 0/3 sample replies ended with </s>" in said
    assert f"--epochs {plan.epochs * 2:g}" in said


def test_report_of_a_run_from_before_the_stop_rate_says_nothing_about_it(tmp_path, plan):
    run = written_run(tmp_path, plan, samples([None] * 3, [None] * 3), {})
    report = analyse(run)
    assert not [f for f in report.findings if f.topic in ("stopping", "end token")]
    said = reported(run)
    assert "Sample replies" in said and "before the token limit" not in said and "end token" not in said


def test_the_model_card_shows_the_stop_rate_and_never_a_prompt_or_reply(tmp_path, plan):
    run = written_run(tmp_path, plan, samples([False, False, True], [True, True, True]), {})
    card = model_card(run, run.read_plan(), merged=False)
    assert "| replies that stop | base model 1/3, trained 3/3 stopped before the token limit (held-out prompts, " \
           "greedy) |" in card
    assert not [text for text in PRIVATE if text in card]
    old = written_run(tmp_path / "old", plan, samples([None] * 3, [None] * 3), {})
    assert "replies that stop" not in model_card(old, old.read_plan(), merged=False)


def test_the_summary_shows_the_stop_rate(tmp_path):
    from llmcustoms.training.position import TrainResult
    from llmcustoms.ui import console

    result = TrainResult(status="completed", steps=8, final_loss=2.1, best_eval_loss=None, best_eval_step=None,
                         seconds=3.0, tokens_per_s=100.0, output_path=tmp_path / "adapter",
                         samples=side_by_side(samples([False] * 3, [True, True, False])))
    with console.console.capture() as captured:
        console.show_summary(result)
    shown = " ".join(captured.get().replace("│", " ").split())
    assert "replies that stop base model 0/3, trained 2/3 stopped before the token limit" in shown
    with console.console.capture() as captured:
        console.show_summary(replace(result, samples=side_by_side(samples([None] * 3, [None] * 3))))
    assert "replies that stop" not in captured.get()
    json.dumps(result.samples)  # entries stay plain JSON values
