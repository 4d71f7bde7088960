"""Every screen whole on an 80-column terminal: no value cut short with "…",
no number or label torn from its value across lines, no line wider than the
terminal; and `hardware` within an 80x24 screen. At 200 columns the same
screens still show everything."""

from __future__ import annotations

import io
import json
import math
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
    {"trial": 0, "state": "complete", "eval_loss": 1.23456, "forgetting": 0.0312, "best": False, "lr": 2.0e-4, "lora_r": 16,
     "alpha_ratio": 2.0, "lora_dropout": 0.05, "warmup_ratio": 0.03, "steps": 60, "budget": 60, "seconds": 228.4,
     "reason": "", "preset": True},
    {"trial": 1, "state": "pruned", "eval_loss": 1.5, "best": False, "lr": 2.81e-4, "lora_r": 64, "alpha_ratio": 0.5,
     "lora_dropout": 0.1, "warmup_ratio": 0.1, "steps": 20, "budget": 60, "seconds": 75.0,
     "reason": "pruned at step 20 of 60: not in the best third at step 20"},
    {"trial": 12, "state": "complete", "eval_loss": 1.1, "forgetting": -0.004, "best": True, "lr": 1.234e-5, "lora_r": 8,
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
    0: r"0 complete 1\.2346 \+3\.12% 2\.00e-04 16 2 0\.05 0\.03 60/60 228s",
    1: r"1 pruned 1\.5000 2\.81e-04 64 0\.5 0\.1 0\.1 20/60 75s",
    12: r"12 complete 1\.1000 -0\.40% 1\.23e-05 8 1 0 0\.05 1000/1000 2281s",
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
    assert_fits(without_paths(text, path), 80)
    for value in ("12.21 GiB", "13.62 GiB", "1.09x", "GPU busy 87%", "0.88 of held-out pairs", "margin +1.234",
                  "3h 20m 34s", "12,346"):
        assert value in text, value
    assert text.splitlines()[-2:] == ["Saved to:", str(path)]  # whole, on a line of its own: a copy takes it


def without_paths(text: str, *paths: Path) -> str:
    """`text` less the lines that are a path, whole: a path wider than the screen is
    left to the terminal to wrap (soft wrap), which copies it whole; a line that
    holds only part of one is still caught (it is no longer the path)."""
    return "\n".join(line for line in text.splitlines() if line not in {str(p) for p in paths})


# ------------------------------------------------------- paths a user copies

# Shorter than 80 columns, longer than a table's value column: the old summary broke it
# across two table lines ("…/ad│" then "│ apter"), the old plan cut it with "…".
COPIED = Path("/home/someone/fine-tuning/runs/tiny-llama-quality-20261202-033016/adapter")


def test_the_summary_gives_the_adapters_path_whole_on_a_line_of_its_own():
    import llmcustoms.ui.console as ui
    from llmcustoms.training.position import TrainResult

    assert 60 < len(str(COPIED)) <= 80
    result = TrainResult("completed", 136, 4.16, 4.30, 136, 58.0, 2810.0, COPIED, base_eval_loss=6.63,
                         memory={"peak_bytes": int(0.79 * GIB), "plan_peak_bytes": int(0.13 * GIB), "ratio": 6.06},
                         kept="the last step's, which had the best eval loss (4.3043)")
    lines = assert_fits(shown(ui.show_summary, result, width=80), 80)
    assert lines[-2:] == ["Saved to:", str(COPIED)]
    assert not any("saved to" in line for line in lines)  # not also in the table, broken


def test_the_plan_gives_a_local_models_path_whole_under_its_table():
    import llmcustoms.ui.console as ui
    from test_report import plan_of

    model = str(COPIED.parent.parent / "models" / "smollm2-135m-instruct")
    text = shown(ui.show_plan, replace(plan_of(40), model=model), width=80)
    lines = assert_fits(text, 80)  # no "…"
    assert lines.index("Model folder:") + 1 == lines.index(model), text
    assert any(cells(line).startswith("model smollm2-135m-instruct") for line in lines), text
    # A Hub id is short: it stays in the table, and nothing is said below.
    hub = shown(ui.show_plan, plan_of(40), width=80)
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in hub and "Model folder" not in hub


# ------------------------------------------------------------------ report


def normal_run(root: Path) -> Path:
    """A finished run as the README's first run leaves it (136 steps, an evaluation
    every 17, the sample replies and the general questions, its memory measured),
    with two recommendations (the loss still falling, the peak above the plan)."""
    from test_forgetting import scores
    from test_report import make_run, plan_of
    from test_stop_rates import samples

    losses = [6.0 - 2.0 * (1 - 0.98 ** step) for step in range(1, 137)]
    evals = {0: 6.63, **{step: 6.0 - 1.7 * (1 - 0.98 ** step) for step in range(17, 137, 17)}}
    run = make_run(root, plan_of(136), losses, evals, base_eval_loss=6.63, best_eval_loss=evals[136],
                   best_eval_step=136, kept_step=136, kept="the last step's, which had the best eval loss (4.3043)",
                   general_knowledge=scores(12, 12),
                   memory={"peak_bytes": int(4.23 * GIB), "plan_peak_bytes": int(2.38 * GIB), "ratio": 1.82,
                           "budget_bytes": int(21.4 * GIB)})
    run.append_samples(samples([False] * 3, [True, True, False]))
    return run.path


def test_report_fits_an_80x24_screen_a_line_per_verdict(tmp_path, cli, clean_environment):
    run = normal_run(tmp_path)
    result = cli("report", str(run), "--plot", env={"COLUMNS": "80", "LINES": "24"})
    assert result.returncode == 0, result.stderr
    lines = assert_fits(without_paths(result.stdout, run / "loss.png"), 80)
    assert len(result.stdout.splitlines()) <= 23, f"the top scrolls off (the prompt takes the 24th)\n{result.stdout}"
    assert result.stdout.splitlines()[-2:] == ["Wrote:", str(run / "loss.png")]
    verdicts = {"quality": "better (perplexity -", "weights kept": "step 136", "stopping": "2/3 stopped",
                "general questions": "kept (12/67 -> 12/67)", "convergence": "still falling (-",
                "overfitting": "no", "learning rate": "effective (peak ", "throughput": "1,000 tokens/s",
                "memory": "above plan (1.82x the plan)", "recoveries": "none"}
    for topic, verdict in verdicts.items():
        assert any(re.match(rf"{topic} +{re.escape(verdict)}", line) for line in lines), f"{topic}:\n{result.stdout}"
    assert "--epochs" in result.stdout and "--batch-size" in result.stdout  # what to change, on the screen
    assert "--details" in result.stdout and "Sample replies" not in result.stdout


def test_report_details_say_each_verdicts_reasons_and_show_the_sample_replies(tmp_path, cli, clean_environment):
    run = normal_run(tmp_path)
    result = cli("report", str(run), "--details", env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    lines = assert_fits(result.stdout, 80)
    flat = " ".join(result.stdout.split())
    for said in (f"quality better perplexity {math.exp(6.63):.2f} ->", "on 50 held-out rows",
                 "memory above plan peak 4.23 GiB; plan 2.38 GiB", "budget 21.4 GiB", "Sample replies",
                 "12/67 base -> 12/67 trained of llmcustoms' general questions", "Recommendations"):
        assert said in flat, said
    assert "better (perplexity" not in flat  # the reasons in place of the short numbers
    assert any(line.startswith("  ") for line in lines)  # a verdict's reasons under it, in the screen's width
