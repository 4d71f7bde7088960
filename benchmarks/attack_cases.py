"""The cases of benchmarks/attack.py: each a command against a fresh copy of the attack's world,
the exit code and phrase it must end with, and what must come out of it unchanged.

The world (attack.build_world): `model/` (a two-layer Llama and its tokenizer), `data/rows.jsonl`
(48 instruction rows), `runs/done` and `runs/sibling` (finished two-step runs). Paths are
relative to it; a case's `prepare` may add files (a symlink, a damaged copy) and returns the
arguments after `llmcustoms`. `problem` is the number of the problem in issue 32; issue 46's cases are in attack_cases_fourth.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import forked_cli

# A Gemma-style template: refuses a system turn, and its refusal quotes the turn.
REFUSING_TEMPLATE = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported: ' "
                     "+ messages[0]['content']) }}{% endif %}{% for message in messages %}<|{{ message['role'] }}|>\n"
                     "{{ message['content'] }}</s>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# Planted where a leak would show them: the output must never hold these.
PASSWORD = "hunter2-attack-secret"
ROW_TEXT = "PRIVATE-ROW-7f3a"
SECRETS = (PASSWORD, ROW_TEXT)
EVERYTHING = ("data", "model", "runs", "exports")


# Every command of the attack shares one HF_HOME in its scratch folder (none of the person's
# settings leak in) and, where its environment allows, is forked (forked_cli.py).
_HF_HOME: list[Path] = []


def start_commands(scratch: Path) -> None:
    _HF_HOME[:] = [scratch / ".hf"]
    forked_cli.start_server(_base_env())


def stop_commands() -> None:
    forked_cli.stop_server()


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCUSTOMS_") and k != "HF_TOKEN"}
    env.update({"COLUMNS": "100", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(_HF_HOME[0])})
    return env


def run_llmcustoms(cwd: Path, argv: list[str], env: dict[str, str] | None = None, timeout: int = 300,
                   stdin: str | None = None) -> subprocess.CompletedProcess:
    """`python -m llmcustoms ARGV` in `cwd` as a process of its own (its own .cache there)."""
    full = {**_base_env(), "LLMCUSTOMS_CACHE_DIR": str(cwd / ".cache"), **(env or {})}
    # surrogateescape: a case's stdin may stand for bytes that are not UTF-8 ("caf\udce9" is b"caf\xe9").
    return forked_cli.run(argv, full, cwd, timeout, stdin, errors="surrogateescape")


@dataclass(frozen=True)
class World:
    root: Path
    # Processes a case's preparation leaves running (a lock's holder): stopped when the case ends,
    # so none outlives it holding the attack's output pipe open.
    background: list[subprocess.Popen] = field(default_factory=list)

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

    def copy(self, source: str, target: str) -> str:
        shutil.copytree(self.root / source, self.root / target, symlinks=True)
        return target

    def cli(self, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """A command run while preparing a case (the world as the case needs it), not the attack itself."""
        return run_llmcustoms(self.root, list(argv), env=env, timeout=600)


@dataclass(frozen=True)
class Case:
    name: str
    problem: int | str  # 7: issue 32's seventh problem; "46.7": issue 46's
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
    # Puts back, after the command, what `prepare` did that would outlive the case (a folder made read-only).
    undo: Callable[[World], None] | None = field(default=None, repr=False)


TRAIN = ["--yes", "--quiet", "--max-steps", "1"]
TUNE_DEFAULT_NAME = ["tune", "data/rows.jsonl", "--model", "model", "--output-dir", "tunes", "--max-steps", "1",
                     "--eval-split", "0.2", "--trials", "1"]
TUNE = TUNE_DEFAULT_NAME[:6] + ["--study-name", "s", "--max-steps", "1", "--eval-split", "0.2"]


# ------------------------------------------------------------ what the cases prepare

def export(output: str) -> Callable[[World], list[str]]:
    return lambda w: ["export", "runs/done", "--output", output, "--overwrite"]


def export_replaced_whole(w: World) -> list[str]:
    adapter = w.path("exports/first/adapter_model.safetensors")
    leftovers = [p.name for p in w.path("exports").iterdir() if p.name.startswith(".")]
    return ([] if adapter.is_file() else ["the earlier export holds no adapter after --overwrite"]) + \
        ([f"left behind: {', '.join(leftovers)}"] if leftovers else [])


def interrupted_run(w: World, name: str = "cut") -> str:
    """A run stopped by SIGINT after step 1 of 2, with its checkpoint: what `resume` continues."""
    ran = w.cli("train", "data/rows.jsonl", "--model", "model", "--max-steps", "2", "--save-every", "1",
                "--eval-split", "0", "--output-dir", "runs", "--run-name", name, "--yes", "--quiet",
                env={"LLMCUSTOMS_FAULT_INJECT": "sigint@1"})
    assert ran.returncode == 130, (ran.stdout + ran.stderr)[-2000:]
    return f"runs/{name}"


def other_weights(w: World) -> None:
    """The model's weights replaced by others of the same shapes (a re-download of another revision)."""
    from safetensors.torch import load_file, save_file

    path = w.path("model/model.safetensors")
    tensors = load_file(str(path))
    save_file({k: v.flip(0).contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def holding_the_lock(w: World, run: str) -> None:
    """Another process owns `run` (through its real path), as a `resume` training it would."""
    from llmcustoms.runs import run_lock

    code = (f"import time; from llmcustoms.runs import run_lock\n"
            f"with run_lock.owning({str(w.path(run))!r}, 'training it'):\n    time.sleep(60)")
    w.background.append(subprocess.Popen([sys.executable, "-c", code], cwd=w.root, start_new_session=True,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    deadline = time.time() + 30
    while run_lock.holder(w.path(run)) is None and time.time() < deadline:
        time.sleep(0.2)


def damaged_model(w: World, change: Callable[[Path], None]) -> str:
    w.copy("model", "model-damaged")
    change(w.path("model-damaged"))
    return "model-damaged"


def cut_weights(model: Path) -> None:
    path = model / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def vocab_off(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 100}))


def no_tokenizer(model: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (model / name).unlink(missing_ok=True)


def unknown_architecture(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "nosucharch"}))


def config_cut(model: Path) -> None:
    text = (model / "config.json").read_text()
    (model / "config.json").write_text(text[: len(text) // 2])


def refusing_rows(w: World) -> str:
    rows = [{"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": "Yes."}]}
            for i in range(12)]
    rows[4]["messages"].insert(0, {"role": "system", "content": ROW_TEXT})
    w.write("data/chat.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    w.copy("model", "model-refusing")
    w.write("model-refusing/chat_template.jinja", REFUSING_TEMPLATE)
    return "model-refusing"


def damage_records(w: World, run: str) -> None:
    with w.path(f"{run}/metrics.jsonl").open("a") as metrics:
        metrics.write('5\nnull\n{"loss": 1.0}\n{"step": 1, "loss": "high"}\n')
    w.edit_json(f"{run}/status.json", lambda s: s.update(updated_at="yesterday", best_eval_loss="low"))


def tampered_store(w: World) -> list[str]:
    ran = w.cli("plan", "data/rows.jsonl", "--model", "model")
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-2000:]
    for ids in w.path(".cache").rglob("ids.bin"):
        data = bytearray(ids.read_bytes())
        data[:8], data[8:16] = data[8:16], data[:8]  # valid ids, in the wrong places
        ids.write_bytes(bytes(data))
    return ["plan", "data/rows.jsonl", "--model", "model"]


def killed_while_tokenizing(w: World) -> list[str]:
    w.cli("plan", "data/rows.jsonl", "--model", "model", env={"LLMCUSTOMS_FAULT_INJECT": "kill_tokenizing@1"})
    return ["plan", "data/rows.jsonl", "--model", "model"]


def no_temporary_store(w: World) -> list[str]:
    left = [p.name for p in w.path(".cache").rglob("*") if p.is_dir() and p.name.endswith(".tmp")]
    return [f"temporary stores left: {', '.join(left)}"] if left else []


def a_study_first(w: World, *extra: str, env: dict[str, str] | None = None) -> None:
    w.cli(*TUNE, "--trials", "1", *extra, env=env)


def distinct_trials(w: World) -> list[str]:
    """Two trials in the study, with different values: the second invocation did not draw the first's again."""
    import csv

    path = w.path("tunes/tune-s/trials.csv")
    rows = list(csv.DictReader(path.open())) if path.exists() else []
    values = {tuple(row[k] for k in ("lr", "lora_r", "alpha_ratio", "lora_dropout", "warmup_ratio")) for row in rows}
    return [] if len(rows) == 2 and len(values) == 2 else [f"trials.csv holds {len(rows)} trials, {len(values)} distinct"]


def edited_rows(w: World) -> None:
    lines = w.path("data/rows.jsonl").read_text().splitlines()
    row = json.loads(lines[0])
    row["output"] = row["output"] + " (edited)"
    w.write("data/rows.jsonl", "\n".join([json.dumps(row)] + lines[1:]) + "\n")


def long_model_folder(w: World) -> str:
    return w.copy("model", "tiny-llama-" + "x" * 220)


# ------------------------------------------------------------------------ the cases

CASES: list[Case] = [
    # 1. export --overwrite never removes what the tool did not make, nor the run it exports.
    Case("export over the run itself", 1, export("runs/done"), says="export never writes there", reduced=True),
    Case("export over the runs folder", 1, export("runs"), says="export never writes there", reduced=True),
    Case("export over the run's adapter", 1, export("runs/done/adapter"), says="export never writes there"),
    Case("export over the data folder", 1, export("data"), says="nothing was removed", reduced=True),
    Case("export over a regular file", 1, export("data/rows.jsonl"), says="is a file"),
    Case("export over a symlink to a sibling run", 1,
         lambda w: ["export", "runs/done", "--output", w.link("out-link", "runs/sibling"), "--overwrite"],
         says="is a symbolic link", keep=EVERYTHING + ("out-link",), reduced=True),
    Case("export over a folder of the user's", 1,
         lambda w: ["export", "runs/done", "--output", w.write("mine/notes.txt", "mine") and "mine", "--overwrite"],
         says="is not an export llmcustoms wrote", keep=EVERYTHING + ("mine",)),
    Case("export over an earlier export replaces it whole", 1, export("exports/first"), exits=(0,),
         keep=("data", "model", "runs"), check=export_replaced_whole, reduced=True),
    # 2. train --overwrite removes only a run directory the tool made.
    Case("train --overwrite over the data folder", 2,
         lambda w: ["train", "data/rows.jsonl", "--model", "model", "--output-dir", ".", "--run-name", "data",
                    "--overwrite", *TRAIN], says="holds the training data", reduced=True),
    Case("train --overwrite over a folder of the user's", 2,
         lambda w: ["train", "data/rows.jsonl", "--model", "model", "--output-dir", ".", "--run-name",
                    w.write("mine/notes.txt", "mine") and "mine", "--overwrite", *TRAIN],
         says="is not an llmcustoms run", keep=EVERYTHING + ("mine",)),
    Case("train --overwrite over a symlink to a sibling run", 2,
         lambda w: ["train", "data/rows.jsonl", "--model", "model", "--output-dir", "runs", "--run-name",
                    w.link("runs/link", "runs/sibling").split("/")[-1], "--overwrite", *TRAIN],
         says="is a symbolic link"),
    # 3. one owner per run, through a symlink too.
    Case("resume through a symlink while the run is owned", 3,
         lambda w: [holding_the_lock(w, interrupted_run(w)), "resume", w.link("cut-link", "runs/cut")][1:],
         says="right now", keep=EVERYTHING + ("cut-link",)),
    # 4-6. the tokenized-rows cache.
    Case("a tampered token store is rebuilt", 4, tampered_store, exits=(0,), says="did not match their checksum",
         reduced=True),
    Case("data edited while it is tokenized", 5, lambda w: ["plan", "data/rows.jsonl", "--model", "model"],
         env={"LLMCUSTOMS_FAULT_INJECT": "edit_data@1"}, says="changed while it was being tokenized",
         keep=("model", "runs")),
    Case("--cache-dir naming a file", 6,
         lambda w: ["plan", "data/rows.jsonl", "--model", "model", "--cache-dir", w.write("cachefile", "mine")],
         exits=(0,), says="not cached", never_says=("cached for the next run",), keep=EVERYTHING + ("cachefile",)),
    Case("a store left by a killed tokenizer is cleaned", 6, killed_while_tokenizing, exits=(0,),
         check=no_temporary_store),
    # 7. resume on other weights.
    Case("resume after the base model's weights were replaced", 7,
         lambda w: [interrupted_run(w), other_weights(w), "resume", "runs/cut"][2:4],
         says="has changed since the run started", keep=("data", "runs"), timeout=300),
    # 8-14. tune.
    Case("tune continued tries new values", 8, lambda w: [a_study_first(w), *TUNE, "--trials", "1"][1:],
         exits=(0,), check=distinct_trials, keep=("data", "model", "runs"), timeout=600),
    Case("tune after a killed trial counts it failed", 9,
         lambda w: [a_study_first(w, env={"LLMCUSTOMS_FAULT_INJECT": "sigkill@1"}), *TUNE, "--trials", "1"][1:],
         exits=(0,), says="1 failed", keep=("data", "model", "runs"), timeout=600),
    Case("tune on edited data starts a new study", 10,
         lambda w: [w.cli(*TUNE_DEFAULT_NAME), edited_rows(w), *TUNE_DEFAULT_NAME][2:],
         exits=(0,), says="a new study", keep=("model", "runs"), timeout=600),
    Case("tune stopped by SIGTERM", 11, lambda w: [*TUNE[:-4], "--max-steps", "2", "--eval-split", "0.2", "--trials", "2"],
         env={"LLMCUSTOMS_FAULT_INJECT": "sigterm@1"}, exits=(143,), says="interrupted", timeout=600),
    Case("tune never shows a storage password", 12,
         lambda w: [*TUNE, "--trials", "1", "--storage", f"postgresql://tuner:{PASSWORD}@127.0.0.1:9/study"],
         says="Cannot open the study storage", reduced=True),
    Case("tune on a full disk", 13, lambda w: [*TUNE, "--trials", "3"], env={"LLMCUSTOMS_FAULT_INJECT": "diskfull@2"},
         says="disk is full", timeout=600),
    Case("tune with a study name that climbs out", 14,
         lambda w: [*TUNE[:6], "--study-name", "../../x", "--trials", "1"], says="is not a plain name", reduced=True),
    # 15-16. damaged model folders.
    Case("train on a model whose weights are cut short", 15,
         lambda w: ["train", "data/rows.jsonl", "--model", damaged_model(w, cut_weights), *TRAIN],
         says="damaged or cut short", reduced=True),
    Case("train on a config whose vocabulary is not the weights'", 15,
         lambda w: ["train", "data/rows.jsonl", "--model", damaged_model(w, vocab_off), *TRAIN], says="vocab_size"),
    Case("plan on a model folder without a tokenizer", 16,
         lambda w: ["plan", "data/rows.jsonl", "--model", damaged_model(w, no_tokenizer)], says="no tokenizer",
         never_says=("offline mode",)),
    Case("plan on an architecture transformers does not know", 16,
         lambda w: ["plan", "data/rows.jsonl", "--model", damaged_model(w, unknown_architecture)],
         says="nosucharch", never_says=("offline mode",)),
    Case("train on a config.json that is not JSON", 16,
         lambda w: ["train", "data/rows.jsonl", "--model", damaged_model(w, config_cut), *TRAIN],
         says="not valid JSON", never_says=("offline mode",)),
    # 17. templates that refuse.
    Case("a template refusing a row never shows it", 17,
         lambda w: ["plan", "data/chat.jsonl", "--model", refusing_rows(w)], says="refused row 5", reduced=True),
    Case("chat --system with a template that refuses it", 17,
         lambda w: [w.write("runs/done/adapter/chat_template.jinja", REFUSING_TEMPLATE) and "chat", "runs/done",
                    "--system", ROW_TEXT], stdin="hello\n/exit\n", says="refused a system message",
         keep=("data", "model", "runs/sibling")),
    # 18. damaged run records.
    Case("report on damaged metrics and status", 18,
         lambda w: [damage_records(w, "runs/done"), "report", "runs/done"][1:], exits=(0,), says="damaged"),
    Case("runs lists a run whose status is not JSON", 18,
         lambda w: [w.write("runs/sibling/status.json", "{not json"), "runs", "--output-dir", "runs"][1:],
         exits=(0,), says="damaged"),
    Case("resume past damaged metrics lines", 18,
         lambda w: [damage_records(w, interrupted_run(w)), "resume", "runs/cut"][1:], exits=(0,),
         keep=("data", "model", "runs/done")),
    # 19. a closed terminal.
    Case("runs shows a run whose owner is gone as stopped", 19,
         lambda w: [w.edit_json("runs/done/status.json", lambda s: s.update(status="running")), "runs",
                    "--output-dir", "runs"][1:], exits=(0,), says="stopped"),
    # 20-21. numbers and files.
    Case("plan with --epochs 1e308", 20, lambda w: ["plan", "data/rows.jsonl", "--model", "model", "--epochs", "1e308"],
         says="--epochs", reduced=True),
    Case("generate with a seed of -1", 20, lambda w: ["generate", "runs/done", "hello", "--seed", "-1"], says="--seed"),
    Case("setup writing into a file", 21,
         lambda w: ["setup", "--data", "data/rows.jsonl", "--env-file", w.write("afile", "mine") + "/x.env"],
         says="Cannot write the settings file", keep=EVERYTHING + ("afile",)),
    # 22. a long model folder name.
    Case("train on a model folder with a long name", 22,
         lambda w: ["train", "data/rows.jsonl", "--model", long_model_folder(w), "--output-dir", "runs2", *TRAIN],
         exits=(0,), never_says=("--run-name",)),
]
