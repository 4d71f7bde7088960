"""Measured memory and hardware use: every step row carries the memory used
since the row before, the run's peak is compared with the plan's prediction
for the batches it trained, and the GPU sampler reports without a GPU's help."""

from __future__ import annotations

import io
import json
import re
import sys
import time

import pytest
from rich.console import Console

from conftest import DATA_FILES
from llmcustoms.planning.memory import CUDA_CONTEXT_BYTES
from llmcustoms.commands.report import analyse
from llmcustoms.training import resource_use
from llmcustoms.training.resource_use import GpuSampler, OtherWork, ResourceUse, compare, predicted_at
from llmcustoms.runs.run_directory import RunDirectory
from llmcustoms.ui.train_progress import TrainingProgress
from llmcustoms.ui.train_view import RichReporter

MIB = 1024 ** 2
ESTIMATE = {"weights_bytes": 500 * MIB, "trainable_bytes": 20 * MIB, "gradients_bytes": 20 * MIB,
            "optimizer_bytes": 40 * MIB, "activations_bytes": 800 * MIB, "logits_bytes": 200 * MIB,
            "overhead_bytes": 100 * MIB, "budget_bytes": 8000 * MIB, "gathered_bytes": 0,
            "total_bytes": (500 + 20 + 40 + 1000 + 100) * MIB}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's peak resident size is Linux's")
def test_a_cpu_row_holds_the_peak_since_the_row_before_and_the_next_row_forgets_it():
    import torch

    use = ResourceUse(None)
    before = use.row(100)["memory_bytes"]
    block = torch.ones(300 * MIB // 4)  # 300 MiB touched, then freed before the row is read
    block.add_(1.0)
    del block
    during = use.row(100)["memory_bytes"]
    after = use.row(100)["memory_bytes"]
    # Freed before the row, yet its peak is there (most of it: under memory pressure from parallel
    # tests the kernel counted 273 of the 300 MiB once).
    assert during >= before + 200 * MIB
    assert after <= during - 250 * MIB  # a new interval: the freed block is not counted again
    assert use.peak == during


class SpikingAnswers:
    """Stands in for the sample replies and general questions: each answering
    touches `size` bytes for a moment, as a batch of 67 general questions does."""

    def __init__(self, size: int):
        self.size, self.labels = size, []

    def answer_in_run(self, processes, model, step, label, reporter, due=True) -> None:
        import torch

        block = torch.ones(self.size // 4)
        block.add_(1.0)
        self.labels.append(label)

    def cheap(self, training_seconds: float) -> bool:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's peak resident size is Linux's")
def test_the_base_models_answers_before_the_first_step_are_not_the_training_peak(tmp_path, tiny_models):
    from test_finetuner import train

    answers = SpikingAnswers(400 * MIB)
    _, result, run_dir, _ = train(tmp_path, tiny_models["llama"], tuner_args={"samples": answers},
                                  eval_every=2, max_steps=4)
    assert answers.labels[0] == "base" and "trained" in answers.labels  # it did answer before the first step
    steps = [r for r in run_dir.read_metrics() if "loss" in r]
    # A tiny model's steps use a few MiB: a first step that carried the answers' 400 MiB read 1.8x the plan.
    assert steps and max(r["memory_bytes"] for r in steps) < 200 * MIB
    assert result.memory["peak_bytes"] < 200 * MIB


@pytest.mark.skipif(not sys.platform.startswith("linux") or resource_use.LIBC is None,
                    reason="the kernel's peak resident size and glibc's heap")
def test_earlier_garbage_in_a_long_lived_process_does_not_hide_the_training_peak():
    # The summary test's flake in a parallel suite: the worker's heap held freed blocks of
    # earlier tests when the run began; handed back at the first row, they left the resident
    # size below the baseline, which then fell to a point holding the model: a peak of ~0.
    import torch

    blocks = [bytes(4000) for _ in range(150 * MIB // 4000)]
    kept = blocks[::64]  # what stays alive keeps free() from shrinking the heap: 150 MiB freed, resident
    del blocks
    use = ResourceUse(None)
    model = torch.ones(60 * MIB // 4)  # the model and its training state, held through the run
    model.add_(1.0)
    use.restart()
    for _ in range(3):
        activations = torch.ones(10 * MIB // 4)
        activations.add_(1.0)
        del activations
        use.row(100)
    assert use.peak >= 55 * MIB, use.peak  # the model is counted (before the fix: ~10 MiB, or 0)
    assert kept and model.sum() > 0


def test_evaluation_rows_do_not_count_towards_the_training_peak():
    use = ResourceUse(None)
    use.row()  # an evaluation row: no batch
    assert use.peak == 0 and use.batch_tokens == 0
    use.row(640)
    assert use.batch_tokens == 640


def test_the_prediction_compared_is_for_the_largest_micro_batch_trained():
    # Half the planned tokens: activations and logits halve, the rest stays.
    assert predicted_at(ESTIMATE, 1000, 2000) == (500 + 20 + 40 + 500 + 100) * MIB
    assert predicted_at(ESTIMATE, 4000, 2000) == ESTIMATE["total_bytes"]  # never above the plan's own
    # Tiny batches: the gradients, written as activations are freed, are the larger.
    assert predicted_at(ESTIMATE, 10, 2000) == (500 + 20 + 40 + 20 + 100) * MIB
    result = compare(900 * MIB, ESTIMATE, on_gpu=False, gpu_util=None, batch_tokens=1000, planned_tokens=2000)
    assert result["predicted_bytes"] == 1160 * MIB and result["ratio"] == round(900 / 1160, 3)
    assert result["plan_peak_bytes"] == ESTIMATE["total_bytes"] and result["budget_bytes"] == 8000 * MIB
    on_gpu = compare(900 * MIB, ESTIMATE, on_gpu=True, gpu_util=71.26, batch_tokens=2000, planned_tokens=2000)
    assert on_gpu["predicted_bytes"] == ESTIMATE["total_bytes"] - CUDA_CONTEXT_BYTES  # the allocator never sees it
    assert on_gpu["plan_peak_bytes"] == ESTIMATE["total_bytes"]  # the plan as its table shows it, one number
    assert on_gpu["gpu_util"] == 71.3
    assert compare(900 * MIB, None, False, None)["ratio"] is None  # a plan without an estimate


def test_the_gpu_sampler_averages_utilisation_and_keeps_the_most_memory_between_rows():
    readings = iter([(90.0, 5 * MIB), (70.0, 7 * MIB), (80.0, 6 * MIB)])
    sampler = GpuSampler(lambda: next(readings), interval=0.01).start()
    deadline = time.monotonic() + 5
    while len(sampler.utilisation) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    # The fourth read raises StopIteration: a driver that stops answering ends the thread, not the run.
    sampler.thread.join(timeout=5)
    assert not sampler.thread.is_alive()
    assert sampler.take() == {"gpu_util": 80.0, "gpu_memory_bytes": 7 * MIB}
    assert sampler.take() == {}  # nothing new since


def test_the_display_shows_memory_against_the_plan_and_the_budget_within_80_columns():
    progress = TrainingProgress(total_steps=60, start_step=0, now=0.0, memory=ESTIMATE)
    assert progress.resources_line() == "memory - (plan 1.62, budget 7.8)"
    progress.step({"step": 1, "loss": 2.0, "lr": 1e-4, "grad_norm": 0.53171, "tokens_per_s": 50.0, "seconds": 4.0,
                   "memory_bytes": int(1.21 * 1024 ** 3), "gpu_util": 87.4, "gpu_memory_bytes": 12 * 1024 ** 3},
                  now=5.0)
    assert progress.resources_line() == "memory 1.21 GiB (plan 1.62, budget 7.8)  grad norm 0.532  gpu 87% 12.0 GiB"
    reporter = RichReporter(Console(file=io.StringIO(), width=80))
    reporter.training_started(60, 0, ESTIMATE)
    try:
        reporter.step({"step": 1, "loss": 2.0, "lr": 1e-4, "grad_norm": 0.5, "tokens_per_s": 50.0, "seconds": 4.0,
                       "memory_bytes": 3 * 1024 ** 3})
        out = Console(file=io.StringIO(), width=80, color_system=None)
        out.print(reporter.render())
        lines = out.file.getvalue().splitlines()
        assert len(lines) == 3 and all(len(line) <= 80 for line in lines)
        assert lines[2].startswith("memory 3.00 GiB (plan 1.62, budget 7.8)  grad norm 0.5")
    finally:
        reporter.training_finished()


def write_run(tmp_path, memory: dict) -> RunDirectory:
    from test_report import plan_of

    run = RunDirectory(tmp_path / "run")
    run.create()
    run.write_plan(plan_of(4))
    for step in range(1, 5):
        run.append_metrics({"step": step, "loss": 2.0, "lr": 1e-4, "grad_norm": 0.5, "tokens_per_s": 900.0})
    run.write_status("completed", step=4, memory=memory)
    return run


@pytest.mark.parametrize("ratio, verdict, advice", [(1.02, "as planned", None), (1.6, "above plan", "leave more"),
                                                    (0.5, "below plan", "may fit")])
def test_the_report_flags_a_measured_peak_outside_the_estimates_range(tmp_path, ratio, verdict, advice):
    memory = {"peak_bytes": int(ratio * 1000 * MIB), "predicted_bytes": 1000 * MIB, "ratio": ratio,
              "budget_bytes": 8000 * MIB}
    report = analyse(write_run(tmp_path, memory))
    [finding] = [f for f in report.findings if f.topic == "memory"]
    assert finding.verdict == verdict and f"{ratio:.2f}x the estimate for the largest batch trained" in finding.detail
    said = [r for r in report.recommendations if f"{ratio:.2f}x the plan's estimate for the largest batch" in r]
    assert (advice is None and not said) or (advice is not None and advice in said[0])


def test_the_report_flags_an_under_used_gpu(tmp_path):
    memory = {"peak_bytes": 900 * MIB, "predicted_bytes": 1000 * MIB, "ratio": 0.9, "budget_bytes": 8000 * MIB,
              "gpu_util": 31.0}
    report = analyse(write_run(tmp_path, memory))
    [finding] = [f for f in report.findings if f.topic == "gpu"]
    assert finding.verdict == "under-used"
    assert any("busy only 31%" in r and "--batch-size" in r for r in report.recommendations)


def test_other_work_is_counted_in_threads_wanting_a_core(monkeypatch):
    """(wall s, the machine's busy CPU s, this process's CPU s) readings 10 s apart on 2 CPUs."""
    readings = iter([(0.0, 0.0, 0.0), (10.0, 11.0, 10.0), (20.0, 31.0, 25.0), (30.0, 51.0, 30.0), (30.01, 51.0, 30.0),
                     (40.0, 61.0, 35.0)])
    monkeypatch.setattr(resource_use, "cpu_seconds", lambda: next(readings))
    others = OtherWork(cpus=2)
    assert others.take(threads=1) == 0.1  # a CPU to spare: the others used what they wanted
    # Every CPU busy: 2 threads got 1.5 cores (0.75 each), so the others' 0.5 of a core was 0.67 threads wanting one.
    assert others.take(threads=2) == 0.67
    # 1 thread with half a core beside 1.5 cores of others: 3 threads wanting one each (a load of 3).
    assert others.take(threads=1) == 3.0
    assert others.take(threads=1) is None  # too soon to say: the next reading measures from the one before
    assert others.take(threads=1) == 0.5


@pytest.mark.slow
def test_a_cpu_run_measures_memory_on_every_step_and_compares_it_with_the_plan(tmp_path, tiny_models, cli):
    result = cli("train", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["llama"]), "--max-steps", "6",
                 "--batch-size", "4", "--grad-accum", "1", "--eval-every", "3", "--output-dir", str(tmp_path),
                 "--run-name", "run", "--yes")
    assert result.returncode == 0, result.stderr
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 6 and all(r["memory_bytes"] > 0 and r["batch_tokens"] > 0 for r in steps)
    # What the speed was measured beside; other work over at least 0.1 s (a tiny model's step is shorter).
    assert all(r["cpu_threads"] >= 1 for r in steps) and all(r["cpu_others"] >= 0 for r in rows if "cpu_others" in r)
    assert any("cpu_others" in r for r in rows)
    assert all("memory_bytes" in r for r in rows if "eval_loss" in r)
    memory = json.loads((run / "status.json").read_text())["memory"]
    plan = json.loads((run / "plan.json").read_text())
    assert memory["peak_bytes"] == max(r["memory_bytes"] for r in steps)
    assert memory["batch_tokens"] == max(r["batch_tokens"] for r in steps)
    assert memory["plan_peak_bytes"] == plan["memory"]["total_bytes"]
    assert memory["ratio"] == round(memory["peak_bytes"] / memory["predicted_bytes"], 3)
    summary = " ".join(result.stdout.split())  # the summary: peak, the plan's total (its table's), the ratio
    assert f"; plan {memory['plan_peak_bytes'] / 1024 ** 3:.2f} GiB" in summary and re.search(r"\d\.\d\dx", summary)
