"""Replay (`training/replay.py`, `--replay SHARE`): the base model's own replies to the
general prompts the package ships, mixed into each step, so a run keeps what it knew."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from llmcustoms.data.token_store import TokenRows
from llmcustoms.data.tokenization import TokenizedExample
from llmcustoms.training import replay
from llmcustoms.training.batching import collate, epoch_steps
from test_finetuner import train


def _rows(lengths: list[int], first_row: int = 0) -> TokenRows:
    return TokenRows.from_examples([TokenizedExample(first_row + i, list(range(1, n + 1)), [-100] + list(range(2, n + 1)))
                                    for i, n in enumerate(lengths)])


def test_each_step_takes_its_share_of_replayed_rows_in_a_seeded_order_round_all_of_them():
    lengths = [5 + i % 7 for i in range(40)] + [9] * 6  # 40 rows of data, then 6 replayed
    mixed = replay.with_replay(epoch_steps, 40, 6, 0.25)
    steps = mixed(lengths, 8, 42, 0)
    plain = epoch_steps(lengths[:40], 8, 42, 0)
    assert [s[:8] for s in steps] == plain  # the data's steps as they were
    drawn = [i for s in steps for i in s[8:]]
    assert all(len(s) == 10 for s in steps) and all(40 <= i < 46 for i in drawn)  # 2 replayed rows a step
    assert sorted(drawn[:6]) == list(range(40, 46))  # every replayed row before any comes twice
    assert mixed(lengths, 8, 42, 0) == steps and mixed(lengths, 8, 42, 1) != steps  # (seed, epoch) decide
    assert replay.replayed_per_step(0.01, 8) == 1 and replay.replayed_per_step(0.0, 8) == 0


def test_mixed_rows_are_the_data_then_the_replayed_rows():
    rows = replay.MixedRows(_rows([4, 6]), _rows([3], first_row=100))
    assert len(rows) == 3 and rows.lengths.tolist() == [4, 6, 3]
    assert [e.row for e in rows.examples([2, 0])] == [100, 0]
    assert rows.input_tokens([0, 2]) == 7 and rows.trained_tokens([1, 2]) == 5 + 2
    assert rows.cut(4).lengths.tolist() == [4, 4, 3]


def _loss_on(model, rows: TokenRows, pad_id: int) -> float:
    batch = collate(rows.examples(list(range(len(rows)))), pad_id)
    model.eval()
    with torch.no_grad():
        return float(model(**{k: v.to(model.device) for k, v in batch.items()}).loss)


def test_a_run_with_replay_stays_closer_to_the_base_models_own_replies(tmp_path, tiny_models):
    """The tiny model trained hard on the fixture, with and without replay: the one with
    replay keeps a lower loss on the base model's replies to the replay prompts."""
    settings = {"max_steps": 12, "lr": 3e-2, "micro_batch_size": 4, "grad_accum": 1, "lora_dropout": 0.0}
    with_it, result, run_dir, _ = train(tmp_path, tiny_models["llama"], name="replay", replay=0.5, **settings)
    kept = json.loads((run_dir.path / replay.RUN_FILE).read_text())
    assert kept["prompts"] == replay.replay_prompts() and len(kept["replies"]) == 48
    data = with_it.data
    assert isinstance(data.train, replay.MixedRows) and result.steps == 12  # the plan's steps, each larger
    replayed = data.train.replayed
    without, _, _, _ = train(tmp_path, tiny_models["llama"], name="plain", **settings)
    pad = with_it.tokenizer.pad_token_id
    near = _loss_on(with_it.accelerator.unwrap_model(with_it.model), replayed, pad)
    far = _loss_on(without.accelerator.unwrap_model(without.model), replayed, pad)
    assert near < far


def test_a_run_made_again_in_its_directory_reads_its_replies_instead_of_generating(tmp_path, tiny_models, monkeypatch):
    _, _, run_dir, _ = train(tmp_path, tiny_models["llama"], name="again", replay=0.25, max_steps=2)
    before = (run_dir.path / replay.RUN_FILE).read_text()

    def no_generation(*args, **kwargs):
        raise AssertionError("generated again")

    monkeypatch.setattr("llmcustoms.training.general_knowledge.answer_questions", no_generation)
    from llmcustoms.reporting import SilentReporter
    from llmcustoms.training.finetuner import FineTuner
    from test_finetuner import FIXTURES, Hardware, TrainOptions, prepare_run

    options = TrainOptions(data=str(FIXTURES / "alpaca.jsonl"), model=str(tiny_models["llama"]),
                           overrides={"max_steps": (2, "flag"), "replay": (0.25, "flag")})
    prepared = prepare_run(options, Hardware.cpu_only())
    FineTuner(prepared.plan, prepared.tokenizer, prepared.train, prepared.evaluation, run_dir, SilentReporter()).run()
    assert (run_dir.path / replay.RUN_FILE).read_text() == before


def test_the_next_run_of_the_same_model_beside_it_reads_the_replies_kept(tmp_path, tiny_models, monkeypatch):
    _, _, first, _ = train(tmp_path, tiny_models["llama"], name="first", replay=0.25, max_steps=2)

    def no_generation(*args, **kwargs):
        raise AssertionError("generated again")

    monkeypatch.setattr("llmcustoms.training.general_knowledge.answer_questions", no_generation)
    _, _, second, _ = train(tmp_path, tiny_models["llama"], name="second", replay=0.25, max_steps=2)
    assert (second.path / replay.RUN_FILE).read_text() == (first.path / replay.RUN_FILE).read_text()


def test_replay_is_off_for_preference_pairs_and_several_processes_and_says_why():
    from llmcustoms.planning.objective_kinds import objective_named

    plan = type("P", (), {"replay": 0.25, "objective": "sft", "world_size": 1,
                          "objective_kind": property(lambda p: objective_named(p.objective))})()
    assert replay.why_off(plan) is None
    plan.objective = "dpo"
    assert "preference pairs" in replay.why_off(plan)
    plan.objective, plan.world_size = "sft", 2
    assert "one process" in replay.why_off(plan)
    plan.replay = 0.0
    assert replay.why_off(plan) is None


def test_the_replay_prompts_share_no_question_with_the_check_or_the_general_rows():
    from llmcustoms.training.general_knowledge import load_questions
    from llmcustoms.training.general_text import general_messages

    prompts = replay.replay_prompts()
    probe = {q.question for q in load_questions()}
    chooser = {m[0]["content"] for m in general_messages()}
    assert len(prompts) == len(set(prompts)) == 48 and not (set(prompts) & (probe | chooser))
