"""The rows a run reads are read once (issue 50): preparation keeps the usable rows of a file
that fits in memory, the sample replies and export's check prompts are drawn from them, and
an export reads the prompts and system prompt the run kept, never the data file."""

from __future__ import annotations

import json

from llmcustoms.commands import merging
from llmcustoms.data import dataset as dataset_module
from llmcustoms.data.dataset import read_dataset, usable_examples
from llmcustoms.data.prompt_draws import common_system_prompt, pick_prompts
from llmcustoms.planning.hardware import Hardware
from llmcustoms.planning.train_options import TrainOptions
from llmcustoms.preparation.preparing import prepare_run
from llmcustoms.runs import check_prompts
from llmcustoms.runs.run_directory import RunDirectory
from llmcustoms.training.samples import CHECK_PROMPTS, held_out_prompts, run_samples
from tiny_models import FIXTURES

SYSTEM = "You answer in one short sentence."


def chat_rows(path, systems):
    path.write_text("".join(json.dumps({"messages": ([{"role": "system", "content": s}] if s else []) + [
        {"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer number {i}."}]}) + "\n"
                            for i, s in enumerate(systems)))
    return path


def test_the_usable_rows_are_kept_as_a_second_pass_would_give_them(tmp_path, monkeypatch):
    path = FIXTURES / "alpaca.jsonl"
    streamed = [(e.row, e.prompt, e.completion) for e in usable_examples(path)]
    kept = read_dataset(path)
    assert kept.kept is not None and [(e.row, e.prompt, e.completion) for e in kept.examples()] == streamed
    monkeypatch.setattr(dataset_module, "KEPT_CHARS", 500)  # a file too large to hold: streamed again, the same rows
    large = read_dataset(path)
    assert large.kept is None and [(e.row, e.prompt, e.completion) for e in large.examples()] == streamed


def test_the_system_prompt_every_row_shares_is_found_while_reading(tmp_path):
    for systems, shared in (([SYSTEM] * 5, SYSTEM), ([SYSTEM] * 4 + ["Something else."], None),
                            ([SYSTEM] * 4 + [""], None), ([""] * 5, None)):
        path = chat_rows(tmp_path / "rows.jsonl", systems)
        found = read_dataset(path)
        assert found.system_prompt == shared == common_system_prompt(usable_examples(path)), systems


def prepared(tmp_path, tiny_models, data):
    options = TrainOptions(data=str(data), model=str(tiny_models["llama"]), cache_dir=str(tmp_path / "cache"),
                           overrides={"max_steps": (2, "flag"), "eval_split": (0.25, "flag"),
                                      "max_seq_len": (256, "flag")})
    return prepare_run(options, Hardware.cpu_only())


def test_samples_and_check_prompts_come_from_the_rows_read_and_export_needs_no_data(tmp_path, tiny_models,
                                                                                      monkeypatch):
    data = chat_rows(tmp_path / "rows.jsonl", [SYSTEM] * 24)
    run = prepared(tmp_path, tiny_models, data)
    expected_samples = held_out_prompts(run)
    evaluated = set(run.evaluation.row_numbers.tolist())
    drawn = pick_prompts([e for e in usable_examples(data) if e.row in evaluated], CHECK_PROMPTS, run.plan.seed)
    assert expected_samples and len(drawn) == CHECK_PROMPTS

    def no_second_pass(path):
        raise AssertionError(f"{path} read again")

    monkeypatch.setattr(dataset_module, "usable_examples", no_second_pass)
    run_dir = RunDirectory(tmp_path / "run")
    run_dir.create()
    run_dir.write_plan(run.plan)
    samples = run_samples(run, run_dir, warn=lambda text: None)
    assert [p.messages for p in samples.prompts] == [p.messages for p in expected_samples]
    # Export, with the data file gone: the run's own prompts (held out) and the system prompt its rows share.
    data.unlink()
    assert merging.check_prompts(run.plan, run_dir.path) == [list(p.messages) for p in drawn]
    assert all(m[0] == {"role": "system", "content": SYSTEM} for m in merging.check_prompts(run.plan, run_dir.path))
    assert merging.system_prompt(run.plan, run_dir.path) == SYSTEM


def test_a_run_without_the_record_or_its_data_is_checked_on_general_prompts(tmp_path):
    run_path = tmp_path / "run"
    run_path.mkdir()
    plan = type("Plan", (), {"data": str(tmp_path / "gone.jsonl"), "eval_data": None, "seed": 0})()
    prompts = merging.check_prompts(plan, run_path)
    assert [p[0]["content"] for p in prompts] == list(merging.GENERAL_PROMPTS[:CHECK_PROMPTS])
    assert merging.system_prompt(plan, run_path) is None
    (run_path / check_prompts.FILE).write_text('{"prompts": [[{"role": "user"}]], "system_prompt": null}')
    assert check_prompts.read(run_path) is None  # a damaged record is no record
