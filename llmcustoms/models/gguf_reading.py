"""Read a GGUF file back: its metadata, its tokenizer and its model, through
transformers' GGUF reader (weights dequantized to the dtype asked for).

Used twice: `export --format gguf` checks what it wrote against the model it
came from, and `--model path/to/model.gguf` trains a model a user already has
for Ollama, llama.cpp or LM Studio.

transformers rebuilds a byte-level tokenizer's pre-tokenizer from
`tokenizer.ggml.pre` only for the names it knows; for "smollm" (each digit
alone, then GPT-2's split) it falls back to GPT-2's, which joins digits: the
pre-tokenizer is set here, so "2024" gets the ids llama.cpp gives it.

A file whose general.architecture is not what its tensors are (edited, or
written wrong) is refused with what does not fit: transformers raised on some
(a size mismatch), and on others silently started the weights the file lacks
from random values, or dropped the tensors it had no place for.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from llmcustoms.models.gguf_vocab import GgufRefused

# Told how far the reading is: (tensors dequantized, tensors in the file).
Counted = Callable[[int, int], None]

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


def tensor_count(path: Path) -> int:
    """How many tensors the file holds, from its header alone."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    return len(read_gguf_metadata(str(path), ())[1])


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


def load_model(path: Path, dtype: Any, on_tensor: Counted = lambda done, total: None) -> Any:
    """The model in the file, dequantized to `dtype`, as a plain model (one
    that saves like any other); one clear refusal for what transformers cannot read.
    `on_tensor` hears each tensor dequantized: the reading takes a minute for a
    135M model on a busy CPU, and a count is what says it is moving."""
    import torch
    import transformers.modeling_gguf_pytorch_utils as reader
    from transformers import AutoModelForCausalLM

    bar = reader.tqdm
    reader.tqdm = _counting(on_tensor)  # in place of its own progress bar, drawn over our display
    try:
        # Mismatched sizes are read to be reported below, with the weights missing, rather than as transformers' error.
        with _read_once():
            read, loading = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype,
                                                                 output_loading_info=True, ignore_mismatched_sizes=True)
    except torch.OutOfMemoryError:
        raise
    except (ValueError, NotImplementedError, KeyError) as exc:
        raise GgufRefused(f"transformers cannot read {path.name}: {_first_line(exc)}",
                          "Use a GGUF of a Llama, Mistral, Qwen2 or Phi-3 model, or the model's own "
                          "Hugging Face folder or name.") from None
    except (RuntimeError, AttributeError, TypeError, IndexError) as exc:  # a config it cannot set, say
        raise _not_its_architecture(path, f"transformers stopped reading it ({_first_line(exc)})") from None
    finally:
        reader.tqdm = bar
    problems = _misread(path, read, loading)
    if problems:
        raise _not_its_architecture(path, "; ".join(problems))
    # The weights are dequantized already, but the model still counts as "quantized with gguf",
    # which save_pretrained refuses: the same weights in a plain model of the same config.
    config = read.config
    for attribute in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attribute):
            delattr(config, attribute)
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(read.state_dict())
    return plain.eval()


def _counting(on_tensor: Counted) -> Callable[..., Iterator[Any]]:
    """What transformers' reader takes for tqdm: its tensors as they are, each counted once dequantized."""
    def counted(iterable: Iterable[Any], **_bar: Any) -> Iterator[Any]:
        items = list(iterable)
        on_tensor(0, len(items))
        for done, item in enumerate(items, start=1):
            yield item  # the reader dequantizes it before asking for the next
            on_tensor(done, len(items))
    return counted


@contextmanager
def _read_once() -> Iterator[None]:
    """transformers' GGUF loading, without the work it repeats: it parses the whole file's
    metadata (every token of the vocabulary) once for the config and again for the
    weights, and builds gguf's tensor-name map afresh for each of a model's modules
    (397 times for SmolLM2-135M). Each is the same every time, so it is built once here:
    before the first tensor, 15 s of waiting without a count became about 5 (2 cores)."""
    import functools

    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=2)(reader_class)  # by path and mode; read-only memory maps
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


@contextmanager
def no_library_bars() -> Iterator[None]:
    """transformers' own progress bars off ("Writing model shards" drawn over the
    display), whichever command runs, and as they were after."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()


def _misread(path: Path, model: Any, loading: dict[str, Any]) -> list[str]:
    """What shows the file is not the architecture it says, as transformers
    read it: weights it would start from random values (missing, or of another
    size), and tensors of the file it had no place for and dropped (the biases
    of a Qwen2 file labelled llama). All silent in transformers."""
    missing = sorted({_weight_kind(name) for name in loading["missing_keys"]})
    sizes = {_weight_kind(name): (tuple(found), tuple(wanted)) for name, found, wanted in loading["mismatched_keys"]}
    dropped = _unplaced(path, model)
    return (([f"it has no {_some(missing)}, which such a model has"] if missing else [])
            + [f"its {name} is {_shape(found)} where such a model's is {_shape(wanted)}"
               for name, (found, wanted) in sorted(sizes.items())[:2]]
            + ([f"it has {_some(dropped)}, which such a model has no place for"] if dropped else []))


def _unplaced(path: Path, model: Any) -> list[str]:
    """The file's tensors (by llama.cpp's names, without their layer) that none
    of the model's weights is read from; none when gguf cannot name every
    weight of the model (nothing to compare with). Rotary factors
    (rope_freqs, rope_factors_long) are computed, not loaded, by transformers."""
    import gguf
    from transformers.integrations.gguf.reader import read_gguf_metadata

    found, tensors = read_gguf_metadata(str(path), ())
    architecture = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(found.get("general.architecture"))
    if architecture is None:
        return []
    names = gguf.get_tensor_name_map(architecture, model.config.num_hidden_layers)
    placed = {names.get_name(name, try_suffixes=(".weight", ".bias")) for name, _ in model.named_parameters()}
    if None in placed:
        return []
    return sorted({_weight_kind(tensor) for tensor in tensors if tensor not in placed and not tensor.startswith("rope_")})


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0][:200]


def _weight_kind(name: str) -> str:
    """A weight's name without its layer ("model.layers.3.self_attn.q_proj.bias" -> "self_attn.q_proj.bias")."""
    parts = name.split(".")
    layer = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return ".".join(parts[layer + 1:]) if layer is not None and layer + 1 < len(parts) else name


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(str(size) for size in shape)


def _not_its_architecture(path: Path, why: str) -> GgufRefused:
    """A file whose general.architecture is not what its tensors are (edited, or written wrong)."""
    try:
        architecture = metadata(path).get("general.architecture") or "not given"
    except Exception:  # noqa: BLE001 - the message must not fail on the file it is about
        architecture = "not readable"
    return GgufRefused(f"{path.name} says its architecture is {architecture}, but its tensors cannot be read as a "
                       f"{architecture} model's: {why}.",
                       "The file's general.architecture does not match its weights (it was edited or written "
                       "wrong): use the GGUF as it was published, or the model's own Hugging Face folder or name.")
