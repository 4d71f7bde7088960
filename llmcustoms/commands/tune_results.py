"""What a tuning study has found: a row per trial (for the live table and
trials.csv), the counts of its trials by state, and the winner (the picked
trial, `tune_pareto.pick`, or the preset's own values when none qualifies or
the pick did not beat them at full length: `tune_confirm`) as a preset file
`train --preset FILE` accepts. `commands/tune.py` runs the trials."""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmcustoms.commands.tune_pareto import pareto_front, pick, points, trial_forgetting, trial_loss
from llmcustoms.commands.tune_space import RUNG_ATTR
from llmcustoms.commands.tune_studies import TuneSettings
from llmcustoms.planning.plan import Plan
from llmcustoms.planning.presets import TUNABLE_FIELDS, TrainingPreset, load_families, parse_preset
from llmcustoms.preparation.prepared_run import PreparedRun


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
    points: list[Any] = field(default_factory=list)  # the complete trials (`tune_pareto.Point`)
    pick: Any = None  # `tune_pareto.Pick`: the trial checked and written; None: no trial completed

    @property
    def interrupted(self) -> bool:
        return self.signum is not None

    def counts(self) -> dict[str, int]:
        """Trials of the whole study by state; they add up to all of them (`running`: in another process now)."""
        states = ("complete", "pruned", "fail", "interrupted", "running")
        return {state: sum(1 for r in self.rows if r["state"] == state) for state in states}

    def front(self) -> list[Any]:
        """The Pareto front of the complete trials (`tune_pareto.pareto_front`)."""
        return pareto_front(self.points)

    def not_measured(self) -> list[int]:
        """The complete trials whose forgetting is unknown: out of the front and the pick."""
        return [p.trial for p in self.points if p.forgetting is None]

    def best_row(self) -> dict[str, Any] | None:
        """The picked trial (`tune_pareto.pick`), as its table row."""
        return next((r for r in self.rows if r["best"]), None)

    def preset_row(self) -> dict[str, Any] | None:
        """The complete trial of the preset's own values, as its table row."""
        return next((r for r in self.rows if r["preset"] and r["state"] == "complete"), None)


def trial_rows(study: Any, limit: float | None = None) -> list[dict[str, Any]]:
    """One row per trial, for the live table and trials.csv; `best` marks the
    trial the pick chooses (`tune_pareto.pick`, `limit`: --forgetting-limit as
    given). A pruned trial's eval loss is its last rung's."""
    rows = []
    for t in study.trials:
        state = "interrupted" if t.user_attrs.get("interrupted") else t.state.name.lower()
        rungs = t.user_attrs.get(RUNG_ATTR, {})
        loss = trial_loss(t) if t.values else (rungs[max(rungs, key=int)] if rungs else None)
        rows.append({"trial": t.number, "state": state, "eval_loss": loss, "forgetting": trial_forgetting(t),
                     **{k: t.params.get(k) for k in ("lr", "lora_r", "alpha_ratio", "lora_dropout", "warmup_ratio")},
                     "steps": t.user_attrs.get("steps"), "budget": t.user_attrs.get("budget"),
                     "seconds": t.user_attrs.get("seconds"), "preset": bool(t.user_attrs.get("preset")),
                     "reason": "; ".join(filter(None, [t.user_attrs.get("reason")] + t.user_attrs.get("recoveries", []))),
                     "best": False})
    chosen = pick(points(study), limit).point
    for row in rows:
        row["best"] = chosen is not None and row["trial"] == chosen.trial
    return rows


def write_trials_csv(rows: list[dict[str, Any]], path: Path) -> None:
    columns = ["trial", "state", "eval_loss", "forgetting", "lr", "lora_r", "alpha_ratio", "lora_dropout", "warmup_ratio",
               "steps", "seconds", "reason", "budget", "preset"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) for k in columns})


def write_best_preset(base: Plan, preset: TrainingPreset, prepared: PreparedRun, settings: TuneSettings,
                      params: dict[str, Any], said: str) -> Path:
    """`params` (a trial's, or the preset's own point) as a preset file `train
    --preset FILE` accepts, `said` its description's last sentence. The preset's
    adjustments for this dataset's size and this model's size are folded in, so
    the tuned values are the ones that apply."""
    from llmcustoms.models.loading import describe_model

    model = describe_model(base.model, load_families(), "plan", base.trust_remote_code)
    values = preset.resolve(prepared.dataset.rows, model.arch.params, base.objective).values
    values.update(lr=float(params["lr"]), warmup_ratio=float(params["warmup_ratio"]))
    if "lora_r" in params:
        rank = int(params["lora_r"])
        values.update(lora_r=rank, lora_alpha=max(1, round(rank * params["alpha_ratio"])),
                      lora_dropout=float(params["lora_dropout"]))
    data = {"name": f"tuned-{settings.study_name}",
            "description": (f"Tuned by llmcustoms tune on {Path(base.data).name}"
                            f"{f' for preference tuning ({base.objective.upper()})' if base.objective_kind.pairs else ''}: {said}"),
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
