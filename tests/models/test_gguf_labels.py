"""A GGUF whose general.architecture is not what its tensors are (edited, or
written wrong) is one clear refusal, never a traceback, and never a model
trained with weights transformers started from random values or dropped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from conftest import DATA_FILES
from llmcustoms.cli import app
from llmcustoms.models.gguf_folder import gguf_folder
from llmcustoms.models.gguf_vocab import GgufRefused
from llmcustoms.models.gguf_writing import write_gguf
from tiny_models import WIDE

gguf = pytest.importorskip("gguf")


def relabelled(source: Path, target: Path, architecture: str) -> Path:
    """`source` with general.architecture, and the keys named after it, saying `architecture`."""
    reader = gguf.GGUFReader(str(source))
    old = reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(str(target), architecture)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        name = architecture + field.name[len(old):] if field.name.startswith(old + ".") else field.name
        writer.add_key_value(name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data)
    writer.close()
    return target


def written(tiny_models, family: str, path: Path) -> Path:
    model = AutoModelForCausalLM.from_pretrained(tiny_models[family], dtype=torch.float32)
    write_gguf(model, AutoTokenizer.from_pretrained(tiny_models[family]), path, "f16", f"tiny-{family}", None)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCUSTOMS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("family, label, says", [
    ("llama", "qwen3", "self_attn.k_proj.weight is 32x64 where such a model's is 256x64"),  # transformers raised
    ("llama", "qwen2", "it has no self_attn.k_proj.bias"),  # transformers made the biases up
    ("qwen2", "llama", "it has attn_k.bias, attn_q.bias, attn_v.bias, which such a model has no place for"),  # dropped
])
def test_tensors_of_another_architecture_are_refused(tiny_models, tmp_path, cache, family, label, says):
    path = relabelled(written(tiny_models, family, tmp_path / "real.gguf"), tmp_path / "m.gguf", label)
    with pytest.raises(GgufRefused) as refused:
        gguf_folder(path)
    assert refused.value.message.startswith(f"m.gguf says its architecture is {label}, but its tensors cannot be "
                                            f"read as a {label} model's")
    assert says in refused.value.message
    assert not list((cache / "gguf").glob("*"))  # nothing half-converted stays


def test_train_on_a_mislabelled_file_is_exit_2_without_a_traceback(tiny_models, tmp_path, cache):
    path = relabelled(written(tiny_models, "llama", tmp_path / "real.gguf"), tmp_path / "m.gguf", "phi3")
    result = CliRunner().invoke(app, ["train", str(DATA_FILES["messages"]), "--model", str(path), "--max-steps", "1",
                                      "--yes", "--quiet", "--output-dir", str(tmp_path / "runs")],
                                env={"COLUMNS": WIDE}, catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert "m.gguf says its architecture is phi3" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
def test_a_file_as_written_reads_without_complaint(tiny_models, tmp_path, cache, family):
    folder = gguf_folder(written(tiny_models, family, tmp_path / f"{family}.gguf"))
    assert AutoModelForCausalLM.from_pretrained(folder).config.model_type == family
