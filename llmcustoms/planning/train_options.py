"""What the user asked `train`, `plan`, `tune` and `lr-find` for, as one typed
record (`TrainOptions`), from the settings with the command's flags merged in.

The options table (`planning/options.py`) declares every option once; a
command's flags and the environment become `Settings` (`planning/settings.py`);
this turns them into the record the commands pass on, down to the planner.
None means "not given": the plan decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmcustoms.errors import ConfigError
from llmcustoms.planning.access_tokens import hide_tokens, looks_like_token
from llmcustoms.planning.options import BY_NAME, Given, Overrides
from llmcustoms.planning.settings import Settings


def bad_row_policy(strict: bool, skip_bad_rows: bool) -> str:
    """'strict', 'skip' or 'default' from the two flags."""
    if strict and skip_bad_rows:
        raise ConfigError("--strict and --skip-bad-rows contradict each other.",
                          "Pass one: --strict stops at the first bad row, --skip-bad-rows skips any number.")
    return "strict" if strict else "skip" if skip_bad_rows else "default"


@dataclass
class TrainOptions:
    """What the user asked for. None means "not given": the plan decides."""

    data: str
    model: str | None = None
    preset: str | None = None
    eval_data: str | None = None
    skip_bad_rows: bool = False
    strict: bool = False
    # plan field -> value and source: plan values set by a flag or the environment
    overrides: Overrides = field(default_factory=dict)
    model_source: str = "flag"
    preset_source: str = "default"
    cache_dir: str | None = None  # where tokenized data is cached; None: the default place
    from_run: str | None = None  # a finished run to start from (`models/from_run.py`)

    def __post_init__(self) -> None:
        # A caller may pass plain (value, source) pairs; each becomes a `Given`.
        self.overrides = {name: Given(*given) for name, given in self.overrides.items()}

    def override(self, name: str, default: Any) -> Any:
        return self.overrides.get(name, Given(default, "")).value

    @property
    def policy(self) -> str:
        return bad_row_policy(self.strict, self.skip_bad_rows)


def train_options(settings: Settings) -> TrainOptions:
    """What the user asked for, from the settings with the command's flags
    already merged in (flag > environment); what neither gives, the plan decides."""
    chosen = settings.values
    if chosen.get("data") is None:
        raise ConfigError("No training data given.",
                          "Pass the data file (`llmcustoms train data.jsonl`), or set LLMCUSTOMS_DATA "
                          "(`llmcustoms setup` writes it).")
    overrides = {BY_NAME[name].plan: Given(*given) for name, given in chosen.items() if BY_NAME[name].plan}

    def value(name: str, default: Any = None) -> Any:
        return chosen[name][0] if name in chosen else default

    def source(name: str, default: str) -> str:
        return chosen[name][1] if name in chosen else default

    model = value("model")
    if model and looks_like_token(model) and not Path(model).expanduser().exists():
        # Sent to the Hub as a model id, and repeated by every message that names the model.
        raise ConfigError(f"The model {hide_tokens(model)!r} looks like an access token, not a model; it was not used.",
                          "Give a Hugging Face token as HF_TOKEN (or `hf auth login`), and --model a Hub id "
                          "(organisation/name) or a model folder.")

    return TrainOptions(data=str(value("data")), model=model, preset=value("preset"),
                        eval_data=value("eval_data"), skip_bad_rows=bool(value("skip_bad_rows", False)),
                        strict=bool(value("strict", False)), overrides=overrides,
                        model_source=source("model", "flag"), preset_source=source("preset", "default"),
                        cache_dir=value("cache_dir"), from_run=value("from_run"))


