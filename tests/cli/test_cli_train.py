"""`llmcustoms train` end to end: every family on every data format, through the
real command-line app, plus the contract of exit codes and output."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from conftest import DATA_FILES, FAMILIES
from llmcustoms.cli import app

runner = CliRunner()


def invoke(*args: str):
    """The real Typer app, in this process (imports are paid once for the whole matrix)."""
    return runner.invoke(app, list(args), catch_exceptions=False)


def flat(text: str) -> str:
    """Output with Rich's line wrapping undone."""
    return " ".join(text.split())


@pytest.mark.parametrize("data_format", list(DATA_FILES))
@pytest.mark.parametrize("family", FAMILIES)
def test_train_every_family_on_every_format(tmp_path, tiny_models, family, data_format):
    result = invoke("train", str(DATA_FILES[data_format]), "--model", str(tiny_models[family]),
                    "--max-steps", "2", "--batch-size", "4", "--grad-accum", "1", "--yes",
                    "--output-dir", str(tmp_path), "--run-name", "run")
    assert result.exit_code == 0, result.output
    assert "detected format" in result.output
    run = tmp_path / "run"
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "completed" and status["step"] == 2
    plan = json.loads((run / "plan.json").read_text())
    assert plan["family"] == {"llama": "tinyllama", "mistral": "mistral", "qwen2": "qwen",
                              "phi": "phi", "phi3": "phi"}[family]
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "loss" in r] == [1, 2]


def test_detected_format_and_plan_are_shown(tmp_path, tiny_models):
    result = invoke("train", str(DATA_FILES["sharegpt"]), "--model", str(tiny_models["phi"]), "--max-steps", "1",
                    "--yes", "--output-dir", str(tmp_path), "--run-name", "r")
    assert result.exit_code == 0, result.output
    assert "ShareGPT" in result.output
    assert "fallback template" in result.output  # Phi-2 style tokenizers have no chat template
    assert "Training plan" in result.output and "Training finished" in result.output
    # Where the run goes, said before it trains (and not with --quiet: the test below).
    shown = flat(result.output)
    assert f"Run directory: {tmp_path / 'r'}" in shown
    assert shown.index("Run directory:") > shown.index("Training plan")
    assert shown.index("Run directory:") < shown.index("Training finished")


def test_quiet_prints_only_where_the_adapter_is(tmp_path, tiny_models):
    result = invoke("train", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["llama"]), "--max-steps", "1",
                    "--quiet", "--output-dir", str(tmp_path), "--run-name", "q")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(tmp_path / "q" / "adapter")  # for scripts: the path alone
    # stderr has the warnings only (the plan's: the fixture's rows repeat, so its held-out rows are copies).
    assert not result.stderr.strip() or flat(result.stderr).startswith("warning:"), result.stderr


def test_eval_data_file_replaces_the_split(tmp_path, tiny_models):
    result = invoke("train", str(DATA_FILES["alpaca"]), "--eval-data", str(DATA_FILES["messages"]),
                    "--model", str(tiny_models["llama"]), "--max-steps", "2", "--yes",
                    "--output-dir", str(tmp_path), "--run-name", "e")
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "e" / "plan.json").read_text())
    assert plan["train_rows"] == 48 and plan["eval_rows"] == 24
    evals = [json.loads(l) for l in (tmp_path / "e" / "metrics.jsonl").read_text().splitlines() if "eval_loss" in l]
    assert evals and evals[-1]["step"] == 2


def test_eval_split_is_seeded_and_sized(tmp_path, tiny_models):
    for name in ("a", "b"):
        result = invoke("train", str(DATA_FILES["alpaca"]), "--eval-split", "0.25", "--seed", "3",
                        "--model", str(tiny_models["llama"]), "--max-steps", "1", "--yes",
                        "--output-dir", str(tmp_path), "--run-name", name)
        assert result.exit_code == 0, result.output
    plans = [json.loads((tmp_path / n / "plan.json").read_text()) for n in ("a", "b")]
    assert plans[0]["eval_rows"] == 12 and plans[0]["train_rows"] == 36
    evals = [[json.loads(l)["eval_loss"] for l in (tmp_path / n / "metrics.jsonl").read_text().splitlines()
              if "eval_loss" in l] for n in ("a", "b")]
    assert evals[0] == evals[1]  # same seed: same held-out rows, same eval loss


def test_flags_land_in_the_plan_with_their_source(tmp_path, tiny_models):
    result = invoke("train", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["qwen2"]), "--preset", "highspeed",
                    "--lora-r", "4", "--lora-alpha", "8", "--lr", "0.001", "--max-seq-len", "48", "--max-steps", "1",
                    "--yes", "--output-dir", str(tmp_path), "--run-name", "f")
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "f" / "plan.json").read_text())
    assert plan["preset"] == "highspeed" and plan["sources"]["preset"] == "flag"
    assert plan["lora"]["r"] == 4 and plan["lora"]["alpha"] == 8 and plan["sources"]["lora.r"] == "flag"
    assert plan["lr"] == 0.001 and plan["max_seq_len"] == 48 and plan["sources"]["max_seq_len"] == "flag"
    assert plan["lora"]["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert plan["sources"]["lora.dropout"].startswith("preset highspeed")


def test_an_existing_run_directory_is_not_overwritten(tmp_path, tiny_models):
    args = ["train", str(DATA_FILES["text"]), "--model", str(tiny_models["llama"]), "--max-steps", "1", "--yes",
            "--output-dir", str(tmp_path), "--run-name", "same"]
    assert invoke(*args).exit_code == 0
    before = (tmp_path / "same" / "metrics.jsonl").read_text()
    again = invoke(*args)
    assert again.exit_code == 2
    message = flat(again.output)
    assert "already exists" in message and "llmcustoms resume" in message and "--overwrite" in message
    assert "Training plan" not in message  # refused before any data or model work
    assert (tmp_path / "same" / "metrics.jsonl").read_text() == before
    assert invoke(*args, "--overwrite").exit_code == 0


def test_help_does_not_import_heavy_libraries():
    code = (
        "import sys\n"
        "from llmcustoms.cli import app\n"
        "for args in (['--help'], ['train', '--help']):\n"
        "    try:\n"
        "        app(args)\n"
        "    except SystemExit as exit:\n"
        "        assert exit.code == 0, exit.code\n"
        "heavy = [m for m in ('torch', 'transformers', 'peft', 'optuna', 'bitsandbytes', 'accelerate', 'datasets') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout
    assert "--max-seq-len" in out.stdout and "--train-on-prompt" in out.stdout


@pytest.mark.slow
def test_train_as_a_real_subprocess(tmp_path, tiny_models, cli):
    result = cli("train", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["mistral"]), "--method", "qlora",
                 "--max-steps", "3", "--yes", "--run-name", "sub", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    run = tmp_path / "runs" / "sub"  # --output-dir defaults to ./runs
    assert json.loads((run / "status.json").read_text())["status"] == "completed"
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_models["mistral"])  # what loading needs
    # The adapter's model card names the base model without a path on this machine.
    assert "base_model: tiny-mistral\n" in (run / "adapter" / "README.md").read_text()
    assert config["r"] == 16 and sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


@pytest.mark.slow
def test_python_dash_m_and_version(cli):
    result = cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("llmcustoms ")


@pytest.mark.slow
def test_dot_env_in_the_working_directory_is_read(tmp_path, cli):
    # HF_HUB_OFFLINE comes only from .env here; the message names offline mode
    # only when the variable is set.
    (tmp_path / ".env").write_text("HF_HUB_OFFLINE=1\n")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    result = subprocess.run([sys.executable, "-m", "llmcustoms", "train", str(DATA_FILES["alpaca"]),
                             "--model", "no-such-org/no-such-model", "--yes"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "not in the local Hugging Face cache" in flat(result.stderr)
    assert "offline mode is on (HF_HUB_OFFLINE=1)" in flat(result.stderr)


@pytest.mark.parametrize("name", [".", "..", "a/b", "/tmp/elsewhere"])
def test_a_run_name_must_stay_inside_the_output_directory(tmp_path, tiny_models, name):
    keep = tmp_path / "runs" / "precious"
    keep.mkdir(parents=True)
    (keep / "plan.json").write_text("{}")
    result = invoke("train", str(DATA_FILES["text"]), "--model", str(tiny_models["llama"]), "--max-steps", "1", "--yes",
                    "--output-dir", str(tmp_path / "runs"), "--run-name", name, "--overwrite")
    assert result.exit_code == 2 and "not a plain name" in flat(result.output)
    assert (keep / "plan.json").exists()


def test_a_file_where_the_run_directory_would_go_is_a_clear_error(tmp_path, tiny_models):
    (tmp_path / "afile").write_text("x")
    for extra in (["--output-dir", str(tmp_path), "--run-name", "afile"], ["--output-dir", str(tmp_path / "afile")]):
        result = invoke("train", str(DATA_FILES["text"]), "--model", str(tiny_models["llama"]), "--max-steps", "1",
                        "--yes", *extra)
        assert result.exit_code == 2 and "is a file" in flat(result.output), result.output


@pytest.mark.parametrize("plan_text,status_text", [("[]", None), ("null", None), ("{bad", None), (None, "{bad")])
def test_resume_of_a_damaged_run_is_a_clear_error(tmp_path, tiny_models, plan_text, status_text):
    assert invoke("train", str(DATA_FILES["text"]), "--model", str(tiny_models["llama"]), "--max-steps", "1", "--yes",
                  "--output-dir", str(tmp_path), "--run-name", "r").exit_code == 0
    run = tmp_path / "r"
    (run / "status.json").write_text('{"status": "interrupted", "step": 0}')
    if plan_text is not None:
        (run / "plan.json").write_text(plan_text)
    if status_text is not None:
        (run / "status.json").write_text(status_text)
    result = invoke("resume", str(run))
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "damaged" in flat(result.output) or "not a readable llmcustoms run" in flat(result.output)


def test_resume_refuses_a_completed_run(tmp_path, tiny_models):
    assert invoke("train", str(DATA_FILES["text"]), "--model", str(tiny_models["llama"]), "--max-steps", "1", "--yes",
                  "--output-dir", str(tmp_path), "--run-name", "r").exit_code == 0
    result = invoke("resume", str(tmp_path / "r"))
    assert result.exit_code == 2 and "already completed" in flat(result.output)


def test_early_stopping_without_evaluation_rows_is_refused(tmp_path, tiny_models):
    result = invoke("plan", str(DATA_FILES["text"]), "--model", str(tiny_models["llama"]), "--eval-split", "0",
                    "--early-stopping-patience", "2")
    assert result.exit_code == 2 and "Early stopping needs evaluation rows" in flat(result.output)
