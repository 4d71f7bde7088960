"""Honest durations: evaluation counted, and the speed measured on this machine
used (and said) once a model has trained here."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from llmcustoms.planning.hardware import Hardware
from llmcustoms.models.loading import choice_from_spec
from llmcustoms.planning.plan import DataStats
from llmcustoms.planning.planner import Planner
from llmcustoms.planning.presets import find_model_spec, load_families, load_preset
from llmcustoms.runs.speeds import (FILE_NAME, measured_beside, measured_tokens_per_s, record_speed, typical_speed,
                                    with_measured_speeds)

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"
FAMILIES = load_families()


def plan(hardware: Hardware, eval_rows: int = 100, **overrides):
    stats = DataStats(lengths=tuple([100] * 900), first_loss_positions=tuple([20] * 900), eval_rows=eval_rows)
    choice = choice_from_spec(find_model_spec(SMOL, FAMILIES), FAMILIES, "flag")
    return Planner(hardware, load_preset("quality"), None, ()).plan(
        choice, stats, {k: (v, "flag") for k, v in {"max_steps": 8, "method": "lora", "replay": 0, **overrides}.items()})


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
    assert no_evaluation.duration_parts["training"] == pytest.approx(tokens / 50.0, abs=0.05)  # the steps' part
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


def cpu_steps(tokens_per_s: float, others: float, threads: int) -> list[dict]:
    return [{**row, "cpu_others": others, "cpu_threads": threads} for row in steps(9.0, 2.0, 2.0, 2.0, tokens_per_s=tokens_per_s)]


def test_one_run_under_heavy_load_does_not_become_the_machines_speed(tmp_path):
    machine = Hardware.cpu_only(cores=2)
    for _ in range(4):
        record_speed(tmp_path, machine, SMOL, "lora", cpu_steps(100.0, 0.1, 2))
    # Beside 6 threads of other work (a load of 6 on 2 cores), with 1 thread: 7x slower than idle.
    record_speed(tmp_path, machine, SMOL, "lora", cpu_steps(100.0 / 7, 6.0, 1))
    kept = json.loads((tmp_path / FILE_NAME).read_text())[machine.machine_key][f"{SMOL}|lora"]
    assert len(kept) == 5 and kept[-1] == {"tokens_per_s": 14.29, "load": 6.0, "threads": 1}
    measured = with_measured_speeds(machine, tmp_path).measured_speed(SMOL, "lora")
    assert measured == pytest.approx(105.0, rel=0.01)  # the idle runs' 100 tokens/s beside 0.1 others: 1.05x
    # An outlier the load does not explain is outvoted by the median.
    record_speed(tmp_path, machine, SMOL, "lora", cpu_steps(3.0, 0.0, 2))
    assert with_measured_speeds(machine, tmp_path).measured_speed(SMOL, "lora") == pytest.approx(105.0, rel=0.01)
    assert len(json.loads((tmp_path / FILE_NAME).read_text())[machine.machine_key][f"{SMOL}|lora"]) == 5  # the last 5
    # Today's load applies to the idle speed: the plan on a busy machine is longer by its slow-down.
    idle, busy = plan(with_measured_speeds(machine, tmp_path)), plan(with_measured_speeds(replace(machine, cpu_load=2.9), tmp_path))
    def slowed(plan) -> float:  # every part the load slows: all but reading and writing the weights
        return sum(v for part, v in plan.duration_parts.items() if part != "loading and saving")

    assert slowed(busy) == pytest.approx(3.9 * slowed(idle), rel=1e-3)
    assert any("from the speed measured on this machine" in r and "the machine is busy (load 2.9 on 2 cores)" in r
               for r in busy.reasons)


def test_speeds_json_of_one_number_per_key_still_reads_and_grows_into_a_list(tmp_path):
    machine = Hardware.cpu_only(cores=2)
    (tmp_path / FILE_NAME).write_text(json.dumps({machine.machine_key: {f"{SMOL}|lora": 50.0, f"{SMOL}|full": "x"}}))
    assert with_measured_speeds(machine, tmp_path).speeds == ((f"{SMOL}|lora", 50.0),)
    record_speed(tmp_path, machine, SMOL, "lora", steps(9.0, 2.0, 2.0, 2.0, tokens_per_s=70.0))  # rows without load
    kept = json.loads((tmp_path / FILE_NAME).read_text())[machine.machine_key][f"{SMOL}|lora"]
    assert kept == [{"tokens_per_s": 50.0}, {"tokens_per_s": 70.0}]
    assert with_measured_speeds(machine, tmp_path).measured_speed(SMOL, "lora") == pytest.approx(60.0)


def test_a_gpus_speed_is_kept_as_measured():
    rows = cpu_steps(100.0, 6.0, 1)
    gpu = Hardware.with_gpu(24)
    assert measured_beside(rows) == {"load": 6.0, "threads": 1} and measured_beside(steps(1.0, 1.0)) == {}
    assert typical_speed([{"tokens_per_s": 100.0, "load": 6.0, "threads": 1}], gpu.cpu_cores, gpu.has_gpu) == 100.0
