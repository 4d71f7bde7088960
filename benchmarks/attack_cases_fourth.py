"""The cases of issue 46 (the fourth attack) for benchmarks/attack.py: `problem` "46.N" is the
issue's Nth problem. The world and the Case fields are attack_cases.py's.
"""

from __future__ import annotations

import io
import json
import subprocess
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

def cut_adapter(w: World, run: str = "runs/done") -> str:
    """The run's adapter weights cut to half, as a full disk or a copy stopped midway leaves them."""
    path = w.path(f"{run}/adapter/adapter_model.safetensors")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return run


def adapter_config_off(change: dict) -> Callable[[World], str]:
    """adapter_config.json edited so that it no longer says what the weights are."""
    def edit(w: World) -> str:
        w.edit_json("runs/done/adapter/adapter_config.json", lambda config: config.update(change))
        return "runs/done"
    return edit


def plan_off(change: dict, run: str = "runs/done") -> Callable[[World], str]:
    """plan.json edited by hand: a field of the wrong type or out of range."""
    def edit(w: World) -> str:
        w.edit_json(f"{run}/plan.json", lambda plan: plan.update(change))
        return run
    return edit


def nothing_at(path: str) -> Callable[[World], list[str]]:
    return lambda w: [f"{path} was written"] if w.path(path).exists() else []


def read_only(w: World, run: str = "runs/done") -> str:
    """`chmod -R a-w` on the run. Root writes through that, so as root the run is also made
    immutable (chattr +i, which stops root too); `writable_again` undoes both."""
    import os
    import stat

    for path in [w.path(run), *w.path(run).rglob("*")]:
        path.chmod(stat.S_IMODE(path.stat().st_mode) & ~0o222)
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-R", "+i", str(w.path(run))], check=True, capture_output=True)
    return run


def writable_again(w: World, run: str = "runs/done") -> None:
    import os

    if os.geteuid() == 0:
        subprocess.run(["chattr", "-R", "-i", str(w.path(run))], capture_output=True)
    for path in [w.path(run), *w.path(run).rglob("*")]:
        path.chmod(path.stat().st_mode | 0o200)


# ------------------------------------------------ items 5, 10, 12, 16: exports and GGUF files

# The export still writing in the background of a case (46.5), by the case's world.
_BACKGROUND: dict[str, subprocess.Popen] = {}


def export_in_background(output: str) -> Callable[[World], list[str]]:
    """An export of runs/done to `output` that is still writing (slow_export holds it 20 s once its
    partial folder is started), and the command of a second export to the same folder."""
    def prepare(w: World) -> list[str]:
        import os
        import sys
        import time

        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCUSTOMS_")}
        env.update({"HF_HUB_OFFLINE": "1", "HF_HOME": str(w.path(".hf")), "LLMCUSTOMS_CACHE_DIR": str(w.path(".cache")),
                    "LLMCUSTOMS_FAULT_INJECT": "slow_export@20"})
        first = subprocess.Popen([sys.executable, "-m", "llmcustoms", "export", "runs/done", "--output", output],
                                 cwd=w.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _BACKGROUND[str(w.root)] = first
        partial = w.path(output).parent / f".{w.path(output).name}.partial-export"
        deadline = time.time() + 120
        while not partial.exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        return ["export", "runs/done", "--output", output]
    return prepare


def first_export_whole(output: str) -> Callable[[World], list[str]]:
    """The background export finished, whole, and nothing of the two is left beside it."""
    def check(w: World) -> list[str]:
        first = _BACKGROUND.pop(str(w.root))
        said, _ = first.communicate(timeout=300)
        problems = [] if first.returncode == 0 else [f"the first export ended with exit {first.returncode}"]
        problems += ["the first export showed a traceback"] if "Traceback" in said else []
        folder = w.path(output)
        problems += [f"{output}/{name} is missing" for name in ("adapter_model.safetensors", "README.md",
                                                                 ".llmcustoms-export") if not (folder / name).is_file()]
        left = [p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}.")]
        return problems + ([f"left beside it: {', '.join(left)}"] if left else [])
    return check


def nothing_beside(folder: str) -> Callable[[World], list[str]]:
    """No partial export, old export or lock is left in `folder`."""
    def check(w: World) -> list[str]:
        left = [p.name for p in w.path(folder).iterdir() if p.name.startswith(".")]
        return [f"left in {folder}: {', '.join(left)}"] if left else []
    return check


def gguf_of_done(w: World) -> str:
    """runs/done exported to GGUF (f16, unchecked: the cases check what is done with it)."""
    ran = w.cli("export", "runs/done", "--format", "gguf", "--quant", "f16", "--no-verify", "--output", "exports/g")
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-2000:]
    return "exports/g/model.gguf"


def rewritten_gguf(w: World, source: str, target: str, architecture: str | None = None,
                   tokens: dict[str, str] | None = None) -> str:
    """A copy of the GGUF file `source` whose general.architecture (and the keys named after it) says
    `architecture`, or whose vocabulary has `tokens` renamed: a file edited or mislabelled by hand."""
    import gguf

    reader = gguf.GGUFReader(str(w.path(source)))
    old = reader.get_field("general.architecture").contents()
    new = architecture or old
    w.path(target).parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(w.path(target)), new)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind, value = field.types[0], field.contents()
        if field.name == "tokenizer.ggml.tokens" and tokens:
            value = [tokens.get(token, token) for token in value]
        name = new + field.name[len(old):] if field.name.startswith(old + ".") else field.name
        writer.add_key_value(name, value, kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return target


def mislabelled_gguf(architecture: str) -> Callable[[World], list[str]]:
    """`train` on runs/done's GGUF (a Llama's tensors) relabelled as `architecture`."""
    return lambda w: ["train", "data/rows.jsonl", "--model",
                      rewritten_gguf(w, gguf_of_done(w), "downloads/m.gguf", architecture), *TRAIN]


def trained_on_a_gguf_without_endoftext(w: World) -> list[str]:
    """A run trained on a GGUF whose vocabulary has no <|endoftext|> (transformers' GGUF reader then
    adds one past the model's rows), and the command exporting it to GGUF again."""
    model = rewritten_gguf(w, gguf_of_done(w), "downloads/plain.gguf", tokens={"<|endoftext|>": "<|notext|>"})
    ran = w.cli("train", "data/rows.jsonl", "--model", model, "--max-steps", "1", "--eval-split", "0",
                "--output-dir", "runs", "--run-name", "from-gguf", "--yes", "--quiet")
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-2000:]
    return ["export", "runs/from-gguf", "--format", "gguf", "--quant", "f16", "--output", "exports/again"]


def one_token_per_row(w: World) -> list[str]:
    """The GGUF written again holds one token per embedding row, as llama.cpp needs."""
    from llmcustoms.models.gguf_reading import metadata

    found = metadata(w.path("exports/again/model.gguf"))
    tokens, rows = found.get("tokenizer.ggml.tokens"), found.get(f"{found.get('general.architecture')}.vocab_size")
    return [] if tokens == rows else [f"the GGUF holds {tokens} tokens for {rows} embedding rows"]



# ------------------------------------------------ items 11, 15, 17, 18, 19: terminals, arguments, advice

# Bytes of a Latin-1 terminal: b"caf\xe9" reaches Python (and the harness's stdin) as "caf\udce9".
LATIN1_CAFE = "caf\udce9"
# A Hugging Face token pasted as --model: the output must never repeat it.
HUB_TOKEN = "hf_AttackTokenQ7dL2mX9pR4sT8vW3yZ6b"

# Put in the CLI's own process before it starts (PYTHONPATH=hooks: Python imports sitecustomize.py
# first): its standard output on /dev/full (`> /dev/full`), or its working directory deleted
# under it (`mkdir x && cd x && rmdir ../x`). The harness itself needs both to run it.
PROCESS_HOOK = """import os
if os.environ.get("ATTACK_HOOK") == "full-stdout":
    os.dup2(os.open("/dev/full", os.O_WRONLY), 1)
elif os.environ.get("ATTACK_HOOK") == "cwd-gone":
    os.mkdir("gone")
    os.chdir("gone")
    os.rmdir(os.path.join("..", "gone"))
"""


def hooked(argv: list[str]) -> Callable[[World], list[str]]:
    """`argv`, run with PROCESS_HOOK in place (the case's env chooses which part)."""
    return lambda w: [w.write("hooks/sitecustomize.py", PROCESS_HOOK) and argv[0], *argv[1:]]


def fifo_env_file(w: World) -> list[str]:
    import os

    os.mkfifo(w.path("settings.fifo"))
    return ["setup", "--data", "data/rows.jsonl", "--env-file", "settings.fifo"]


def run_being_rewritten(w: World) -> list[str]:
    """`train --overwrite runs/done` under way: it holds the run, and has deleted its adapter's weights."""
    from attack_cases import holding_the_lock

    holding_the_lock(w, "runs/done")
    w.path("runs/done/adapter/adapter_model.safetensors").unlink()
    return ["generate", "runs/done", "hi"]


def control_character_row(w: World) -> list[str]:
    rows = w.path("data/rows.jsonl").read_text()
    w.write("data/tabbed.jsonl", rows + '{"instruction": "a\tb", "output": "c"}\n')
    return ["plan", "data/tabbed.jsonl", "--model", "model", "--strict"]


# ------------------------------------------------ items 4, 6, 13, 14: held-out rows, markup, storage, presets

def second_run_into(w: World, output: str) -> list[str]:
    """A finished run in `output`, and the command for a second one beside it (its warnings quote the folder)."""
    w.cli("train", "data/rows.jsonl", "--model", "model", "--output-dir", output, "--run-name", "first", *TRAIN)
    return ["train", "data/rows.jsonl", "--model", "model", "--output-dir", output, "--run-name", "second", *TRAIN]


def trained_rows_not_held_out(w: World) -> list[str]:
    """train.log and `report` of the run trained with --eval-data naming its own data."""
    problems = [] if "training rows too" in w.path("runs2/ev/train.log").read_text() else ["train.log does not say it"]
    said = " ".join(w.cli("report", "runs2/ev").stdout.replace("│", " ").split())
    return problems + ([] if "not held out" in said else ["report calls the rows held out"])


def preset_with_slips(w: World) -> str:
    """A copy of the default preset whose model list holds a number and a mapping (YAML slips)."""
    from llmcustoms.planning.presets import presets_dir

    text = (presets_dir() / "quality.yaml").read_text().replace("models:\n", "models:\n  - 42\n  - {name: x}\n", 1)
    return w.write("my-preset.yaml", text.replace("name: quality", "name: mine", 1))


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
    # Issue 46, 7: an adapter whose files do not load is one message naming them, and what to do.
    Case("export a run whose adapter weights are cut short", "46.7",
         lambda w: ["export", cut_adapter(w), "--output", "x"], says="the run's adapter is damaged",
         check=nothing_at("x"), reduced=True),
    Case("generate on a run whose adapter weights are cut short", "46.7",
         lambda w: ["generate", cut_adapter(w), "hi"], says="--checkpoint latest"),
    Case("chat on a run whose adapter weights are cut short", "46.7",
         lambda w: ["chat", cut_adapter(w)], stdin="hi\n/exit\n", says="the run's adapter is damaged"),
    Case("generate with an adapter_config of another rank", "46.7",
         lambda w: ["generate", adapter_config_off({"r": 8})(w), "hi"], says="adapter_config.json says rank 8"),
    Case("generate with an adapter_config targeting fewer modules", "46.7",
         lambda w: ["generate", adapter_config_off({"target_modules": ["q_proj", "v_proj"]})(w), "hi"],
         says="the run's adapter is damaged"),
    # Issue 46, 8: a plan.json edited by hand or cut short names the field, and the run is still listed.
    Case("export a run whose plan.json has lr as text", "46.8",
         lambda w: ["export", plan_off({"lr": "5e-4"})(w), "--output", "x"], says='damaged: "lr" is the text',
         check=nothing_at("x")),
    Case("export a run whose plan.json has a list for total_steps", "46.8",
         lambda w: ["export", plan_off({"total_steps": [2]})(w), "--output", "x"], says='"total_steps" is a list',
         check=nothing_at("x")),
    Case("resume a run whose plan.json has micro_batch_size 0", "46.8",
         lambda w: ["resume", plan_off({"micro_batch_size": 0})(w), "--max-steps", "4"],
         says='"micro_batch_size" is 0', reduced=True),
    Case("runs lists a run whose plan.json is cut short", "46.8",
         lambda w: [w.write("runs/sibling/plan.json", w.path("runs/sibling/plan.json").read_text()[:300]), "runs",
                    "--output-dir", "runs"][1:], exits=(0,), says="damaged", reduced=True),
    # Issue 46, 9: a read-only run folder: the commands that write it say so (report, generate, export read it).
    Case("report --plot on a read-only run", "46.9", lambda w: ["report", read_only(w), "--plot"],
         says="cannot be written", undo=writable_again),
    Case("resume --max-steps on a read-only run", "46.9", lambda w: ["resume", read_only(w), "--max-steps", "4"],
         says="cannot be written", undo=writable_again),
    # --- items 5, 10, 12, 16
    # Issue 46, 5: a second export to the same folder is refused; the first finishes whole.
    Case("two exports to one folder at once", "46.5", export_in_background("exports/new"),
         says="another export is writing", keep=("data", "model", "runs", "exports/first"),
         check=first_export_whole("exports/new")),
    # Issue 46, 10: a disk that fills after the space check: one message, the earlier export as it was.
    Case("a GGUF export over an earlier one on a disk that fills up", "46.10",
         lambda w: ["export", "runs/done", "--format", "gguf", "--quant", "f16", "--no-verify", "--output",
                    "exports/first", "--overwrite"],
         env={"LLMCUSTOMS_FAULT_INJECT": "diskfull_export@1"}, says="disk is full", check=nothing_beside("exports")),
    # Issue 46, 12: a GGUF whose general.architecture is not its tensors' is one clear refusal.
    Case("train on a Llama GGUF labelled qwen3", "46.12", mislabelled_gguf("qwen3"),
         says="says its architecture is qwen3", never_says=("ignore_mismatched_sizes",)),
    Case("train on a Llama GGUF labelled qwen2", "46.12", mislabelled_gguf("qwen2"),
         says="says its architecture is qwen2"),
    # Issue 46, 16: GGUF in, GGUF out: the token transformers' reader adds past the rows is left out.
    Case("export to GGUF a run trained on a GGUF", "46.16", trained_on_a_gguf_without_endoftext, exits=(0,),
         says="Exported a GGUF model", keep=("data", "model", "runs/done", "runs/sibling", "exports/first", "exports/g"),
         reduced=True, timeout=600, check=one_token_per_row),
    # --- items 11, 15, 17, 18, 19
    # Issue 46, 11: text that is not UTF-8 (a Latin-1 terminal) is said, never a traceback.
    Case("generate with a prompt that is not UTF-8", "46.11", lambda w: ["generate", "runs/done", LATIN1_CAFE],
         says="the prompt is not UTF-8 text", reduced=True),
    Case("chat typed in a Latin-1 terminal", "46.11", lambda w: ["chat", "runs/done", "--max-new-tokens", "2"],
         stdin=f"{LATIN1_CAFE}\n/exit\n", exits=(0,), says="is not UTF-8 text, so it was not sent"),
    # Issue 46, 15: output that cannot be written, a working directory deleted: one message, exit 2.
    Case("plan with its output on a full device", "46.15", hooked(["plan", "data/rows.jsonl", "--model", "model"]),
         env={"PYTHONPATH": "hooks", "ATTACK_HOOK": "full-stdout"}, says="Cannot write the output", reduced=True),
    Case("runs with its output on a full device", "46.15", hooked(["runs", "--output-dir", "runs"]),
         env={"PYTHONPATH": "hooks", "ATTACK_HOOK": "full-stdout", "PYTHONUNBUFFERED": ""},
         says="the disk (or device) is full"),
    Case("runs in a current directory that was deleted", "46.15", hooked(["runs"]),
         env={"PYTHONPATH": "hooks", "ATTACK_HOOK": "cwd-gone"}, says="current directory no longer exists",
         reduced=True),
    # Issue 46, 17: an env file that is a named pipe (setup waited forever), runs under a file.
    Case("setup writing into a named pipe", "46.17", fifo_env_file, stdin="\n\nmodel\n\n\ny\n",
         says="is a named pipe", timeout=120, reduced=True),
    Case("train with an output directory that is a file", "46.17",
         lambda w: ["train", "data/rows.jsonl", "--model", "model", "--output-dir", "data/rows.jsonl",
                    "--run-name", "r", *TRAIN], says="data/rows.jsonl is a file, not a folder",
         never_says=("Cannot lock",)),
    Case("tune with an output directory that is a file", "46.17",
         lambda w: ["tune", "data/rows.jsonl", "--model", "model", "--output-dir", "data/rows.jsonl", "--trials", "1",
                    "--max-steps", "1"], says="is a file, not a folder"),
    # Issue 46, 18: a token pasted as --model is never repeated.
    Case("plan with a Hub token as --model", "46.18",
         lambda w: ["plan", "data/rows.jsonl", "--model", HUB_TOKEN], says="looks like an access token",
         never_says=(HUB_TOKEN,), reduced=True),
    Case("train with a Hub token inside a model id", "46.18",
         lambda w: ["train", "data/rows.jsonl", "--model", f"org/{HUB_TOKEN}", *TRAIN], says="hf_***",
         never_says=(HUB_TOKEN, HUB_TOKEN[3:])),
    # Issue 46, 19: advice that fits.
    Case("generate while train --overwrite rewrites the run", "46.19", run_being_rewritten, says="right now",
         never_says=("Convert it",), keep=("data", "model", "runs/sibling"), reduced=True),
    Case("a JSON error names its column once", "46.19", control_character_row,
         says="Invalid control character at column", never_says=("at at column",)),
    Case("tune on a database server shows no experimental warning", "46.19",
         lambda w: [*TUNE, "--trials", "1", "--storage", "postgresql://tuner@127.0.0.1:9/study"],
         says="Cannot open the study storage", never_says=("ExperimentalWarning",)),
    # --- items 4, 6, 13, 14
    Case("a second train into an output folder named o[/]", "46.6", lambda w: second_run_into(w, "o[/]"),
         exits=(0,), never_says=("MarkupError",), reduced=True, timeout=600),
    Case("report --plot on a run in a folder named o[/]", "46.6",
         lambda w: ["report", w.copy("runs/done", "o[/]/done"), "--plot"], exits=(0,), says="loss.png",
         never_says=("MarkupError",)),
    Case("export to out[/]x", "46.6", lambda w: ["export", "runs/done", "--output", "out[/]x"], exits=(0,),
         says="out[/]x", never_says=("MarkupError",), reduced=True),
    Case("setup given a data file named [/]x.json", "46.6", lambda w: ["setup", "--env-file", "x.env"],
         stdin="[/]x.json\n", says="Data file not found: [/]x.json", never_says=("MarkupError",)),
    Case("train with --eval-data naming the training file", "46.4",
         lambda w: ["train", "data/rows.jsonl", "--model", "model", "--eval-data", "data/rows.jsonl", "--output-dir",
                    "runs2", "--run-name", "ev", *TRAIN], exits=(0,), says="all 48 evaluation rows are training rows too",
         check=trained_rows_not_held_out),
    Case("tune --storage journal: in a folder that does not exist", "46.13",
         lambda w: [*TUNE, "--trials", "1", "--storage", "journal:no-such-folder/study.log"], says="does not exist"),
    Case("a preset whose models list holds a number and a mapping", "46.14",
         lambda w: ["plan", "data/rows.jsonl", "--preset", preset_with_slips(w)], says="models item 1 is a number"),
]
