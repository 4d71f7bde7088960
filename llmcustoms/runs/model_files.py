"""Whether the base model's files are still those a run began with.

`train` records a fingerprint of the model in plan.json (`model_fingerprint`);
`resume` compares it with the model's files now and refuses a difference: a
checkpoint's adapter continued on other base weights would go on training
something else, silently, even with every shape the same.

The fingerprint is cheap, read once per command, never the whole weights: for
a local model directory, each weight file's (and config.json's) size and a
hash of its start (a safetensors header: names, shapes, dtypes), its end and
evenly spread samples of its middle; for a Hub model, the revision (commit) its
files in the Hugging Face cache come from, which names their content. File
times are left out: a copy or a fresh download of the same model is the same
model. Plans written before the fingerprint existed have none and resume as
before.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Any

from llmcustoms.errors import ModelError

# The files whose content is the model: weights (any format) and the config that says how to use them.
MODEL_FILE_PATTERNS = ("config.json", "*.safetensors", "*.safetensors.index.json", "*.bin", "*.pt", "*.pth")
SAMPLE_BYTES = 1 << 20  # hashed at the start and at the end of each file
MIDDLE_SAMPLES = 8  # 64 KiB pieces hashed between them
MIDDLE_SAMPLE_BYTES = 1 << 16


def _file_fingerprint(path: Path) -> str:
    size = path.stat().st_size
    digest = hashlib.blake2b(str(size).encode())
    with open(path, "rb") as f:
        if size <= 2 * SAMPLE_BYTES + MIDDLE_SAMPLES * MIDDLE_SAMPLE_BYTES:  # small: all of it
            digest.update(f.read())
            return digest.hexdigest()
        pieces = [(0, SAMPLE_BYTES), (size - SAMPLE_BYTES, SAMPLE_BYTES)]
        step = (size - 2 * SAMPLE_BYTES) // (MIDDLE_SAMPLES + 1)
        pieces += [(SAMPLE_BYTES + step * (i + 1), MIDDLE_SAMPLE_BYTES) for i in range(MIDDLE_SAMPLES)]
        for offset, length in pieces:
            f.seek(offset)
            digest.update(f.read(length))
    return digest.hexdigest()


def _hub_revision(name: str) -> str | None:
    from huggingface_hub import try_to_load_from_cache

    try:
        config = try_to_load_from_cache(name, "config.json")
    except Exception:  # not a valid repository id: loading the model says what is wrong
        return None
    return Path(config).parent.name if isinstance(config, str) else None


def model_fingerprint(name: str) -> dict[str, str]:
    """File name -> fingerprint for a local model directory; {"revision": commit}
    for a Hub model in the local cache; {} when the model's files are not here
    (nothing to compare: loading it says what is missing)."""
    path = Path(name).expanduser()
    if path.is_dir():
        found = sorted({f for pattern in MODEL_FILE_PATTERNS for f in path.glob(pattern) if f.is_file()})
        return {f.name: _file_fingerprint(f) for f in found}
    if path.exists() or name.startswith((".", "/", "~")):
        return {}
    revision = _hub_revision(name)
    return {"revision": revision} if revision else {}


def differences(recorded: dict[str, str], now: dict[str, str]) -> list[str]:
    """What differs, in words: changed, new and missing files (or the revision)."""
    said = [f"the Hub revision was {recorded[name][:12]}, is now {now[name][:12]}" if name == "revision"
            else f"{name} differs" for name in sorted(recorded.keys() & now.keys()) if recorded[name] != now[name]]
    said += [f"{name} is new" for name in sorted(now.keys() - recorded.keys())]
    return said + [f"{name} is gone" for name in sorted(recorded.keys() - now.keys())]


def with_model_checked(plan: Any, changed_ok: bool) -> Any:
    """`plan` if its base model's files are those it recorded (or it recorded
    none, or they are not here to compare); with `changed_ok`, the plan with
    the new fingerprint (and a reason saying so), so later resumes compare with
    the weights the run now goes on from. Otherwise an error naming what changed."""
    recorded = plan.model_fingerprint
    now = model_fingerprint(plan.model) if recorded else {}
    if not recorded or not now or now == recorded:
        return plan
    what = ", ".join(differences(recorded, now))
    if changed_ok:
        return replace(plan, model_fingerprint=now, reasons=plan.reasons + (
            f"resumed on changed base model files ({what}) by `resume --model-changed-ok`",))
    raise ModelError(f"The base model {plan.model} has changed since the run started ({what}); its checkpoints were "
                     "trained on the weights it had then.",
                     "Put back the model files the run began with, or add --model-changed-ok to the resume command "
                     "to go on training on the new ones.")
