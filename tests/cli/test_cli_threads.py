"""The CPU threads a real run trains with: the plan's choice, OMP_NUM_THREADS when
set, and the plan names it (`planning/cpu_share.py`)."""

from __future__ import annotations

import json
import os

import psutil
import pytest

from conftest import DATA_FILES


def train(cli, tmp_path, model, name: str, env: dict[str, str]) -> tuple[dict, list[dict], str]:
    result = cli("train", str(DATA_FILES["alpaca"]), "--model", str(model), "--max-steps", "2", "--yes",
                 "--output-dir", str(tmp_path), "--run-name", name, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    run = tmp_path / name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return json.loads((run / "plan.json").read_text()), [r for r in rows if "loss" in r], result.stdout


@pytest.mark.slow
def test_omp_num_threads_1_trains_with_one_thread_and_the_plan_names_it(tmp_path, tiny_models, cli):
    plan, steps, shown = train(cli, tmp_path, tiny_models["llama"], "one", {"OMP_NUM_THREADS": "1"})
    assert plan["cpu_threads"] == 1 and plan["sources"]["cpu_threads"] == "env OMP_NUM_THREADS"
    assert "threads 1: OMP_NUM_THREADS" in plan["reasons"] and "threads 1: OMP_NUM_THREADS" in shown
    assert len(steps) == 2 and all(r["cpu_threads"] == 1 for r in steps)  # torch.get_num_threads() in the loop


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get("OMP_NUM_THREADS")), reason="OMP_NUM_THREADS is set for the whole suite")
def test_without_omp_num_threads_the_run_trains_with_the_plans_threads(tmp_path, tiny_models, cli):
    plan, steps, shown = train(cli, tmp_path, tiny_models["llama"], "planned", {})
    [reason] = [r for r in plan["reasons"] if r.startswith("threads")]
    assert reason.startswith(f"threads {plan['cpu_threads']}: ") and reason in shown
    cores = psutil.cpu_count(logical=False) or os.cpu_count()
    assert all(r["cpu_threads"] == min(plan["cpu_threads"], cores) for r in steps)
