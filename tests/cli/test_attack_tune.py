"""Issue 32, `llmcustoms tune`: nothing of the user's is lost and every fault is
one message. Each test runs the CLI in a subprocess on a tiny model, with
trials of one or two steps.

- two `tune` of one study, at once, draw four different sets of values
- a trial killed with kill -9 is failed when the study continues, and counted
- changed data (same path, same rows) or another trial budget is no silent continuation
- SIGTERM / Ctrl-C in a trial: recorded as interrupted, exit 143 / 130, no traceback
- a storage URL's password is never shown
- a full disk is one message, and the study is kept
- --study-name cannot leave --output-dir
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import optuna
import pytest

from conftest import DATA_FILES, run_cli, start_cli

PASSWORD = "S3cretPassw0rd"


def tune_args(out: Path, model: Path, *extra: str, data: Path = DATA_FILES["alpaca"]) -> list[str]:
    return ["tune", str(data), "--model", str(model), "--eval-split", "0.2", "--output-dir", str(out), *extra]


def trials(out: Path, name: str = "s") -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{out / f'tune-{name}' / 'study.db'}").trials


def said(result: subprocess.CompletedProcess) -> str:
    return " ".join((result.stdout + result.stderr).split())


def no_traceback(result: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]


@pytest.mark.slow
def test_two_tunes_of_one_study_at_once_draw_different_values(tmp_path, tiny_models, clean_environment):
    out = tmp_path / "out"
    args = tune_args(out, tiny_models["llama"], "--study-name", "s", "--trials", "2", "--max-steps", "1")
    runs = [start_cli(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for run in runs:
        stdout, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, stderr[-3000:]
    done = trials(out)
    # Every trial ended; which state is another matter (the note on issue 32: a rare race between two starts).
    assert len(done) == 4 and all(t.state.name != "RUNNING" for t in done)
    drawn = {tuple(sorted(t.params.items())) for t in done}
    assert len(drawn) == 4, [t.params for t in done]  # each process seeded alike drew the same values


@pytest.mark.slow
def test_a_trial_killed_with_kill_9_is_failed_when_the_study_continues(tmp_path, tiny_models, clean_environment):
    out = tmp_path / "out"
    killed = run_cli(*tune_args(out, tiny_models["llama"], "--study-name", "s", "--trials", "2", "--max-steps", "2"),
                     env={"LLMCUSTOMS_FAULT_INJECT": "sigkill@1"})
    assert killed.returncode == -9
    assert [t.state.name for t in trials(out)] == ["RUNNING"]
    # Continued, and stopped by Ctrl-C in its own trial: 130, no traceback, and every trial counted.
    again = run_cli(*tune_args(out, tiny_models["llama"], "--study-name", "s", "--trials", "2", "--max-steps", "2"),
                    env={"LLMCUSTOMS_FAULT_INJECT": "sigint@1"})
    assert again.returncode == 130, again.stderr[-3000:]
    no_traceback(again)
    first, second = trials(out)
    assert first.state.name == "FAIL" and "ended without finishing it" in first.user_attrs["reason"]
    assert second.state.name == "PRUNED" and second.user_attrs["interrupted"] == "SIGINT"
    assert "2 trials in all (0 complete, 0 pruned, 1 failed, 1 interrupted)" in said(again)


@pytest.mark.slow
def test_sigterm_in_a_trial_records_it_as_interrupted_and_exits_143(tmp_path, tiny_models, clean_environment):
    out = tmp_path / "out"
    result = run_cli(*tune_args(out, tiny_models["llama"], "--study-name", "s", "--trials", "2", "--max-steps", "2"),
                     env={"LLMCUSTOMS_FAULT_INJECT": "sigterm@1"})
    assert result.returncode == 143, result.stderr[-3000:]
    no_traceback(result)
    [trial] = trials(out)  # the study stopped: no second trial
    assert trial.state.name == "PRUNED" and trial.user_attrs["reason"] == "interrupted by SIGTERM at step 1"
    assert "1 trials in all (0 complete, 0 pruned, 0 failed, 1 interrupted)" in said(result)
    assert "interrupted" in (out / "tune-s" / "trials.csv").read_text()


@pytest.mark.slow
def test_changed_data_or_another_budget_is_not_continued_silently(tmp_path, tiny_models, clean_environment):
    out, data = tmp_path / "out", tmp_path / "data.jsonl"
    shutil.copy(DATA_FILES["alpaca"], data)
    model = tiny_models["llama"]
    first = run_cli(*tune_args(out, model, "--trials", "1", "--max-steps", "1", data=data))
    assert first.returncode == 0, first.stderr[-3000:]
    name = "data-tiny-llama"  # the default name: data file and model
    # Another budget, the study named: refused, nothing added to it.
    budget = run_cli(*tune_args(out, model, "--trials", "1", "--max-steps", "2", "--study-name", name, data=data))
    assert budget.returncode == 2 and "1 optimizer steps per trial, not 2" in said(budget)
    no_traceback(budget)
    # The same path and row count, other content: a new study beside the old one, and said so.
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[0]["output"] = "edited: " + rows[0]["output"]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    changed = run_cli(*tune_args(out, model, "--trials", "1", "--max-steps", "1", data=data))
    assert changed.returncode == 0, changed.stderr[-3000:]
    assert "the data changed since; its checksum differs" in said(changed) and "a new study" in said(changed)
    assert len(trials(out, name)) == 1  # the old study is kept as it was
    [new] = [p.name[len("tune-"):] for p in out.glob(f"tune-{name}-*")]
    assert len(trials(out, new)) == 1


@pytest.mark.slow
def test_a_storage_password_is_never_shown(tmp_path, tiny_models, clean_environment):
    url = f"postgresql://tuner:{PASSWORD}@127.0.0.1:9/study"
    result = run_cli(*tune_args(tmp_path, tiny_models["llama"], "--trials", "1", "--storage", url))
    assert result.returncode == 2
    assert PASSWORD not in result.stdout + result.stderr
    assert "Cannot open the study storage postgresql://***@127.0.0.1:9/study" in said(result)
    no_traceback(result)
    # A SQLite URL has no password: shown as it is.
    sqlite = f"sqlite:///{tmp_path}/no/such/dir/study.db"
    result = run_cli(*tune_args(tmp_path, tiny_models["llama"], "--trials", "1", "--storage", sqlite))
    assert result.returncode == 2 and f"Cannot open the study storage {sqlite}" in said(result)
    no_traceback(result)


@pytest.mark.slow
def test_a_full_disk_during_a_study_is_one_message_and_keeps_the_study(tmp_path, tiny_models, clean_environment):
    out = tmp_path / "out"
    # From the second step on (trial 1's first), every write to the study's SQLite file fails as on a full disk.
    result = run_cli(*tune_args(out, tiny_models["llama"], "--study-name", "s", "--trials", "3", "--max-steps", "1"),
                     env={"LLMCUSTOMS_FAULT_INJECT": "diskfull@2"})
    assert result.returncode == 2, result.stderr[-3000:]
    no_traceback(result)
    assert "The disk is full: the study s could not be saved" in said(result)
    assert "run the same command again to continue the study" in said(result)
    first, second = trials(out)
    assert first.state.name == "COMPLETE" and second.state.name == "RUNNING"  # the next run fails it (kill -9 test)


def test_a_study_name_cannot_leave_the_output_directory(tmp_path, tiny_models, clean_environment):
    out = tmp_path / "a" / "b"
    # out/tune-../../../x is tmp_path/a/x: outside --output-dir.
    result = run_cli(*tune_args(out, tiny_models["llama"], "--trials", "1", "--study-name", "../../../x"))
    assert result.returncode == 2 and "--study-name '../../../x' is not a plain name" in said(result)
    no_traceback(result)
    assert not (tmp_path / "a").exists()  # refused before anything was written
