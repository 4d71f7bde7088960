"""The cases of benchmarks/attack.py: each a command against a fresh copy of the attack's world,
the exit code and phrase it must end with, and what must come out of it unchanged.

The world (attack.build_world): `model/` (a two-layer Llama and its tokenizer), `data/rows.jsonl`
(48 instruction rows), `runs/done` and `runs/sibling` (finished two-step runs). Paths are
relative to it; a case's `prepare` may add files (a symlink, a damaged copy) and returns the
arguments after `llmcustoms`. `problem` is the number of the problem in issue 32.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# Planted where a leak would show them: the output must never hold these.
PASSWORD = "hunter2-attack-secret"
ROW_TEXT = "PRIVATE-ROW-7f3a"
SECRETS = (PASSWORD, ROW_TEXT)
EVERYTHING = ("data", "model", "runs")


@dataclass(frozen=True)
class World:
    root: Path

    def path(self, relative: str) -> Path:
        return self.root / relative

    def link(self, relative: str, target: str) -> str:
        os.symlink(self.root / target, self.root / relative)
        return relative

    def write(self, relative: str, text: str) -> str:
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return relative

    def edit_json(self, relative: str, change: Callable[[dict], None]) -> None:
        path = self.root / relative
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))


@dataclass(frozen=True)
class Case:
    name: str
    problem: int
    prepare: Callable[[World], list[str]]
    exits: tuple[int, ...] = (2,)
    says: str = ""
    never_says: tuple[str, ...] = ()
    keep: tuple[str, ...] = EVERYTHING
    env: dict[str, str] | None = None
    stdin: str | None = None
    timeout: int = 300
    reduced: bool = False
    check: Callable[[World], list[str]] | None = field(default=None, repr=False)


def export(output: str, *extra: str) -> Callable[[World], list[str]]:
    return lambda w: ["export", "runs/done", "--output", output, "--overwrite", *extra]


def exported_whole(relative: str) -> Callable[[World], list[str]]:
    def check(w: World) -> list[str]:
        adapter = w.path(relative) / "adapter_model.safetensors"
        return [] if adapter.is_file() else [f"{relative} holds no adapter after the export"]
    return check


def copy_run_as(w: World, name: str) -> None:
    shutil.copytree(w.path("runs/done"), w.path(f"runs/{name}"), symlinks=True)


CASES: list[Case] = [
    # 1. export --overwrite never removes what the tool did not make, nor the run it exports.
    Case("export over the run itself", 1, export("runs/done"), says="not", reduced=True),
    Case("export over the runs folder", 1, export("runs"), says="not", reduced=True),
    Case("export over the run's adapter", 1, export("runs/done/adapter"), says="not"),
    Case("export over the data folder", 1, export("data"), says="not", reduced=True),
    Case("export over a regular file", 1, export("data/rows.jsonl"), says="file"),
    Case("export over a symlink to a sibling run", 1,
         lambda w: ["export", "runs/done", "--output", w.link("out-link", "runs/sibling"), "--overwrite"],
         says="link", keep=EVERYTHING + ("out-link",), reduced=True),
    Case("export over an earlier export", 1,
         lambda w: ["export", "runs/done", "--output", "exported", "--overwrite"],
         exits=(0,), check=exported_whole("exported"), keep=("data", "model", "runs")),
    # 2. train --overwrite removes only a run directory the tool made.
    Case("train --overwrite over the data folder", 2,
         lambda w: ["train", "data/rows.jsonl", "--model", "model", "--output-dir", ".", "--run-name", "data",
                    "--overwrite", "--yes", "--quiet", "--max-steps", "1"], says="not", reduced=True),
    Case("train --overwrite over a folder of the user's", 2,
         lambda w: [w.write("mine/notes.txt", "the user's own file") and "train", "data/rows.jsonl", "--model", "model",
                    "--output-dir", ".", "--run-name", "mine", "--overwrite", "--yes", "--quiet", "--max-steps", "1"],
         says="not", keep=EVERYTHING + ("mine",)),
]
