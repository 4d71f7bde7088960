"""A GGUF holds one token per embedding row: tokens past the model's rows
(the <|endoftext|> transformers' GGUF reader adds to a byte-level file that
has none, a token added without resizing the model) are left out, unless the
file must name one of them (EOS, BOS, the end of a turn): then one refusal."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmcustoms.models import gguf_reading
from llmcustoms.models.gguf_vocab import GgufRefused, gguf_vocab, tokens_past_rows
from llmcustoms.models.gguf_writing import write_gguf

pytest.importorskip("gguf")


@pytest.fixture
def llama(tiny_models):
    folder = tiny_models["llama"]
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), AutoTokenizer.from_pretrained(folder)


def test_a_token_added_without_resizing_is_left_out_and_the_file_reads_back(llama, tmp_path):
    model, tokenizer = llama
    rows = model.config.vocab_size
    tokenizer.add_tokens(["<|added-later|>"])
    assert len(tokenizer) == rows + 1
    assert tokens_past_rows(tokenizer, rows, None) == [rows]
    path = tmp_path / "model.gguf"
    write_gguf(model, tokenizer, path, "f16", "tiny", None)
    assert gguf_reading.metadata(path)["tokenizer.ggml.tokens"] == rows
    read = gguf_reading.load_model(path, torch.float32)
    assert read.get_input_embeddings().weight.shape[0] == rows
    text = "Write one sentence about the sea."
    assert gguf_reading.load_tokenizer(path)(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_gguf_in_gguf_out_writes_the_same_rows_again(tiny_models, tmp_path):
    """The file has no <|endoftext|>; transformers' reader adds it past the rows; written again, it is left out."""
    folder = shutil.copytree(tiny_models["llama"], tmp_path / "no-endoftext")
    spec = (folder / "tokenizer.json").read_text()
    (folder / "tokenizer.json").write_text(spec.replace(json.dumps("<|endoftext|>"), json.dumps("<|notext|>")))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rows = model.config.vocab_size
    first = tmp_path / "first.gguf"
    write_gguf(model, AutoTokenizer.from_pretrained(folder), first, "f16", "tiny", None)
    read_back = gguf_reading.load_tokenizer(first)
    assert len(read_back) == rows + 1 and read_back.convert_ids_to_tokens(rows) == "<|endoftext|>"  # the premise
    again = tmp_path / "again.gguf"
    write_gguf(gguf_reading.load_model(first, torch.float32), read_back, again, "f16", "tiny", None)
    assert gguf_reading.metadata(again)["tokenizer.ggml.tokens"] == rows
    assert gguf_reading.load_model(again, torch.float32).get_output_embeddings().weight.shape[0] == rows


def test_an_eos_past_the_rows_is_refused_before_a_byte_is_written(llama, tmp_path):
    model, tokenizer = llama
    rows = model.config.vocab_size
    tokenizer.add_special_tokens({"eos_token": "<|my-end|>"})
    with pytest.raises(GgufRefused) as refused:
        tokens_past_rows(tokenizer, rows, None)
    assert f"EOS token (id {rows})" in refused.value.message and "resize_token_embeddings" in refused.value.hint
    with pytest.raises(GgufRefused):
        write_gguf(model, tokenizer, tmp_path / "model.gguf", "f16", "tiny", None)
    assert not (tmp_path / "model.gguf").exists()


def test_an_end_of_turn_token_past_the_rows_is_refused(llama):
    model, tokenizer = llama
    tokenizer.add_tokens(["<|turn-end|>"], special_tokens=True)
    with pytest.raises(GgufRefused, match="end-of-turn token"):
        tokens_past_rows(tokenizer, model.config.vocab_size, model.config.vocab_size)


def test_a_padding_token_past_the_rows_goes_unnamed(llama):
    model, tokenizer = llama
    rows = model.config.vocab_size
    tokenizer.add_special_tokens({"pad_token": "<|my-pad|>"})
    vocab = gguf_vocab(tokenizer, rows, None)
    assert len(vocab.tokens) == rows and "pad" not in vocab.special_ids
    assert vocab.special_ids["eos"] == tokenizer.eos_token_id


def test_a_tokenizer_smaller_than_the_rows_is_still_padded(llama):
    model, tokenizer = llama
    vocab = gguf_vocab(tokenizer, model.config.vocab_size + 3, None)
    assert vocab.tokens[-3:] == [f"[PAD{model.config.vocab_size + i}]" for i in range(3)]
