"""The forgetting check (issue 36, item 3): the general question set, how a
reply is scored, batched greedy answering, and a run recording the base and
the trained model's scores."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import llmcustoms
from llmcustoms.recovery.stop_signals import StopRequested
from llmcustoms.runs.run_directory import RunDirectory
from llmcustoms.training import general_knowledge as gk
from llmcustoms.training.general_knowledge import (BRIEFLY, GeneralKnowledge, GeneralQuestion, answer_questions,
                                                   general_check, is_right, load_questions, read_general_rows)
from llmcustoms.training.samples import run_samples
from test_stop_replies import prepared_run

QUESTIONS = [GeneralQuestion("What is 7 times 8?", ("56", "fifty-six")),
             GeneralQuestion("What is the capital of Japan?", ("Tokyo",)),
             GeneralQuestion("In Python, which function returns the length of a list?", ("len",)),
             GeneralQuestion("What is the chemical formula of water?", ("H2O",)),
             GeneralQuestion("How many days are in a week?", ("7", "seven"))]
REPLIES = {"What is 7 times 8?": "Fifty-six.", "What is the capital of Japan?": "The capital is Kyoto.",
           "In Python, which function returns the length of a list?": "`len()` does.",
           "What is the chemical formula of water?": "water is h2o",
           "How many days are in a week?": "A week has 17 days."}  # right: 1st, 3rd, 4th


def test_the_question_set_is_well_formed_and_ships_in_the_package():
    questions = load_questions()
    assert len(questions) >= 60
    texts = [q.question.casefold() for q in questions]
    assert len(set(texts)) == len(texts)  # no question twice
    for q in questions:
        assert q.question.strip() and q.answers and all(isinstance(a, str) and a.strip() for a in q.answers)
        assert len(set(a.casefold() for a in q.answers)) == len(q.answers)
        # Echoing the question is never a right answer.
        assert not is_right(q.question + BRIEFLY, q.answers), q.question
        assert is_right(f"It is {q.answers[0]}.", q.answers)  # the answer said in a sentence is
    # Inside the package directory, so the wheel (hatch, packages = ["llmcustoms"]) has it; written for us.
    assert gk.QUESTIONS_FILE.parent == Path(llmcustoms.__file__).parent / "training"
    about = json.loads(gk.QUESTIONS_FILE.read_text(encoding="utf-8"))["about"]
    assert "written for llmcustoms" in about and "Apache-2.0" in about


def test_a_reply_is_right_when_it_holds_an_answer_as_a_word():
    assert is_right("7 times 8 is 56.", ("56",)) and not is_right("It is 156, or 560.", ("56",))
    assert is_right("The capital is TOKYO's centre", ("Tokyo",)) and is_right("fifty-six", ("56", "Fifty-Six"))
    assert is_right("Use `len()`.", ("len",)) and not is_right("the length of a list", ("len",))
    assert is_right('Use <a href="...">', ("<a>", "<a ")) and is_right("Use the <a> tag", ("<a>",))
    assert not is_right("", ("56",)) and is_right("Brasília", ("Brasilia", "Brasília"))


class ScriptedModel:
    """Stands in for a causal LM: replies to each left-padded prompt with the
    tokens of its question's reply in REPLIES, then a stop token, then padding."""

    def __init__(self, tokenizer, replies: dict[str, str]):
        self.tokenizer, self.replies, self.training, self.device = tokenizer, replies, True, torch.device("cpu")
        self.batches: list[int] = []

    def eval(self):
        self.training = False
        return self

    def train(self, mode: bool = True):
        self.training = mode
        return self

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, stopping_criteria,
                 **kwargs):
        assert kwargs["do_sample"] is False and not self.training
        assert (attention_mask[:, -1] == 1).all()  # left-padded: every prompt ends at the last column
        self.batches.append(len(input_ids))
        for criterion in stopping_criteria:
            criterion(input_ids, None)
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            prompt = self.tokenizer.decode(ids[mask.bool()])
            [reply] = [r for q, r in self.replies.items() if q + BRIEFLY in prompt]
            new = self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [eos_token_id[0]]
            rows.append(new + [pad_token_id] * (max_new_tokens - len(new)) + self.tokenizer("junk")["input_ids"])
        width = max(map(len, rows))
        rows = [r + [pad_token_id] * (width - len(r)) for r in rows]
        return torch.cat([input_ids, torch.tensor(rows)], dim=1)


@pytest.fixture
def prepared(tiny_models, tmp_path):
    return prepared_run(tiny_models["llama"], tmp_path)


def test_the_score_counts_the_right_replies_and_is_recorded_in_the_run(prepared, tmp_path):
    run_dir = RunDirectory(tmp_path / "run")
    run_dir.create()
    run_dir.write_status("running", step=0)
    warnings: list[str] = []
    check = GeneralKnowledge(prepared.tokenizer, prepared.plan, run_dir, QUESTIONS, warn=warnings.append,
                             batch_size=2)
    model = ScriptedModel(prepared.tokenizer, REPLIES)
    score = check.score(model, 0, "base")
    assert (score["right"], score["asked"]) == (3, 5) and model.batches == [2, 2, 1] and model.training
    rows = read_general_rows(run_dir.path)
    assert [r["reply"] for r in rows] == [REPLIES[q.question] for q in QUESTIONS]  # cut at the stop token
    assert [r["right"] for r in rows] == [True, False, True, True, False]
    assert {r["label"] for r in rows} == {"base"} and warnings == []

    # The trained model answers all five; answered again, a label's rows replace its earlier ones.
    model.replies = {q.question: q.answers[0] for q in QUESTIONS}
    assert check.score(model, 8, "trained")["right"] == 5
    assert check.score(model, 8, "trained")["right"] == 5
    status = run_dir.read_status()["general_knowledge"]
    assert {label: (s["right"], s["asked"]) for label, s in status.items()} == {"base": (3, 5), "trained": (5, 5)}
    assert [r["label"] for r in read_general_rows(run_dir.path)] == ["base"] * 5 + ["trained"] * 5


def test_a_failure_warns_and_a_stop_ends_it_recording_nothing(prepared, tmp_path):
    run_dir = RunDirectory(tmp_path / "run")
    run_dir.create()
    warnings: list[str] = []
    check = GeneralKnowledge(prepared.tokenizer, prepared.plan, run_dir, QUESTIONS, warn=warnings.append,
                             batch_size=2)
    model = ScriptedModel(prepared.tokenizer, {})  # finds no reply: generate fails
    assert check.score(model, 0, "base") is None and model.training
    assert len(warnings) == 1 and warnings[0].startswith("general questions (base) skipped (ValueError")
    asked: list[int] = []
    model.replies = REPLIES
    assert check.score(model, 0, "base", lambda: asked.append(1) or len(asked) > 2) is None
    assert len(asked) == 3 and len(warnings) == 1 and model.training
    assert "general_knowledge" not in run_dir.read_status() and read_general_rows(run_dir.path) == []


def test_batched_answers_are_the_answers_one_at_a_time(prepared, tiny_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float64).eval()
    model.config.use_cache = False  # as training leaves it
    questions = [q.question for q in load_questions()[:6]]  # prompts of different lengths, so padded
    alone = answer_questions(model, prepared.tokenizer, prepared.plan, questions, 8, batch_size=1)
    assert answer_questions(model, prepared.tokenizer, prepared.plan, questions, 8, batch_size=4) == alone
    assert len(alone) == 6 and len({len(prepared.tokenizer(q)["input_ids"]) for q in questions}) > 1
    calls: list[int] = []
    with pytest.raises(StopRequested):  # a stop is asked for after every token
        answer_questions(model, prepared.tokenizer, prepared.plan, questions, 8, 4, lambda: calls.append(1) or len(calls) > 3)
    assert len(calls) == 4


def test_a_run_with_evaluation_rows_records_the_scores_and_its_summary_shows_them(prepared, tmp_path):
    from llmcustoms.commands.train import run_training
    from llmcustoms.ui import console

    run_dir = RunDirectory(tmp_path / "run")
    run_dir.create()
    run_dir.write_plan(prepared.plan)
    samples = run_samples(prepared, run_dir, warn=lambda text: None)  # what run_training answers with
    assert samples.general is not None and len(samples.general.questions) == len(load_questions())
    result = run_training(prepared, run_dir, quiet=True, resume=False, cache=str(tmp_path / "cache"))
    scores = run_dir.read_status()["general_knowledge"]
    assert set(scores) == {"base", "trained"} and result.general == scores
    answers = {q.question: q.answers for q in load_questions()}
    rows = read_general_rows(run_dir.path)
    for label, score in scores.items():
        mine = [r for r in rows if r["label"] == label]
        assert score["asked"] == len(mine) == len(answers) and score["seconds"] >= 0
        assert score["right"] == sum(is_right(r["reply"], answers[r["question"]]) for r in mine)
        assert all(r["right"] == is_right(r["reply"], answers[r["question"]]) for r in mine)
    assert {r["step"] for r in rows if r["label"] == "trained"} == {prepared.plan.total_steps}
    with console.console.capture() as captured:
        console.show_summary(result)
    shown = " ".join(captured.get().replace("│", " ").split())
    assert (f"general questions {scores['base']['right']}/{scores['base']['asked']} base -> "
            f"{scores['trained']['right']}/{scores['trained']['asked']} trained") in shown
    # Without evaluation rows, no check.
    assert general_check(SimpleNamespace(plan=SimpleNamespace(eval_rows=0)), run_dir, print) is None
