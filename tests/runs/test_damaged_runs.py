"""Runs damaged or read-only (issue 46, items 7 to 9): an adapter whose files
do not load, a plan.json edited by hand or cut short, a run folder that cannot
be written. Each is one message naming the file, never a traceback, and a
damaged run is still listed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from llmcustoms.cli import app
from llmcustoms.errors import ConfigError
from llmcustoms.runs import read_only
from llmcustoms.runs.adapter_files import adapter_problem
from llmcustoms.runs.read_only import check_writable
from llmcustoms.runs.run_directory import RunDirectory, list_runs
from llmcustoms.runs.run_weights import choose_weights, trained_output
from test_plan_values import valid_plan
from tiny_models import WIDE

MODULES = ("q_proj", "v_proj")
PREFIX = "base_model.model.model.layers"


def adapter(directory: Path, rank: int = 4, config: dict | None = None, modules=MODULES, layers: int = 2) -> Path:
    """An adapter folder as peft saves one: adapter_config.json, and A [r, 8] and B [8, r] per module."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in range(layers):
        for module in modules:
            tensors[f"{PREFIX}.{layer}.self_attn.{module}.lora_A.weight"] = torch.zeros(rank, 8)
            tensors[f"{PREFIX}.{layer}.self_attn.{module}.lora_B.weight"] = torch.zeros(8, rank)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    written = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": list(MODULES), "rank_pattern": {},
               **(config or {})}
    (directory / "adapter_config.json").write_text(json.dumps(written))
    return directory


def cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# ------------------------------------------------------------ item 7: the adapter's files

def test_a_whole_adapter_has_no_problem(tmp_path):
    assert adapter_problem(adapter(tmp_path / "a")) is None
    # peft's rank_pattern gives a module its own rank; a string target is a regular expression.
    patterned = adapter(tmp_path / "b", rank=2, config={"r": 4, "rank_pattern": {"q_proj": 2, "v_proj": 2}})
    assert adapter_problem(patterned) is None
    assert adapter_problem(adapter(tmp_path / "c", config={"target_modules": r".*\.(q_proj|v_proj)"})) is None


@pytest.mark.parametrize("damage,named", [
    (lambda a: cut(a / "adapter_model.safetensors"), "adapter_model.safetensors holds"),
    (lambda a: (a / "adapter_model.safetensors").write_bytes(b"\x00" * 4), "has no safetensors header"),
    (lambda a: cut(a / "adapter_config.json"), "adapter_config.json is not valid JSON"),
    (lambda a: (a / "adapter_config.json").write_text("[4]"), "adapter_config.json is not a JSON object"),
    (lambda a: edit_config(a, r=8), "adapter_config.json says rank 8, but the weights of model.layers.0.self_attn."
                                    "q_proj in adapter_model.safetensors are of rank 4"),
    (lambda a: edit_config(a, r="4"), "the rank r of adapter_config.json is not a whole number"),
    (lambda a: edit_config(a, target_modules=["q_proj"]), "holds weights of model.layers.0.self_attn.v_proj, "
                                                          "which the target_modules of adapter_config.json leave out"),
    (lambda a: edit_config(a, target_modules=["q_proj", "v_proj", "o_proj"]),
     "the target_modules of adapter_config.json name o_proj, of which adapter_model.safetensors holds no weights"),
    (lambda a: edit_config(a, target_modules=7), "target_modules of adapter_config.json are not a list"),
    (lambda a: save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 8)},
                         str(a / "adapter_model.safetensors")), "holds only lora_A of model.layers.0.self_attn.q_proj"),
    (lambda a: save_file({"other": torch.zeros(2)}, str(a / "adapter_model.safetensors")), "holds no LoRA weights"),
])
def test_a_damaged_adapter_is_named_in_a_sentence(tmp_path, damage, named):
    folder = adapter(tmp_path / "adapter")
    damage(folder)
    assert named in adapter_problem(folder)


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))


def test_an_adapter_without_safetensors_weights_is_left_to_the_loader(tmp_path):
    """Its refusal says why (a pickle file is not loaded): `loading.adapter_weights`."""
    folder = adapter(tmp_path / "adapter")
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    assert adapter_problem(folder) is None


def finished_run(root: Path) -> Path:
    """A run as `train` leaves one, by hand: plan.json, status.json, adapter/; no checkpoints."""
    run = root / "run"
    adapter(run / "adapter")
    plan = {**valid_plan(), "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": list(MODULES)}}
    (run / "plan.json").write_text(json.dumps(plan))
    RunDirectory(run).write_status("completed", step=2)
    return run


def test_generate_and_export_refuse_a_damaged_adapter_saying_what_to_do(tmp_path):
    run = finished_run(tmp_path)
    assert choose_weights(RunDirectory(run), None).directory == run / "adapter"
    assert trained_output(RunDirectory(run))[1] == run / "adapter"
    cut(run / "adapter" / "adapter_model.safetensors")
    for choose in (lambda: choose_weights(RunDirectory(run), None), lambda: choose_weights(RunDirectory(run), "best"),
                   lambda: trained_output(RunDirectory(run))):
        with pytest.raises(ConfigError) as refused:
            choose()
        assert refused.value.message.startswith("The run's adapter is damaged (adapter_model.safetensors holds")
        assert str(run / "adapter") in refused.value.message
        assert "Train the run again" in refused.value.hint and "--checkpoint" not in refused.value.hint  # none to try


def test_a_run_whose_adapter_is_damaged_is_no_starting_point(tmp_path):
    from llmcustoms.models.from_run import starting_point

    run = finished_run(tmp_path)
    assert starting_point(str(run)).adapter == str((run / "adapter").resolve())
    edit_config(run / "adapter", r=8)
    with pytest.raises(ConfigError, match=r"--from-run .*: its adapter is damaged \(adapter_config.json says rank 8"):
        starting_point(str(run))


# ------------------------------------------------------------ item 8: plan.json

@pytest.mark.parametrize("text,named", [
    (json.dumps({**valid_plan(), "lr": "5e-4"}), '"lr" is the text "5e-4", where a number belongs'),
    (json.dumps({**valid_plan(), "micro_batch_size": 0}), '"micro_batch_size" is 0, where it must be at least 1'),
    (json.dumps(valid_plan())[:200], "it is not valid JSON (cut short, or edited by hand)"),
    ("[]", "it is a list, where an object of fields belongs"),
    ("\udcff", "it is not valid JSON (cut short, or edited by hand)"),
])
def test_a_damaged_plan_is_one_message_naming_the_field(tmp_path, text, named):
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ConfigError) as refused:
        RunDirectory(run).read_plan()
    assert refused.value.message == f"The plan.json of the run {run} is damaged: {named}."
    assert "nothing was changed" in refused.value.hint


def test_a_run_whose_plan_is_damaged_is_listed_as_damaged(tmp_path):
    for name, plan in (("typed", {"model": "m", "method": "lora", "total_steps": [12]}),
                       ("listed", ["not", "an", "object"]), ("fine", {"model": "m", "method": "lora", "total_steps": 12})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "plan.json").write_text(json.dumps(plan))
        RunDirectory(tmp_path / name).write_status("interrupted", step=3)
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "plan.json").write_text(json.dumps(valid_plan())[:100])
    runs = {run.name: run for run in list_runs(tmp_path)}
    assert {name: run.status for name, run in runs.items()} == {"cut": "damaged", "typed": "damaged",
                                                               "listed": "damaged", "fine": "interrupted"}
    assert runs["typed"].step == 3 and runs["typed"].total_steps is None  # status.json's step is still shown
    shown = CliRunner().invoke(app, ["runs", "--output-dir", str(tmp_path)], env={"COLUMNS": WIDE})
    assert shown.exit_code == 0 and shown.output.count("damaged") == 3, shown.output


# ------------------------------------------------------------ item 9: a run folder that cannot be written

@pytest.fixture
def denied(monkeypatch):
    """os.access says no for the paths added to the set: the mode bits of an account
    other than root, an immutable file or a read-only mount, whoever runs the tests."""
    paths: set[Path] = set()
    real = os.access
    monkeypatch.setattr(read_only.os, "access",
                        lambda path, mode, **kw: not (mode & os.W_OK and Path(path) in paths) and real(path, mode, **kw))
    return paths


def test_a_run_folder_that_cannot_be_written_is_refused_naming_what(tmp_path, denied):
    run = finished_run(tmp_path)
    check_writable(run, "so it cannot be resumed")  # all writable
    denied.add(run / "adapter" / "adapter_config.json")
    with pytest.raises(ConfigError) as refused:
        check_writable(run, "so it cannot be resumed")
    assert refused.value.message == (f"The run folder {run} cannot be written (adapter/adapter_config.json in it is "
                                     "read-only), so it cannot be resumed.")
    assert f"chmod -R u+w {run}" in refused.value.hint and "copy it somewhere you can write" in refused.value.hint
    check_writable(run, "so --plot cannot save loss.png there", ("loss.png",))  # only the folder and loss.png
    denied.add(run)
    with pytest.raises(ConfigError, match=r"\(the folder itself is read-only\), so --plot"):
        check_writable(run, "so --plot cannot save loss.png there", ("loss.png",))


def test_report_plot_and_resume_refuse_a_read_only_run_and_the_readers_still_work(tmp_path, denied):
    run = finished_run(tmp_path)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0, "lr": 1e-4}) + "\n")
    RunDirectory(run).write_status("interrupted", step=1)
    denied.add(run)
    before = sorted(p.name for p in run.iterdir())
    for argv in (["report", str(run), "--plot"], ["resume", str(run)]):
        result = CliRunner().invoke(app, argv, env={"COLUMNS": WIDE})
        assert result.exit_code == 2 and "cannot be written" in result.output, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)
    assert sorted(p.name for p in run.iterdir()) == before  # no loss.png, nothing else
    assert CliRunner().invoke(app, ["report", str(run)], env={"COLUMNS": WIDE}).exit_code == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod -R a-w: the folder is not read-only to it "
                                              "(the fake os.access above stands in)")
def test_a_folder_made_read_only_with_chmod_is_refused(tmp_path):
    run = finished_run(tmp_path)
    for path in [run, *run.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    try:
        with pytest.raises(ConfigError, match="the folder itself is read-only"):
            check_writable(run, "so it cannot be resumed")
    finally:
        for path in [run, *run.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)
