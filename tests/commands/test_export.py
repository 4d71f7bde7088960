"""Export: the model card names the base as the Hub knows it, and a merged
export says the dtype its weights were written in."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from llmcustoms.commands import export
from llmcustoms.cli import app
from llmcustoms.commands.model_card import model_card
from llmcustoms.models.loading import card_base_model
from llmcustoms.runs.run_directory import RunDirectory
from tiny_models import WIDE, build_model


def local_model(directory: Path, name_or_path: object = None) -> Path:
    directory.mkdir(parents=True)
    config = {"model_type": "llama"} if name_or_path is None else {"model_type": "llama", "_name_or_path": name_or_path}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_the_card_names_a_hub_id_as_given():
    assert card_base_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"


def test_a_local_directory_is_named_by_the_hub_id_it_came_from(tmp_path):
    saved = local_model(tmp_path / "models" / "my-qwen", "Qwen/Qwen2.5-0.5B-Instruct")
    assert card_base_model(str(saved)) == "Qwen/Qwen2.5-0.5B-Instruct"


@pytest.mark.parametrize("name_or_path", [None, "/home/me/models/my-qwen", "../my-qwen", "", 3])
def test_otherwise_a_local_directory_is_named_by_its_name(tmp_path, name_or_path):
    saved = local_model(tmp_path / "models" / "my-qwen", name_or_path)
    assert card_base_model(str(saved)) == "my-qwen"
    assert card_base_model(str(saved) + "/") == "my-qwen"


def test_a_local_path_that_is_gone_is_named_by_its_name(tmp_path):
    assert card_base_model(str(tmp_path / "moved" / "tiny-llama")) == "tiny-llama"


def card_plan(model: str) -> SimpleNamespace:
    lora = SimpleNamespace(r=8, alpha=16, dropout=0.0, target_modules=["q_proj", "v_proj"])
    return SimpleNamespace(model=model, method="lora", lora=lora, preset="quality", data="/data/train.jsonl",
                           data_format="alpaca", train_rows=90, eval_rows=10, effective_batch_size=8, lr=2e-4,
                           lr_scheduler="cosine", max_seq_len=256, trust_remote_code=False, eval_data=None, seed=0)


def test_the_card_never_shows_the_local_path(tmp_path):
    saved = local_model(tmp_path / "models" / "my-qwen", "Qwen/Qwen2.5-0.5B-Instruct")
    (tmp_path / "run").mkdir()
    card = model_card(RunDirectory(tmp_path / "run"), card_plan(str(saved)), merged=False)
    assert "base_model: Qwen/Qwen2.5-0.5B-Instruct\n" in card
    assert str(tmp_path) not in card
    assert "AutoPeftModelForCausalLM.from_pretrained(\".\")" in card and "its Hub id" in card


@pytest.fixture
def run_with_adapter(tmp_path, monkeypatch):
    """A run directory holding a LoRA adapter on a tiny fp32 Llama (untrained: the dtype is the point)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = build_model("llama", tmp_path / "tiny-llama")
    run = tmp_path / "run"
    adapter = run / "adapter"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, target_modules=["q_proj"]))
    model.save_pretrained(adapter)
    AutoTokenizer.from_pretrained(base).save_pretrained(adapter)
    (run / "plan.json").write_text("{}")  # what `export` checks; the plan itself comes from below
    monkeypatch.setattr(export, "trained_output", lambda _run: (card_plan(str(base)), adapter))
    return run


@pytest.mark.parametrize("dtype,written", [("auto", "float32"), ("bfloat16", "bfloat16")])
def test_a_merged_export_says_the_dtype_it_wrote(run_with_adapter, tmp_path, dtype, written):
    out = tmp_path / f"merged-{dtype}"
    result = CliRunner().invoke(app, ["export", str(run_with_adapter), "--output", str(out), "--merge",
                                      "--dtype", dtype], env={"COLUMNS": WIDE}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert f"a merged model ({written} weights)" in result.stdout and "16-bit" not in result.output
    assert "Merging the adapter into" in result.stderr and "done in" in result.stderr  # a wait, shown on stderr
    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == written


@pytest.mark.parametrize("merge", [False, True])
def test_exported_weights_are_readable_like_every_other_file(run_with_adapter, tmp_path, merge):
    from llmcustoms.runs.file_modes import usual_mode

    out = tmp_path / f"out-{merge}"
    result = CliRunner().invoke(app, ["export", str(run_with_adapter), "--output", str(out), *(["--merge"] * merge)],
                                env={"COLUMNS": WIDE}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    modes = {path.name: path.stat().st_mode & 0o777 for path in out.iterdir()}
    assert any(name.endswith(".safetensors") for name in modes)  # safetensors writes these 0600
    assert set(modes.values()) == {usual_mode()}, modes


def test_a_local_base_gets_no_hub_link_and_a_gguf_card_says_how_to_run_it(tmp_path):
    saved = local_model(tmp_path / "models" / "my-llama")
    card = model_card(RunDirectory(tmp_path / "run"), card_plan(str(saved)), merged=True, gguf=True)
    assert "base_model:" not in card  # a local folder's name is no Hub id to link to
    assert "Fine-tuned from a local model, `my-llama`" in card
    assert "ollama create my-model -f Modelfile" in card and "llama-cli -m model.gguf" in card
    assert "from_pretrained" not in card and "gguf]" in card


def python_block(card: str) -> str:
    """The one fenced python block of a model card."""
    blocks = re.findall(r"```python\n(.*?)```", card, re.S)
    assert len(blocks) == 1, card
    return blocks[0]


@pytest.mark.slow  # a Python of its own imports torch, transformers and peft
@pytest.mark.parametrize("merge", [False, True])
def test_the_cards_code_runs_as_written_from_the_export_folder(run_with_adapter, tmp_path, merge):
    """The snippet once named the base by a name from_pretrained could not find and
    left "PATH" to fill in; now it is run, offline, from the folder it was written in."""
    out = tmp_path / f"export-{merge}"
    result = CliRunner().invoke(app, ["export", str(run_with_adapter), "--output", str(out), *(["--merge"] * merge)],
                                env={"COLUMNS": WIDE}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    card = (out / "README.md").read_text()
    code = python_block(card)
    assert "PATH" not in code and "tiny-llama" not in code and str(tmp_path) not in card
    if not merge:  # what the adapter's snippet loads its base from: the path training loaded it from
        base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert Path(base) == tmp_path / "tiny-llama" and "AutoPeftModelForCausalLM" in code
    ran = subprocess.run([sys.executable, "-c", code], cwd=out, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "peft" in code.split("\n")[0] if not merge else "peft" not in code


def test_a_tokenizer_without_a_chat_template_gets_a_plain_prompt(tmp_path):
    from llmcustoms.commands.model_card import has_chat_template

    (tmp_path / "run").mkdir()
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    plain = has_chat_template(tmp_path / "export")
    code = python_block(model_card(RunDirectory(tmp_path / "run"), card_plan("my-llama"), merged=True,
                                   chat_template=plain))
    assert not plain and 'tokenizer("Hello!", return_tensors="pt")' in code and "apply_chat_template" not in code
    (tmp_path / "export" / "chat_template.jinja").write_text("{{ messages }}")
    assert has_chat_template(tmp_path / "export")
