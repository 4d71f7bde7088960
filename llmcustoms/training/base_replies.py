"""The base model's answers, kept for the next run: the same model, prompts and settings answer the same.

Before its first step a run answers its sample prompts and the forgetting
check's general questions with the base model (`samples.py`,
`general_knowledge.py`). That costs 35-45 s on a 2-core CPU for
SmolLM2-135M and 34 s on an H200 for TinyLlama (more than the 20 steps that
run trained), in every run, for answers that change only when something they
depend on does: greedy decoding of the same weights, prompts, chat template,
precision and device writes the same tokens. So the answers are kept in the
output directory, `.base-replies/<key>.json` beside the runs (whose
samples.jsonl already holds the same prompts and replies), and a later run
with the same key reads them instead of generating.

The key is a hash of everything the answers depend on: the base model's
files (`plan.model_fingerprint`), the method (QLoRA answers with 4-bit
weights), the precision and `--compile`, the prompt format, the tokenizer
(`plan.tokens_key`: its whole definition and special tokens) and chat
template, the stop tokens, the model's generation config, the prompts as
asked, the token limit and batch size, the device and its dtype, `FORMAT`,
and the versions of llmcustoms, torch and transformers. The folder holds the
base model's replies to the user's prompts, so it is theirs like the runs
beside it; the docs say so. A run whose
base is not the model's files (`--from-run`) or whose files have no
fingerprint keeps nothing. A kept file that cannot be read, or does not
match, is a miss: the answers are generated as before. One that cannot be
written is skipped silently: keeping is a saving, never worth a warning.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from llmcustoms.runs.disk_writes import replace_file

FOLDER = ".base-replies"  # in the output directory, beside the runs
# Part of every key: raise it when how the answers are generated or decoded
# changes (generation.py, general_knowledge.py), so no older answer is read.
FORMAT = 1


def answers_key(kind: str, plan: Any, tokenizer: Any, model: Any, prompts: list[Any], settings: dict[str, Any]
                ) -> str | None:
    """The key of `kind`'s ("samples", "general") base answers to `prompts`, or
    None when they cannot be kept (no fingerprint of the base model's files, or
    a base that is an earlier run's weights)."""
    if not getattr(plan, "model_fingerprint", None) or getattr(plan, "from_run", ""):
        return None
    import torch
    import transformers

    import llmcustoms
    from llmcustoms.models.generation import generation_stops

    device, dtype = _device_and_dtype(model)
    generation_config = getattr(model, "generation_config", None)
    described = {
        "kind": kind, "format_version": FORMAT, "model": plan.model_fingerprint, "method": plan.method,
        "precision": plan.mixed_precision, "compile": plan.compile,
        "format": [plan.data_format, plan.raw_prompts, bool(plan.data_report)],
        # the tokenizer's whole definition, template and special tokens (`token_cache.tokenization_cache_key`)
        "tokenizer": plan.tokens_key, "template": getattr(tokenizer, "chat_template", None),
        "stops": sorted(generation_stops(tokenizer, plan)),
        "generation_config": generation_config.to_json_string() if hasattr(generation_config, "to_json_string")
        else None,
        "prompts": prompts, "settings": settings, "device": device, "dtype": dtype,
        "versions": [llmcustoms.__version__, torch.__version__, transformers.__version__],
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _device_and_dtype(model: Any) -> tuple[str, str]:
    """Where the model answers and in what dtype ("cuda:NVIDIA H200", "torch.bfloat16"):
    greedy tokens can differ between kernels."""
    import torch

    try:
        weight = next(model.parameters())
    except (AttributeError, StopIteration, TypeError):
        return "unknown", "unknown"
    device = weight.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return f"{device.type}:{name}", str(weight.dtype)


def kept_answers(output_dir: Path, key: str | None, count: int) -> tuple[list[Any], float] | None:
    """The answers kept under `key`, and the seconds generating them took, when
    there are `count` of them; None otherwise."""
    if key is None:
        return None
    try:
        kept = json.loads((output_dir / FOLDER / f"{key}.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(kept, dict):
        return None
    answers, seconds = kept.get("answers"), kept.get("seconds")
    if not isinstance(answers, list) or len(answers) != count or not isinstance(seconds, (int, float)):
        return None
    return answers, float(seconds)


def keep_answers(output_dir: Path, key: str | None, answers: list[Any], seconds: float, kind: str = "",
                 plan: Any = None) -> None:
    """Keep `answers` (and the `seconds` they took) under `key` for the next run;
    nothing when that cannot be written. `kind` and `plan`'s hint let the next
    plan tell, before any model loads, that it will read them (`answered_before`)."""
    if key is None:
        return
    kept = {"answers": answers, "seconds": seconds, "kind": kind, "hint": plan_hint(plan) if plan else ""}
    try:
        (output_dir / FOLDER).mkdir(exist_ok=True)
        replace_file(output_dir / FOLDER / f"{key}.json", json.dumps(kept))
    except OSError:  # a full or read-only disk: the next run generates them again
        return


def plan_hint(plan: Any) -> str:
    """What of the key a plan knows before the model loads: the model's files, method,
    precision, data and versions. Equal hints nearly always mean equal keys; the
    answers' own key still decides whether they are read."""
    import llmcustoms

    described = [plan.model_fingerprint, plan.method, plan.mixed_precision, plan.compile, plan.data_format,
                 plan.raw_prompts, plan.data_sha256, plan.eval_data_sha256, plan.eval_split,
                 plan.seed, plan.from_run, FORMAT, llmcustoms.__version__]
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:32]


def planned_with_kept_answers(output_dir: Path, plan: Any) -> Any:
    """`plan`, its time without the base model's answers when a run here kept them."""
    from llmcustoms.planning.duration import with_base_answers_kept

    return with_base_answers_kept(plan) if answered_before(output_dir, plan) else plan


def answered_before(output_dir: Path, plan: Any) -> bool:
    """Whether an earlier run in `output_dir` kept both kinds of base answers that
    `plan`'s run will ask for: its plan then leaves their time out."""
    if not plan.model_fingerprint or plan.from_run:
        return False
    hint, kinds = plan_hint(plan), set()
    for path in sorted((Path(output_dir) / FOLDER).glob("*.json")) if (Path(output_dir) / FOLDER).is_dir() else []:
        try:
            kept = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        if isinstance(kept, dict) and kept.get("hint") == hint:
            kinds.add(kept.get("kind"))
    return {"samples", "general"} <= kinds
