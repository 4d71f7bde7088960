"""`--model path/to/model.gguf`: a model a user already has on disk for
Ollama, llama.cpp or LM Studio, trained like any other.

The file is read once through transformers' GGUF reader (`gguf_reading`),
dequantized, and written as an ordinary model folder in the cache
(`<cache>/gguf/<name>-<key>`, the key from the file's path, size and
modification time), so every later step (planning, loading, resume, export)
sees a folder and nothing else changes. Dequantized weights are kept in 32-bit
floats, since a q8_0 or q4_0 weight times its 16-bit scale does not fit 16
bits exactly; a file of f16 or bf16 weights stays in that dtype.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import sys
from pathlib import Path

from llmcustoms.data.token_cache import cache_dir
from llmcustoms.models.gguf_reading import Counted
from llmcustoms.models.gguf_vocab import GgufRefused

DONE = ".converted-from-gguf"


def is_gguf(name: str) -> bool:
    return name.lower().endswith(".gguf")


def gguf_folder(path: Path, progress: Counted = lambda done, total: None) -> Path:
    """The cached model folder of the GGUF file at `path`, written on first use;
    `progress` hears how far (done, total): each tensor read, and the steps around them."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise GgufRefused(f"GGUF file not found: {path}", "Pass --model with the path of an existing .gguf file.")
    stat = path.stat()
    key = hashlib.blake2b(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode(), digest_size=6).hexdigest()
    folder = cache_dir() / "gguf" / f"{path.stem}-{key}"
    if (folder / DONE).is_file():
        return folder
    _convert(path, folder, progress)
    return folder


def _convert(path: Path, folder: Path, progress: Counted) -> None:
    import torch

    from llmcustoms.models import gguf_reading

    try:
        found = gguf_reading.metadata(path)
    except (ValueError, OSError, IndexError, struct.error) as exc:  # not GGUF at all, or cut short
        raise GgufRefused(f"{path.name} is not a readable GGUF file ({str(exc).splitlines()[0][:120]}).",
                          "Check that the download finished, or pass --model a model folder or Hub id.") from None
    kind = gguf_reading.FILE_TYPES.get(found.get("general.file_type"), "unknown")
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16}.get(kind, torch.float32)
    # A plain line on stderr, once per file: this can take a minute for a large model.
    sys.stderr.write(f"Reading {path.name} ({found.get('general.architecture')}, {kind}) once, into {folder}\n")
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    # Counted as the tensors and three items more: transformers' reading of the file's
    # layout before the first tensor (6 s of the 12 s for SmolLM2-135M at q8_0 on 2
    # idle cores), the model built from the tensors, and the tokenizer read and the folder written.
    total = gguf_reading.tensor_count(path) + 3
    progress(0, total)
    try:
        with gguf_reading.no_library_bars():
            model = gguf_reading.load_model(path, dtype, lambda done, tensors: progress(1 + done, total))
            progress(total - 1, total)
            tokenizer = gguf_reading.load_tokenizer(path)
            model.config.llmcustoms_gguf_source = {"file": path.name, "quantization": kind}
            model.save_pretrained(partial, safe_serialization=True)
            tokenizer.save_pretrained(partial)
        progress(total, total)
        (partial / DONE).write_text(f"{path}\n")
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(partial, folder)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def source_quantization(folder: Path) -> str | None:
    """The quantization of the GGUF file a cached folder was read from; None for other folders."""
    import json

    try:
        source = json.loads((folder / "config.json").read_text()).get("llmcustoms_gguf_source") or {}
    except (OSError, ValueError, AttributeError):
        return None
    return source.get("quantization")
