"""With the Hugging Face Hub unreachable: one quick check, no retries, and the
plan says which models can be used. The Hub is made unreachable by pointing
HF_ENDPOINT at a closed local port (the conftest otherwise sets offline mode)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from conftest import DATA_FILES

CACHED = "HuggingFaceTB/SmolLM2-360M-Instruct"  # a preset CPU model, put in a fake cache below


def unreachable_hub(cache: Path) -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "", "HF_ENDPOINT": "http://127.0.0.1:9",
            "HF_HUB_CACHE": str(cache)}


def cache_model(cache: Path, hub_id: str, model_dir: Path) -> None:
    """The Hugging Face cache layout: refs/main names a snapshot holding the files."""
    repo = cache / f"models--{hub_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    shutil.copytree(model_dir, repo / "snapshots" / ("0" * 40))


def test_plan_without_a_model_prefers_the_cached_one_and_says_so(tmp_path, tiny_models, cli):
    cache_model(tmp_path / "hub", CACHED, tiny_models["llama"])
    started = time.monotonic()
    result = cli("plan", str(DATA_FILES["alpaca"]), "--json", env=unreachable_hub(tmp_path / "hub"))
    seconds = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["model"] == CACHED  # not the preset's first CPU choice, which is not on this disk
    assert any("usable offline: SmolLM2-360M-Instruct" in reason for reason in plan["reasons"])
    assert "Retrying" not in result.stderr and "thrown while requesting" not in result.stderr
    assert seconds < 30  # about 4 s here; huggingface_hub's own retries took over a minute


def test_plan_for_an_uncached_hub_model_says_train_cannot_load_it(tmp_path, cli):
    result = cli("plan", str(DATA_FILES["alpaca"]), "--model", "Qwen/Qwen2.5-0.5B-Instruct",
                 env=unreachable_hub(tmp_path / "hub"))
    assert result.returncode == 0, result.stderr
    shown = " ".join(result.stdout.split())
    assert "the Hugging Face Hub cannot be reached" in shown and "`train` cannot load it" in shown
    assert "Retrying" not in result.stderr


def test_train_with_an_uncached_hub_model_fails_fast_with_one_message(tmp_path, cli):
    started = time.monotonic()
    result = cli("train", str(DATA_FILES["alpaca"]), "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--yes",
                 "--output-dir", str(tmp_path), env=unreachable_hub(tmp_path / "hub"))
    assert result.returncode == 2, result.stderr
    assert "not in the local Hugging Face cache and the Hub cannot be reached" in " ".join(result.stderr.split())
    assert "Retrying" not in result.stderr and "Traceback" not in result.stderr
    assert time.monotonic() - started < 30


def test_hardware_marks_each_model_as_cached_or_not(tmp_path, tiny_models, cli):
    cache_model(tmp_path / "hub", CACHED, tiny_models["llama"])
    result = cli("hardware", env={**unreachable_hub(tmp_path / "hub"), "COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    # A row per family: its name first, where its models load from last (the table has no rules).
    rows = {line.split()[0]: line.rstrip() for line in result.stdout.splitlines() if line.rstrip().endswith(("cached", "no"))}
    assert rows["smollm2"].endswith(" 1 of 2 cached")  # SmolLM2-360M is, 135M is not
    assert rows["qwen"].endswith(" offline: no")
    assert "…" not in result.stdout
