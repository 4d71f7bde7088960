"""The base model's answers kept for the next run (`training/base_replies.py`):
a second run with the same model, prompts and settings reads them instead of
generating, and gets exactly what generating gave; anything that changes the
answers changes the key."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from llmcustoms.runs.run_directory import RunDirectory
from llmcustoms.training.base_replies import FOLDER, answered_before, answers_key
from llmcustoms.training.general_knowledge import GeneralKnowledge, read_general_rows
from test_general_knowledge import QUESTIONS, REPLIES, ScriptedModel
from test_stop_replies import prepared_run


@pytest.fixture
def prepared(tiny_models, tmp_path):
    return prepared_run(tiny_models["llama"], tmp_path)


def _run_dir(path):
    run_dir = RunDirectory(path)
    run_dir.create()
    run_dir.write_status("running", step=0)
    return run_dir


def test_a_second_run_reads_the_base_answers_instead_of_generating(prepared, tmp_path):
    first = GeneralKnowledge(prepared.tokenizer, prepared.plan, _run_dir(tmp_path / "out" / "one"), QUESTIONS)
    model = ScriptedModel(prepared.tokenizer, REPLIES)
    score = first.score(model, 0, "base")
    assert model.batches and not first.reused and len(list((tmp_path / "out" / FOLDER).iterdir())) == 1

    second_dir = _run_dir(tmp_path / "out" / "two")
    second = GeneralKnowledge(prepared.tokenizer, prepared.plan, second_dir, QUESTIONS)
    silent = ScriptedModel(prepared.tokenizer, {})  # generating would fail: it has no replies
    again = second.score(silent, 0, "base")
    assert silent.batches == [] and second.reused
    assert (again["right"], again["asked"], again["seconds"]) == (score["right"], score["asked"], score["seconds"])
    assert again["reused"] is True and "reused" not in score
    assert [r["reply"] for r in read_general_rows(second_dir.path)] == [REPLIES[q.question] for q in QUESTIONS]
    # The trained model's answers are never read from the kept ones.
    assert second.score(silent, 4, "trained") is None and not second.reused


def test_a_damaged_kept_file_is_a_miss_and_is_written_again(prepared, tmp_path):
    check = GeneralKnowledge(prepared.tokenizer, prepared.plan, _run_dir(tmp_path / "out" / "one"), QUESTIONS)
    check.score(ScriptedModel(prepared.tokenizer, REPLIES), 0, "base")
    [kept] = (tmp_path / "out" / FOLDER).iterdir()
    for damage in ("{not json", json.dumps({"answers": ["too few"], "seconds": 1.0}), json.dumps([1, 2])):
        kept.write_text(damage)
        model = ScriptedModel(prepared.tokenizer, REPLIES)
        assert check.score(model, 0, "base")["right"] == 3 and model.batches and not check.reused
        assert len(json.loads(kept.read_text())["answers"]) == len(QUESTIONS)


def test_whatever_changes_the_answers_changes_the_key(prepared):
    plan, tokenizer, model = prepared.plan, prepared.tokenizer, ScriptedModel(prepared.tokenizer, {})
    prompts, settings = ["What is 7 times 8?"], {"max_new_tokens": 24}
    key = answers_key("general", plan, tokenizer, model, prompts, settings)
    assert key == answers_key("general", plan, tokenizer, model, list(prompts), dict(settings))
    changed = [answers_key("samples", plan, tokenizer, model, prompts, settings),
               answers_key("general", plan, tokenizer, model, ["What is 6 times 9?"], settings),
               answers_key("general", plan, tokenizer, model, prompts, {"max_new_tokens": 48}),
               answers_key("general", replace(plan, method="qlora"), tokenizer, model, prompts, settings),
               answers_key("general", replace(plan, mixed_precision="bf16"), tokenizer, model, prompts, settings),
               answers_key("general", replace(plan, tokens_key="another tokenizer"), tokenizer, model, prompts,
                           settings),
               answers_key("general", replace(plan, compile=not plan.compile), tokenizer, model, prompts, settings),
               answers_key("general", replace(plan, model_fingerprint={"config.json": "other"}), tokenizer, model,
                           prompts, settings)]
    assert None not in changed and len({key, *changed}) == len(changed) + 1
    # Nothing is kept for a base that is not the model's files as fingerprinted.
    assert answers_key("general", replace(plan, model_fingerprint={}), tokenizer, model, prompts, settings) is None
    assert answers_key("general", replace(plan, from_run="runs/earlier"), tokenizer, model, prompts, settings) is None


def test_a_real_second_run_reuses_the_base_model_replies_it_would_have_generated(prepared, tmp_path):
    """Two runs of the tiny model into one output directory: the second's base
    sample replies and general answers are the first's, read rather than generated."""
    from llmcustoms.commands.train import run_training

    out, rows = tmp_path / "runs", {}
    assert not answered_before(out, prepared.plan)
    for name in ("first", "second"):
        run_dir = RunDirectory(out / name)
        run_dir.create()
        run_dir.write_plan(prepared.plan)
        run_training(prepared, run_dir, quiet=True, resume=False, cache=str(tmp_path / "cache"))
        samples = [r for r in run_dir.read_samples() if r["label"] == "base"]
        general = [r for r in read_general_rows(run_dir.path) if r["label"] == "base"]
        rows[name] = (samples, general, run_dir.read_status()["general_knowledge"]["base"],
                      (run_dir.path / "train.log").read_text())
    assert rows["first"][0] and rows["first"][0] == rows["second"][0]
    assert rows["first"][1] and rows["first"][1] == rows["second"][1]
    assert "reused" not in rows["first"][2] and rows["second"][2]["reused"] is True
    assert "reused from an earlier run" not in rows["first"][3] and "reused from an earlier run" in rows["second"][3]
    assert len(list((out / FOLDER).iterdir())) == 2  # the sample replies' and the general questions'
    # The next plan knows, before the model loads, that its base answers will be read.
    assert answered_before(out, prepared.plan)
    assert not answered_before(out, replace(prepared.plan, seed=prepared.plan.seed + 1))  # other prompts
    assert not answered_before(out, replace(prepared.plan, method="qlora"))
    first = next((out / FOLDER).iterdir())
    first.write_text("{damaged")  # one kind left: the plan still counts the base model's answers
    assert not answered_before(out, prepared.plan)
