"""The benchmark scripts run (small versions), so they cannot silently rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DATA_FILES

pytestmark = pytest.mark.slow
BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def run(script: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, str(BENCHMARKS / script), *args, "--json"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_memory_accuracy_measures_a_configuration():
    summary = run("memory_accuracy.py", "--only", "llama-lora-s256")
    [result] = summary["results"]
    assert result["measured_bytes"] > 0 and 0.8 <= result["ratio"] <= 1.25
    assert summary["all_within_0.8_1.25"] is True


def test_throughput_compares_llmcustoms_with_a_baseline():
    summary = run("throughput.py", "--data", str(DATA_FILES["alpaca"]), "--rows", "32",
                  "--only", "trainer_dynamic", "--only", "llmcustoms")
    assert set(summary["baselines"]) == {"trainer_dynamic"}
    for result in (summary["llmcustoms"], summary["baselines"]["trainer_dynamic"]):
        assert result["tokens_per_s"] > 0 and result["peak_mem_bytes"] > 0 and result["eval_loss"] > 0
    assert summary["speedup_vs_fastest"] > 0


def test_sharding_memory_measures_ddp_and_fsdp_per_process():
    summary = run("sharding_memory.py")
    for mode in ("ddp", "fsdp"):
        assert len(summary["modes"][mode]["measured_bytes"]) == 2 and 0.8 <= summary["modes"][mode]["ratio"] <= 1.25
    assert summary["fsdp_vs_ddp_measured"] < 0.9  # sharding the training state saves memory per process
