"""Attacks on what a run keeps and relies on between commands (issue 32): the
token store's contents, a data file edited while it is tokenized, a cache that
cannot be written, temporary stores left by a killed run, and base model
weights replaced under a run. Through the CLI, as a user meets them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time

import numpy as np
import pytest

from conftest import DATA_FILES
from llmcustoms.recovery.faults import ENV_VAR
from llmcustoms.planning.plan import Plan


def said(result) -> str:
    """What the command printed, its lines rewrapped into one."""
    return " ".join((result.stdout + result.stderr).split())


def plan_args(data, model) -> tuple[str, ...]:
    return ("plan", str(data), "--model", str(model))


def test_a_store_whose_ids_were_changed_is_rebuilt_not_trained_on(tmp_path, tiny_models, clean_environment, cli):
    args = plan_args(DATA_FILES["alpaca"], tiny_models["llama"])
    assert cli(*args).returncode == 0
    [store] = (tmp_path / "cache" / "tokenized").iterdir()
    ids = store / "ids.bin"
    original = ids.read_bytes()
    shuffled = np.random.default_rng(0).permutation(np.frombuffer(original, np.int32))
    shuffled.tofile(ids)  # every id valid, the store's lengths whole: only its content is wrong
    assert ids.read_bytes() != original

    result = cli(*args)
    assert result.returncode == 0, result.stderr
    text = said(result)
    assert "alpaca.jsonl did not match their checksum" in text and "tokenized again" in text
    assert "from the cache" not in text and "Traceback" not in text
    assert ids.read_bytes() == original  # rebuilt from the data


def test_a_data_file_edited_while_tokenized_leaves_no_store_keyed_to_its_old_bytes(tmp_path, tiny_models,
                                                                                    clean_environment, cli):
    data = tmp_path / "rows.jsonl"
    shutil.copy(DATA_FILES["alpaca"], data)
    original = data.read_bytes()
    args = plan_args(data, tiny_models["llama"])

    edited = cli(*args, env={ENV_VAR: "edit_data@1"})  # rows 1 and 2 swapped as tokenizing starts
    assert data.read_bytes() != original
    assert edited.returncode == 2, edited.stdout + edited.stderr
    text = said(edited)
    assert "rows.jsonl changed while it was being tokenized" in text and "Run the command again" in text
    assert "Traceback" not in text
    assert not list((tmp_path / "cache" / "tokenized").iterdir())

    data.write_bytes(original)  # the edit undone: the bytes of the first key again
    again = cli(*args)
    assert again.returncode == 0, again.stderr
    assert "from the cache" not in said(again) and "cached for the next run" in said(again)


def test_a_cache_that_cannot_be_written_is_said_not_claimed(tmp_path, tiny_models, clean_environment, cli):
    # That such a run still trains: the resume test below trains with --cache-dir naming a file.
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("the user's file\n")
    result = cli(*plan_args(DATA_FILES["alpaca"], tiny_models["llama"]), "--cache-dir", str(blocker),
                 "--eval-data", str(DATA_FILES["alpaca"]))  # two stores that cannot be kept: the reason said once
    assert result.returncode == 0, result.stdout + result.stderr
    text = said(result)
    assert f"Tokenized rows not cached: {blocker} cannot be written (Not a directory)" in text
    assert text.count("Tokenized rows not cached") == 1
    assert "not cached." in text and "cached for the next run" not in text
    assert blocker.read_text() == "the user's file\n"


def test_a_store_left_by_a_killed_run_is_removed_by_the_next(tmp_path, tiny_models, clean_environment, cli):
    args = plan_args(DATA_FILES["alpaca"], tiny_models["llama"])
    killed = cli(*args, env={ENV_VAR: "kill_tokenizing@1"})
    assert killed.returncode == -signal.SIGKILL
    tokenized = tmp_path / "cache" / "tokenized"
    assert len(list(tokenized.glob(".*.tmp"))) == 1 and not list(tokenized.glob("[!.]*"))
    # From an older llmcustoms or another machine: no writer to ask, untouched for two hours.
    old = tokenized / ".other.abc.tmp"
    old.mkdir()
    (old / "ids.bin").write_bytes(b"\0" * 8)
    for path in (old / "ids.bin", old):
        os.utime(path, (time.time() - 7200,) * 2)
    # Being written right now by a live process: kept.
    live = tokenized / ".other.live.tmp"
    live.mkdir()
    (live / "writer.json").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))

    again = cli(*args)
    assert again.returncode == 0, again.stderr
    assert [p.name for p in tokenized.glob(".*.tmp")] == [live.name]
    assert len(list(tokenized.glob("[!.]*"))) == 1 and "cached for the next run" in said(again)


@pytest.mark.slow
def test_resume_refuses_base_weights_replaced_with_the_same_shapes(tmp_path, tiny_models, clean_environment, cli):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], model)
    run = tmp_path / "runs" / "run"
    blocker = tmp_path / "not-a-directory"  # a cache that cannot be written: the run trains all the same
    blocker.write_text("the user's file\n")
    first = cli("train", str(DATA_FILES["alpaca"]), "--model", str(model), "--max-steps", "2", "--save-every", "1",
                "--output-dir", str(tmp_path / "runs"), "--run-name", "run", "--yes", "--cache-dir", str(blocker),
                env={ENV_VAR: "sigint@1"})
    assert first.returncode == 130, first.stdout + first.stderr
    assert "Tokenized rows not cached" in said(first) and blocker.read_text() == "the user's file\n"

    weights = model / "model.safetensors"
    with safe_open(str(weights), "pt") as f:
        metadata = f.metadata()
    save_file({name: tensor + 0.01 for name, tensor in load_file(str(weights)).items()}, str(weights), metadata)
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())

    refused = cli("resume", str(run), "--quiet")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    text = said(refused)
    assert "has changed since the run started (model.safetensors differs)" in text
    assert "--model-changed-ok" in text and "Traceback" not in text
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == checkpoints
    assert json.loads((run / "status.json").read_text())["status"] == "interrupted"
    assert json.loads((run / "plan.json").read_text())["model_fingerprint"]

    # A plan written before the fingerprint existed resumes as before.
    from llmcustoms.runs.model_files import with_model_checked

    older = json.loads((run / "plan.json").read_text())
    del older["model_fingerprint"]
    assert with_model_checked(Plan.from_json(older), changed_ok=False) == Plan.from_json(older)

    resumed = cli("resume", str(run), "--quiet", "--model-changed-ok")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    plan = json.loads((run / "plan.json").read_text())
    assert any("--model-changed-ok" in reason for reason in plan["reasons"])
    assert json.loads((run / "status.json").read_text())["status"] == "completed"
