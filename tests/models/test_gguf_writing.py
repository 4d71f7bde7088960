"""The GGUF writer: each family the presets offer, written and read back
through transformers' GGUF reader, gives the same metadata, token ids and
logits as the model it came from."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmcustoms.models import gguf_reading
from llmcustoms.models.gguf_check import expected_metadata
from llmcustoms.models.gguf_vocab import GgufRefused, gguf_vocab
from llmcustoms.models.gguf_writing import write_gguf

pytest.importorskip("gguf")

SAMPLES = ["Hello world, 2024 is a year!", "  two spaces\nand a newline", "<|user|>\nWhat is 7 x 8?</s>\n",
           "<|im_start|>user\nnaïve café<|im_end|>\n"]
ARCHITECTURE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "phi3": "phi3"}


def loaded(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(folder)


def logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "phi3"])
def test_every_family_round_trips_at_f16(tiny_models, tmp_path, family):
    model, tokenizer = loaded(tiny_models[family])
    path = tmp_path / "model.gguf"
    written = write_gguf(model, tokenizer, path, "f16", f"tiny-{family}", None)
    assert written.architecture == ARCHITECTURE[family] and path.stat().st_size == written.bytes

    found = gguf_reading.metadata(path)
    for key, value in expected_metadata(model, tokenizer, written.architecture, None).items():
        assert found[key] == value, key
    assert found[f"{written.architecture}.attention.head_count_kv"] == model.config.num_key_value_heads
    assert gguf_reading.tensor_types(path) == ["F16", "F32"]  # matrices in 16 bits, norms in 32

    reread = gguf_reading.load_tokenizer(path)
    for text in SAMPLES:
        assert reread(text, add_special_tokens=False)["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    back = gguf_reading.load_model(path, torch.float32).eval()
    ids = tokenizer(SAMPLES[0] + SAMPLES[2])["input_ids"]
    difference = (logits(model, ids) - logits(back, ids)).abs().max().item()
    assert difference < 0.02, difference  # f16 rounding of the weights, nothing more
    assert (logits(model, ids).argmax(-1) == logits(back, ids).argmax(-1)).all()


@pytest.mark.parametrize("quant, smaller_than_f16", [("q8_0", 0.6), ("q4_0", 0.45)])
def test_quantized_files_are_smaller_and_stay_close(tiny_models, tmp_path, quant, smaller_than_f16):
    model, tokenizer = loaded(tiny_models["llama"])
    f16 = write_gguf(model, tokenizer, tmp_path / "f16.gguf", "f16", "tiny", None)
    small = write_gguf(model, tokenizer, tmp_path / f"{quant}.gguf", quant, "tiny", None)
    assert small.bytes < smaller_than_f16 * f16.bytes
    assert quant.upper() in gguf_reading.tensor_types(small.path)
    back = gguf_reading.load_model(small.path, torch.float32).eval()
    ids = tokenizer(" ".join(SAMPLES))["input_ids"]
    want, got = logits(model, ids), logits(back, ids)
    # A random model's logits are nearly flat, so agreement is loose here; the real model's is measured in the docs.
    assert (want - got).abs().max().item() < (0.3 if quant == "q8_0" else 2.0)
    assert (want.argmax(-1) == got.argmax(-1)).float().mean().item() > (0.8 if quant == "q8_0" else 0.4)


def test_the_end_of_turn_token_is_named_when_it_is_not_eos(tiny_models, tmp_path):
    model, tokenizer = loaded(tiny_models["llama"])
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    path = write_gguf(model, tokenizer, tmp_path / "model.gguf", "f16", "tiny", end).path
    found = gguf_reading.metadata(path)
    assert found["tokenizer.ggml.eot_token_id"] == end and found["tokenizer.ggml.eos_token_id"] == tokenizer.eos_token_id
    assert found["tokenizer.ggml.add_bos_token"] is True  # the zephyr-style tokenizer puts <s> first


def test_llama_query_and_key_rows_are_put_in_llama_cpp_order(tiny_models, tmp_path):
    """Without the permutation the file loads, but every attention score is wrong."""
    from gguf import GGUFReader

    model, tokenizer = loaded(tiny_models["llama"])
    path = write_gguf(model, tokenizer, tmp_path / "model.gguf", "f16", "tiny", None).path
    stored = {t.name: t for t in GGUFReader(str(path)).tensors}
    q = model.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    written = stored["blk.0.attn_q.weight"].data.astype("float32").reshape(q.shape)
    heads, half = model.config.num_attention_heads, q.shape[0] // model.config.num_attention_heads // 2
    assert abs(written - q).max() > 0.01  # rows moved
    assert abs(written[1] - q[half]).max() < 1e-2  # row 1 of head 0 is the first row of its second half
    v = model.model.layers[0].self_attn.v_proj.weight.detach().numpy()
    assert abs(stored["blk.0.attn_v.weight"].data.astype("float32").reshape(v.shape) - v).max() < 1e-2
    assert heads == 4


def test_a_sentencepiece_tokenizer_is_written_as_llama_with_byte_tokens(tmp_path):
    from tokenizers import SentencePieceBPETokenizer
    from transformers import LlamaTokenizer

    trainer = SentencePieceBPETokenizer()
    trainer.train_from_iterator(["hello world", "the quick brown fox jumps"] * 20, vocab_size=120,
                                special_tokens=["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)])
    spec = json.loads(trainer.to_str())
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]]
    tokenizer = LlamaTokenizer(vocab=spec["model"]["vocab"], merges=merges)
    vocab = gguf_vocab(tokenizer, len(tokenizer), None)
    assert vocab.model == "llama" and vocab.pre is None
    assert vocab.types[vocab.tokens.index("<0x0A>")] == 6  # BYTE
    assert vocab.types[vocab.tokens.index("<unk>")] in (2, 3)  # UNKNOWN or CONTROL
    normal = [i for i, kind in enumerate(vocab.types) if kind == 1]
    assert vocab.scores[normal[0]] > vocab.scores[normal[-1]]  # earlier merges score higher

    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config)
    path = write_gguf(model, tokenizer, tmp_path / "spm.gguf", "f16", "spm", None).path
    reread = gguf_reading.load_tokenizer(path)
    for text in ("hello world", "the quick brown fox", "ünïcode ✓ falls back to bytes"):
        assert reread(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_pre_tokenizers_are_read_off_the_tokenizer(tiny_models):
    from tokenizers import pre_tokenizers

    _, tokenizer = loaded(tiny_models["llama"])
    assert gguf_vocab(tokenizer, len(tokenizer), None).pre == "gpt-2"
    _, qwen = loaded(tiny_models["qwen2"])
    assert gguf_vocab(qwen, len(qwen), None).pre == "qwen2"
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    assert gguf_vocab(tokenizer, len(tokenizer), None).pre == "smollm"
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Punctuation(), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    with pytest.raises(GgufRefused, match="split text differently"):
        gguf_vocab(tokenizer, len(tokenizer), None)


def test_a_smollm_style_tokenizer_reads_back_with_digits_apart(tiny_models, tmp_path):
    from tokenizers import pre_tokenizers

    model, tokenizer = loaded(tiny_models["llama"])
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    path = write_gguf(model, tokenizer, tmp_path / "model.gguf", "f16", "tiny", None).path
    text = "In 2024, 365 days"
    assert gguf_reading.load_tokenizer(path)(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_architectures_it_cannot_write_are_one_clear_refusal(tiny_models, tmp_path):
    model, tokenizer = loaded(tiny_models["phi"])
    with pytest.raises(GgufRefused, match="does not write phi models") as refused:
        write_gguf(model, tokenizer, tmp_path / "model.gguf", "f16", "tiny", None)
    assert "--merge" in refused.value.hint
    assert not (tmp_path / "model.gguf").exists()
