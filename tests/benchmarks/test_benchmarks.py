"""The benchmark scripts run (small versions), so they cannot silently rot."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DATA_FILES

pytestmark = pytest.mark.slow
BENCHMARKS = Path(__file__).parent.parent.parent / "benchmarks"


def run(script: str, *args: str) -> dict:
    # the timeouts guard against a hang, not a slow run: a machine under load takes twice as long
    out = subprocess.run([sys.executable, str(BENCHMARKS / script), *args, "--json"], capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_text(script: str, *args: str) -> str:
    out = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_memory_accuracy_measures_a_configuration():
    summary = run("memory_accuracy.py", "--only", "llama-lora-s256")
    [result] = summary["results"]
    assert result["measured_bytes"] > 0 and 0.8 <= result["ratio"] <= 1.25
    assert summary["all_within_0.8_1.25"] is True


def test_throughput_compares_llmcustoms_with_baselines_on_a_given_model(tiny_models):
    # A local model stands in for SmolLM2 (the default, which the shared script builds).
    summary = run("throughput.py", "--model", str(tiny_models["llama"]), "--data", str(DATA_FILES["alpaca"]),
                  "--rows", "32", "--only", "trainer_dynamic", "--only", "trainer_bf16", "--only", "llmcustoms")
    assert set(summary["baselines"]) == {"trainer_dynamic", "trainer_bf16"}
    assert summary["model"] == str(tiny_models["llama"]) and summary["llmcustoms_precision"] in ("no", "bf16")
    for result in (summary["llmcustoms"], *summary["baselines"].values()):
        assert result["tokens_per_s"] > 0 and result["peak_mem_bytes"] > 0 and result["eval_loss"] > 0
    # One shared evaluator scores every system's adapter on the same fp32 model: after the same
    # rows at the same settings the losses are close, whatever precision each trained in.
    losses = [summary["llmcustoms"]["eval_loss"], *(b["eval_loss"] for b in summary["baselines"].values())]
    assert max(losses) < 1.1 * min(losses)
    assert set(summary["speedup"]) == {"trainer_dynamic", "trainer_bf16"}


def test_throughput_on_the_toy_model_builds_it_from_the_data():
    summary = run("throughput.py", "--toy", "--data", str(DATA_FILES["alpaca"]), "--rows", "16", "--only", "llmcustoms")
    assert summary["llmcustoms"]["tokens_per_s"] > 0 and summary["baselines"] == {}


def test_sharding_memory_measures_ddp_and_fsdp_per_process():
    summary = run("sharding_memory.py")
    for mode in ("ddp", "fsdp"):
        assert len(summary["modes"][mode]["measured_bytes"]) == 2 and 0.8 <= summary["modes"][mode]["ratio"] <= 1.25
    assert summary["fsdp_vs_ddp_measured"] < 0.9  # sharding the training state saves memory per process


def test_quality_trains_through_the_cli_and_scores_against_the_base_model(tmp_path, tiny_models):
    # The shared datasets' shapes, from the project's own fixtures.
    data = tmp_path / "data"
    data.mkdir()
    (data / "sharegpt_identity.json").write_text((Path(__file__).parent.parent / "fixtures" / "sharegpt.json").read_text())
    rows = [json.loads(line) for line in (Path(__file__).parent.parent / "fixtures" / "alpaca.jsonl").read_text().splitlines()]
    (data / "code_alpaca_2k.json").write_text(json.dumps(rows))
    results = tmp_path / "quality.json"
    summary = run("quality.py", "--model", str(tiny_models["qwen2"]), "--data-dir", str(data), "--rows", "12,6,4",
                  "--only", "code:base,code:quality,code:tune,code:unsloth,code:trl,code:default,code:equal-time,"
                  "identity:base,identity:highspeed", "--trials", "2", "--seeds", "1", "--results", str(results), "--fork",
                  "--work", str(tmp_path / "work"))
    assert set(summary["code"]) == {"base", "quality", "tune", "unsloth", "trl", "default", "equal-time"}
    assert set(summary["identity"]) == {"base", "highspeed"}
    code = {config: seeds["0"] for config, seeds in summary["code"].items()}  # by seed: one, here
    quality, base = code["quality"], code["base"]
    assert quality["test_ppl"] == pytest.approx(math.exp(quality["test_loss"]))
    assert quality["steps"] >= 1 and quality["kept_step"] <= quality["steps"]
    assert code["tune"]["planned_steps"] == quality["planned_steps"]  # the same budget
    assert code["tune"]["found"]["trial_steps"] >= 1
    # The peers ran their recipes: Unsloth's 60 steps at lr 2e-4; TRL's 3 epochs of batch 8 at its default lr.
    assert code["unsloth"]["steps"] == 60 and code["unsloth"]["lr"] == 2e-4
    assert code["trl"]["steps"] == 3 * math.ceil(12 / 8) and code["trl"]["lr"] == code["trl"]["settings"]["learning_rate"]
    for config in ("unsloth", "trl", "default", "equal-time", "quality"):
        result = code[config]
        assert result["test_loss"] != pytest.approx(base["test_loss"], abs=1e-6), config  # it trained
        assert result["wall_seconds"] > 0 and 0 <= result["general"] <= result["general_asked"] and result["load"] >= 0
    assert 1 <= code["equal-time"]["steps"]
    assert 0.0 <= summary["identity"]["base"]["0"]["identity_accuracy"] <= 1.0 and base["test_loss"] > 0
    assert json.loads(results.read_text()) == summary
    shown = run_text("quality.py", "--table", "--results", str(results))
    assert all(f"| code | {config} |" in shown for config in ("unsloth", "trl", "equal-time"))


def test_large_data_measures_memory_and_time_to_first_step(tmp_path, tiny_models):
    sys.path.insert(0, str(BENCHMARKS))
    import large_data

    model = str(tiny_models["llama"])
    baseline = large_data.measure_baseline(model, tmp_path, seed=1)
    entry = large_data.measure_size(200 * 1024 / large_data.GiB, model, tmp_path, seed=1, baseline=baseline)
    assert entry["bytes"] >= 200 * 1024 and entry["rows"] > 20
    rows = [json.loads(line) for line in Path(entry["file"]).read_text().splitlines()]
    assert len(rows) == entry["rows"] and len({json.dumps(r) for r in rows}) == len(rows)
    assert max(len(m["content"]) for r in rows for m in r["messages"]) >= 0.99 * max(entry["huge_row_chars"])
    for run in (baseline["train"], entry["plan"], entry["train_cold"], entry["train_warm"]):
        assert run["returncode"] == 0, run.get("log_tail")
        assert run["peak_rss_mib"] > 100  # the process holds at least torch
    for run in (baseline["train"], entry["train_cold"], entry["train_warm"]):
        assert 0 < run["first_step_s"] <= run["seconds"]
    table = large_data.table({"baseline": baseline, "sizes": {"0.0002": entry}})
    assert len(table.splitlines()) == 4 and "failed" not in table


def test_kill_anywhere_kills_resumes_and_ends_with_the_uninterrupted_adapter():
    summary = run("kill_anywhere.py", "--kills", "4", "--per-run", "4", "--steps", "16")
    assert summary["kills"] == 4 and sum(summary["landed"].values()) == 4
    assert summary["all_identical"] is True and summary["max_difference"] <= 1e-5
    for result in summary["results"]:
        assert result["status"] == "completed" and result["one_row_per_step"]


def test_step_profile_measures_each_lever_on_a_given_model(tiny_models):
    summary = run("step_profile.py", "--model", str(tiny_models["llama"]), "--tokens", "16", "--steps", "1")
    assert [r["variant"] for r in summary["results"]] == ["fp32", "fp32_selective", "bf16_autocast", "bf16_weights",
                                                           "no_mask"]
    assert all(r["tokens_per_s"] > 0 for r in summary["results"])


def test_busy_machine_plans_beside_a_hog(tiny_models):
    summary = run("busy_machine.py", "--model", str(tiny_models["llama"]), "--data", str(DATA_FILES["alpaca"]),
                  "--dry-run", "--runs", "idle,busy", "--hog", "1", "--warmup", "0")
    assert [r["run"] for r in summary["runs"]] == ["idle", "busy"] and summary["runs"][1]["hog"] == 1
    for result in summary["runs"]:
        assert result["threads"] >= 1 and result["estimate_s"] > 0
        assert result["threads_reason"].startswith(f"threads {result['threads']}: ")


def test_turn_cost_counts_every_reply_against_a_sequence_per_reply(tmp_path, family_models):
    out = tmp_path / "cost.json"
    text = run_text("turn_cost.py", str(Path(__file__).parent.parent / "fixtures" / "shapes" /
                                        "multi_turn_reasoning_tools.jsonl"),
                    "--tokenizer", str(family_models["qwen3"]), "--template", "qwen3", "--template", "qwen2_5",
                    "--json", str(out))
    assert "qwen3" in text and "qwen2_5" in text
    results = json.loads(out.read_text())["results"]
    for template in ("qwen3", "qwen2_5"):
        found = results[template]
        assert (found["rows"], found["replies"], found["llmcustoms_learned"], found["last_reply_learned"]) == (2, 7, 7, 2)
        assert found["per_reply_tokens"] > found["llmcustoms_tokens"] >= found["last_reply_tokens"]
