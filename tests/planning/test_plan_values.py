"""A plan.json edited by hand or damaged: each field is checked against the
plan's annotations and ranges, and what is wrong names the field (issue 46, item 8)."""

from __future__ import annotations

import json

import pytest

from llmcustoms.planning.plan import Plan
from llmcustoms.planning.plan_values import PlanDamaged, plan_problem


def valid_plan() -> dict:
    """A whole plan.json of a LoRA run, as `train` writes one (the fields without a default, and a few with)."""
    return dict(model="model", family="llama", model_type="llama", preset="quality", method="lora",
                micro_batch_size=8, grad_accum=1, effective_batch_size=8, max_seq_len=64, gradient_checkpointing=False,
                mixed_precision="bf16", lr=5e-4, lr_scheduler="cosine", warmup_steps=0, weight_decay=0.0,
                max_grad_norm=1.0, epochs=4.0, steps_per_epoch=6, total_steps=2, eval_every=0,
                early_stopping_patience=0, save_every=5, keep_checkpoints=3, seed=42, train_on_prompt=False,
                trust_remote_code=False, train_rows=48, eval_rows=0,
                lora={"r": 16, "alpha": 32, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]},
                memory={"total_bytes": 112601728}, estimated_seconds=None, eval_data=None, reasons=["why"],
                sources={"lr": "preset"}, model_fingerprint={"config.json": "abc"}, data_report={"rows": 48})


def test_a_whole_plan_loads_and_round_trips():
    plan = Plan.from_json(valid_plan())
    assert plan.lr == 5e-4 and plan.lora.target_modules == ("q_proj", "v_proj")
    assert Plan.from_json(json.loads(plan.dumps())) == plan


@pytest.mark.parametrize("change,named", [
    ({"lr": "5e-4"}, '"lr" is the text "5e-4", where a number belongs'),
    ({"micro_batch_size": 0}, '"micro_batch_size" is 0, where it must be at least 1'),
    ({"grad_accum": -2}, '"grad_accum" is -2, where it must be at least 1'),
    ({"total_steps": [2]}, '"total_steps" is a list, where a whole number belongs'),
    ({"total_steps": 2.5}, '"total_steps" is 2.5, where a whole number belongs'),
    ({"warmup_steps": -1}, '"warmup_steps" is -1, where it must be at least 0'),
    ({"epochs": 0}, '"epochs" is 0, where it must be above 0'),
    ({"lr": float("nan")}, '"lr" is NaN, where a number belongs'),
    ({"eval_split": 1.0}, '"eval_split" is 1.0, where it must be below 1'),
    ({"gradient_checkpointing": 1}, '"gradient_checkpointing" is 1, where true or false belongs'),
    ({"seed": True}, '"seed" is true, where a whole number belongs'),
    ({"method": "lorax"}, '"method" is the text "lorax", where one of lora, qlora, full belongs'),
    ({"distributed": "ddpp"}, '"distributed" is the text "ddpp", where one of none, ddp, fsdp belongs'),
    ({"model": None}, '"model" is null, where text belongs'),
    ({"lora": [16]}, '"lora" is a list, where an object of fields belongs'),
    ({"lora": {"r": "8", "alpha": 32, "dropout": 0.0, "target_modules": []}},
     '"lora.r" is the text "8", where a whole number belongs'),
    ({"lora": {"r": 0, "alpha": 32, "dropout": 0.0, "target_modules": []}}, '"lora.r" is 0, where it must be at least 1'),
    ({"lora": {"r": 8, "alpha": 32, "dropout": 0.0}}, '"lora.target_modules" is missing'),
    ({"reasons": "why"}, '"reasons" is the text "why", where a list of text belongs'),
    ({"reasons": ["why", 3]}, '"reasons" holds 3, where only text belongs'),
    ({"memory": {"total_bytes": "big"}}, '"memory.total_bytes" is the text "big", where a number belongs'),
    ({"sources": {"lr": 1}}, '"sources.lr" is 1, where text belongs'),
    ({"data_report": []}, '"data_report" is a list, where an object belongs'),
    ({"estimated_seconds": -3.0}, '"estimated_seconds" is -3.0, where it must be at least 0'),
])
def test_a_damaged_field_is_named_with_what_belongs_there(change, named):
    with pytest.raises(PlanDamaged) as damaged:
        Plan.from_json({**valid_plan(), **change})
    assert str(damaged.value) == named


def test_a_missing_field_and_a_plan_that_is_not_an_object_are_named():
    data = valid_plan()
    del data["total_steps"]
    with pytest.raises(PlanDamaged, match='"total_steps" is missing'):
        Plan.from_json(data)
    for not_an_object in ([], None, "plan", 3):
        with pytest.raises(PlanDamaged, match="it is .*, where an object of fields belongs"):
            Plan.from_json(not_an_object)


def test_what_may_be_there_loads():
    """An int where a float belongs, null where null may be, a full run without LoRA, and
    keys a newer version wrote (at the top and in lora) all load."""
    data = {**valid_plan(), "lr": 1, "epochs": 2, "eval_data": None, "future_field": [1, 2]}
    data["lora"] = {**data["lora"], "future_key": True}
    plan = Plan.from_json(data)
    assert plan.lr == 1 and plan.lora.r == 16
    assert Plan.from_json({**valid_plan(), "method": "full", "lora": None}).lora is None


def test_a_listing_checks_only_the_fields_there():
    assert plan_problem(Plan, {"model": "/models/tiny", "method": "lora", "total_steps": 100}, complete=False) is None
    assert plan_problem(Plan, {"model": "m", "total_steps": "100"}, complete=False) == \
        '"total_steps" is the text "100", where a whole number belongs'
    assert plan_problem(Plan, {"model": "m"}) == '"family" is missing'


def test_a_long_text_is_shown_cut_short():
    with pytest.raises(PlanDamaged) as damaged:
        Plan.from_json({**valid_plan(), "lr": "x" * 500})
    assert len(str(damaged.value)) < 100 and '..."' in str(damaged.value)
