"""`tune`'s two objectives, the Pareto front of a study's trials, and the pick.

Each complete trial is scored twice, both the lower the better, both of the
evaluation `train` would keep of it (the lowest eval loss among those within
the plan's forgetting limit: `position.Position.early_stop`):

- **held-out loss**: its eval loss on the study's fixed held-out rows;
- **forgetting**: its loss on the general chat rows no run trains on, over
  the base model's, less 1 (`training/general_text.py`; +0.031: 3.1% higher).

A trial that could not measure forgetting (preference pairs have no such
loss) is `None` here and shown as unknown; Optuna, which needs a number, is
given `UNMEASURED`, worse than any real value, so its sampler treats such a
trial as forgetting most. It is left out of the front and, when there is a
bound, out of the pick: nothing shows it forgets no more.

The **Pareto front** holds the complete trials no other beats on both (as
low on both and lower on one); trials with equal values are all on it.

The **pick**, the trial checked at full length and written as the preset
(`tune.StudyTrials.conclude`), is the lowest held-out loss among the trials
forgetting no more than a bound: `--forgetting-limit` when the user gave it
to `tune`; else the preset's own trial's forgetting. The preset's trial meets
its own bound, so the pick never forgets more than the preset and never has
a higher held-out loss. When the preset's trial measured none, the default
limit stands in; when no trial measured any (or the user gave 0, no limit),
it is the lowest held-out loss of all. With the user's limit, when no trial meets
it, the preset's own values stay. The front and the pick go to `pareto.json`
in the study's directory.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The bound when the preset's own trial measured no forgetting (it failed) and none was given:
# the general text's loss at most 10% above the base model's.
FALLBACK_BOUND = 0.1
# Optuna's second value for a trial whose forgetting is unknown: far above any real rise.
UNMEASURED = 1e6


@dataclass(frozen=True)
class Point:
    """A complete trial, as the front and the pick see it."""
    trial: int
    eval_loss: float
    forgetting: float | None  # None: not measured
    params: dict[str, Any] = field(default_factory=dict)
    preset: bool = False  # the preset's own values


def objective_values(loss: float | None, forgetting: float | None) -> tuple[float, float]:
    """What a trial gives Optuna; a NaN loss fails the trial, as a lost loss did before."""
    return (math.nan if loss is None else loss, UNMEASURED if forgetting is None else forgetting)


class BaseGeneral:
    """The base model's general-text loss, forgetting's zero, measured once per
    `tune` process: every trial and full-length run starts from the same base
    model (a new LoRA adapter changes nothing before its first step), so the
    first evaluates the base model (its held-out rows too) and the others start
    from its number. Without it a run could not tell its forgetting, nor keep
    its weights within the plan's limit as `train` does."""

    def __init__(self) -> None:
        self.measured = False
        self.loss: float | None = None  # None once measured: this run measures no forgetting

    def baseline(self) -> bool:
        """Whether the next run is to evaluate the base model itself (FineTuner's `baseline`)."""
        return not self.measured

    def start(self, tuner: Any) -> None:
        """Before `tuner.run()`: the base model's loss, when known, as its run's own."""
        if self.measured:
            tuner.position.base_general = self.loss

    def learn(self, tuner: Any) -> None:
        """After a run that evaluated the base model: its general loss (None: this run measures none)."""
        if not self.measured and tuner.position.base_eval is not None:
            self.measured, self.loss = True, tuner.position.base_general


def trial_loss(trial: Any) -> float | None:
    """A trial's held-out loss (its first value); None when it has none that is finite."""
    values = trial.values or ()
    return values[0] if values and math.isfinite(values[0]) else None


def trial_forgetting(trial: Any) -> float | None:
    """A trial's forgetting (its second value); None when it was not measured or it has no values."""
    values = trial.values or ()
    return values[1] if len(values) > 1 and values[1] < UNMEASURED else None


def points(study: Any) -> list[Point]:
    """The study's complete trials with a finite held-out loss."""
    from optuna.trial import TrialState

    return [Point(t.number, loss, trial_forgetting(t), dict(t.params), bool(t.user_attrs.get("preset")))
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if (loss := trial_loss(t)) is not None]


def dominates(a: Point, b: Point) -> bool:
    """`a` is as low as `b` on both objectives and lower on one (both measured)."""
    if a.forgetting is None or b.forgetting is None:
        return False
    return (a.eval_loss <= b.eval_loss and a.forgetting <= b.forgetting
            and (a.eval_loss < b.eval_loss or a.forgetting < b.forgetting))


def pareto_front(found: list[Point]) -> list[Point]:
    """The points no other dominates, those with forgetting measured only, by held-out loss."""
    known = [p for p in found if p.forgetting is not None]
    front = [p for p in known if not any(dominates(q, p) for q in known)]
    return sorted(front, key=lambda p: (p.eval_loss, p.forgetting, p.trial))


@dataclass(frozen=True)
class Pick:
    point: Point | None  # None: no trial qualifies, the preset's own values stay
    rule: str  # "preset", "limit", "default" (a bound), "unlimited", "unmeasured" (none)
    bound: float | None  # the forgetting allowed; None: not limited
    qualifying: int
    said: str  # the pick in one sentence


def pick(found: list[Point], limit: float | None) -> Pick:
    """The trial to check and write (see the module's docstring); `limit`: --forgetting-limit as given, else None."""
    preset = next((p for p in found if p.preset and p.forgetting is not None), None)
    if not any(p.forgetting is not None for p in found):  # preference pairs: no limit means anything
        return _lowest(found, "unmeasured", "forgetting was measured in none of them")
    if limit == 0:
        return _lowest(found, "unlimited", "--forgetting-limit 0: forgetting not limited")
    if limit is not None:
        rule, bound, what = "limit", limit, f"--forgetting-limit ({rise(limit)})"
    elif preset is not None:
        rule, bound, what = "preset", preset.forgetting, f"the preset's own trial ({rise(preset.forgetting)})"
    else:
        rule, bound = "default", FALLBACK_BOUND
        what = f"the default limit ({rise(bound)}; the preset's own trial measured no forgetting)"
    qualifying = [p for p in found if p.forgetting is not None and p.forgetting <= bound]
    if not qualifying:
        return Pick(None, rule, bound, 0, f"No trial stays within {what}: the preset's own values stay.")
    best = min(qualifying, key=lambda p: (p.eval_loss, p.forgetting, p.trial))
    return Pick(best, rule, bound, len(qualifying),
                f"{_trial(best)}: the lowest held-out loss, {best.eval_loss:.4f}, among the "
                f"{_trials(len(qualifying))} forgetting no more than {what}.")


def _lowest(found: list[Point], rule: str, why: str) -> Pick:
    best = min(found, key=lambda p: (p.eval_loss, p.trial)) if found else None
    if best is None:
        return Pick(None, rule, None, 0, "No trial completed.")
    return Pick(best, rule, None, len(found),
                f"{_trial(best)}: the lowest held-out loss, {best.eval_loss:.4f}, of the {_trials(len(found))} ({why}).")


def rise(value: float) -> str:
    """Forgetting as shown: +3.12% (two decimals: trials often differ by less than a tenth of a percent)."""
    return f"{value:+.2%}"


def _trial(point: Point) -> str:
    return f"trial {point.trial}" + (" (the preset's own values)" if point.preset else "")


def _trials(count: int) -> str:
    return f"{count} trial" + ("" if count == 1 else "s")


def write_pareto(path: Path, found: list[Point], chosen: Pick) -> None:
    """`pareto.json`: the front (held-out loss, forgetting, the values), the trials
    whose forgetting is unknown, and the pick, with its rule and sentence."""
    data = {"objectives": {"eval_loss": "held-out loss of the evaluation `train` would keep (lower is better)",
                           "forgetting": "that evaluation's general-text loss over the base model's, less 1 "
                                         "(0.031: 3.1% higher; lower is better; null: not measured)"},
            "front": [asdict(p) for p in pareto_front(found)],
            "not_measured": [p.trial for p in found if p.forgetting is None],
            "pick": {"trial": chosen.point.trial if chosen.point else None, "rule": chosen.rule,
                     "bound": chosen.bound, "qualifying": chosen.qualifying, "said": chosen.said,
                     "then": "checked at full length against the preset's own values unless --no-confirm: "
                             "best_preset.yaml says which was written"}}
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
