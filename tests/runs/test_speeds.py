"""Honest durations: evaluation counted, and the speed measured on this machine
used (and said) once a model has trained here."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmcustoms.planning.hardware import Hardware
from llmcustoms.models.loading import choice_from_spec
from llmcustoms.planning.plan import DataStats
from llmcustoms.planning.planner import Planner
from llmcustoms.planning.presets import find_model_spec, load_families, load_preset
from llmcustoms.runs.speeds import FILE_NAME, measured_tokens_per_s, record_speed, with_measured_speeds

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"
FAMILIES = load_families()


def plan(hardware: Hardware, eval_rows: int = 100, **overrides):
    stats = DataStats(lengths=tuple([100] * 900), first_loss_positions=tuple([20] * 900), eval_rows=eval_rows)
    choice = choice_from_spec(find_model_spec(SMOL, FAMILIES), FAMILIES, "flag")
    return Planner(hardware, load_preset("quality"), None, ()).plan(
        choice, stats, {k: (v, "flag") for k, v in {"max_steps": 8, "method": "lora", **overrides}.items()})


def steps(*seconds: float, tokens_per_s: float = 100.0) -> list[dict]:
    return [{"step": i + 1, "loss": 1.0, "tokens_per_s": tokens_per_s, "seconds": s} for i, s in enumerate(seconds)]


def test_evaluation_is_part_of_the_estimate():
    machine = Hardware.cpu_only(cores=2)
    assert plan(machine, eval_rows=400).estimated_seconds > 1.5 * plan(machine, eval_rows=0).estimated_seconds


def test_a_measured_speed_replaces_the_nominal_one_and_the_plan_says_so(tmp_path):
    machine = Hardware.cpu_only(cores=2)
    nominal = plan(machine)
    assert any("rough: from this machine's nominal speed" in r for r in nominal.reasons)
    record_speed(tmp_path, machine, SMOL, "lora", steps(9.0, 2.0, 2.0, 2.0, tokens_per_s=50.0))
    measured_machine = with_measured_speeds(machine, tmp_path)
    assert measured_machine.measured_speed(SMOL, "lora") == pytest.approx(50.0)
    measured = plan(measured_machine)
    assert any("from the speed measured on this machine" in r for r in measured.reasons)
    no_evaluation = plan(measured_machine, eval_rows=0)
    tokens = 8 * no_evaluation.effective_batch_size * 100  # 8 steps of 100-token rows
    assert no_evaluation.estimated_seconds == pytest.approx(tokens / 50.0)
    assert measured.estimated_seconds > 8 * measured.effective_batch_size * 100 / 50.0  # and evaluation on top
    # Another machine, or another method, keeps the nominal estimate.
    assert with_measured_speeds(Hardware.cpu_only(cores=8), tmp_path).speeds == ()
    assert plan(measured_machine, method="full").estimated_seconds == plan(replace(machine), method="full").estimated_seconds


def test_the_warm_up_step_and_short_runs_are_not_measured(tmp_path):
    assert measured_tokens_per_s(steps(30.0, 1.0, 1.0, 1.0)) == pytest.approx(100.0)  # step 1 left out
    assert measured_tokens_per_s(steps(1.0, 1.0, 1.0)) is None  # two steps after the first: too few
    assert measured_tokens_per_s([{"step": 1, "loss": 1.0, "tokens_per_s": 5.0}] * 5) is None  # rows without time
    (tmp_path / FILE_NAME).write_text("{not json")
    assert with_measured_speeds(Hardware.cpu_only(), tmp_path).speeds == ()  # a damaged file is ignored
    record_speed(tmp_path, Hardware.cpu_only(), SMOL, "lora", steps(1.0, 1.0, 1.0, 1.0))  # and replaced
    assert with_measured_speeds(Hardware.cpu_only(), tmp_path).measured_speed(SMOL, "lora") == pytest.approx(100.0)
