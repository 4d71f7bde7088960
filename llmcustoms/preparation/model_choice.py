"""The --model a user gave, described before anything loads, and what the plan says of it:
a GGUF file read into a folder, a model that cannot load offline, one the Hub gates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmcustoms.models import hub_access
from llmcustoms.models.gguf_folder import gguf_folder, is_gguf, source_quantization
from llmcustoms.planning.presets import find_model_spec
from llmcustoms.planning.train_options import TrainOptions
from llmcustoms.preparation.prepared_run import Progress


def given_model_reason(name: str, families: dict | None = None) -> str | None:
    """What the plan says of a --model: a GGUF file and what was made of it, a
    model that cannot load, or one the Hub gates that is still to download
    (said before the download fails); nothing for the usual folder or Hub id."""
    from llmcustoms.models.loading import model_location

    if is_gguf(name):
        folder = Path(model_location(name))
        quantization = source_quantization(folder) or "unknown"
        kept = {"f16": "float16", "bf16": "bfloat16"}.get(quantization, "float32")
        return (f"model {Path(name).name}: a GGUF file ({quantization}), read through transformers' GGUF reader "
                f"and dequantized to {kept} once, into {folder}")
    where = hub_access.availability(name)
    if where == hub_access.UNAVAILABLE:
        return (f"model {name}: {hub_access.offline_note()}, and it is not in the local "
                "Hugging Face cache: `train` cannot load it; pass --model PATH to a local model directory")
    spec = find_model_spec(name, families or {})
    family = (families or {}).get(spec.family) if spec else None
    if where == hub_access.DOWNLOADABLE and family is not None and family.hub_licence:
        return f"model {name}: to download, and gated: {family.hub_licence}"
    return None


def given_model(options: TrainOptions, families: dict, trust_remote_code: bool, progress: Progress) -> tuple[Any, str | None]:
    """The --model given, described, and what the plan says of it. A GGUF file is
    read into its folder first, its tensors counted on `progress` (a minute's
    wait for a 135M model on a busy CPU), rather than on first use, uncounted."""
    from llmcustoms.models import loading

    if is_gguf(options.model) and loading.looks_like_path(options.model):  # as `model_location` reads it
        gguf_folder(Path(options.model), lambda done, total: progress("gguf", done, total))
    model = loading.describe_model(options.model, families, options.model_source, trust_remote_code)
    return model, given_model_reason(options.model, families)
