"""A machine busy with other work: the plan trains with the cores left free, says
so, and stretches its estimate by the share of the CPU the run will get."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmcustoms.planning import hardware
from llmcustoms.planning.cpu_share import cores_taken, slowdown_for
from llmcustoms.planning.hardware import Hardware, omp_threads, other_load
from llmcustoms.planning.plan import Plan
from llmcustoms.planning.planner import Planner
from llmcustoms.planning.presets import load_preset
from test_planning import CATALOG, model, plan_for, stats

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
TWO_CORES = Hardware.cpu_only(ram_gib=16, cores=2)
STEPS = {"max_steps": 8}


def busy_reasons(plan: Plan) -> list[str]:
    return [r for r in plan.reasons if "busy" in r]


def test_a_busy_machine_trains_with_the_free_cores_and_the_plan_says_why_and_how_long():
    idle = plan_for(replace(TWO_CORES, cpu_load=0.1), SMOLLM2, STEPS)
    busy = plan_for(replace(TWO_CORES, cpu_load=2.9), SMOLLM2, STEPS)
    assert busy.cpu_threads == 1 and busy.sources["cpu_threads"] == "planner"
    assert "threads 1: the machine is busy (load 2.9 on 2 cores), so 1 thread, not 2 (OMP_NUM_THREADS sets it)" \
        in busy.reasons
    [duration] = [r for r in busy.reasons if r.startswith("estimated duration")]
    # 1 thread beside 2.9 threads of other work gets 2 / 3.9 of a core: 3.9x an idle machine's 2 cores.
    assert ("the machine is busy (load 2.9 on 2 cores): the estimate assumes it stays this busy; "
            "about 3.9x longer than on an idle machine") in duration
    unknown = plan_for(TWO_CORES, SMOLLM2, STEPS)  # no load average (Windows): an idle machine's estimate

    def computed(plan: Plan) -> float:  # all but starting and the disk, which other work slows little
        return plan.estimated_seconds - plan.duration_parts["loading and saving"]
    assert computed(busy) == pytest.approx(3.9 * computed(unknown), rel=1e-3)
    assert computed(idle) == pytest.approx(1.05 * computed(unknown), rel=1e-3)  # 2 threads beside 0.1

    assert idle.cpu_threads == 2 and "threads 2: one per physical core" in idle.reasons
    assert busy_reasons(idle) == [] and idle.warnings == busy.warnings == ()
    assert unknown.cpu_threads == 2 and busy_reasons(unknown) == []


def test_omp_num_threads_wins_and_the_plan_names_it():
    for load in (None, 2.9):
        plan = plan_for(replace(TWO_CORES, cpu_load=load, omp_threads=1), SMOLLM2, STEPS)
        assert plan.cpu_threads == 1 and "threads 1: OMP_NUM_THREADS" in plan.reasons
        assert plan.sources["cpu_threads"] == "env OMP_NUM_THREADS"
    idle_one = plan_for(replace(TWO_CORES, omp_threads=1), SMOLLM2, STEPS)
    assert any("1 thread on 2 cores: about 2x longer than with one per core" in r for r in idle_one.reasons)
    # More threads than free cores on a busy machine: kept, with a warning that fewer would be faster.
    crowded = plan_for(replace(TWO_CORES, cpu_load=2.9, omp_threads=2), SMOLLM2, STEPS)
    assert crowded.cpu_threads == 2
    [warning] = crowded.warnings
    assert "OMP_NUM_THREADS=2 on a busy machine (load 2.9 on 2 cores)" in warning and "1 would be faster" in warning


def test_processes_share_the_free_cores_and_a_gpu_keeps_torchs_threads():
    four = replace(Hardware.cpu_only(ram_gib=64, cores=4), cpu_load=1.2)
    plan = Plan.from_json(plan_for(four, SMOLLM2, STEPS).to_json())
    assert plan.cpu_threads == 3
    gpu = plan_for(replace(Hardware.with_gpu(24), cpu_load=30.0), SMOLLM2, STEPS)
    assert gpu.cpu_threads == 0 and "cpu_threads" not in gpu.sources
    assert not any(r.startswith("threads") for r in gpu.reasons) and busy_reasons(gpu) == []
    old = plan.to_json()
    del old["cpu_threads"]
    assert Plan.from_json(old).cpu_threads == 0  # written before: one per physical core, as then


def test_the_slow_down_follows_the_share_of_the_cpu_the_run_gets():
    assert slowdown_for(2, None, 2) == slowdown_for(2, 0.0, None) == 1.0
    assert slowdown_for(2, 0.0, 1) == 2.0  # half the cores
    assert slowdown_for(2, 2.9, 1) == pytest.approx(3.9)
    assert slowdown_for(2, 2.9, 2) == pytest.approx(2.45)  # all cores, shared with 2.9 others
    assert [cores_taken(2, load) for load in (None, 0.4, 0.5, 1.6, 9.0)] == [0, 0, 1, 2, 2]


def test_detection_reads_the_load_less_this_process_and_omp_num_threads(monkeypatch):
    monkeypatch.setattr(hardware, "_busy_now", lambda: None)  # where it cannot be measured: the load average
    monkeypatch.setattr(hardware, "_load_average", lambda: 3.0)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    found = hardware.detect()
    assert 2.0 < found.cpu_load <= 3.0 and found.omp_threads == 1
    monkeypatch.setattr(hardware, "_load_average", lambda: None)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert hardware.detect().cpu_load is None and hardware.detect().omp_threads is None
    # A process that kept a core busy for the last two minutes made most of a load of 1 itself.
    assert other_load(1.0, 120.0, 120.0) == pytest.approx(0.14, abs=0.01)
    assert other_load(3.0, 0.5, 10.0) == pytest.approx(3.0, abs=0.01)
    assert [omp_threads(v) for v in ("4", " 2,1", "", None, "0", "x")] == [4, 2, None, None, None, None]


def test_several_processes_share_the_free_cores_and_say_so():
    four = Hardware.cpu_only(ram_gib=64, cores=4)
    idle = Planner(four, load_preset("quality"), catalog=CATALOG).plan(model(SMOLLM2), stats(), {}, world_size=2)
    assert idle.cpu_threads == 2 and "threads 2 per process: one per physical core, shared by 2 processes" in idle.reasons
    busy = Planner(replace(four, cpu_load=2.0), load_preset("quality"), catalog=CATALOG).plan(
        model(SMOLLM2), stats(), {}, world_size=2)
    assert busy.cpu_threads == 1
    assert ("threads 1 per process: the machine is busy (load 2.0 on 4 cores), so 1 thread per process, not 2 "
            "(OMP_NUM_THREADS sets it)") in busy.reasons


def test_the_cpu_use_measured_now_wins_over_the_lagging_load_average(monkeypatch):
    monkeypatch.setattr(hardware, "_load_average", lambda: 1.9)  # a test suite that ended a minute ago
    monkeypatch.setattr(hardware, "_busy_now", lambda: 0.05)
    assert hardware.detect().cpu_load == 0.05

