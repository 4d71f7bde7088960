"""Where each value of a plan comes from, and why the planner chose what it chose: a `Resolver`.

The planner's steps (`planner.py`, `step_choices.py`, `cpu_share.py`) read every value
through it, in order: what the user gave (a flag, the environment, .env, `--preset`),
then the preset's value for this data and model, then a default; each read records
the value's source for the plan. A step that chooses a value itself says why
(`chose`, `note`), and what may go wrong (`warn`). Part of planning: no torch.
"""

from __future__ import annotations

from typing import Any

from llmcustoms.planning import options
from llmcustoms.planning.options import Overrides
from llmcustoms.planning.presets import PresetValues

# Values a flag, a variable or a preset may set: the options table's plan values.
OVERRIDABLE = options.plan_overridable()


class Resolver:
    """Picks each value from overrides, then the preset, then a default, noting the
    source; the steps of a plan note their reasons and warnings here, in order."""

    def __init__(self, overrides: Overrides, preset: PresetValues):
        unknown = set(overrides) - set(OVERRIDABLE)
        if unknown:
            raise ValueError(f"unknown override(s): {sorted(unknown)}")
        self._overrides = dict(overrides)  # the caller's stay as given
        self._preset = preset
        self._sources: dict[str, str] = {}
        self._reasons: list[str] = []
        self._warnings: list[str] = []

    # ------------------------------------------------------------- reading values

    def given(self, name: str) -> bool:
        return name in self._overrides

    def given_value(self, name: str) -> Any:
        """The value given for `name`, or None; records no source (for checks)."""
        return self._overrides.get(name, (None, ""))[0]

    def given_values(self) -> dict[str, Any]:
        """Every value given, by name (for checks)."""
        return {name: value for name, (value, _) in self._overrides.items()}

    def in_preset(self, name: str) -> bool:
        return name in self._preset.values

    def get(self, name: str, default: Any = None, plan_field: str | None = None) -> Any:
        """The value in force for `name`, its source recorded under `plan_field` (default: `name`)."""
        key = plan_field or name
        if name in self._overrides:
            value, source = self._overrides[name]
            self._sources[key] = source
            return value
        if name in self._preset.values:
            self._sources[key] = self._preset.sources[name]
            return self._preset.values[name]
        self._sources[key] = "default"
        return default

    def source_of(self, name: str) -> str:
        return self._sources[name]

    # ------------------------------------------------------- recording choices

    def chose(self, name: str, value: Any, reason: str) -> Any:
        """`value`, chosen by the planner for `reason`."""
        self._sources[name] = "planner"
        self._reasons.append(reason)
        return value

    def record(self, name: str, source: str) -> None:
        """`name`'s value came from `source` ("planner", "default", "env OMP_NUM_THREADS", ...)."""
        self._sources[name] = source

    def rename(self, old: str, new: str) -> None:
        """The source recorded for `old` is the plan's `new` field's (max_steps: total_steps)."""
        self._sources[new] = self._sources.pop(old)

    def forget(self, name: str) -> None:
        """`name` has no source in the plan: the value was not used."""
        self._sources.pop(name, None)

    def imply(self, name: str, value: Any, source: str) -> None:
        """`value` for `name` as if given, from `source`: a choice another value forces (fsdp: full)."""
        self._overrides[name] = (value, source)

    def note(self, reason: str) -> None:
        self._reasons.append(reason)

    def warn(self, warning: str) -> None:
        self._warnings.append(warning)

    # ---------------------------------------------------------------- the plan's

    @property
    def reasons(self) -> list[str]:
        """The reasons so far, in order; appended to by `duration.expected_seconds`."""
        return self._reasons

    @property
    def warnings(self) -> tuple[str, ...]:
        return tuple(self._warnings)

    @property
    def sources(self) -> dict[str, str]:
        return dict(self._sources)
