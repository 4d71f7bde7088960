"""`llmcustoms setup`: an interactive wizard that writes the env file.

Every question has a default, so pressing Enter throughout gives a sensible
setup, and it works with piped input (`yes '' | llmcustoms setup ...`). The
file is written once, at the end, through a temporary file and a rename, so
Ctrl-C at any prompt leaves no half-written file. Variables already in the
file that the wizard does not set (HF_TOKEN, say) are kept.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llmcustoms import dialog
from llmcustoms.data import read_dataset
from llmcustoms.errors import ConfigError, DataError
from llmcustoms.fitting import fitting_models
from llmcustoms.hardware import Hardware
from llmcustoms.planning import ParameterOptimizer
from llmcustoms.preparation import estimated_stats
from llmcustoms.presets import builtin_preset_names, load_families, load_preset
from llmcustoms.settings import PREFIX, read_env_file

GOALS = {
    "highspeed": "a quick first result: small adapter, short sequences, one or two epochs",
    "quality": "a good adapter in reasonable time (recommended)",
    "bestaccuracy": "the best this machine can do: bigger adapter, longer sequences, early stopping",
}
MAX_ATTEMPTS = 3


def ask_data(default: str | None) -> tuple[str, Any]:
    for _ in range(MAX_ATTEMPTS):
        path = dialog.ask("Training data file (.jsonl, .json, .csv, .parquet)", default)
        if not path:
            dialog.ask_again("Please give the path of your data file.")
            continue
        try:
            dataset = read_dataset(path)
        except DataError as error:
            dialog.show_data_problem(error.message, error.hint)
            default = None
            continue
        stats = estimated_stats(dataset, None, 0)
        dialog.show_data_checked(dataset.format_description, dataset.rows, stats.percentile(50),
                                 stats.percentile(95))
        return path, (dataset, stats)
    raise ConfigError("No usable data file was given.", "Run `llmcustoms setup --data PATH`.")


def run_wizard(hardware: Hardware, env_file: Path, data: str | None) -> list[str]:
    """Ask, then write `env_file`. Returns the train command to run next."""
    dialog.show_setup_start(hardware)
    data_path, (dataset, stats) = ask_data(data)

    dialog.show_goals([(name, GOALS.get(name, load_preset(name).description)) for name in builtin_preset_names()])
    preset_name = dialog.ask("Goal", "quality", choices=builtin_preset_names())
    preset = load_preset(preset_name)

    seq_len = min(preset.max_seq_len, max(64, -(-stats.percentile(99) // 64) * 64))
    model = ask_model(hardware, preset, stats, seq_len)
    output_dir = dialog.ask("Where to put runs", "runs")
    save_every = ask_save_every()

    # The data too, so `llmcustoms train`, `plan` and `tune` need no argument.
    values = {f"{PREFIX}DATA": data_path, f"{PREFIX}PRESET": preset_name, f"{PREFIX}MODEL": model,
              f"{PREFIX}OUTPUT_DIR": output_dir}
    if save_every != "auto":
        values[f"{PREFIX}SAVE_EVERY"] = save_every
    if env_file.exists():
        overwrite = dialog.ask(f"{env_file} exists. Replace its llmcustoms settings? (other variables are kept)", "y",
                               choices=["y", "n"])
        if overwrite != "y":
            dialog.say("Nothing written.")
            return []
    write_env(env_file, values)
    dialog.say(f"Wrote {env_file}.")
    command = ["llmcustoms", "train"]
    if env_file.resolve() != Path(".env").resolve():
        command += ["--env-file", str(env_file)]
    return command


def ask_model(hardware: Hardware, preset: Any, stats: Any, seq_len: int) -> str:
    """Offer the catalog models that fit, suggesting the one `train` would choose."""
    from llmcustoms.modeling import choice_from_spec
    from llmcustoms.presets import find_model_spec

    families = load_families()
    models = fitting_models(hardware, families, seq_len)
    preferred = preset.model_candidates(hardware.has_gpu)
    candidates = [m for m in preferred if m in {choice.hub_id for choice in models}]
    choices = [choice_from_spec(find_model_spec(m, families), families, "optimizer") for m in (candidates or preferred)]
    try:
        suggested = ParameterOptimizer(hardware, preset).choose_model(choices, stats, {})[0].name
    except ConfigError:
        suggested = models[0].hub_id if models else preferred[-1]
    dialog.show_model_choices(models, seq_len)
    answer = dialog.ask("Model (number, hub id or local directory)", suggested)
    return models[int(answer) - 1].hub_id if answer.isdigit() and 1 <= int(answer) <= len(models) else answer


def ask_save_every() -> str:
    """A whole number of steps, or "auto"."""
    for _ in range(MAX_ATTEMPTS):
        save_every = dialog.ask("Checkpoint every how many steps (Enter: automatic, about 10 per run)", "auto")
        if save_every == "auto" or (save_every.isdigit() and int(save_every) > 0):
            return save_every
        dialog.ask_again("A whole number above 0, or auto.")
    return "auto"


def write_env(path: Path, values: dict[str, str]) -> None:
    """Merge `values` into the env file atomically: other variables stay."""
    kept = {}
    if path.exists():
        kept = {k: v for k, (v, _) in read_env_file(path).items() if k not in values and not k.startswith(PREFIX)}
    lines = ["# Written by `llmcustoms setup`. See .env.example for every variable.", ""]
    lines += [f"{k}={_quote(v)}" for k, v in values.items()]
    if kept:
        lines += ["", "# Kept from the previous file"] + [f"{k}={_quote(v)}" for k, v in kept.items()]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _quote(value: str) -> str:
    return f'"{value}"' if any(c in value for c in " #'\"") else value
