"""What a tuning study has found: a row per trial (for the live table and
trials.csv), the counts of its trials by state, and the winner (the best
trial, or the preset's own values when the best did not beat them at full
length: `tune_confirm`) as a preset file `train --preset FILE` accepts.
`commands/tune.py` runs the trials."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmcustoms.planning.plan import Plan
from llmcustoms.commands.preparation import PreparedRun
from llmcustoms.commands.tune_studies import TuneSettings
from llmcustoms.planning.presets import TUNABLE_FIELDS, TrainingPreset, load_families, parse_preset


@dataclass
class StudyOutcome:
    study: Any
    trials_this_run: int
    steps_run: int
    steps_budgeted: int
    best_preset_path: Path | None
    signum: int | None = None  # the signal that stopped the study (SIGINT, SIGTERM); None: it ran to its end
    stale: int = 0  # trials a dead process had left running, failed as this run started
    rows: list[dict[str, Any]] = field(default_factory=list)
    confirm: bool = True  # whether the search's best is to be checked at full length before it is written
    confirmation: Any = None  # `tune_confirm.Confirmation`; None: not checked (--no-confirm, interrupted, no best)
    search_won: bool = True  # what best_preset.yaml holds: the search's best, or the preset's own values
    lr_centre: float | None = None  # lr-find's suggestion the lr range was centred on

    @property
    def interrupted(self) -> bool:
        return self.signum is not None

    def counts(self) -> dict[str, int]:
        """Trials of the whole study by state; they add up to all of them (`running`: in another process now)."""
        states = ("complete", "pruned", "fail", "interrupted", "running")
        return {state: sum(1 for r in self.rows if r["state"] == state) for state in states}

    def best_row(self) -> dict[str, Any] | None:
        """The complete trial with the lowest eval loss, as its table row."""
        return next((r for r in self.rows if r["best"]), None)

    def preset_row(self) -> dict[str, Any] | None:
        """The complete trial of the preset's own values, as its table row."""
        return next((r for r in self.rows if r["preset"] and r["state"] == "complete"), None)


def best_trial(study: Any) -> Any:
    from optuna.trial import TrialState

    complete = [t for t in study.trials if t.state == TrialState.COMPLETE and t.value is not None and math.isfinite(t.value)]
    return min(complete, key=lambda t: t.value) if complete else None


def trial_rows(study: Any) -> list[dict[str, Any]]:
    """One row per trial, for the live table and trials.csv; `best` marks the
    complete trial with the lowest eval loss."""
    rows = []
    for t in study.trials:
        state = "interrupted" if t.user_attrs.get("interrupted") else t.state.name.lower()
        rows.append({"trial": t.number, "state": state, "eval_loss": t.value,
                     **{k: t.params.get(k) for k in ("lr", "lora_r", "alpha_ratio", "lora_dropout", "warmup_ratio")},
                     "steps": t.user_attrs.get("steps"), "budget": t.user_attrs.get("budget"),
                     "seconds": t.user_attrs.get("seconds"), "preset": bool(t.user_attrs.get("preset")),
                     "reason": "; ".join(filter(None, [t.user_attrs.get("reason")] + t.user_attrs.get("recoveries", []))),
                     "best": False})
    done = [r for r in rows if r["state"] == "complete" and r["eval_loss"] is not None]
    if done:
        min(done, key=lambda r: r["eval_loss"])["best"] = True
    return rows


def write_trials_csv(rows: list[dict[str, Any]], path: Path) -> None:
    columns = ["trial", "state", "eval_loss", "lr", "lora_r", "alpha_ratio", "lora_dropout", "warmup_ratio",
               "steps", "seconds", "reason", "budget", "preset"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) for k in columns})


def write_best_preset(study: Any, base: Plan, preset: TrainingPreset, prepared: PreparedRun,
                      settings: TuneSettings, params: dict[str, Any] | None = None, said: str | None = None) -> Path:
    """`params` (by default the best trial's) as a preset file `train --preset
    FILE` accepts, `said` its description's last sentence. The preset's
    adjustments for this dataset's size and this model's size are folded in, so
    the tuned values are the ones that apply."""
    from llmcustoms.models.loading import describe_model

    best = best_trial(study)
    if params is None:
        params = best.params
        said = f"best of {len(study.trials)} trials, eval loss {best.value:.4f} (trial {best.number})."
    model = describe_model(base.model, load_families(), "plan", base.trust_remote_code)
    values = preset.resolve(prepared.dataset.rows, model.arch.params, base.objective).values
    values.update(lr=float(params["lr"]), warmup_ratio=float(params["warmup_ratio"]))
    if "lora_r" in params:
        rank = int(params["lora_r"])
        values.update(lora_r=rank, lora_alpha=max(1, round(rank * params["alpha_ratio"])),
                      lora_dropout=float(params["lora_dropout"]))
    data = {"name": f"tuned-{settings.study_name}",
            "description": (f"Tuned by llmcustoms tune on {Path(base.data).name}"
                            f"{' for preference tuning (DPO)' if base.objective == 'dpo' else ''}: {said}"),
            "models": list(preset.models),
            **({"cpu_models": list(preset.cpu_models)} if preset.cpu_models else {}),
            **{k: values[k] for k in TUNABLE_FIELDS},
            "by_dataset_size": {}}
    families = {spec.hub_id for family in load_families().values() for spec in family.models}
    parse_preset(data, "best_preset.yaml", families)  # what we write must load
    path = settings.study_dir / "best_preset.yaml"
    header = (f"# Written by `llmcustoms tune` (study {settings.study_name}): {said}\n"
              f"# Use it with: llmcustoms train DATA --preset {path}\n")
    path.write_text(header + yaml.safe_dump(data, sort_keys=False))
    return path
