"""What loading a model may do: a model's own code only with
--trust-remote-code, weights only from safetensors unless
--allow-pickle-weights, adapters only from adapter_model.safetensors. A run
directory can come from anyone, so `resume`, `generate`, `chat` and `export`
take both from their own flags, never from the run's plan.json (nor the
environment), and refuse before anything loads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import DATA_FILES
from llmcustoms.cli import app
from llmcustoms.errors import ModelError
from llmcustoms.models.loading import Allowed, _explain, check_weight_files
from llmcustoms.runs.run_directory import RunDirectory
from tiny_models import WIDE, build_model

DATA = str(DATA_FILES["alpaca"])
REMOTE_CODE = "runs code from its repository (trust_remote_code)"
PASS_TRUST = "Pass --trust-remote-code to allow it for this command, if you trust that repository."


def invoke(*args: str, env: dict[str, str] | None = None, input: str | None = None):
    return CliRunner().invoke(app, list(args), catch_exceptions=False, env={"COLUMNS": WIDE, **(env or {})},
                              input=input)


def said(result) -> str:
    """stdout and stderr with whitespace collapsed, so line wrapping cannot split a phrase."""
    return " ".join((result.stdout + "\n" + result.stderr).split())


def train_args(model: Path, output: Path, name: str, *more: str) -> list[str]:
    return ["train", DATA, "--model", str(model), "--max-steps", "2", "--save-every", "2", "--eval-every", "2",
            "--yes", "--quiet", "--output-dir", str(output), "--run-name", name, *more]


def edit_plan(run: Path, **changes: object) -> None:
    plan = json.loads((run / "plan.json").read_text())
    plan.update(changes)
    (run / "plan.json").write_text(json.dumps(plan))


def pickle_only(directory: Path) -> Path:
    """A tiny Llama whose weights are in pytorch_model.bin only, as older Hub repositories have them."""
    from transformers import AutoModelForCausalLM

    build_model("llama", directory)
    model = AutoModelForCausalLM.from_pretrained(directory)
    torch.save(model.state_dict(), directory / "pytorch_model.bin")
    (directory / "model.safetensors").unlink()
    return directory


@pytest.fixture(scope="module")
def finished(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("trust")
    result = invoke(*train_args(tiny_models["llama"], root, "done"))
    assert result.exit_code == 0, result.output
    return root / "done"


@pytest.fixture(scope="module")
def received(finished):
    """The finished run as someone else could hand it over: its plan.json says remote code is trusted."""
    run = finished.parent / "received"
    shutil.copytree(finished, run)
    edit_plan(run, trust_remote_code=True)
    return run


@pytest.fixture
def received_unfinished(received, tmp_path):
    """The same, interrupted at its last checkpoint: no adapter yet, something to resume."""
    run = tmp_path / "received-unfinished"
    shutil.copytree(received, run, ignore=shutil.ignore_patterns("adapter", "adapter-last"))
    RunDirectory(run).write_status("interrupted", step=2, reason="stopped by SIGINT")
    return run


@pytest.fixture
def nothing_loads(monkeypatch):
    """Any model, config, tokenizer or adapter load fails the test."""
    import peft
    import transformers

    def loaded(*args, **kwargs):
        raise AssertionError("something was loaded")

    for owner in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForCausalLM,
                  peft.PeftModel):
        monkeypatch.setattr(owner, "from_pretrained", loaded)


@pytest.fixture
def no_weights_load(monkeypatch):
    """Loading a model's weights fails the test (its config and tokenizer may load: no pickle there)."""
    import transformers

    def loaded(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loaded)


def refused_commands(received: Path, unfinished: Path, out: Path) -> dict[str, list[str]]:
    return {"generate": ["generate", str(received), "hi"], "chat": ["chat", str(received)],
            "export": ["export", str(received), "--output", str(out), "--merge"],
            "resume": ["resume", str(unfinished)]}


@pytest.mark.parametrize("command", ["generate", "chat", "export", "resume"])
def test_a_run_whose_plan_trusts_remote_code_is_refused_without_the_flag(received, received_unfinished, tmp_path,
                                                                          nothing_loads, command):
    before = (received_unfinished / "status.json").read_text()
    args = refused_commands(received, received_unfinished, tmp_path / "out")[command]
    result = invoke(*args, env={"LLMCUSTOMS_TRUST_REMOTE_CODE": "true"})  # the environment does not allow it either
    assert result.exit_code == 2, result.output
    text = said(result)
    assert f"This run's model ({json.loads((received / 'plan.json').read_text())['model']}) {REMOTE_CODE}." in text
    assert PASS_TRUST in text and "Traceback" not in text
    assert not (tmp_path / "out").exists()
    assert (received_unfinished / "status.json").read_text() == before


def test_the_refusal_comes_before_torch_is_imported(received, received_unfinished, tmp_path):
    commands = refused_commands(received, received_unfinished, tmp_path / "out")
    code = ("import sys\nfrom llmcustoms import cli\ncodes = []\n"
            f"for argv in {[commands[name] for name in ('generate', 'chat', 'export')]!r}:\n"
            "    sys.argv = ['llmcustoms', *argv]\n"
            "    try:\n        cli.main()\n    except SystemExit as end:\n        codes.append(end.code)\n"
            "print('loaded:', [m for m in ('torch', 'transformers', 'peft') if m in sys.modules], codes)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "COLUMNS": WIDE})
    assert result.stdout.strip() == "loaded: [] [2, 2, 2]", result.stdout + result.stderr
    assert " ".join(result.stderr.split()).count(PASS_TRUST) == 3


@pytest.mark.slow
def test_with_the_flag_the_run_is_used(received, received_unfinished, tmp_path):
    result = invoke("generate", str(received), "hi", "--max-new-tokens", "3", "--trust-remote-code")
    assert result.exit_code == 0, result.output
    result = invoke("chat", str(received), "--max-new-tokens", "3", "--trust-remote-code", input="hi\n/exit\n")
    assert result.exit_code == 0, result.output
    out = tmp_path / "merged"
    result = invoke("export", str(received), "--output", str(out), "--merge", "--trust-remote-code")
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").is_file()
    result = invoke("resume", str(received_unfinished), "--quiet", "--trust-remote-code")
    assert result.exit_code == 0, result.output
    assert RunDirectory(received_unfinished).read_status()["status"] == "completed"
    assert (received_unfinished / "adapter" / "adapter_model.safetensors").is_file()


def test_copying_the_adapter_loads_nothing_so_needs_no_flag(received, tmp_path, nothing_loads):
    result = invoke("export", str(received), "--output", str(tmp_path / "copy"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "copy" / "adapter_model.safetensors").is_file()


def test_from_run_of_a_run_that_trusts_remote_code_needs_the_flag(received, tmp_path, nothing_loads):
    result = invoke("train", DATA, "--from-run", str(received), "--yes", "--quiet", "--output-dir", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert f"--from-run {received}: its model" in said(result) and REMOTE_CODE in said(result)
    assert PASS_TRUST in said(result)


def test_a_resume_passes_its_permissions_on_to_the_processes_it_starts(clean_environment, monkeypatch):
    from llmcustoms.commands.train import Session

    monkeypatch.setenv("LLMCUSTOMS_TRUST_REMOTE_CODE", "true")
    monkeypatch.setenv("LLMCUSTOMS_ALLOW_PICKLE_WEIGHTS", "true")
    trained = Session.load({}, None)  # `train`: the user's own settings allow it
    assert trained.resume_options()[-2:] == ["--trust-remote-code", "--allow-pickle-weights"]
    resumed = Session.load({}, None, allowed=Allowed())  # `resume` without the flags: the environment does not count
    assert "--trust-remote-code" not in resumed.resume_options()
    assert Session.load({}, None, allowed=Allowed(True, False)).resume_options()[-1] == "--trust-remote-code"


def remote_code_model(directory: Path, source: Path, marker: Path) -> Path:
    """A model whose config is a class of its own, in code that leaves `marker` when it runs."""
    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="custom-llama", auto_map={"AutoConfig": "configuration_custom.CustomConfig"})
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "configuration_custom.py").write_text(
        f"from pathlib import Path\nfrom transformers import LlamaConfig\n\nPath({str(marker)!r}).touch()\n\n\n"
        "class CustomConfig(LlamaConfig):\n    model_type = 'custom-llama'\n")
    return directory


def test_train_of_a_model_that_needs_its_own_code_says_so_and_runs_none(tiny_models, tmp_path):
    marker = tmp_path / "the-model's-code-ran"
    model = remote_code_model(tmp_path / "custom", tiny_models["llama"], marker)
    result = invoke(*train_args(model, tmp_path / "runs", "custom"))
    assert result.exit_code == 2, result.output
    assert f"The model '{model}' {REMOTE_CODE}" in said(result)
    assert "Pass --trust-remote-code (or set LLMCUSTOMS_TRUST_REMOTE_CODE=true)" in said(result)
    assert not marker.exists() and not (tmp_path / "runs" / "custom").exists()
    result = invoke("plan", DATA, "--model", str(model), "--trust-remote-code")
    assert result.exit_code == 0, result.output
    assert marker.exists()  # the flag is what lets it run


@pytest.fixture(scope="module")
def pickled(tmp_path_factory):
    return pickle_only(tmp_path_factory.mktemp("pickled") / "tiny-pickled")


PICKLE_REFUSAL = "The weights of '{}' are in a pickle file (pytorch_model.bin), which can run code when it is loaded"


def test_pickle_weights_load_only_with_the_flag(pickled, tmp_path, no_weights_load):
    result = invoke(*train_args(pickled, tmp_path, "pickled"))
    assert result.exit_code == 2, result.output
    assert PICKLE_REFUSAL.format(pickled) in said(result)
    assert "--allow-pickle-weights" in said(result) and "save_pretrained(DIR) writes model.safetensors" in said(result)
    assert not (tmp_path / "pickled").exists()
    result = invoke("plan", DATA, "--model", str(pickled))
    assert result.exit_code == 2 and "--allow-pickle-weights" in said(result)


@pytest.fixture(scope="module")
def pickled_run(pickled, tmp_path_factory):
    """A run trained on the pickle-only model, with the flag."""
    root = tmp_path_factory.mktemp("pickled-runs")
    result = invoke(*train_args(pickled, root, "pickled", "--allow-pickle-weights"))
    assert result.exit_code == 0, result.output
    assert json.loads((root / "pickled" / "plan.json").read_text())["allow_pickle_weights"] is True
    return root / "pickled"


@pytest.mark.slow
def test_a_run_on_pickle_weights_needs_the_flag_on_every_command_that_loads_it(pickled, pickled_run, tmp_path):
    assert (pickled_run / "adapter" / "adapter_model.safetensors").is_file()
    allowed_by_env = {"LLMCUSTOMS_ALLOW_PICKLE_WEIGHTS": "true"}  # the run's plan.json says so too: neither counts
    for args in (["generate", str(pickled_run), "hi"], ["export", str(pickled_run), "--output", str(tmp_path / "o"),
                                                        "--merge"], ["resume", str(pickled_run), "--epochs", "9"]):
        result = invoke(*args, env=allowed_by_env)
        assert result.exit_code == 2, result.output
        assert PICKLE_REFUSAL.format(pickled) in said(result) and "--allow-pickle-weights" in said(result)
    result = invoke("generate", str(pickled_run), "hi", "--max-new-tokens", "3", "--allow-pickle-weights")
    assert result.exit_code == 0, result.output


def test_an_adapter_is_loaded_from_safetensors_only(finished, tmp_path):
    from safetensors.torch import load_file

    run = tmp_path / "bin-adapter"
    shutil.copytree(finished, run)
    adapter = run / "adapter"
    torch.save(load_file(str(adapter / "adapter_model.safetensors")), adapter / "adapter_model.bin")
    (adapter / "adapter_model.safetensors").unlink()
    for args in (["generate", str(run), "hi", "--allow-pickle-weights"],
                 ["export", str(run), "--output", str(tmp_path / "o"), "--merge", "--allow-pickle-weights"],
                 ["train", DATA, "--from-run", str(run), "--yes", "--output-dir", str(tmp_path / "runs")]):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert (f"The adapter in {adapter} has no adapter_model.safetensors (only adapter_model.bin, a pickle file "
                "that can run code when loaded).") in said(result)


def test_a_config_naming_a_pickle_weights_file_is_refused_though_safetensors_are_there(tiny_models, tmp_path):
    model = tmp_path / "named"
    shutil.copytree(tiny_models["llama"], model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "transformers_weights": "adapter_model.bin"}))
    with pytest.raises(ModelError, match=r"in a pickle file \(adapter_model.bin\)"):
        check_weight_files(str(model), allow_pickle=False)
    check_weight_files(str(model), allow_pickle=True)
    check_weight_files(str(tiny_models["llama"]), allow_pickle=False)


def test_a_hub_model_without_safetensors_weights_is_explained():
    error = OSError("org/old does not appear to have a file named model.safetensors or model.safetensors.index.json "
                    "and thus cannot be loaded with `safetensors`. Please do not set `use_safetensors=True`.")
    explained = _explain("org/old", error)
    assert explained.message.startswith("The model 'org/old' has no safetensors weights, only pickle files")
    assert "--allow-pickle-weights" in (explained.hint or "")
