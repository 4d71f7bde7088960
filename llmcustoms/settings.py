"""Settings from `.env` and `LLMCUSTOMS_*` environment variables.

Precedence, for every value: flag > environment > preset > default. The
environment is the process environment, then the env file (`./.env`, or
`--env-file PATH`): a variable set in the shell wins over the file. Every
variable is documented in `.env.example`; `SETTINGS` below is the list.

Other variables in the file (HF_TOKEN, HF_HOME, ...) are exported to this
process for the libraries that read them. HF_TOKEN is never printed, logged
or written anywhere by llmcustoms.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from llmcustoms.errors import ConfigError

PREFIX = "LLMCUSTOMS_"
# Variables with the prefix that are not settings: a testing aid, the
# tokenization cache's place, and what the launcher tells its processes.
NOT_SETTINGS = ("LLMCUSTOMS_FAULT_INJECT", "LLMCUSTOMS_CACHE_DIR", "LLMCUSTOMS_RESTARTS_ON_REQUEST")
SECRET_NAMES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY")


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.strip() not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return text.strip()
    return parse


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("expected a whole number of at least 1")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("expected a whole number of at least 0")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise ValueError("expected a number from 0 up to (not including) 1")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise ValueError("expected a number above 0")
    return value


@dataclass(frozen=True)
class Setting:
    name: str  # without the prefix
    target: str  # a plan override name, or model / preset / output_dir / report_to
    parse: Callable[[str], Any]
    help: str


SETTINGS = (
    Setting("MODEL", "model", str, "Hub id or local directory of the model (like --model)"),
    Setting("PRESET", "preset", str, "highspeed, quality, bestaccuracy or a preset file (like --preset)"),
    Setting("OUTPUT_DIR", "output_dir", str, "where run directories go (like --output-dir)"),
    Setting("METHOD", "method", _choice("lora", "qlora", "full"), "lora, qlora or full"),
    Setting("EPOCHS", "epochs", _positive_float, "passes over the data"),
    Setting("MAX_STEPS", "max_steps", _positive_int, "stop after this many optimizer steps"),
    Setting("BATCH_SIZE", "micro_batch_size", _positive_int, "micro-batch size"),
    Setting("GRAD_ACCUM", "grad_accum", _positive_int, "gradient accumulation steps"),
    Setting("LR", "lr", _positive_float, "peak learning rate"),
    Setting("MAX_SEQ_LEN", "max_seq_len", _positive_int, "longest sequence in tokens"),
    Setting("LORA_R", "lora_r", _positive_int, "LoRA rank"),
    Setting("LORA_ALPHA", "lora_alpha", _positive_int, "LoRA alpha"),
    Setting("LORA_DROPOUT", "lora_dropout", _fraction, "LoRA dropout"),
    Setting("EVAL_SPLIT", "eval_split", _fraction, "share of rows held out for evaluation"),
    Setting("SAVE_EVERY", "save_every", _positive_int, "checkpoint every N optimizer steps"),
    Setting("KEEP_CHECKPOINTS", "keep_checkpoints", _positive_int, "checkpoints to keep (plus the best)"),
    Setting("EARLY_STOPPING_PATIENCE", "early_stopping_patience", _non_negative_int, "evaluations without improvement before stopping (0: never)"),
    Setting("GRADIENT_CHECKPOINTING", "gradient_checkpointing", _bool, "true or false (default: only when needed)"),
    Setting("MIXED_PRECISION", "mixed_precision", _choice("no", "bf16", "fp16"), "no, bf16 or fp16"),
    Setting("SEED", "seed", int, "random seed"),
    Setting("REPORT_TO", "report_to", _choice("none", "tensorboard", "wandb"), "none, tensorboard or wandb"),
)
BY_NAME = {PREFIX + s.name: s for s in SETTINGS}


@dataclass
class Settings:
    """Values from the environment, each with where it came from."""

    values: dict[str, tuple[Any, str]]  # target -> (value, "env LLMCUSTOMS_X")

    def get(self, target: str, default: Any = None) -> Any:
        return self.values.get(target, (default, ""))[0]

    def plan_overrides(self) -> dict[str, tuple[Any, str]]:
        """The values that are plan fields (not model, preset, output dir or tracking)."""
        return {k: v for k, v in self.values.items() if k not in ("model", "preset", "output_dir", "report_to")}


def read_env_file(path: Path) -> dict[str, tuple[str, int]]:
    """NAME -> (value, line) from a .env file; a malformed line is an error naming it."""
    from dotenv.parser import parse_stream

    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text.", "Save the env file as UTF-8.") from None
    except OSError as exc:
        raise ConfigError(f"Cannot read {path}: {exc.strerror}.") from None
    values = {}
    for binding in parse_stream(io.StringIO(text)):
        line = binding.original.line
        if binding.error or (binding.key is not None and binding.value is None and binding.key.startswith(PREFIX)):
            raise ConfigError(f"{path}, line {line}: not a NAME=value line.",
                              "Fix or delete that line; lines starting with # are comments.")
        if binding.key is not None and binding.value is not None:
            values[binding.key] = (binding.value, line)
    return values


def load_settings(env_file: Path | None = None) -> Settings:
    """Read `env_file` (default ./.env if present), export its non-llmcustoms
    variables to this process, and return the LLMCUSTOMS_* values."""
    path = env_file if env_file is not None else Path(".env")
    if env_file is not None and not path.is_file():
        raise ConfigError(f"Env file not found: {path}", "Check the path, or run `llmcustoms setup` to write one.")
    from_file = read_env_file(path) if path.is_file() else {}
    for name, (value, _) in from_file.items():
        if not name.startswith(PREFIX):
            os.environ.setdefault(name, value)  # the shell's own value wins
    values: dict[str, tuple[Any, str]] = {}
    problems = []
    for name, setting in BY_NAME.items():
        if name in os.environ:
            raw, where = os.environ[name], f"environment variable {name}"
        elif name in from_file:
            raw, line = from_file[name]
            where = f"{path}, line {line} ({name})"
        else:
            continue
        if not raw.strip():
            continue  # NAME= with nothing after it means "not set"
        try:
            values[setting.target] = (setting.parse(raw), f"env {name}")
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
    unknown = sorted(n for n in set(os.environ) | set(from_file) if n.startswith(PREFIX) and n not in BY_NAME
                     and n not in NOT_SETTINGS)
    problems += [f"unknown setting {n}" for n in unknown]
    if problems:
        raise ConfigError("Invalid setting(s):\n  " + "\n  ".join(problems),
                          "See .env.example for every LLMCUSTOMS_ variable and its values.")
    return Settings(values)


def example_file() -> str:
    """The text of .env.example: every variable, documented, commented out."""
    lines = ["# Copy this file to .env in the directory you run llmcustoms from (or pass --env-file PATH).",
             "# Precedence for every value: command-line flag > environment > preset > default.",
             "# A variable already set in the shell wins over this file. `llmcustoms setup` writes one for you.",
             "", "# --- llmcustoms settings (each is the default for the flag of the same name) ---"]
    for setting in SETTINGS:
        lines += [f"# {setting.help[0].upper()}{setting.help[1:]}.", f"# {PREFIX}{setting.name}="]
    lines += ["", "# Where prepared (tokenized) data is cached (default: ~/.cache/llmcustoms).",
              f"# {PREFIX}CACHE_DIR=",
              "", "# --- read by the libraries llmcustoms uses ---",
              "# Access token for gated models (Mistral, some Llama checkpoints). llmcustoms never",
              "# prints, logs or saves it. Never commit your .env.",
              "# HF_TOKEN=hf_...",
              "# Where downloaded models are cached (default: ~/.cache/huggingface).",
              "# HF_HOME=/data/huggingface",
              "# Set to 1 to never touch the network: only cached or local models load.",
              "# HF_HUB_OFFLINE=1",
              "# Which GPUs to use, by index (default: all).",
              "# CUDA_VISIBLE_DEVICES=0",
              "# For --report-to wandb.",
              "# WANDB_API_KEY=...",
              ""]
    return "\n".join(lines)
