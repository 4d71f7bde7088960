"""Settings: .env and LLMCUSTOMS_* variables, precedence flag > env > preset > default,
and the setup wizard that writes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import DATA_FILES
from llmcustoms.cli import app
from llmcustoms.errors import ConfigError
from llmcustoms.settings import SETTINGS, example_file, load_settings

runner = CliRunner()
ROOT = Path(__file__).parent.parent


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith("LLMCUSTOMS_") or name == "HF_TOKEN":
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LLMCUSTOMS_CACHE_DIR", str(tmp_path / "cache"))  # never the user's ~/.cache
    monkeypatch.chdir(tmp_path)


def plan_json(*args: str) -> dict:
    result = runner.invoke(app, ["plan", str(DATA_FILES["alpaca"]), "--json", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_a_dot_env_in_the_working_directory_changes_the_plan(tmp_path, tiny_models):
    (tmp_path / ".env").write_text(f"LLMCUSTOMS_PRESET=bestaccuracy\nLLMCUSTOMS_MODEL={tiny_models['llama']}\n")
    plan = plan_json()
    assert plan["preset"] == "bestaccuracy" and plan["sources"]["preset"] == "env LLMCUSTOMS_PRESET"
    assert plan["model"] == str(tiny_models["llama"]) and plan["sources"]["model"] == "env LLMCUSTOMS_MODEL"


def test_flag_beats_environment_beats_file_beats_preset(tmp_path, tiny_models, monkeypatch):
    (tmp_path / ".env").write_text(f"LLMCUSTOMS_MODEL={tiny_models['llama']}\nLLMCUSTOMS_LR=0.003\n"
                                   "LLMCUSTOMS_LORA_R=4\nLLMCUSTOMS_SEED=7\n")
    monkeypatch.setenv("LLMCUSTOMS_LR", "0.002")  # the shell wins over the file
    plan = plan_json("--seed", "9")  # and a flag wins over both
    assert plan["lr"] == 0.002 and plan["sources"]["lr"] == "env LLMCUSTOMS_LR"
    assert plan["lora"]["r"] == 4 and plan["sources"]["lora.r"] == "env LLMCUSTOMS_LORA_R"
    assert plan["seed"] == 9 and plan["sources"]["seed"] == "flag"
    assert plan["sources"]["lora.alpha"].startswith("preset quality")


def test_env_file_option_reads_another_file(tmp_path, tiny_models):
    other = tmp_path / "other.env"
    other.write_text(f"LLMCUSTOMS_MODEL={tiny_models['qwen2']}\nLLMCUSTOMS_PRESET=highspeed\n")
    plan = plan_json("--env-file", str(other))
    assert plan["preset"] == "highspeed" and plan["family"] == "qwen"


@pytest.mark.parametrize("content,expected", [
    ("LLMCUSTOMS_PRESET=quality\nthis line is broken\n", "line 2: not a NAME=value line"),
    ("LLMCUSTOMS_LR=fast\n", "line 1 (LLMCUSTOMS_LR): expected a number above 0 and below 1"),
    ("LLMCUSTOMS_METHOD=magic\n", "line 1 (LLMCUSTOMS_METHOD): expected one of lora, qlora, full"),
    ("LLMCUSTOMS_PRESETT=quality\n", "unknown setting LLMCUSTOMS_PRESETT"),
])
def test_a_bad_env_file_names_the_line_and_exits_2(tmp_path, content, expected):
    (tmp_path / ".env").write_text(content)
    result = runner.invoke(app, ["plan", str(DATA_FILES["alpaca"])])
    assert result.exit_code == 2
    assert expected in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_hf_token_is_exported_but_never_shown_or_saved(tmp_path, tiny_models):
    secret = "hf_SECRETtoken1234567890"
    (tmp_path / ".env").write_text(f"HF_TOKEN={secret}\nLLMCUSTOMS_MODEL={tiny_models['llama']}\n")
    result = runner.invoke(app, ["train", str(DATA_FILES["alpaca"]), "--max-steps", "1", "--yes",
                                 "--run-name", "r"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert os.environ.get("HF_TOKEN") == secret  # the Hugging Face libraries read it from here
    assert secret not in result.output
    for path in (tmp_path / "runs" / "r").rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_env_example_documents_every_variable():
    text = (ROOT / ".env.example").read_text()
    assert text == example_file()
    for setting in SETTINGS:
        assert f"# {setting.variable}=" in text
    assert "HF_TOKEN" in text


def test_an_unset_value_is_ignored(tmp_path):
    (tmp_path / ".env").write_text("LLMCUSTOMS_LR=\n")
    assert "lr" not in load_settings().values


def test_a_missing_env_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError):
        load_settings(tmp_path / "nope.env")


def run_setup(tmp_path: Path, env_file: Path, stdin: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCUSTOMS_")}
    return subprocess.run([sys.executable, "-m", "llmcustoms", "setup", "--data", str(DATA_FILES["alpaca"]),
                           "--env-file", str(env_file)], input=stdin, capture_output=True, text=True,
                          cwd=tmp_path, env={**env, "COLUMNS": "120"}, timeout=120)


def test_setup_with_enter_throughout_writes_a_sensible_env_file(tmp_path):
    env_file = tmp_path / "F.env"
    result = run_setup(tmp_path, env_file, "\n" * 20)  # what `yes ''` sends
    assert result.returncode == 0, result.stdout + result.stderr
    values = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line and not line.startswith("#"))
    assert values["LLMCUSTOMS_PRESET"] == "quality"
    # No GPU here: one of the preset's CPU models, by how long it would take.
    assert values["LLMCUSTOMS_MODEL"] in ("HuggingFaceTB/SmolLM2-360M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert values["LLMCUSTOMS_OUTPUT_DIR"] == "runs"
    assert values["LLMCUSTOMS_DATA"] == str(DATA_FILES["alpaca"])
    assert f"llmcustoms train --env-file {env_file}" in result.stdout  # the data is in the file
    assert "ok: Alpaca" in result.stdout  # the data was validated on the spot
    # What it wrote is what `plan` then uses.
    result = runner.invoke(app, ["plan", "--json", "--env-file", str(env_file)], catch_exceptions=False)
    plan = json.loads(result.output)
    assert plan["preset"] == "quality" and plan["sources"]["preset"] == "env LLMCUSTOMS_PRESET"
    assert plan["data"] == str(DATA_FILES["alpaca"].resolve())


def test_setup_answers_are_used_and_other_variables_are_kept(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("HF_TOKEN=hf_keepme\nLLMCUSTOMS_PRESET=quality\n")
    answers = "\n".join(["", "bestaccuracy", "2", "out", "40", "y"]) + "\n"
    result = run_setup(tmp_path, env_file, answers)
    assert result.returncode == 0, result.stdout + result.stderr
    text = env_file.read_text()
    assert "LLMCUSTOMS_PRESET=bestaccuracy" in text and "LLMCUSTOMS_OUTPUT_DIR=out" in text
    assert "LLMCUSTOMS_SAVE_EVERY=40" in text and "HF_TOKEN=hf_keepme" in text
    assert "hf_keepme" not in result.stdout


def test_setup_with_bad_data_says_why_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n')
    env_file = tmp_path / "F.env"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCUSTOMS_")}
    result = subprocess.run([sys.executable, "-m", "llmcustoms", "setup", "--data", str(bad), "--env-file", str(env_file)],
                            input="\n" * 10, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 2
    assert "cannot tell the data format" in " ".join(result.stdout.split())
    assert not env_file.exists()


def test_the_data_file_is_a_setting_too(tmp_path, tiny_models):
    """After `setup` (which writes LLMCUSTOMS_DATA), the commands need no data argument."""
    (tmp_path / ".env").write_text(f"LLMCUSTOMS_DATA={DATA_FILES['alpaca']}\nLLMCUSTOMS_MODEL={tiny_models['llama']}\n")
    result = runner.invoke(app, ["plan", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["data"] == str(DATA_FILES["alpaca"].resolve())
    # A data argument still beats the variable.
    result = runner.invoke(app, ["plan", str(DATA_FILES["sharegpt"]), "--json"], catch_exceptions=False)
    assert json.loads(result.output)["data"] == str(DATA_FILES["sharegpt"].resolve())


def test_no_data_anywhere_is_one_clear_message(tmp_path):
    result = runner.invoke(app, ["train", "--yes"])
    assert result.exit_code == 2
    assert "No training data given" in result.output and "LLMCUSTOMS_DATA" in " ".join(result.output.split())
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_tune_with_the_data_in_the_environment(tmp_path, tiny_models, cli):
    """Exactly as the README documents it, with the data from LLMCUSTOMS_DATA."""
    result = cli("tune", "--trials", "1", "--max-steps", "2", "--model", str(tiny_models["llama"]),
                 "--eval-split", "0.2", cwd=tmp_path, env={"LLMCUSTOMS_DATA": str(DATA_FILES["alpaca"])})
    assert result.returncode == 0, result.stdout + result.stderr
    assert list((tmp_path / "runs").glob("tune-*/best_preset.yaml"))


def test_the_cache_directory_from_the_env_file_is_used(tmp_path, tiny_models, monkeypatch):
    """LLMCUSTOMS_CACHE_DIR in .env used to be ignored: now it is a setting like the rest, and a flag."""
    monkeypatch.delenv("LLMCUSTOMS_CACHE_DIR", raising=False)
    (tmp_path / ".env").write_text(f"LLMCUSTOMS_CACHE_DIR={tmp_path / 'from-env'}\n")
    assert plan_json("--model", str(tiny_models["llama"]))["model"] == str(tiny_models["llama"])
    assert list((tmp_path / "from-env" / "tokenized").glob("*/meta.json"))
    plan_json("--model", str(tiny_models["llama"]), "--cache-dir", str(tmp_path / "from-flag"))
    assert list((tmp_path / "from-flag" / "tokenized").glob("*/meta.json"))
