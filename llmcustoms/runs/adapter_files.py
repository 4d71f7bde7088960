"""Whether a LoRA adapter folder (a run's adapter/) can be loaded, from its files alone.

peft trusts adapter_config.json and adapter_model.safetensors. A weights
file cut short ended in a SafetensorError traceback; a rank in the config
other than the weights' in a size-mismatch traceback; and target modules
that leave out some of the weights' in a model that loaded and replied
with part of its training silently dropped. So both files are read here
first, as untrusted bytes and without torch (`checkpoint_content` parses
the safetensors header), and what is wrong is one sentence, or None.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from llmcustoms.runs.checkpoint_content import TensorInfo, Unusable, read_json, safetensors_header

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# A LoRA weight as peft saves it: "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight".
LORA_WEIGHT = re.compile(r"(?P<module>.+)\.lora_(?P<side>[AB])\.weight")
PEFT_PREFIX = "base_model.model."


def adapter_problem(directory: Path) -> str | None:
    """What is wrong with the LoRA adapter in `directory`, or None. A folder
    without adapter_model.safetensors is left to the loader, whose refusal
    says why (`loading.adapter_weights`: a pickle file is not loaded)."""
    if not (Path(directory) / ADAPTER_WEIGHTS).is_file():
        return None
    try:
        config = read_json(Path(directory) / ADAPTER_CONFIG)
        tensors = safetensors_header(Path(directory) / ADAPTER_WEIGHTS)
    except Unusable as exc:
        return str(exc)
    if not isinstance(config, dict):
        return f"{ADAPTER_CONFIG} is not a JSON object"
    if config.get("peft_type", "LORA") != "LORA":
        return None  # not an adapter llmcustoms writes: peft's own checks are all there is
    rank, targets = config.get("r"), config.get("target_modules")
    if type(rank) is not int or rank < 1:
        return f"the rank r of {ADAPTER_CONFIG} is not a whole number of at least 1"
    if not (isinstance(targets, str) or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        return f"the target_modules of {ADAPTER_CONFIG} are not a list of module names"
    modules = _lora_modules(tensors)
    if not modules:
        return f"{ADAPTER_WEIGHTS} holds no LoRA weights"
    return _fit_problem(modules, rank, config.get("rank_pattern") or {}, targets)


def _lora_modules(tensors: dict[str, TensorInfo]) -> dict[str, dict[str, TensorInfo]]:
    """The LoRA weights by module ("model.layers.0.self_attn.q_proj"), each its A and B."""
    modules: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        match = LORA_WEIGHT.fullmatch(name)
        if match is not None:
            module = match["module"].removeprefix(PEFT_PREFIX)
            modules.setdefault(module, {})[match["side"]] = info
    return modules


def _fit_problem(modules: dict[str, dict[str, TensorInfo]], rank: int, pattern: Any,
                 targets: str | list[str]) -> str | None:
    """Whether the weights are what the config says: every module targeted, A and
    B of each there with the config's rank, and every target with weights."""
    for module, sides in sorted(modules.items()):
        if not _targeted(module, targets):
            return (f"{ADAPTER_WEIGHTS} holds weights of {module}, which the target_modules of {ADAPTER_CONFIG} "
                    "leave out")
        if set(sides) != {"A", "B"}:
            return f"{ADAPTER_WEIGHTS} holds only lora_{''.join(sides)} of {module}"
        wanted = _rank_of(module, rank, pattern)
        a, b = sides["A"].shape, sides["B"].shape
        if len(a) < 2 or len(b) < 2 or a[0] != wanted or b[1] != wanted:
            found = "not a matrix" if len(a) < 2 or len(b) < 2 else f"of rank {a[0] if a[0] != wanted else b[1]}"
            return f"{ADAPTER_CONFIG} says rank {wanted}, but the weights of {module} in {ADAPTER_WEIGHTS} are {found}"
    if isinstance(targets, list):
        missing = [t for t in targets if not any(_targeted(module, [t]) for module in modules)]
        if missing:
            return (f"the target_modules of {ADAPTER_CONFIG} name {missing[0]}, of which {ADAPTER_WEIGHTS} holds "
                    "no weights")
    return None


def _targeted(module: str, targets: str | list[str]) -> bool:
    """peft's rule: a list names modules by their last parts, a string is a regular expression."""
    if isinstance(targets, list):
        return any(module == t or module.endswith("." + t) for t in targets)
    if targets == "all-linear":  # peft writes the modules it chose; a config saying this leaves them unknown
        return True
    try:
        return re.fullmatch(targets, module) is not None
    except re.error:
        return False


def _rank_of(module: str, rank: int, pattern: Any) -> int:
    """The module's rank: the config's r, unless its rank_pattern names the module."""
    if isinstance(pattern, dict):
        for key, value in pattern.items():
            try:
                if type(value) is int and re.match(rf"(.*\.)?({key})$", module):
                    return value
            except re.error:
                continue
    return rank
