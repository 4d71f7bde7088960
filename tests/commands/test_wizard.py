"""`llmcustoms setup`: every answer is checked as `train` would meet it, a
refused one is asked again (or, with no one to answer, stops with exit 2), and
the models are offered with where they load from and how long they would take.

The wizard runs as a user runs it, in a subprocess with the answers piped in.
Tests run offline (conftest), so a Hub model is usable only when it is in the
Hugging Face cache: `fake_hub_cache` puts the catalog's ids there.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import DATA_FILES
from llmcustoms.models import hub_access
from llmcustoms.cli import app
from llmcustoms.data.dataset import read_dataset
from llmcustoms.planning.duration import CPU_TIME_LIMIT_S
from llmcustoms.planning.hardware import Hardware
from llmcustoms.planning.presets import load_preset
from llmcustoms.planning.settings import load_settings
from llmcustoms.commands.setup import model_offers, planning_stats, suggested_model
from tiny_models import WIDE

runner = CliRunner()
SMOLLM2 = ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-360M-Instruct")
TIME = r"\d+(\.\d)? (s|min|h)"
ROOT_EXAMPLE = Path(__file__).parent.parent.parent / "examples" / "identity.json"


pytestmark = pytest.mark.usefixtures("clean_environment")


def fake_hub_cache(home: Path, hub_ids: tuple[str, ...]) -> Path:
    """A Hugging Face home whose cache holds `hub_ids` (config and a weights file,
    which is all `hub_access.is_cached` looks for)."""
    for hub_id in hub_ids:
        repo = home / "hub" / f"models--{hub_id.replace('/', '--')}"
        snapshot = repo / "snapshots" / "0123abcd"
        snapshot.mkdir(parents=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0123abcd")
        (snapshot / "config.json").write_text("{}")
        (snapshot / "model.safetensors").write_bytes(b"")
    return home


def run_setup(tmp_path: Path, env_file: Path, stdin: str, data: Path | None = DATA_FILES["alpaca"],
              cached: tuple[str, ...] = SMOLLM2, **env: str) -> subprocess.CompletedProcess:
    """`llmcustoms setup` with `stdin` piped in, offline, with `cached` in the Hugging Face cache."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("LLMCUSTOMS_") and k != "CI"}
    home = fake_hub_cache(tmp_path / "hf-home", cached)
    args = ["--data", str(data)] if data else []
    return subprocess.run([sys.executable, "-m", "llmcustoms", "setup", *args, "--env-file", str(env_file)],
                          input=stdin, capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**base, "COLUMNS": WIDE, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", **env})


def answers(*lines: str) -> str:
    return "\n".join(lines) + "\n"


def env_values(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line and not line.startswith("#"))


def said(result: subprocess.CompletedProcess) -> str:
    """Everything shown, on one line: Rich wraps long messages."""
    return " ".join((result.stdout + result.stderr).split())


def alpaca_with_empty_replies(path: Path, rows: int, empty: tuple[int, ...]) -> Path:
    """`rows` Alpaca rows, the ones at `empty` (0-based) with an empty output and a prompt no report may show."""
    lines = [json.dumps({"instruction": f"PRIVATE-PROMPT-{i}" if i in empty else f"Name the number {i}.",
                         "input": "", "output": "" if i in empty else f"The number is {i}, written out."})
             for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


# ------------------------------------------------------------------- moved from test_settings.py


def test_setup_with_enter_throughout_writes_a_sensible_env_file(tmp_path):
    env_file = tmp_path / "F.env"
    result = run_setup(tmp_path, env_file, "\n" * 20)  # what `yes ''` sends
    assert result.returncode == 0, result.stdout + result.stderr
    values = env_values(env_file)
    assert values["LLMCUSTOMS_PRESET"] == "quality"
    # No GPU here: one of the preset's CPU models (both cached), by how long it would take.
    assert values["LLMCUSTOMS_MODEL"] in SMOLLM2
    assert values["LLMCUSTOMS_OUTPUT_DIR"] == "runs"
    assert values["LLMCUSTOMS_DATA"] == str(DATA_FILES["alpaca"])
    assert "LLMCUSTOMS_SKIP_BAD_ROWS" not in values  # the fixture has no bad row
    assert f"llmcustoms train --env-file {env_file}" in result.stdout  # the data is in the file
    assert "ok: Alpaca" in result.stdout  # the data was validated on the spot
    # What it wrote is what `plan` then uses.
    result = runner.invoke(app, ["plan", "--json", "--env-file", str(env_file)], catch_exceptions=False)
    plan = json.loads(result.output)
    assert plan["preset"] == "quality" and plan["sources"]["preset"] == "env LLMCUSTOMS_PRESET"
    assert plan["data"] == str(DATA_FILES["alpaca"].resolve())


def test_setup_writes_the_data_path_whole_so_train_finds_it_from_anywhere(tmp_path, monkeypatch):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "data.jsonl").write_bytes(DATA_FILES["alpaca"].read_bytes())
    env_file = tmp_path / "F.env"
    result = run_setup(tmp_path, env_file, "\n" * 20, data=Path("mine") / "data.jsonl")  # relative to where it runs
    assert result.returncode == 0, result.stdout + result.stderr
    assert env_values(env_file)["LLMCUSTOMS_DATA"] == str((tmp_path / "mine" / "data.jsonl").resolve())
    # The file names what exists for a pip-installed user, not a .env.example they do not have.
    assert "llmcustoms settings --example" in env_file.read_text() and ".env.example" not in env_file.read_text()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    result = runner.invoke(app, ["plan", "--json", "--env-file", str(env_file)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["data"] == str((tmp_path / "mine" / "data.jsonl").resolve())


def test_setup_answers_are_used_and_other_variables_are_kept(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("HF_TOKEN=hf_keepme\nLLMCUSTOMS_PRESET=quality\n")
    result = run_setup(tmp_path, env_file, answers("", "bestaccuracy", "3", "out", "40", "y"))
    assert result.returncode == 0, result.stdout + result.stderr
    text = env_file.read_text()
    assert "LLMCUSTOMS_PRESET=bestaccuracy" in text and "LLMCUSTOMS_OUTPUT_DIR=out" in text
    assert f"LLMCUSTOMS_MODEL={SMOLLM2[1]}" in text  # number 3 of the list, smallest first (Gemma 3 270M is 2)
    assert "LLMCUSTOMS_SAVE_EVERY=40" in text and "HF_TOKEN=hf_keepme" in text
    assert "hf_keepme" not in result.stdout


def test_setup_with_bad_data_says_why_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n')
    env_file = tmp_path / "F.env"
    result = run_setup(tmp_path, env_file, "\n" * 10, data=bad)
    assert result.returncode == 2
    assert "cannot tell the data format" in said(result)
    assert not env_file.exists()


# ------------------------------------------------------------------- the model answer


def test_a_model_path_that_does_not_exist_is_refused_asked_again_and_never_written(tmp_path, tiny_models):
    env_file = tmp_path / "F.env"
    missing, no_config = tmp_path / "no-such-model", tmp_path / "not-a-model"
    no_config.mkdir()
    model = tiny_models["llama"]  # planned as `plan` plans it: its tokenizer is read
    result = run_setup(tmp_path, env_file, answers("", "", str(missing), str(no_config), str(model), "", ""))
    assert result.returncode == 0, result.stdout + result.stderr
    shown = said(result)
    assert f"{missing} does not exist" in shown and f"{no_config} has no config.json" in shown
    assert shown.count("Model (number, hub id or local directory)") == 3  # asked again after each refusal
    assert re.search(f"ok: {re.escape(model.name)}: a local model directory; estimated training time here about {TIME} "
                     f"{re.escape(str(model))}", shown)  # the whole path on a line of its own
    assert env_values(env_file)["LLMCUSTOMS_MODEL"] == str(model)
    assert "no-such-model" not in env_file.read_text() and "not-a-model" not in env_file.read_text()


@pytest.mark.parametrize("how", ["input runs out", "CI"])
def test_with_no_one_to_answer_again_a_refused_model_stops_with_one_message(tmp_path, how):
    """Piped answers used up (or CI, where no one answers): the refusal is the
    end, exit 2, not the default quietly put in place of the answer given."""
    env_file = tmp_path / "F.env"
    missing = tmp_path / "no-such-model"
    if how == "CI":  # a good answer follows, but under CI a refusal is final
        result = run_setup(tmp_path, env_file, answers("", "", str(missing), SMOLLM2[0]), CI="true")
    else:
        result = run_setup(tmp_path, env_file, answers("", "", str(missing)))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("Error:") == 1 and f"{missing} does not exist" in " ".join(result.stderr.split())
    assert "nothing was written" in said(result) and "Traceback" not in result.stderr
    assert not env_file.exists()


def test_offline_with_no_model_cached_suggests_none_and_refuses_the_hub_ids(tmp_path):
    env_file = tmp_path / "F.env"
    result = run_setup(tmp_path, env_file, answers("", "", "1", "org/a..b", "Qwen/Qwen2.5-0.5B-Instruct"), cached=())
    assert result.returncode == 2
    shown = said(result)
    assert "'org/a..b' is neither a directory here nor a Hub id" in shown and "Traceback" not in shown
    assert "No suggestion: no listed model can be used here" in shown
    assert f"{SMOLLM2[0]} is not a directory here nor in the local Hugging Face cache" in shown  # number 1
    assert "Qwen/Qwen2.5-0.5B-Instruct is not a directory here" in shown
    assert not env_file.exists()


def test_the_model_choices_show_where_each_loads_from_and_how_long_it_would_take(tmp_path):
    result = run_setup(tmp_path, tmp_path / "F.env", "\n" * 20, cached=SMOLLM2[:1])
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {line.split()[1]: line for line in result.stdout.splitlines() if re.match(r"\s*\d+\. ", line)}
    assert len(rows) > 5 and all(re.search(TIME, line) for line in rows.values()), result.stdout
    assert re.search(rf"{TIME}\s+cached\s+<-$", rows[SMOLLM2[0]].rstrip())  # the one usable offline: suggested
    assert "offline: no" in rows[SMOLLM2[1]] and "offline: no" in rows["mistralai/Mistral-7B-Instruct-v0.3"]
    assert "Offline:" in result.stdout and env_values(tmp_path / "F.env")["LLMCUSTOMS_MODEL"] == SMOLLM2[0]


def test_on_two_cores_the_suggestion_is_usable_and_the_7b_models_are_marked_slow(tmp_path, monkeypatch):
    data = alpaca_with_empty_replies(tmp_path / "d.jsonl", 2000, ())
    preset = load_preset("quality")
    hardware = Hardware.cpu_only(24, cores=2)  # the machine of the complaint
    stats = planning_stats(read_dataset(data), preset)
    monkeypatch.setattr(hub_access, "is_cached", lambda hub_id: hub_id == SMOLLM2[0])
    offers = {offer.hub_id: offer for offer in model_offers(hardware, preset, stats, 256)}
    assert offers[SMOLLM2[0]].where == hub_access.CACHED and offers[SMOLLM2[1]].where == hub_access.UNAVAILABLE
    big = offers["mistralai/Mistral-7B-Instruct-v0.3"]
    assert big.method == "qlora" and big.seconds > 10 * CPU_TIME_LIMIT_S > offers[SMOLLM2[0]].seconds
    assert suggested_model(hardware, preset, stats, list(offers.values()))[0] == SMOLLM2[0]
    monkeypatch.setattr(hub_access, "is_cached", lambda hub_id: False)
    offline = model_offers(hardware, preset, stats, 256)
    assert suggested_model(hardware, preset, stats, offline)[0] is None


# ------------------------------------------------------------------- bad rows


def test_a_few_bad_rows_are_skipped_as_train_skips_them_and_reported_by_line(tmp_path):
    data = alpaca_with_empty_replies(tmp_path / "d.jsonl", 60, (3, 41))  # 2 of 60: under the share
    env_file = tmp_path / "F.env"
    result = run_setup(tmp_path, env_file, "\n" * 20, data=data)
    assert result.returncode == 0, result.stdout + result.stderr
    shown = said(result)
    assert "ok: Alpaca (instruction, input, output), 58 rows" in shown
    assert "2 bad rows will be skipped" in shown and "field 'output' is empty: 2 rows (line 4, line 42)" in shown
    assert "PRIVATE-PROMPT" not in shown and "--skip-bad-rows" not in shown
    assert "LLMCUSTOMS_SKIP_BAD_ROWS" not in env_file.read_text()  # the default policy is enough


def test_more_bad_rows_than_the_share_are_offered_for_skipping_and_the_choice_is_saved(tmp_path):
    data = alpaca_with_empty_replies(tmp_path / "d.jsonl", 10, (3, 7))  # 20%
    env_file = tmp_path / "F.env"
    result = run_setup(tmp_path, env_file, answers("", "y") + "\n" * 10, data=data)
    assert result.returncode == 0, result.stdout + result.stderr
    shown = said(result)
    assert "2 of 10 rows (20%) fail validation" in shown and "(line 4, line 8)" in shown
    assert "ok: Alpaca (instruction, input, output), 8 rows" in shown
    assert "PRIVATE-PROMPT" not in shown and "--skip-bad-rows" not in shown  # a flag setup does not take
    assert env_values(env_file)["LLMCUSTOMS_SKIP_BAD_ROWS"] == "true"
    assert load_settings(env_file).values["skip_bad_rows"][0] is True  # what train, plan and tune then read


def test_declining_to_skip_with_no_one_to_answer_again_stops_and_writes_nothing(tmp_path):
    data = alpaca_with_empty_replies(tmp_path / "d.jsonl", 10, (3, 7))
    env_file = tmp_path / "F.env"
    result = run_setup(tmp_path, env_file, answers("", "n"), data=data)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "d.jsonl: 2 of 10 rows fail validation" in " ".join(result.stderr.split())
    assert "answer y to skip them" in said(result) and not env_file.exists()


def test_the_env_file_setup_writes_is_the_owners_alone_and_an_existing_files_mode_is_kept(tmp_path):
    """It may hold HF_TOKEN: a new file is 0600; a file the user made 0640 stays 0640 (never widened to 0644)."""
    from llmcustoms.commands.setup import write_env

    new = tmp_path / "new.env"
    write_env(new, {"LLMCUSTOMS_PRESET": "quality"})
    assert new.stat().st_mode & 0o777 == 0o600
    existing = tmp_path / "existing.env"
    existing.write_text("HF_TOKEN=hf_notarealtokenbutlongenough000000\n")
    os.chmod(existing, 0o640)
    write_env(existing, {"LLMCUSTOMS_PRESET": "quality"})
    assert existing.stat().st_mode & 0o777 == 0o640
    assert "HF_TOKEN=hf_notarealtokenbutlongenough000000" in existing.read_text()
    assert not list(tmp_path.glob(".*.tmp"))


# ------------------------------------------------------------------- a first run with no data of one's own


def test_with_no_data_file_setup_offers_the_example_and_plan_trains_on_it(tmp_path, tiny_models):
    """Enter at the data question takes the example, copied into the working
    directory; the env file names the copy, and `plan` plans the tiny model on it."""
    from llmcustoms.commands.example_data import example_path

    env_file = tmp_path / "F.env"
    result = run_setup(tmp_path, env_file, answers("", "", "", str(tiny_models["llama"]), "", ""), data=None)
    assert result.returncode == 0, result.stdout + result.stderr
    shown = said(result)
    assert "No data file yet? Press Enter (the answer example) to start with the example" in shown
    assert "teach the model it is Vicuna" in shown and "ok: ShareGPT (conversations: [{from, value}]), 300 rows" in shown
    copy = tmp_path / "identity.json"
    assert f"Copied the example to {copy.name}" in shown and copy.read_bytes() == example_path().read_bytes()
    assert env_values(env_file)["LLMCUSTOMS_DATA"] == str(copy)
    planned = runner.invoke(app, ["plan", "--json", "--env-file", str(env_file)], catch_exceptions=False)
    assert planned.exit_code == 0, planned.output
    plan = json.loads(planned.output)
    assert plan["data"] == str(copy) and plan["model"] == str(tiny_models["llama"])
    assert plan["data_format"] == "sharegpt" and plan["train_rows"] + plan["eval_rows"] == 300


def test_a_setup_that_stops_copies_nothing(tmp_path):
    """The example is copied with the env file, at the end: stopped at the model
    question (no one to answer again), setup leaves no file behind."""
    result = run_setup(tmp_path, tmp_path / "F.env", answers("", "", "", str(tmp_path / "no-such-model")), data=None)
    assert result.returncode == 2, result.stdout + result.stderr
    assert not (tmp_path / "identity.json").exists() and not (tmp_path / "F.env").exists()


def test_setup_estimates_the_time_plan_gives_for_the_same_answers(tmp_path, tiny_models, monkeypatch):
    """Setup said 11 min where `plan` said 13 for the same configuration: it
    counted the rows' tokens from their characters, `plan` with the model's
    tokenizer. Both now come from one call. On a machine where the tiny model
    trains at 20 tokens/s (a measured speed), the difference is minutes."""
    from test_speeds import steps

    from llmcustoms.models.loading import describe_model
    from llmcustoms.planning import hardware as hardware_module
    from llmcustoms.planning.duration import human_duration
    from llmcustoms.planning.planner import Planner
    from llmcustoms.planning.presets import load_families
    from llmcustoms.runs.speeds import record_speed, with_measured_speeds
    from llmcustoms.ui import dialog

    machine, model = Hardware.cpu_only(16, cores=2), str(tiny_models["llama"])
    monkeypatch.setattr(hardware_module, "detect", lambda: machine)  # one machine, not today's load, for both
    monkeypatch.setattr(dialog, "_input_ended", False)  # the answers run out at the end: not for the next test
    record_speed(tmp_path / "cache", machine, model, "lora", steps(1.0, 1.0, 1.0, 1.0, tokens_per_s=20.0))
    data = str(ROOT_EXAMPLE)
    env_file = tmp_path / "F.env"
    result = runner.invoke(app, ["setup", "--data", data, "--env-file", str(env_file)],
                           input=answers("", "", model, "", ""), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    shown = " ".join(result.output.split())
    estimate = re.search(rf"ok: {re.escape(Path(model).name)}: a local model directory; estimated training time here "
                         rf"(about {TIME}) {re.escape(model)}", shown)
    assert estimate, shown
    planned = runner.invoke(app, ["plan", "--json", "--env-file", str(env_file)], catch_exceptions=False)
    assert estimate[1] == human_duration(json.loads(planned.output)["estimated_seconds"])
    # What setup said before: the same planner on lengths from characters.
    dataset, preset = read_dataset(data), load_preset("quality")
    choice = describe_model(model, load_families(), "env")
    by_characters = Planner(with_measured_speeds(machine, tmp_path / "cache"), preset).plan(
        choice, planning_stats(dataset, preset), {}).estimated_seconds
    assert human_duration(by_characters) != estimate[1], (by_characters, estimate[1])


# ------------------------------------------------------- offline: the models on this disk


def run_of(runs: Path, name: str, model: Path, started_at: str) -> None:
    """A run directory as `runs` lists it: plan.json naming `model`, and status.json."""
    (runs / name).mkdir(parents=True)
    (runs / name / "plan.json").write_text(json.dumps({"model": str(model), "method": "lora", "total_steps": 4}))
    (runs / name / "status.json").write_text(json.dumps({"status": "completed", "step": 4, "started_at": started_at}))


def test_offline_enter_takes_the_local_model_the_runs_here_trained(tmp_path, tiny_models):
    """The Hub unreachable, nothing cached: every catalog model is "offline: no", so the
    model the runs in ./runs trained is offered first, and Enter throughout sets up."""
    older, newer = tiny_models["qwen2"], tiny_models["llama"]
    run_of(tmp_path / "runs", "a", older, "2025-01-01T12:00:00+0000")
    run_of(tmp_path / "runs", "b", newer, "2025-02-01T12:00:00+0000")
    run_of(tmp_path / "runs", "gone", tmp_path / "deleted-model", "2025-03-01T12:00:00+0000")  # not offered
    env_file = tmp_path / "F.env"
    result = run_setup(tmp_path, env_file, answers("", "", "", "", ""), cached=(), COLUMNS="80")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    listed = [line for line in lines if re.match(r" ?\d+\. ", line)]
    assert re.match(rf" ?1\. {newer.name} +\d\.\dB lora +{TIME} local +<-", listed[0]), result.stdout
    assert re.match(rf" ?2\. {older.name} ", listed[1]) and "offline: no" in listed[2], result.stdout
    assert lines[lines.index("1. used by a run here:") + 1] == str(newer)  # the whole path, on its own line
    assert "deleted-model" not in result.stdout
    assert "Model (number, hub id or local directory) (1):" in said(result)
    assert env_values(env_file)["LLMCUSTOMS_MODEL"] == str(newer)


def test_offline_a_language_model_in_the_hugging_face_cache_is_offered_and_enter_takes_it(tmp_path, tiny_models):
    import shutil

    home = tmp_path / "hf-home"
    repo = home / "hub" / "models--someone--tiny-llama"
    shutil.copytree(tiny_models["llama"], repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    env_file = tmp_path / "F.env"
    result = run_setup(tmp_path, env_file, answers("", "", "", "", ""), cached=())
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(rf"1\. someone/tiny-llama +\d\.\dB lora .*{TIME} cached +<-", result.stdout), result.stdout
    assert "1. in the Hugging Face cache: someone/tiny-llama" in result.stdout
    assert env_values(env_file)["LLMCUSTOMS_MODEL"] == "someone/tiny-llama"


def test_without_a_gpu_setup_says_what_the_times_below_say():
    """It said "expect hours for real models", then offered one estimated at 9 minutes."""
    import io

    from rich.console import Console

    from llmcustoms.ui import dialog

    saved, dialog.console = dialog.console, Console(file=io.StringIO(), width=80, record=True, color_system=None)
    try:
        dialog.show_setup_start(Hardware.cpu_only(16, cores=2))
        text = " ".join(dialog.console.export_text().split())
    finally:
        dialog.console = saved
    assert "expect hours" not in text and "minutes for the smallest models, hours for larger ones" in text
