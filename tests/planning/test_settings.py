"""Settings: .env and LLMCUSTOMS_* variables, precedence flag > env > preset > default.
The setup wizard that writes them is tested in tests/commands/test_wizard.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import DATA_FILES
from llmcustoms.cli import app
from llmcustoms.errors import ConfigError
from llmcustoms.planning.settings import SETTINGS, example_file, load_settings
from tiny_models import WIDE

runner = CliRunner()
ROOT = Path(__file__).parent.parent.parent


pytestmark = pytest.mark.usefixtures("clean_environment")


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


def test_settings_example_prints_every_variable_explained_for_users_without_the_repository():
    result = runner.invoke(app, ["settings", "--example"], env={"COLUMNS": WIDE})
    assert result.exit_code == 0, result.output
    assert result.output == example_file()
    lines = result.output.splitlines()
    for setting in SETTINGS:
        line = lines.index(f"# {setting.variable}=")
        assert lines[line - 1].startswith(f"# {setting.help}")  # its one-line explanation above it
    assert "HF_TOKEN" in result.output


def test_settings_shows_those_set_and_where_from_and_refuses_a_bad_one(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMCUSTOMS_CACHE_DIR")  # clean_environment's
    monkeypatch.delenv("LLMCUSTOMS_REPLAY")  # the suite's (tests/conftest.py)
    result = runner.invoke(app, ["settings"], env={"COLUMNS": WIDE})
    assert result.exit_code == 0 and "No LLMCUSTOMS_ setting is set" in result.output
    (tmp_path / ".env").write_text("HF_TOKEN=hf_secret\nLLMCUSTOMS_PRESET=highspeed\nLLMCUSTOMS_LR=1e-3\n")
    monkeypatch.setenv("LLMCUSTOMS_LR", "2e-4")  # the shell wins over the file
    result = runner.invoke(app, ["settings"], env={"COLUMNS": WIDE})
    assert result.exit_code == 0, result.output
    assert "LLMCUSTOMS_PRESET=highspeed" in result.output and "line 2" in result.output
    assert "LLMCUSTOMS_LR=2e-4" in result.output and "environment" in result.output
    assert "1e-3" not in result.output and "hf_secret" not in result.output
    monkeypatch.setenv("LLMCUSTOMS_LR", "fast")
    result = runner.invoke(app, ["settings"], env={"COLUMNS": WIDE})
    assert result.exit_code == 2 and "LLMCUSTOMS_LR" in result.output


def test_an_unset_value_is_ignored(tmp_path):
    (tmp_path / ".env").write_text("LLMCUSTOMS_LR=\n")
    assert "lr" not in load_settings().values


def test_a_missing_env_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError):
        load_settings(tmp_path / "nope.env")


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
