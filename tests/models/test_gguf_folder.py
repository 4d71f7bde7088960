"""`--model path/to/model.gguf`: a GGUF file a user has for Ollama or
llama.cpp is read once into a cached folder, then planned and trained like
any other model; what cannot be read is one clear message."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from conftest import DATA_FILES
from llmcustoms.cli import app
from llmcustoms.models.gguf_folder import gguf_folder, source_quantization
from llmcustoms.models.gguf_writing import write_gguf
from tiny_models import WIDE

pytest.importorskip("gguf")
runner = CliRunner()


@pytest.fixture
def gguf_file(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCUSTOMS_CACHE_DIR", str(tmp_path / "cache"))
    folder = tiny_models["qwen2"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    path = tmp_path / "downloads" / "tiny-qwen2-q8_0.gguf"
    path.parent.mkdir()
    write_gguf(model, AutoTokenizer.from_pretrained(folder), path, "q8_0", "tiny-qwen2", None)
    return path


def test_a_gguf_file_is_read_once_into_a_plain_model_folder(gguf_file):
    folder = gguf_folder(gguf_file)
    assert (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))
    assert source_quantization(folder) == "q8_0"
    model = AutoModelForCausalLM.from_pretrained(folder)  # no gguf_file: an ordinary folder now
    assert model.dtype == torch.float32 and model.config.model_type == "qwen2"
    written = (folder / "config.json").stat().st_mtime_ns
    assert gguf_folder(gguf_file) == folder and (folder / "config.json").stat().st_mtime_ns == written  # cached


def test_plan_says_the_model_is_a_gguf_file_and_train_trains_it(gguf_file, tmp_path):
    plan = runner.invoke(app, ["plan", str(DATA_FILES["messages"]), "--model", str(gguf_file)],
                         env={"COLUMNS": WIDE}, catch_exceptions=False)
    assert plan.exit_code == 0, plan.output
    assert "a GGUF file (q8_0)" in plan.output and "dequantized to float32 once" in plan.output
    train = runner.invoke(app, ["train", str(DATA_FILES["messages"]), "--model", str(gguf_file), "--max-steps", "2",
                                "--yes", "--quiet", "--output-dir", str(tmp_path / "runs"), "--run-name", "from-gguf"],
                          env={"COLUMNS": WIDE}, catch_exceptions=False)
    assert train.exit_code == 0, train.output
    assert (tmp_path / "runs" / "from-gguf" / "adapter" / "adapter_model.safetensors").is_file()


def test_a_file_that_is_not_gguf_is_one_clear_message(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCUSTOMS_CACHE_DIR", str(tmp_path / "cache"))
    broken = tmp_path / "half-downloaded.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 5)
    result = runner.invoke(app, ["plan", str(DATA_FILES["messages"]), "--model", str(broken)],
                           env={"COLUMNS": WIDE}, catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert "half-downloaded.gguf is not a readable GGUF file" in result.output and "Traceback" not in result.output
    assert not list((tmp_path / "cache" / "gguf").glob("*"))  # nothing half-converted stays


def test_an_architecture_transformers_cannot_read_is_refused(tmp_path, monkeypatch):
    import gguf
    import numpy as np

    monkeypatch.setenv("LLMCUSTOMS_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "rwkv.gguf"
    writer = gguf.GGUFWriter(str(path), "rwkv6")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    result = runner.invoke(app, ["plan", str(DATA_FILES["messages"]), "--model", str(path)],
                           env={"COLUMNS": WIDE}, catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert "cannot read rwkv.gguf" in result.output and "Llama, Mistral, Qwen2 or Phi-3" in result.output


def test_reading_a_gguf_file_counts_its_tensors_and_draws_no_bar_of_transformers(gguf_file, capfd):
    """`plan --model FILE.gguf` once showed one static line for 50 s, and
    transformers drew its "Writing model shards" bar over the display."""
    from transformers.utils import logging

    told: list[tuple[int, int]] = []
    was = logging.is_progress_bar_enabled()
    logging.enable_progress_bar()  # as a command that has not quieted the libraries would have it
    try:
        gguf_folder(gguf_file, lambda done, total: told.append((done, total)))
    finally:
        (logging.enable_progress_bar if was else logging.disable_progress_bar)()
    from gguf import GGUFReader

    total = len(GGUFReader(str(gguf_file)).tensors) + 3  # each tensor, and the layout, the model, the folder
    assert told == [(0, total), *((done, total) for done in range(1, total - 1)), (total - 1, total), (total, total)]
    stderr = capfd.readouterr().err
    assert "Writing model shards" not in stderr and "it/s" not in stderr and "Reading tiny-qwen2-q8_0.gguf" in stderr


def test_preparing_a_run_from_a_gguf_file_reports_the_reading_as_a_stage(gguf_file):
    from llmcustoms.preparation.preparing import prepare_run
    from llmcustoms.planning.hardware import Hardware
    from llmcustoms.planning.train_options import TrainOptions

    stages: list[tuple[str, int, int | None]] = []
    prepare_run(TrainOptions(data=str(DATA_FILES["messages"]), model=str(gguf_file)), Hardware.cpu_only(),
                progress=lambda stage, done, total: stages.append((stage, done, total)))
    read = [(done, total) for stage, done, total in stages if stage == "gguf"]
    assert read and read[-1][0] == read[-1][1] > 1 and stages.index(("gguf", *read[-1])) < len(stages) - 1
