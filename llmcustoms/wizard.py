"""`llmcustoms setup`: an interactive wizard that writes the env file.

Every question has a default, so pressing Enter throughout gives a sensible
setup, and it works with piped input (`yes '' | llmcustoms setup ...`). The
file is written once, at the end, through a temporary file and a rename, so
Ctrl-C at any prompt leaves no half-written file. Variables already in the
file that the wizard does not set (HF_TOKEN, say) are kept.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from rich.prompt import Prompt
from rich.table import Table

from llmcustoms.console import console, escape
from llmcustoms.data import read_dataset
from llmcustoms.errors import ConfigError, DataError
from llmcustoms.hardware import GIB, Hardware
from llmcustoms.memory import MemoryOptimizer
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


def ask(question: str, default: str | None = None, choices: list[str] | None = None) -> str:
    """A prompt whose answer is the default on Enter, or when input has run out."""
    try:
        answer = Prompt.ask(question, default=default, choices=choices, console=console, show_choices=bool(choices))
    except EOFError:
        answer = default
    answer = (answer or "").strip()
    if not sys.stdin.isatty():
        console.print(answer)  # piped input is not echoed; keep the transcript readable
    return answer


def ask_data(default: str | None) -> tuple[str, Any]:
    for _ in range(MAX_ATTEMPTS):
        path = ask("Training data file (.jsonl, .json, .csv, .parquet)", default)
        if not path:
            console.print("[yellow]Please give the path of your data file.[/]")
            continue
        try:
            dataset = read_dataset(path)
        except DataError as error:
            console.print(f"[red]{escape(error.message)}[/]" + (f"\n{escape(error.hint)}" if error.hint else ""))
            default = None
            continue
        stats = estimated_stats(dataset.examples, 0, dataset.format)
        console.print(f"  [green]ok[/]: {escape(dataset.format_description)}, {len(dataset.examples):,} rows, "
                      f"about {stats.percentile(50)} tokens per row (95% under {stats.percentile(95)})")
        return path, (dataset, stats)
    raise ConfigError("No usable data file was given.", "Run `llmcustoms setup --data PATH`.")


def fitting_models(hardware: Hardware, seq_len: int) -> list[tuple[str, str]]:
    """(hub id, what it needs) for every catalog model that fits this machine."""
    fits = []
    for family in load_families().values():
        for spec in family.models:
            memory = MemoryOptimizer(spec, hardware.has_gpu, hardware.memory_budget_bytes)
            for method in ("lora", "qlora"):
                estimate = memory.estimate(method, 1, seq_len, hardware.mixed_precision, True)
                if estimate.fits:
                    fits.append((spec.hub_id, f"{spec.params / 1e9:.1f}B params, {method}, "
                                              f"about {estimate.total_bytes / GIB:.1f} GiB"))
                    break
    return sorted(fits, key=lambda item: float(item[1].split("B")[0]))


def run_wizard(hardware: Hardware, env_file: Path, data: str | None) -> list[str]:
    """Ask, then write `env_file`. Returns the train command to run next."""
    console.rule("llmcustoms setup")
    where = (f"{hardware.gpus[0].name}, {hardware.gpus[0].total_bytes / GIB:.0f} GiB" if hardware.has_gpu
             else f"no GPU; {hardware.cpu_cores} CPU cores, {hardware.ram_bytes / GIB:.0f} GiB RAM")
    console.print(f"This machine: {escape(where)}")
    if not hardware.has_gpu:
        console.print("[yellow]Without a GPU, training works but is slow: expect hours for real models.[/]")

    data_path, (dataset, stats) = ask_data(data)

    table = Table(show_header=False, box=None)
    for name in builtin_preset_names():
        table.add_row(f"[bold]{name}", GOALS.get(name, load_preset(name).description))
    console.print(table)
    preset_name = ask("Goal", "quality", choices=builtin_preset_names())
    preset = load_preset(preset_name)

    seq_len = min(preset.max_seq_len, max(64, -(-stats.percentile(99) // 64) * 64))
    models = fitting_models(hardware, seq_len)
    candidates = [m for m in preset.models if m in {hub for hub, _ in models}]
    optimizer = ParameterOptimizer(hardware, preset)
    from llmcustoms.modeling import choice_from_spec
    from llmcustoms.presets import find_model_spec

    families = load_families()
    choices = [choice_from_spec(find_model_spec(m, families), families, "optimizer") for m in (candidates or preset.models)]
    try:
        suggested = optimizer.choose_model(choices, stats, {})[0].name
    except ConfigError:
        suggested = models[0][0] if models else preset.models[-1]
    console.print(f"Models that fit this machine ({seq_len}-token sequences):")
    for index, (hub_id, need) in enumerate(models, start=1):
        console.print(f"  {index:2}. {escape(hub_id)} [dim]({escape(need)})[/]")
    if not models:
        console.print("  [red]none of the preset models fits; llmcustoms will say why when you run `plan`[/]")
    answer = ask("Model (number, hub id or local directory)", suggested)
    model = models[int(answer) - 1][0] if answer.isdigit() and 1 <= int(answer) <= len(models) else answer

    output_dir = ask("Where to put runs", "runs")
    save_every = ""
    for _ in range(MAX_ATTEMPTS):
        save_every = ask("Checkpoint every how many steps (Enter: automatic, about 10 per run)", "auto")
        if save_every == "auto" or (save_every.isdigit() and int(save_every) > 0):
            break
        console.print("[yellow]A whole number above 0, or auto.[/]")
    else:
        save_every = "auto"

    values = {f"{PREFIX}PRESET": preset_name, f"{PREFIX}MODEL": model, f"{PREFIX}OUTPUT_DIR": output_dir}
    if save_every != "auto":
        values[f"{PREFIX}SAVE_EVERY"] = save_every
    if env_file.exists():
        overwrite = ask(f"{env_file} exists. Replace its llmcustoms settings? (other variables are kept)", "y",
                        choices=["y", "n"])
        if overwrite != "y":
            console.print("Nothing written.")
            return []
    write_env(env_file, values)
    console.print(f"Wrote {escape(str(env_file))}.")
    command = ["llmcustoms", "train", data_path]
    if env_file.resolve() != Path(".env").resolve():
        command += ["--env-file", str(env_file)]
    return command


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
