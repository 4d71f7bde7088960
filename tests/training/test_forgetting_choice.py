"""Forgetting in the choices a run makes (`training/general_text.py`): every
evaluation measures the loss on general rows never trained on; the weights kept
and early stopping count only evaluations within `--forgetting-limit`."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from llmcustoms.training.evaluation import Evaluation
from llmcustoms.training.general_text import forgetting, general_messages, within_limit
from llmcustoms.training.position import Position, StopCause
from test_finetuner import adapter_tensors, max_difference, train


def evaluated(position: Position, step: int, eval_loss: float, general: float, limit: float = 0.1, patience: int = 0):
    position.step = step
    return position.early_stop(eval_loss, patience, general, limit)


def test_the_best_is_the_lowest_eval_loss_among_evaluations_within_the_limit():
    position = Position(base_general=2.0)
    evaluated(position, 2, 1.5, 2.1)  # +5%: within
    evaluated(position, 4, 1.0, 2.5)  # the lowest eval loss, but +25%
    assert (position.best_step, position.evals_since_best) == (2, 1)
    evaluated(position, 6, 1.2, 2.19)  # +9.5%: within, and better than step 2
    assert (position.best_step, position.best_eval, position.best_within) == (6, 1.2, True)
    assert "general loss +9.5% against the base model, within the 10% limit" in position.forgetting_text(0.1)


def test_when_none_is_within_the_one_that_forgot_least_is_kept_and_early_stopping_counts_no_progress():
    position = Position(base_general=2.0)
    assert evaluated(position, 2, 1.5, 2.6, patience=3) is None
    assert evaluated(position, 4, 1.0, 2.4, patience=3) is None  # forgot less: kept, not progress
    assert (position.best_step, position.best_within) == (4, False)
    stop = evaluated(position, 6, 0.9, 2.8, patience=3)
    assert position.best_step == 4 and stop.cause is StopCause.EARLY_STOPPING
    assert "none of 3 evaluations forgot within the limit" in stop.text
    assert "no evaluation stayed within the 10% forgetting limit" in position.forgetting_text(0.1)
    # One within the limit, however worse its eval loss, is preferred to any beyond it.
    evaluated(position, 8, 1.4, 2.1)
    assert (position.best_step, position.best_within, position.evals_since_best) == (8, True, 0)


def test_no_limit_or_no_measure_chooses_by_eval_loss_alone():
    for limit, general in ((0.0, 9.0), (0.1, None)):
        position = Position(base_general=2.0)
        evaluated(position, 2, 1.5, general, limit)
        evaluated(position, 4, 1.0, general, limit)
        assert position.best_step == 4
    assert within_limit(None, 3.0, 0.1) and forgetting(2.0, 2.2) == pytest.approx(0.1)


def test_the_general_rows_are_tokenized_in_the_runs_format_with_only_the_replies_learned(tiny_models):
    from test_finetuner import FIXTURES, TrainOptions, prepare_run, Hardware
    from llmcustoms.training.general_text import general_rows

    options = TrainOptions(data=str(FIXTURES / "alpaca.jsonl"), model=str(tiny_models["llama"]),
                           overrides={"max_steps": (2, "flag")})
    prepared = prepare_run(options, Hardware.cpu_only())
    rows = general_rows(prepared.tokenizer, prepared.plan)
    assert len(rows) == len(general_messages()) == 48
    first, reply = rows[0], general_messages()[0][1]["content"]
    learned = [t for t, label in zip(first.input_ids, first.labels) if label != -100]
    # The reply, learned (cut at the plan's max_seq_len on this tiny tokenizer); the prompt is not.
    assert prepared.tokenizer.decode(learned).startswith(reply[:40]) and len(learned) < len(first.input_ids)
    assert max(len(row.input_ids) for row in rows) <= prepared.plan.max_seq_len
    from dataclasses import replace
    assert general_rows(prepared.tokenizer, replace(prepared.plan, objective="dpo")) is None


def test_a_rigged_run_keeps_the_best_weights_within_the_forgetting_limit(tmp_path, tiny_models, monkeypatch):
    """Evaluations scripted (eval loss, general loss): step 2 has the lowest eval
    loss but forgot 25%; step 4 forgot 5%; step 6 forgot 50%. The adapter is step 4's."""
    script = {0: (3.0, 2.0), 2: (1.0, 2.5), 4: (1.2, 2.1), 6: (0.9, 3.0)}
    real_loss = Evaluation.loss

    def scripted(self, model, step, lower, stop=None):
        real_loss(self, model, step, lower, stop)  # measured, so the general rows really run
        assert "general_loss" in self.metrics
        eval_loss, general = script[step]
        self.metrics["general_loss"] = general
        return eval_loss

    monkeypatch.setattr(Evaluation, "loss", scripted)
    tuner, result, run_dir, _ = train(tmp_path, tiny_models["llama"], max_steps=6, eval_every=2,
                                      early_stopping_patience=0, micro_batch_size=4, forgetting_limit=0.1)
    status = json.loads(run_dir.status_path.read_text())
    assert status["kept_step"] == 4 and result.best_eval_step == 4
    assert status["forgetting"] == pytest.approx(0.05) and result.forgetting == pytest.approx(0.05)
    assert "general loss +5.0% against the base model, within the 10% limit" in status["kept"]
    kept = {k.replace(".default", ""): v for k, v in load_file(str(run_dir.best_path / "step-000004.safetensors")).items()}
    assert max_difference(adapter_tensors(run_dir), kept) < 1e-6  # the adapter is step 4's weights
    general = [row["general_loss"] for row in run_dir.read_metrics() if "general_loss" in row]
    assert general == [2.0, 2.5, 2.1, 3.0]  # every evaluation records what it forgot


def test_no_general_rows_for_a_stand_in_tokenizer_or_a_template_that_refuses_them(tiny_models):
    """Forgetting is a measure, never worth the run: without rows the run trains as before."""
    from dataclasses import replace

    from test_finetuner import FIXTURES, Hardware, TrainOptions, prepare_run
    from llmcustoms.training.general_text import general_rows

    class PadOnly:  # what the benchmarks time the loop with
        pad_token_id = 0

    options = TrainOptions(data=str(FIXTURES / "alpaca.jsonl"), model=str(tiny_models["llama"]),
                           overrides={"max_steps": (2, "flag")})
    prepared = prepare_run(options, Hardware.cpu_only())
    assert general_rows(PadOnly(), prepared.plan) is None
    tokenizer = prepared.tokenizer
    template = tokenizer.chat_template
    tokenizer.chat_template = "{{ raise_exception('only system turns') }}"
    try:
        assert general_rows(tokenizer, replace(prepared.plan, data_format="sharegpt")) is None
    finally:
        tokenizer.chat_template = template
