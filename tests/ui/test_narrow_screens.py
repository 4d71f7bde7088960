"""Every screen whole on an 80-column terminal: no value cut short with "…",
no number or label torn from its value across lines, no line wider than the
terminal; and `hardware` within an 80x24 screen. At 200 columns the same
screens still show everything."""

from __future__ import annotations

import io
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest
from rich.console import Console

from llmcustoms.planning.fitting import fit_table
from llmcustoms.planning.hardware import Gpu, Hardware
from llmcustoms.planning.presets import load_families
from llmcustoms.ui.train_view import RichReporter
from llmcustoms.ui.tune_view import trials_table

GIB = 1024 ** 3


def render(renderable: object, width: int) -> str:
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def assert_fits(text: str, width: int) -> list[str]:
    lines = text.splitlines()
    assert "…" not in text, text
    assert max(len(line) for line in lines) <= width, text
    return lines


def cells(line: str) -> str:
    """A table line without its rules, so a row reads as its values."""
    return " ".join(re.sub(r"[│┃]", " ", line).split())


# ------------------------------------------------------------------ tune

TRIALS = [
    {"trial": 0, "state": "complete", "eval_loss": 1.23456, "best": False, "lr": 2.0e-4, "lora_r": 16,
     "alpha_ratio": 2.0, "lora_dropout": 0.05, "warmup_ratio": 0.03, "steps": 60, "budget": 60, "seconds": 228.4,
     "reason": "", "preset": True},
    {"trial": 1, "state": "pruned", "eval_loss": 1.5, "best": False, "lr": 2.81e-4, "lora_r": 64, "alpha_ratio": 0.5,
     "lora_dropout": 0.1, "warmup_ratio": 0.1, "steps": 20, "budget": 60, "seconds": 75.0,
     "reason": "pruned at step 20 of 60: not in the best third at step 20"},
    {"trial": 12, "state": "complete", "eval_loss": 1.1, "best": True, "lr": 1.234e-5, "lora_r": 8,
     "alpha_ratio": 1.0, "lora_dropout": 0.0, "warmup_ratio": 0.05, "steps": 1000, "budget": 1000,
     "seconds": 2281.0, "reason": ""},
    {"trial": 13, "state": "running", "eval_loss": None, "best": False, "lr": 2.81e-4, "lora_r": 32,
     "alpha_ratio": 2.0, "lora_dropout": 0.05, "warmup_ratio": 0.0, "steps": 40, "budget": 60, "seconds": 22812.0,
     "reason": ""},
    {"trial": 1014, "state": "interrupted", "eval_loss": None, "best": False, "lr": 2.81e-4, "lora_r": 128,
     "alpha_ratio": 0.5, "lora_dropout": 0.05, "warmup_ratio": 0.0, "steps": None, "budget": 60, "seconds": None,
     "reason": "interrupted by SIGINT at step 7"},
]
# Each trial's values, in the table's order: the row must read them whole.
TRIAL_ROWS = {
    0: r"0 complete 1\.2346 2\.00e-04 16 2 0\.05 0\.03 60/60 228s",
    1: r"1 pruned 1\.5000 2\.81e-04 64 0\.5 0\.1 0\.1 20/60 75s",
    12: r"12 complete 1\.1000 1\.23e-05 8 1 0 0\.05 1000/1000 2281s",
    13: r"13 running 2\.81e-04 32 2 0\.05 0 40/60 22812s",
    1014: r"1014 interrupted 2\.81e-04 128 0\.5 0\.05 0",
}


@pytest.mark.parametrize("width", [80, 200])
def test_the_trials_table_shows_every_value_whole(width):
    text = render(trials_table(TRIALS), width)
    rows = [cells(line) for line in assert_fits(text, width)]
    for trial, values in TRIAL_ROWS.items():
        assert any(re.match(values, row) for row in rows), f"trial {trial} not whole:\n{text}"
    flat = " ".join(text.split())  # a note may wrap, at its spaces
    for note in ("the preset's own values", "pruned at step 20 of 60: not in the best third at step 20",
                 "interrupted by SIGINT at step 7"):
        assert note in flat, note


def test_the_trials_table_keeps_its_notes_beside_the_rows_when_wide():
    rows = [cells(line) for line in render(trials_table(TRIALS), 200).splitlines()]
    assert any(row.startswith("1 pruned") and row.endswith("not in the best third at step 20") for row in rows)


# ---------------------------------------------------- the live training display


def live_display(width: int, dpo: bool) -> str:
    reporter = RichReporter(Console(file=io.StringIO(), width=width))
    reporter.training_started(12000, 0, {"total_bytes": int(13.62 * GIB), "budget_bytes": int(79.2 * GIB)})
    try:
        row = {"step": 1234, "epoch": 12.34, "loss": 1.2345, "lr": 2.81e-4, "grad_norm": 1234.5,
               "tokens_per_s": 123456.0, "seconds": 41.0, "memory_bytes": int(12.21 * GIB), "gpu_util": 100.0,
               "gpu_memory_bytes": int(78.5 * GIB), **({"reward_accuracy": 0.625} if dpo else {})}
        reporter.step(row)
        reporter.evaluated({"step": 1200, "eval_loss": 1.3012, **({"eval_reward_accuracy": 0.5} if dpo else {})})
        for _ in range(2):  # two more evaluations without a better loss: the plateau line
            reporter.evaluated({"step": 1200, "eval_loss": 1.4, **({"eval_reward_accuracy": 0.5} if dpo else {})})
        reporter.activity("writing checkpoint 1200/12000")
        reporter.progress.activity_since -= 4
        return render(reporter.render(), width)
    finally:
        reporter.training_finished()


@pytest.mark.parametrize("width", [80, 200])
@pytest.mark.parametrize("dpo", [False, True])
def test_the_live_display_keeps_each_number_with_its_label(width, dpo):
    text = live_display(width, dpo)
    lines = assert_fits(text, width)
    parts = ["1234/12000", "epoch 12.34", "123,456 tok/s", "grad norm 1.23e+03", "gpu 100% 78.5 GiB",
             "memory 12.21 GiB (plan 13.62, budget 79.2)"]
    parts += (["loss 1.2345 acc 0.62", "eval 1.4000 acc 0.50 @1200"] if dpo else
              ["loss 1.2345", "eval 1.4000 @1200", "lr 2.8e-04"])
    for part in parts:
        assert any(part in line for line in lines), f"{part!r} not on one line:\n{text}"
    assert any(re.search(r"elapsed \d+:\d\d:\d\d", line) for line in lines)
    assert any(re.search(r"eta \d+:\d\d:\d\d", line) for line in lines)
    assert any(re.search(r"writing checkpoint 1200/12000 0:00:0\d", line) for line in lines)
    assert "(best 1.3012 @1200)" in " ".join(text.split())


# ------------------------------------------------------------------ runs


def write_run(root: Path, name: str, model: str, status: str, step: int, total: int, best: float | None,
              base: float | None, seconds: float, objective: str = "sft", **extra) -> None:
    run = root / name
    run.mkdir(parents=True)
    (run / "plan.json").write_text(json.dumps({"model": model, "method": "qlora" if "7B" in model else "lora",
                                               "total_steps": total, "objective": objective}))
    (run / "status.json").write_text(json.dumps({
        "status": status, "step": step, "best_eval_loss": best, "base_eval_loss": base, "training_seconds": seconds,
        "started_at": "2025-01-01T12:00:00+0000", "updated_at": "2025-01-01T15:00:00+0000", **extra}))


# Longer than the old table's name column could hold on a line at 80 columns (it folded
# names over three lines); a name over 80 characters can only be folded.
LONG_NAME = "Qwen2.5-0.5B-Instruct-my-own-long-preset-name-for-tickets-20250101-120000"


@pytest.fixture
def runs_dir(tmp_path) -> Path:
    root = tmp_path / ("a-long-directory-name-for-the-runs-of-this-project/" * 3) / "runs"
    assert len(str(root)) > 100
    write_run(root, LONG_NAME, "Qwen/Qwen2.5-0.5B-Instruct", "completed", 1234, 12000, 1.2345, 1.9, 3 * 3600 + 1234,
              memory={"peak_bytes": int(5.5 * GIB), "ratio": 1.07}, kept_step=1100, last_output="last")
    write_run(root, "Mistral-7B-Instruct-v0.3-quality-20250102-083000", "mistralai/Mistral-7B-Instruct-v0.3",
              "interrupted", 12, 5000, None, None, 65)
    write_run(root, "dpo", "/models/tiny-llama", "failed", 30, 30, 0.5, 0.6931, 754, objective="dpo")
    return root


RUN_VALUES = [LONG_NAME, "Qwen2.5-0.5B-Instruct", "qlora", "completed", "1234/12000", "kept 1100", "3.437", "-49%",
              "3h 20m 34s", "5.5G", "1.07x", "Mistral-7B-Instruct-v0.3-quality-20250102-083000",
              "Mistral-7B-Instruct-v0.3", "interrupted", "12/5000", "1m 05s", "dpo", "tiny-llama", "lora", "failed",
              "30/30", "dpo loss 0.500", "12m 34s"]


@pytest.mark.parametrize("width", [80, 200])
def test_runs_shows_each_name_and_value_whole(runs_dir, cli, clean_environment, width):
    result = cli("runs", "--output-dir", str(runs_dir), env={"COLUMNS": str(width)})
    assert result.returncode == 0, result.stderr
    assert_fits(result.stdout, width)
    for value in RUN_VALUES:
        assert value in result.stdout, f"{value!r} not whole:\n{result.stdout}"


def test_runs_give_each_run_one_line_when_wide(runs_dir, cli, clean_environment):
    lines = cli("runs", "--output-dir", str(runs_dir), env={"COLUMNS": "200"}).stdout.splitlines()
    row = next(line for line in lines if LONG_NAME in line)
    assert all(value in row for value in ("Qwen2.5-0.5B-Instruct (lora)", "completed", "1234/12000", "3.437"))


# ------------------------------------------------------------------ hardware


def test_hardware_fits_an_80x24_screen(cli, clean_environment):
    result = cli("hardware", env={"COLUMNS": "80", "LINES": "24"})
    assert result.returncode == 0, result.stderr
    lines = assert_fits(result.stdout, 80)
    assert len(lines) <= 23, f"{len(lines)} lines: the top scrolls off (the prompt takes the 24th)\n{result.stdout}"
    for value in ("CPU cores", "RAM", "GiB available", "precision", "What fits in", "mistral", "smollm2",
                  "0.1-0.4B", "yes N (micro-batch up to N)", "qwen3", "gemma3", "llama3", "smollm3"):
        assert value in result.stdout, value


def shown(show: Callable[..., None], *args: object, width: int) -> str:
    """What a `show_...` function of ui/console.py prints, at `width` columns."""
    import llmcustoms.ui.console as ui

    saved, ui.console = ui.console, Console(file=io.StringIO(), width=width, record=True, color_system=None)
    try:
        show(*args)
        return ui.console.export_text()
    finally:
        ui.console = saved


def show_hardware(width: int, hardware: Hardware, where: str) -> str:
    import llmcustoms.ui.hardware_view as view

    fits = fit_table(hardware, load_families())
    saved, view.console = view.console, Console(file=io.StringIO(), width=width, record=True, color_system=None)
    try:
        view.show_hardware(hardware, fits, {m.hub_id: where for m in fits.models})
        return view.console.export_text()
    finally:
        view.console = saved


H100 = Hardware.with_gpu(79.19, name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0))
CPU = Hardware.cpu_only(ram_gib=23.54, cores=2)


@pytest.mark.parametrize("hardware", [H100, CPU], ids=["gpu", "cpu"])
@pytest.mark.parametrize("where", ["download", "offline: no"])
def test_hardware_at_80_columns_fits_a_screen(hardware, where):
    text = show_hardware(80, hardware, where)
    lines = assert_fits(text, 80)
    assert len(lines) <= 23, f"{len(lines)} lines:\n{text}"
    gpu = ["NVIDIA H100 80GB HBM3", "79.19 GiB", "compute capability 9.0", "bf16 yes"] if hardware.has_gpu else []
    for value in gpu + ["CPU cores", "RAM", "precision", "mistral", "7.2B", "qwen3", "gemma3", "llama3", where]:
        assert any(value in line for line in lines), f"{value!r} not whole:\n{text}"


def test_eight_alike_gpus_are_one_row_and_a_different_one_its_own():
    h100 = H100.gpus[0]
    busy = replace(h100, free_bytes=h100.free_bytes - 10 * 1024 ** 3)
    l4 = Gpu("NVIDIA L4", int(22.5 * 1024 ** 3), int(22.5 * 1024 ** 3), (8, 9))
    eight = replace(H100, gpus=(h100,) * 3 + (busy,) + (h100,) * 4)
    text = show_hardware(80, eight, "download")
    lines = assert_fits(text, 80)
    assert len(lines) <= 23, f"{len(lines)} lines:\n{text}"
    assert any("GPUs 0-7" in line and "8 x NVIDIA H100 80GB HBM3" in line for line in lines), text
    assert any("69.19 GiB to 79.19 GiB free" in line for line in lines), text
    assert any("--num-processes 8" in line for line in lines) and "--distributed fsdp" in text
    mixed = show_hardware(80, replace(H100, gpus=(h100, h100, l4)), "download")
    assert "GPUs 0-1" in mixed and "GPU 2" in mixed and "NVIDIA L4: 22.50 GiB (22.50 GiB free)" in mixed, mixed


def test_hardware_at_200_columns_shows_everything():
    text = show_hardware(200, H100, "download")
    assert_fits(text, 200)
    for value in ("NVIDIA H100 80GB HBM3", "compute capability 9.0", "CPU cores", "mistral", "smollm3",
                  "yes N (micro-batch up to N)"):
        assert value in text, value


# ------------------------------------------------------------------ the summary


def test_a_dpo_runs_summary_keeps_its_memory_and_path_at_80_columns(tmp_path):
    import llmcustoms.ui.console as ui
    from llmcustoms.training.position import TrainResult

    path = tmp_path / ("a-long-directory-name-for-the-runs-of-this-project/" * 3) / "dpo-run"
    result = TrainResult("completed", 1234, 0.4321, 0.5123, 1200, 3 * 3600 + 1234, 12345.6, path,
                         base_eval_loss=0.6931, held_out={"eval_reward_accuracy": 0.875, "eval_reward_margin": 1.2345},
                         memory={"peak_bytes": int(12.21 * GIB), "plan_peak_bytes": int(13.62 * GIB),
                                 "predicted_bytes": int(11.16 * GIB), "ratio": 1.09, "gpu_util": 87.0})
    text = shown(ui.show_summary, result, width=80)
    assert_fits(text, 80)  # the path folds in its column, never cut short
    for value in ("12.21 GiB", "13.62 GiB", "1.09x", "GPU busy 87%", "0.88 of held-out pairs", "margin +1.234",
                  "3h 20m 34s", "12,346"):
        assert value in text, value
    assert "dpo-run" in "".join(re.sub(r"[│ ]", "", line) for line in text.splitlines())
