"""Every command run on paths and text that look like Rich markup (issue 46, 6): a model
folder, a data file, an output folder and a run named with [brackets] and "[/]", and a
prompt holding them. Each ends as it would with plain names: no MarkupError, no run marked
failed because a message quoted its path, and the path shown as written."""

from __future__ import annotations

import shutil

import pytest

from conftest import DATA_FILES

pytestmark = pytest.mark.slow

MARKUP_TRACES = ("Traceback", "MarkupError", "closing tag")


def ok(ran, *says: str) -> str:
    output = ran.stdout + ran.stderr
    assert ran.returncode == 0, output[-3000:]
    assert not [t for t in MARKUP_TRACES if t in output], output[-3000:]
    flat = " ".join(output.replace("│", " ").split())
    for text in says:
        assert text in flat, (text, output[-3000:])
    return flat


def test_every_command_takes_bracketed_paths_as_written(tmp_path, tiny_models, cli):
    model = tmp_path / "m[/]" / "[bold]model"
    shutil.copytree(tiny_models["llama"], model)
    data = tmp_path / "d[/]" / "rows [x].jsonl"
    data.parent.mkdir(parents=True)
    shutil.copy(DATA_FILES["alpaca"], data)
    out = tmp_path / "o[/]"
    common = ["--model", str(model), "--output-dir", str(out), "--max-steps", "2", "--yes",
              "--mixed-precision", "no"]

    ok(cli("plan", str(data), "--model", str(model)), "rows [x].jsonl")
    ok(cli("train", str(data), *common, "--run-name", "r[1]"), "r[1]")
    # A second run into the same folder: warnings quoting the folder (reused base replies) once killed it at step 1.
    ok(cli("train", str(data), *common, "--run-name", "r[2]"), "Training finished")
    run = out / "r[1]"
    ok(cli("runs", "--output-dir", str(out)), "r[1]", "r[2]")
    ok(cli("report", str(run), "--plot"), "loss.png")
    ok(cli("generate", str(run), "say [/] and [bold]", "--max-new-tokens", "4"))
    ok(cli("chat", str(run), "--max-new-tokens", "4", input="[/]x [red]\n/exit\n"))
    ok(cli("export", str(run), "--output", str(tmp_path / "e[/]x")), "e[/]x")
    cut = cli("train", str(data), *common, "--run-name", "cut[x]", "--save-every", "1",
              env={"LLMCUSTOMS_FAULT_INJECT": "sigint@1"})
    assert cut.returncode == 130, (cut.stdout + cut.stderr)[-3000:]
    ok(cli("resume", str(out / "cut[x]")), "Training finished")
    env_file = tmp_path / "e[/]" / "my[1].env"
    env_file.parent.mkdir(parents=True)
    ok(cli("setup", "--data", str(data), "--env-file", str(env_file), input=f"\n\n{model}\n\n\ny\n"),
       "Next, train with")
    assert str(data) in env_file.read_text()
