"""check_prompts.json in a run folder: the prompts `export` checks a merge on
and the system prompt a GGUF export's Modelfile carries, drawn when the run
starts from the rows it read (`training/samples.py`), so an export never
reads the data file again (it may be large, moved or gone by then).

    {"prompts": [[{"role": "user", "content": "..."}], ...], "system_prompt": "..." or null}

The prompts are the user's data, like samples.jsonl's: they stay in the run
folder. A run started before the file existed has none; `read` says so with
None and export draws from the data file as it used to.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmcustoms.runs.run_directory import write_json_atomic

FILE = "check_prompts.json"

Prompts = list[list[dict[str, str]]]


def write(run_path: Path, prompts: Prompts, system_prompt: str | None) -> None:
    write_json_atomic(Path(run_path) / FILE, {"prompts": prompts, "system_prompt": system_prompt})


def read(run_path: Path) -> tuple[Prompts, str | None] | None:
    """The prompts and system prompt kept, or None when the run has no whole record."""
    try:
        kept: Any = json.loads((Path(run_path) / FILE).read_text(encoding="utf-8"))
        prompts, system = kept["prompts"], kept["system_prompt"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    well_formed = isinstance(prompts, list) and all(
        isinstance(p, list) and p and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                          and isinstance(m.get("content"), str) for m in p) for p in prompts)
    if not well_formed or not (system is None or isinstance(system, str)):
        return None
    return [[{"role": m["role"], "content": m["content"]} for m in p] for p in prompts], system
