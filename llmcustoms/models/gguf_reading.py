"""Read a GGUF file back: its metadata, its tokenizer and its model, through
transformers' GGUF reader (weights dequantized to the dtype asked for).

Used twice: `export --format gguf` checks what it wrote against the model it
came from, and `--model path/to/model.gguf` trains a model a user already has
for Ollama, llama.cpp or LM Studio.

transformers rebuilds a byte-level tokenizer's pre-tokenizer from
`tokenizer.ggml.pre` only for the names it knows; for "smollm" (each digit
alone, then GPT-2's split) it falls back to GPT-2's, which joins digits: the
pre-tokenizer is set here, so "2024" gets the ids llama.cpp gives it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmcustoms.models.gguf_vocab import GgufRefused

# What each file type (general.file_type) is called, for messages.
FILE_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 7: "q8_0", 8: "q5_0", 9: "q5_1", 10: "q2_k", 11: "q3_k_s",
              12: "q3_k_m", 13: "q3_k_l", 14: "q4_k_s", 15: "q4_k_m", 16: "q5_k_s", 17: "q5_k_m", 18: "q6_k",
              32: "bf16"}


def metadata(path: Path) -> dict[str, Any]:
    """Every scalar and string field of the file (arrays as their length), by
    key. transformers' reader, which skips over the arrays: gguf's own
    GGUFReader parses every token of the vocabulary, a minute on a busy machine."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    fields, _ = read_gguf_metadata(str(path), ())
    return {key: len(value) if isinstance(value, (list, tuple)) else value for key, value in fields.items()}


def tensor_types(path: Path) -> list[str]:
    """The storage types of the file's tensors ("F16", "Q8_0"), sorted."""
    from gguf import GGUFReader

    return sorted({tensor.tensor_type.name for tensor in GGUFReader(str(path)).tensors})


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if metadata(path).get("tokenizer.ggml.pre") == "smollm":
        from tokenizers import pre_tokenizers

        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return tokenizer


def load_model(path: Path, dtype: Any) -> Any:
    """The model in the file, dequantized to `dtype`, as a plain model (one
    that saves like any other); one clear refusal for what transformers cannot read."""
    from functools import partial

    import transformers.modeling_gguf_pytorch_utils as reader
    from transformers import AutoModelForCausalLM

    bar = reader.tqdm
    reader.tqdm = partial(bar, disable=True)  # its own progress bar, drawn over our display
    try:
        read = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    except (ValueError, NotImplementedError, KeyError) as exc:
        raise GgufRefused(f"transformers cannot read {path.name}: {str(exc).splitlines()[0][:200]}",
                          "Use a GGUF of a Llama, Mistral, Qwen2 or Phi-3 model, or the model's own "
                          "Hugging Face folder or name.") from None
    finally:
        reader.tqdm = bar
    # The weights are dequantized already, but the model still counts as "quantized with gguf",
    # which save_pretrained refuses: the same weights in a plain model of the same config.
    config = read.config
    for attribute in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attribute):
            delattr(config, attribute)
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(read.state_dict())
    return plain.eval()
