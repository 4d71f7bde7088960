"""What the UI modules show: precision in the words people use, and the runs
table whole on an 80-column terminal."""

from __future__ import annotations

import dataclasses
import json
import re

from rich.console import Console

from llmcustoms.ui.console import plan_table, runs_table
from llmcustoms.ui.hardware_view import machine_table
from llmcustoms.planning.hardware import Hardware
from llmcustoms.runs.run_directory import RunSummary
from test_planning import plan_for


def render(renderable: object, width: int = 120) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_fp32_is_shown_as_fp32_and_plan_json_keeps_no():
    cpu = Hardware.cpu_only(ram_gib=16)
    plan = plan_for(cpu, "Qwen/Qwen2.5-0.5B-Instruct")
    assert plan.mixed_precision == "no" and json.loads(plan.dumps())["mixed_precision"] == "no"
    assert re.search(r"precision\W+fp32\W", render(plan_table(plan)))
    assert re.search(r"precision\W+fp32\W", render(machine_table(cpu)))
    assert any(r.startswith("precision fp32: no GPU, and this CPU has no native bf16") for r in plan.reasons)
    assert not any("precision no" in line for line in (*plan.reasons, render(plan_table(plan))))


def test_bf16_and_fp16_are_shown_as_they_are():
    for hardware, precision in ((Hardware.with_gpu(24), "bf16"), (Hardware.with_gpu(6, compute_capability=(7, 5)), "fp16")):
        plan = plan_for(hardware, "Qwen/Qwen2.5-0.5B-Instruct")
        assert plan.mixed_precision == precision
        assert re.search(rf"precision\W+{precision}\W", render(plan_table(plan)))
        assert any(r.startswith(f"precision {precision}: ") for r in plan.reasons)


RUNS = [
    RunSummary("Qwen2.5-0.5B-Instruct-quality-20250101-120000", "Qwen/Qwen2.5-0.5B-Instruct", "qlora", "interrupted",
               1234, 12000, 1.2345, 1.9, 1100, "2025-01-01T12:00:00", 3 * 3600 + 1234),
    RunSummary("SmolLM2-135M-Instruct-highspeed-20250102-083000", "HuggingFaceTB/SmolLM2-135M-Instruct", "full",
               "completed", 300, 300, 2.0, 2.5, None, None, 754, peak_bytes=int(5.5 * 1024 ** 3), memory_ratio=1.07),
    RunSummary("mistral-7b-qlora", "mistralai/Mistral-7B-Instruct-v0.3", "qlora", "failed", 12, 5000, None, None,
               None, None, 65),
    RunSummary("done", "/models/tiny-llama", "lora", "running", 5, None, None, None, None, None, None),
]


def test_the_runs_table_is_whole_at_80_columns():
    """Too narrow for the table: each run's name on a line, never folded, and its
    values under it, each with what it is and never broken."""
    text = render(runs_table("runs", RUNS), width=80)
    lines = text.splitlines()
    assert "…" not in text and max(len(line) for line in lines) <= 80
    for run in RUNS:
        assert run.name in lines
    for value in ("Qwen2.5-0.5B-Instruct (qlora)", "SmolLM2-135M-Instruct (full)", "tiny-llama (lora)",
                  "interrupted", "completed", "failed", "step 1234/12000 (kept 1100)", "eval ppl 3.437 (-49%)",
                  "eval ppl 7.389", "step 300/300", "step 12/5000", "step 5/?", "trained 1m 05s",
                  "trained 12m 34s", "memory 5.5G 1.07x"):
        assert any(value in line for line in lines), value


def test_the_runs_table_keeps_a_run_on_one_line_when_wide():
    text = render(runs_table("runs", RUNS[3:]), width=120)
    row = next(line for line in text.splitlines() if "done" in line)
    assert "tiny-llama (lora)" in row and "running" in row and "5/?" in row


def test_the_runs_table_heads_its_evaluation_column_by_what_the_runs_report():
    sft = RUNS[1]
    dpo = dataclasses.replace(sft, name="prefs-dpo", objective="dpo", best_eval_loss=0.69, base_eval_loss=0.6931)
    only_sft = render(runs_table("runs", [sft]), width=160)
    assert "eval ppl" in only_sft and "evaluation" not in only_sft
    mixed = render(runs_table("runs", [sft, dpo]), width=160)
    header = next(line for line in mixed.splitlines() if "status" in line)
    assert "evaluation" in header and "eval ppl" not in header
    assert "ppl 7.389" in next(line for line in mixed.splitlines() if sft.name in line)
    assert "dpo loss 0.690" in next(line for line in mixed.splitlines() if "prefs-dpo" in line)
