"""The cases of issue 46 (the fourth attack) for benchmarks/attack.py: `problem` "46.N" is the
issue's Nth problem. The world and the Case fields are attack_cases.py's.
"""

from __future__ import annotations

import io
import json
from typing import Callable

from attack_cases import EVERYTHING, PASSWORD, ROW_TEXT, TRAIN, TUNE, Case, World

# A .env as people write them: quotes, a backslash path, comments, an export, a multi-line value.
USERS_ENV = ("# my settings\nWANDB_NOTES='said \"hello\" there'\nexport WINDOWS=C:\\\\support  # the share\n"
             "MULTI=\"line one\nline two\"\nLLMCUSTOMS_SAVE_EVERY=25\n")


def env_kept(w: World) -> list[str]:
    """What `setup` lost of the user's .env: a variable that reads back otherwise, or a comment."""
    from dotenv import dotenv_values

    before, after = dotenv_values(stream=io.StringIO(USERS_ENV)), dotenv_values(w.path("my.env"))
    lost = [f"{k} reads back as {after.get(k)!r}" for k, v in before.items() if after.get(k) != v]
    text = w.path("my.env").read_text()
    lost += [f"comment {c!r} dropped" for c in ("# my settings", "# the share") if c not in text]
    return lost + ([] if after.get("LLMCUSTOMS_MODEL") else ["the answers were not written"])


SYSTEM_PROMPT = 'You are "Ava", the C:\\support bot.'


def system_prompt_run(w: World) -> list[str]:
    """A run trained on rows that all start with SYSTEM_PROMPT; its GGUF export."""
    rows = [{"system": SYSTEM_PROMPT, "instruction": f"Question {i}?", "output": f"Answer {i}."} for i in range(8)]
    w.write("data/system.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    w.cli("train", "data/system.jsonl", "--model", "model", "--max-steps", "1", "--eval-split", "0",
          "--output-dir", "runs", "--run-name", "ava", "--yes", "--quiet")
    return ["export", "runs/ava", "--format", "gguf", "--quant", "f16", "--output", "exports/ava"]


def system_as_written(w: World) -> list[str]:
    """The SYSTEM value as Ollama's parser reads a triple-quoted one: no escapes."""
    text = w.path("exports/ava/Modelfile").read_text()
    start = text.index('SYSTEM """') + len('SYSTEM """')
    value = text[start:text.index('"""', start)]
    return [] if value == SYSTEM_PROMPT else [f"Ollama would read the system prompt as {value!r}"]


# ------------------------------------------------ items 7, 8, 9: damaged and read-only runs


# ------------------------------------------------ items 5, 10, 12, 16: exports and GGUF files


# ------------------------------------------------ items 11, 15, 17, 18, 19: terminals, arguments, advice


# ------------------------------------------------ items 4, 6, 13, 14: held-out rows, markup, storage, presets


FOURTH_CASES: list[Case] = [
    # Issue 46, 1: setup keeps every variable, comment and quote of the user's .env.
    Case("setup over a .env with quotes, backslashes and comments", "46.1",
         lambda w: ["setup", "--data", "data/rows.jsonl", "--env-file", w.write("my.env", USERS_ENV)],
         exits=(0,), stdin="\n\nmodel\n\n\ny\n", reduced=True, check=env_kept),
    # Issue 46, 2: the Modelfile's SYSTEM reaches Ollama as the data wrote it.
    Case("export a run whose system prompt has quotes and a backslash", "46.2", system_prompt_run,
         exits=(0,), says="Exported a GGUF model", keep=("data", "model"), reduced=True, timeout=600,
         check=system_as_written),
    # Issue 46, 3: a password holding "@" is hidden whole, with the user's name.
    Case("tune with a storage password holding @", "46.3",
         lambda w: [*TUNE, "--trials", "1", "--storage", f"postgresql://tuner:p@{PASSWORD}@127.0.0.1:9/study"],
         says="postgresql://***@127.0.0.1:9/study", reduced=True),
    # --- items 7, 8, 9
    # --- items 5, 10, 12, 16
    # --- items 11, 15, 17, 18, 19
    # --- items 4, 6, 13, 14
]
