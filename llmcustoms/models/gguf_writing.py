"""Write a transformers model as one GGUF file, llama.cpp's format, which
Ollama, llama.cpp and LM Studio run: the architecture's hyperparameters, the
tokenizer (`gguf_vocab`), and every weight under llama.cpp's tensor names, in
the quantization asked for.

The file is written in two passes over the weights: first each tensor's name,
shape and type (the header must come first), then each tensor's data, made
one at a time, so a 7B model never needs a second full copy in memory.

Quantizations, as llama.cpp names them:
  f16, bf16  16-bit weights: the trained model, unchanged but for rounding;
  q8_0       8-bit blocks of 32 with one scale each: half the size of f16,
             replies nearly always identical (the default);
  q4_0       4-bit blocks: a quarter of f16, with a small, measurable loss.
             The embedding and output matrices stay q8_0, as llama.cpp's own
             quantizer keeps its output layer at higher precision.
Norms and biases (1-D) stay 32-bit floats in all of them; a matrix whose rows
do not split into blocks of 32 stays f16.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from llmcustoms.models.gguf_vocab import GgufRefused, gguf_vocab

QUANTS = ("f16", "bf16", "q8_0", "q4_0")
# transformers' model_type -> llama.cpp's architecture. Mistral is written as
# llama (llama.cpp's converter does the same: the weights are laid out alike).
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3"}
# Architectures whose query and key rows llama.cpp wants in its own rotary order.
PERMUTED = {"llama"}


@dataclass(frozen=True)
class GgufWritten:
    path: Path
    architecture: str
    quant: str
    tensors: int
    bytes: int


def check_exportable(config: Any) -> str:
    """llama.cpp's architecture for this model, or one clear refusal."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise GgufRefused(f"GGUF export does not write {model_type} models; it writes "
                          f"{', '.join(sorted(ARCHITECTURES))}.",
                          "Export with --merge instead and convert that folder with llama.cpp's convert_hf_to_gguf.py.")
    scaling = _rope_scaling(config)
    if scaling not in (None, "default"):
        raise GgufRefused(f"This model uses {scaling} rotary scaling, which this GGUF export does not write yet.",
                          "Export with --merge instead and convert that folder with llama.cpp's convert_hf_to_gguf.py.")
    unchecked = _unchecked_shape(config)
    if unchecked:
        raise GgufRefused(f"This model has {unchecked}, which transformers' GGUF reader (that checks the written file) "
                          "does not read back, so the export could not be checked.",
                          "Export with --merge instead and convert that folder with llama.cpp's convert_hf_to_gguf.py.")
    return ARCHITECTURES[model_type]


def _unchecked_shape(config: Any) -> str:
    """What of the model's shape a file read back through transformers' GGUF
    reader would lose ("" if nothing): it reads no partial rotary factor (Phi-4-mini's
    0.75) and, for Qwen3, no head width (it assumes Qwen3's 128)."""
    partial = getattr(config, "partial_rotary_factor", None) or 1.0
    if partial != 1.0:
        return f"a partial rotary embedding ({partial:g} of each head)"
    head_dim = getattr(config, "head_dim", None)
    if config.model_type == "qwen3" and head_dim != 128:
        return f"heads {head_dim} wide (Qwen3's are 128)"
    return ""


def write_gguf(model: Any, tokenizer: Any, path: Path, quant: str, name: str, end_of_turn: int | None,
               on_tensor: Callable[[int, int], None] = lambda done, total: None) -> GgufWritten:
    """Write `model` (a merged, unquantized transformers model) and its
    tokenizer to `path`; `on_tensor(done, total)` hears each tensor written."""
    import gguf

    config = model.config
    architecture = check_exportable(config)
    if quant not in QUANTS:
        raise GgufRefused(f"Unknown --quant {quant}.", f"Use one of {', '.join(QUANTS)}.")
    writer = gguf.GGUFWriter(str(path), architecture)
    _add_hyperparameters(writer, config, name, quant)
    gguf_vocab(tokenizer, config.vocab_size, end_of_turn).add_to(writer)
    layout = _layout(model, architecture)
    for gguf_name, _, shape in layout:
        qtype = _qtype(gguf_name, shape, quant)
        stored = gguf.quant_shape_to_byte_shape(shape, qtype) if _is_block(qtype) else shape
        itemsize = 1 if _is_block(qtype) else (2 if qtype == gguf.GGMLQuantizationType.F16 else 4)
        writer.add_tensor_info(gguf_name, stored, _numpy_dtype(qtype), _product(stored) * itemsize,
                               raw_dtype=qtype if _is_block(qtype) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    weights = model.state_dict()
    for done, (gguf_name, hf_name, shape) in enumerate(layout, start=1):
        array = _array(weights[hf_name], hf_name, architecture, config)
        writer.write_tensor_data(gguf.quants.quantize(array, _qtype(gguf_name, shape, quant)))
        on_tensor(done, len(layout))
    writer.close()
    return GgufWritten(path, architecture, quant, len(layout), path.stat().st_size)


def _rope_scaling(config: Any) -> str | None:
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return parameters.get("rope_type") or parameters.get("type")


def _rope_theta(config: Any) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta") or getattr(config, "rope_theta", 10000.0))


def _add_hyperparameters(writer: Any, config: Any, name: str, quant: str) -> None:
    import gguf

    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_name(name)
    writer.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[quant])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    if head_dim != config.hidden_size // heads:  # Qwen3's 128-wide heads at hidden 1024: llama.cpp reads these
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    rotary = int(head_dim * (getattr(config, "partial_rotary_factor", None) or 1.0))
    writer.add_rope_dimension_count(rotary)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)


def _layout(model: Any, architecture: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(llama.cpp's name, transformers' name, shape) of every weight written, in file order."""
    import gguf

    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[architecture.upper()], config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    layout = []
    for hf_name, tensor in model.state_dict().items():
        if hf_name.endswith("rotary_emb.inv_freq") or (tied and hf_name == "lm_head.weight"):
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise GgufRefused(f"GGUF export does not know where the weight {hf_name} goes in llama.cpp's layout.",
                              "Export with --merge instead and convert that folder with llama.cpp's "
                              "convert_hf_to_gguf.py.")
        layout.append((gguf_name, hf_name, tuple(tensor.shape)))
    return layout


def _array(tensor: Any, hf_name: str, architecture: str, config: Any) -> Any:
    """One weight as the float32 numpy array llama.cpp's layout wants."""
    array = tensor.detach().float().cpu().numpy()
    if architecture in PERMUTED and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_attention_heads
        if hf_name.endswith("k_proj.weight"):
            heads = getattr(config, "num_key_value_heads", None) or heads
        array = _rotary_order(array, heads)
    return array


def _rotary_order(weights: Any, heads: int) -> Any:
    """Llama's query/key rows as llama.cpp's rotary embedding pairs them (its
    converter's `permute`): within each head, the two halves interleaved."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, 2, half, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _qtype(gguf_name: str, shape: tuple[int, ...], quant: str) -> Any:
    from gguf import GGMLQuantizationType as Q

    if len(shape) < 2:
        return Q.F32
    wanted = {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[quant]
    if wanted == Q.Q4_0 and gguf_name.startswith(("token_embd", "output.")):
        wanted = Q.Q8_0
    if wanted in (Q.Q8_0, Q.Q4_0) and shape[-1] % 32:
        return Q.F16
    return wanted


def _is_block(qtype: Any) -> bool:
    from gguf import GGMLQuantizationType as Q

    return qtype not in (Q.F32, Q.F16)


def _numpy_dtype(qtype: Any) -> Any:
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    return {Q.F32: np.float32, Q.F16: np.float16}.get(qtype, np.uint8)


def _product(shape: Any) -> int:
    total = 1
    for size in shape:
        total *= int(size)
    return total
