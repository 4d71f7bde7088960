"""What a tuning study's trials must share to compare: its identity, stored with it.

The data (its path and checksum), the model, the held-out rows, the trial
budget, and the objectives the trials are scored by: held-out loss and
forgetting (`commands/tune_pareto.py`). Trials on other data or another
budget do not compare, so such a study is not continued: with a default name
a new study beside it is started, and said so; with --study-name it is an
error. A study made by an older llmcustoms scored held-out loss alone (one
Optuna objective); Optuna keeps a study's objectives for good, and its
trials measured no forgetting, so it is treated the same way.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from llmcustoms.commands.tune_studies import open_storage, study_dir
from llmcustoms.errors import ConfigError

# Held-out loss and forgetting, both minimized (`tune.open_study`).
OBJECTIVES = 2


def study_identity(plan: Any, steps: int) -> dict[str, Any]:
    """What trials must share to compare: the data (and its content), the model, the held-out rows,
    the budget, the number of objectives."""
    return {"data": plan.data, "data_sha256": plan.data_sha256, "eval_data_sha256": plan.eval_data_sha256,
            "model": plan.model, "eval_rows": plan.eval_rows, "steps": steps, "objectives": OBJECTIVES}


def differences(stored: dict[str, Any], identity: dict[str, Any]) -> list[str]:
    """How `identity` differs from a study's, in words; a key the study lacks (an
    older one) is not a difference, but its objectives always are known (Optuna's)."""
    said = []
    if stored.get("data", identity["data"]) != identity["data"]:
        said.append(f"other data ({Path(stored['data']).name}, not {Path(identity['data']).name})")
    elif any(stored.get(k, identity[k]) != identity[k] for k in ("data_sha256", "eval_data_sha256")):
        said.append(f"other content of {Path(identity['data']).name} (the data changed since; its checksum differs)")
    if stored.get("model", identity["model"]) != identity["model"]:
        said.append(f"another model ({stored['model']})")
    if stored.get("eval_rows", identity["eval_rows"]) != identity["eval_rows"]:
        said.append(f"{stored['eval_rows']} held-out rows, not {identity['eval_rows']}")
    if stored.get("steps", identity["steps"]) != identity["steps"]:
        said.append(f"{stored['steps']} optimizer steps per trial, not {identity['steps']} (--max-steps, --budget-tokens)")
    if stored.get("objectives", identity["objectives"]) != identity["objectives"]:
        said.append("held-out loss alone, by an older llmcustoms (trials now also measure forgetting, "
                    "which its trials did not)")
    return said


def stored_identity(storage: Any, name: str) -> dict[str, Any] | None:
    """The identity a study of that name was started with, its objectives
    counted from Optuna's record; None when there is no such study."""
    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError:
        return None
    identity = dict(storage.get_study_user_attrs(study_id).get("identity", {}))
    return {**identity, "objectives": len(storage.get_study_directions(study_id))}


def choose_study(url: str | None, output_dir: Path, name: str, named: bool, identity: dict[str, Any]) -> tuple[str, str]:
    """The study to run trials in, and a note when it is not the one of that name
    (which was started on other data or another budget). `named`: the user
    chose the name, so it is an error instead."""
    found = _identity_of(url, output_dir, name)
    said = differences(found, identity) if found is not None else []
    if not said:
        return name, ""
    if named:
        raise ConfigError(f"The study '{name}' was started on {'; '.join(said)}: its trials would not compare with new ones.",
                          "Use another --study-name to start a new study beside it (it is kept)"
                          + ("." if _only_objectives(found, identity) else
                             ", or the data and flags it was started with to continue it."))
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]
    other = f"{name}-{digest}"
    found_other = _identity_of(url, output_dir, other)
    verb = "continuing the study" if found_other is not None and not differences(found_other, identity) else "a new study"
    return other, f"The study '{name}' was started on {'; '.join(said)}: {verb} '{other}' beside it (it is kept)."


def _only_objectives(stored: dict[str, Any], identity: dict[str, Any]) -> bool:
    """Whether the study differs only by its objectives: no flag of this version continues it."""
    return differences({**stored, "objectives": identity["objectives"]}, identity) == []


def _identity_of(url: str | None, output_dir: Path, name: str) -> dict[str, Any] | None:
    path = study_dir(output_dir, name)
    if url is None and not (path / "study.db").is_file():
        return None  # the default storage is not created only to look
    return stored_identity(open_storage(url, path), name)


def check_identity(study: Any, identity: dict[str, Any]) -> None:
    """A study compares trials on one dataset, model, budget and pair of objectives;
    refuse to mix others in (two `tune` of one name may have raced `choose_study`).
    A study from before a key was part of the identity takes it on."""
    stored = study.user_attrs.get("identity")
    said = differences({**(stored or {}), "objectives": len(study.directions)}, identity)
    if said:
        raise ConfigError(f"The study '{study.study_name}' was started on {'; '.join(said)}.",
                          "Use another --study-name (or --output-dir) for this dataset, model and budget.")
    if stored != identity:
        study.set_user_attr("identity", identity)
