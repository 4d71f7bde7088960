"""What a local model folder must hold, and what is wrong with one that cannot load.

transformers reports a broken folder in words about the Hub: a config.json
that is not JSON, or a missing tokenizer, came out as "not in the local
Hugging Face cache ... offline mode is on", which sends the user looking for a
network problem. A truncated weights file or a config.json whose vocab_size
does not match the weights was a traceback from inside the load, after the run
directory was made. So a local folder is checked from its files, before
anything loads (`check_folder`, `check_weights`: safetensors headers only, no
torch), and a load that fails anyway is explained from the folder (`explain`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmcustoms.errors import ModelError
from llmcustoms.runs.checkpoint_content import Unusable, safetensors_header

# Any of these is a tokenizer transformers can load (fast, sentencepiece, BPE
# vocabulary, WordPiece, tiktoken); tokenizer_config.json may name the rest.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "tokenizer.tiktoken")
# Tensors whose first dimension is the vocabulary: the input embedding and the output layer.
VOCAB_TENSOR_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight",
                         "embed_out.weight", "lm_head.weight")
SAFETENSORS_INDEX = "model.safetensors.index.json"
FIX_FOLDER = "Copy or download the model again, or pass --model with another directory."


def _refused(name: str, what: str, hint: str = FIX_FOLDER) -> ModelError:
    return ModelError(f"The model folder {name} cannot be used: {what}.", hint)


def read_config(name: str, folder: Path) -> dict[str, Any]:
    """config.json as a JSON object, or the error that says what is wrong with it."""
    path = folder / "config.json"
    if not path.is_file():
        raise _refused(name, "it has no config.json", "Point --model at a directory written by `save_pretrained` "
                       "(it holds config.json and the weights), or use a Hub id.")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise _refused(name, "its config.json is not UTF-8 text") from None
    except json.JSONDecodeError as error:  # position only: the file is the user's, not ours to echo
        raise _refused(name, f"its config.json is not valid JSON (line {error.lineno}, column {error.colno})",
                       "Fix config.json, or put back the one that came with the model.") from None
    except OSError as error:
        raise _refused(name, f"its config.json cannot be read ({error.strerror})", "Check the file's permissions.") from None
    if not isinstance(config, dict):
        raise _refused(name, "its config.json does not hold a JSON object", "Put back the config.json that came with "
                       "the model.")
    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise _refused(name, "its config.json names no model_type", "Put back the config.json that came with the "
                       "model; it says which architecture the weights are (\"model_type\": \"llama\", say).")
    return config


def check_folder(name: str, folder: Path) -> None:
    """Everything training reads from a local model folder: a config.json that
    is a JSON object naming its model_type, a tokenizer, and whole weights."""
    read_config(name, folder)
    if not any((folder / file).is_file() for file in TOKENIZER_FILES):
        raise _refused(name, "it has no tokenizer (no tokenizer.json or tokenizer_config.json)",
                       "Save the tokenizer into the folder too (tokenizer.save_pretrained(DIR)), or copy its "
                       "tokenizer files from where the model came from.")
    check_weights(name, folder)


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files transformers would load: those the index names, else model.safetensors."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (OSError, ValueError, AttributeError):
            raise _refused(str(folder), f"its {SAFETENSORS_INDEX} is not a readable JSON object") from None
        if not isinstance(weight_map, dict):
            raise _refused(str(folder), f"its {SAFETENSORS_INDEX} has no weight_map")
        return [folder / file for file in sorted({str(f) for f in weight_map.values()})]
    single = folder / "model.safetensors"
    return [single] if single.exists() else []


def check_weights(name: str, folder: Path) -> None:
    """Each safetensors weights file whole (its header read, its data as long
    as the header says), and as many vocabulary rows as config.json's vocab_size."""
    files = _weight_files(folder)
    vocab = None
    if files and (folder / "config.json").is_file():
        vocab = read_config(name, folder).get("vocab_size")
    for file in files:
        if not file.is_file():
            raise _refused(name, f"its weights file {file.name} is missing (the index names it)")
        try:
            tensors = safetensors_header(file)
        except Unusable as problem:
            raise _refused(name, f"its weights file {file.name} is damaged or cut short ({problem}); an interrupted "
                           "download or copy leaves it so") from None
        if not isinstance(vocab, int) or isinstance(vocab, bool):
            continue
        for tensor, info in tensors.items():
            if tensor.endswith(VOCAB_TENSOR_SUFFIXES) and info.shape and info.shape[0] != vocab:
                raise _refused(name, f"config.json says vocab_size {vocab}, but {tensor} in {file.name} has "
                               f"{info.shape[0]} rows: the config does not belong to these weights",
                               f"Put back the config.json that came with the weights (or set vocab_size to "
                               f"{info.shape[0]} in it).")


def explain(name: str, folder: Path, exc: Exception) -> ModelError:
    """Why loading from the local folder failed, said of the folder (never of the
    Hub): what `check_folder` finds, an architecture this transformers does not
    know, or else the kind of error."""
    failed = _refused(name, f"loading it failed ({type(exc).__name__})",
                      "Check that the folder is complete and its files belong together; copy or download the model "
                      "again, or pass --model with another directory.")
    if not (folder / "config.json").exists() and (folder / "adapter_config.json").is_file():
        return failed  # a run's adapter/: its tokenizer failed to load, not a model folder to judge
    try:
        config = read_config(name, folder)
        if "does not recognize this architecture" in str(exc) or "Unrecognized model" in str(exc):
            import transformers

            return _refused(name, f"its config.json says model_type '{config['model_type']}', an architecture "
                            f"transformers {transformers.__version__} does not know",
                            "Upgrade transformers (pip install -U transformers), pass --trust-remote-code if the "
                            "model ships its own code and you trust it, or fix model_type in config.json.")
        check_folder(name, folder)
    except ModelError as error:
        return error
    return failed
