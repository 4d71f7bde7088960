"""Damaged inputs through the real CLI (issue 32): a model folder that is cut
short, does not fit together or lacks a file; a chat template that refuses a
turn; damaged lines in a run's metrics.jsonl and status.json; numbers out of
range; a settings file that cannot be written. Each is one clear message and
exit 2 (or the command goes on with what is readable), no traceback, no row
content echoed, and nothing of the user's lost or changed."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from conftest import DATA_FILES
from tiny_models import WIDE

SECRET = "PRIVATE-ROW-TEXT-93514"
# A Gemma-style template: refuses a system turn, and its refusal quotes the turn (as a careless one may).
REFUSING_TEMPLATE = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported: ' "
                     "+ messages[0]['content']) }}{% endif %}{% for message in messages %}<|{{ message['role'] }}|>\n"
                     "{{ message['content'] }}</s>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def said(result) -> str:
    """stdout + stderr on one line: Rich wraps long messages."""
    return " ".join((result.stdout + "\n" + result.stderr).split())


def refused(result, *phrases: str) -> str:
    out = said(result)
    assert result.returncode == 2, out
    assert "Traceback" not in out and SECRET not in out, out
    for phrase in phrases:
        assert phrase in out, out
    return out


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def model_copy(tiny_models, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_models["llama"], tmp_path / "model"))


# ------------------------------------------------------------ 15, 16: the model folder

def truncate_weights(model: Path) -> None:
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def wrong_vocab(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 100}))


def no_tokenizer(model: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model / name).unlink(missing_ok=True)


def unknown_type(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "nosucharch"}))


def config_not_json(model: Path) -> None:
    (model / "config.json").write_text('{"model_type": "llama",\n')


FOLDER_DAMAGE = {
    "truncated weights": (truncate_weights, ("model.safetensors", "cut short")),
    "vocab_size unlike the weights": (wrong_vocab, ("vocab_size 612", "model.safetensors", "512 rows")),
    "no tokenizer": (no_tokenizer, ("has no tokenizer",)),
    "unknown model_type": (unknown_type, ("model_type 'nosucharch'", "does not know")),
    "config.json not JSON": (config_not_json, ("config.json is not valid JSON (line 2",)),
}
# Damaged weights were a traceback from `train`; a broken folder was "offline" from both
# (`plan` went on without a tokenizer); one run each keeps the file fast.
FOLDER_CASES = [("truncated weights", "train"), ("vocab_size unlike the weights", "train"), ("no tokenizer", "plan"),
                ("no tokenizer", "train"), ("unknown model_type", "plan"), ("config.json not JSON", "train")]


@pytest.mark.parametrize("damage,command", FOLDER_CASES)
def test_a_damaged_model_folder_is_named_and_refused_before_the_run(cli, tiny_models, tmp_path, clean_environment,
                                                                    damage, command):
    model = model_copy(tiny_models, tmp_path)
    spoil, phrases = FOLDER_DAMAGE[damage]
    spoil(model)
    before = digest(model)
    extra = ["--max-steps", "1", "--yes", "--output-dir", str(tmp_path / "runs")] if command == "train" else []
    out = refused(cli(command, str(DATA_FILES["alpaca"]), "--model", str(model), *extra, timeout=120),
                  "The model folder", *phrases)
    assert "offline mode" not in out and "Hugging Face cache" not in out  # the folder is the problem, not the Hub
    assert not (tmp_path / "runs").exists()  # no run directory, no failure.json: nothing started
    assert digest(model) == before


# ------------------------------------------------------------ 17: a template that refuses

def test_a_template_refusing_a_training_row_names_the_row_and_never_its_text(cli, tiny_models, tmp_path,
                                                                              clean_environment):
    model = model_copy(tiny_models, tmp_path)
    (model / "chat_template.jinja").write_text(REFUSING_TEMPLATE)
    data = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": "Yes."}]}
            for i in range(12)]
    rows[4]["messages"].insert(0, {"role": "system", "content": SECRET})
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    refused(cli("plan", str(data), "--model", str(model), timeout=120),
            "chat template refused row 5", "does not accept a system turn")


# ------------------------------------------------------------ a trained run, shared

@pytest.fixture(scope="module")
def trained(tiny_models, tmp_path_factory):
    """One two-step run of the tiny Llama, copied by each test that changes it."""
    from conftest import run_cli

    root = tmp_path_factory.mktemp("attack-damage")
    result = run_cli("train", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["llama"]), "--max-steps", "2",
                     "--yes", "--quiet", "--output-dir", str(root), "--run-name", "done")
    assert result.returncode == 0, said(result)
    return root / "done"


def run_copy(trained: Path, tmp_path: Path, name: str = "run") -> Path:
    return Path(shutil.copytree(trained, tmp_path / "runs" / name))


@pytest.mark.slow
def test_chat_with_a_system_message_the_template_refuses_says_so(cli, trained, tmp_path, clean_environment):
    run = run_copy(trained, tmp_path)
    (run / "adapter" / "chat_template.jinja").write_text(REFUSING_TEMPLATE)
    before = digest(run / "adapter")
    refused(cli("chat", str(run), "--system", SECRET, input="hello\n/exit\n", timeout=180),
            "refused a system message (--system)", "does not accept a system turn", "Leave out --system")
    assert digest(run / "adapter") == before


# ------------------------------------------------------------ 18: damaged run records

def damage_records(run: Path) -> None:
    """A bare number, null, a row without its step, a step row without its fields; a timestamp that is not one."""
    with (run / "metrics.jsonl").open("a") as metrics:
        metrics.write('5\nnull\n{"loss": 1.0}\n{"step": 1, "loss": "high"}\n')
    status = json.loads((run / "status.json").read_text())
    (run / "status.json").write_text(json.dumps({**status, "status": "interrupted", "updated_at": "yesterday",
                                                 "best_eval_loss": "low"}))


@pytest.mark.slow
def test_report_and_runs_show_a_run_with_damaged_records_and_count_them(cli, trained, tmp_path, clean_environment):
    run = run_copy(trained, tmp_path)
    damage_records(run)
    run_copy(trained, tmp_path, "unreadable").joinpath("status.json").write_text("{not json")
    before = (run / "metrics.jsonl").read_text()
    report = cli("report", str(run), "--details", env={"COLUMNS": WIDE})  # a finding on one line
    assert report.returncode == 0 and "Traceback" not in said(report), said(report)
    assert "metrics.jsonl: 4 damaged lines skipped" in said(report)
    assert "status.json: 2 fields of the wrong type left out" in said(report)
    listing = cli("runs", "--output-dir", str(tmp_path / "runs"))
    assert listing.returncode == 0, said(listing)
    rows = {line.split()[0]: line for line in listing.stdout.splitlines() if line.strip()}
    assert "interrupted" in rows["run"] and "2/2" in rows["run"]
    assert "damaged" in rows["unreadable"]
    assert (run / "metrics.jsonl").read_text() == before  # reading changes nothing


@pytest.mark.slow
def test_resume_goes_on_past_damaged_metrics_lines(cli, trained, tmp_path, clean_environment):
    run = run_copy(trained, tmp_path)
    damage_records(run)
    result = cli("resume", str(run), "--quiet", timeout=240)
    assert result.returncode == 0, said(result)
    assert json.loads((run / "status.json").read_text())["status"] == "completed"
    assert (run / "adapter" / "adapter_model.safetensors").is_file()


# ------------------------------------------------------------ 20: numbers out of range

@pytest.mark.parametrize("args", [["plan", "DATA", "--epochs", "1e308"], ["train", "DATA", "--epochs", "1e308"],
                                  ["resume", "RUN", "--epochs", "1e308"]])
def test_epochs_beyond_the_range_are_refused_before_anything_runs(cli, tmp_path, clean_environment, args):
    given = [str(DATA_FILES["alpaca"]) if a == "DATA" else str(tmp_path / "runs" / "r") if a == "RUN" else a
             for a in args]
    refused(cli(*given, "--output-dir", str(tmp_path / "runs")) if args[0] != "plan" else cli(*given),
            "Invalid value for '--epochs'", "at most 1000")
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.parametrize("seed", ["-1", "123456789012345678901"])
def test_generate_refuses_a_seed_out_of_range_before_loading_the_model(cli, trained, seed, clean_environment):
    out = refused(cli("generate", str(trained), "hello", "--seed", seed, timeout=60),
                  "Invalid value for '--seed'", "4294967295")
    assert "Loading" not in out


# ------------------------------------------------------------ 21: a settings file that cannot be written

@pytest.mark.parametrize("where", ["under a file", "in a folder that is not there"])
def test_setup_refuses_an_env_file_it_cannot_write_before_asking_anything(cli, tiny_models, tmp_path,
                                                                         clean_environment, where):
    in_the_way = tmp_path / "settings"
    in_the_way.write_text("KEEP=1\n")
    env_file = in_the_way / "x.env" if where == "under a file" else tmp_path / "missing" / "x.env"
    answers = f"\n\n{tiny_models['llama']}\n\n\n\n\n\n"  # enough for every question, should it ask
    out = refused(cli("setup", "--data", str(DATA_FILES["alpaca"]), "--env-file", str(env_file), input=answers,
                      timeout=120), "Cannot write the settings file", "nothing was written")
    assert "Goal" not in out  # refused before the first question
    assert in_the_way.read_text() == "KEEP=1\n"
