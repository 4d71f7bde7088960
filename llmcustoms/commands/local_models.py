"""The models on this disk that `setup` offers before the catalog: those the
runs here trained (a local model directory named in a run's plan.json, newest
run first), then the language models in the Hugging Face cache that the
catalog does not list. Offline they are what can be used (the catalog's are
marked "offline: no" unless cached); online, a model the user already trained
is still the likeliest answer. Each is found without the Hub.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmcustoms.models import hub_access
from llmcustoms.models.loading import looks_like_path
from llmcustoms.planning.presets import load_families
from llmcustoms.runs.run_directory import list_runs

FROM_RUNS, FROM_CACHE = "used by a run here", "in the Hugging Face cache"


def models_on_disk(output_dir: Path, catalog: set[str]) -> list[tuple[str, str]]:
    """(model, where it was found: FROM_RUNS or FROM_CACHE), each once, none of
    `catalog` (its list marks them cached already)."""
    found: dict[str, str] = {}
    runs = sorted(list_runs(output_dir) if Path(output_dir).is_dir() else [],
                  key=lambda run: run.started_at or "", reverse=True)
    for run in runs:
        if run.model not in catalog and _usable_here(run.model):
            found.setdefault(str(Path(run.model).expanduser()) if looks_like_path(run.model) else run.model,
                             FROM_RUNS)
    for hub_id in _cached_language_models():
        if hub_id not in catalog:
            found.setdefault(hub_id, FROM_CACHE)
    return list(found.items())


def _usable_here(model: str) -> bool:
    """A model directory with its config (or a GGUF file), or a Hub id in the cache: `train` loads it offline."""
    if looks_like_path(model):
        path = Path(model).expanduser()
        return (path / "config.json").is_file() or (path.is_file() and path.suffix.lower() == ".gguf")
    return hub_access.is_hub_id(model) and hub_access.is_cached(model)


def _cached_language_models() -> list[str]:
    """The Hub ids in the Hugging Face cache with weights and a config whose
    model_type a family of ours trains (no encoder, image or speech models)."""
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    try:
        repos = scan_cache_dir().repos
    except Exception:  # no cache yet, or one huggingface_hub cannot read: nothing to offer from it
        return []
    types = {model_type for family in load_families().values() for model_type in family.model_types}
    found = []
    for repo in sorted(repos, key=lambda r: r.last_accessed, reverse=True):  # the one used last first
        if repo.repo_type != "model" or not hub_access.is_cached(repo.repo_id):
            continue
        config = try_to_load_from_cache(repo.repo_id, "config.json")
        try:
            model_type = json.loads(Path(config).read_text(encoding="utf-8")).get("model_type")
        except (OSError, TypeError, ValueError, AttributeError):  # unreadable, or not a JSON object
            continue
        if model_type in types:
            found.append(repo.repo_id)
    return found
