"""What `tune` searches and how long each trial runs: the search space around
the base plan, the preset's own point in it, the trials' plans, and the rungs
of successive halving.

- **The space**: learning rate on a log scale (a tenth to ten times the preset's,
  or a quarter to four times `lr-find`'s suggestion when there is one), LoRA
  rank, alpha as a ratio of rank, dropout and warmup fraction. Ranks the memory
  estimate rules out are left out.
- **The preset's point** (`preset_point`) is the base plan's own values, the
  study's first trial: each choice holds the preset's value and the lr range
  holds its lr, so the point is one the space can draw and the best trial is
  never worse than the preset on the trials' eval loss.
- **The rungs** (`rungs`, `goes_on`): a trial of S steps is evaluated every
  S/9 steps; at S/9 and S/3 only the best third of the trials that got there
  go on, by held-out loss (successive halving, reduction factor 3).
  `commands/tune.py` runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from llmcustoms.errors import ConfigError
from llmcustoms.planning.hardware import Hardware
from llmcustoms.planning.memory import MemoryEstimator
from llmcustoms.planning.plan import LoraSettings, Plan
from llmcustoms.planning.presets import find_model_spec, load_families

RANKS = (4, 8, 16, 32, 64)
ALPHA_RATIOS = (0.5, 1.0, 2.0, 4.0)
DROPOUTS = (0.0, 0.05, 0.1)
WARMUPS = (0.0, 0.03, 0.1)
LR_SPAN = 10.0  # search lr within [preset lr / 10, preset lr * 10]
LR_FIND_SPAN = 4.0  # or within [suggestion / 4, suggestion * 4]: lr-find measured it on this data
LR_LIMITS = (1e-6, 0.1)
DEFAULT_TRIAL_STEPS = 100
REDUCTION = 3  # successive halving: a third of the trials at a rung go on
RUNGS = 2  # at S/9 and S/3 of a trial's S steps
CATEGORICAL = ("warmup_ratio", "lora_r", "alpha_ratio", "lora_dropout")


@dataclass(frozen=True)
class SearchSpace:
    lr_low: float
    lr_high: float
    ranks: tuple[int, ...]
    alpha_ratios: tuple[float, ...] = ALPHA_RATIOS
    dropouts: tuple[float, ...] = DROPOUTS
    warmups: tuple[float, ...] = WARMUPS
    lora: bool = True
    excluded_ranks: tuple[int, ...] = ()
    lr_centre: float | None = None  # from `lr-find`; None: the base plan's lr
    preset: dict[str, Any] | None = None  # the preset's own values: the study's first trial

    def suggest(self, trial: Any) -> dict[str, Any]:
        params: dict[str, Any] = {"lr": trial.suggest_float("lr", self.lr_low, self.lr_high, log=True),
                                  "warmup_ratio": trial.suggest_categorical("warmup_ratio", list(self.warmups))}
        if self.lora:
            params["lora_r"] = trial.suggest_categorical("lora_r", list(self.ranks))
            params["alpha_ratio"] = trial.suggest_categorical("alpha_ratio", list(self.alpha_ratios))
            params["lora_dropout"] = trial.suggest_categorical("lora_dropout", list(self.dropouts))
        return params

    def choices(self) -> dict[str, tuple[Any, ...]]:
        """Each categorical parameter's choices, by name."""
        found = {"warmup_ratio": self.warmups}
        if self.lora:
            found.update(lora_r=self.ranks, alpha_ratio=self.alpha_ratios, lora_dropout=self.dropouts)
        return found

    def grid(self) -> dict[str, list[Any]]:
        """The same space, discrete, for the grid sampler (lr on 5 log-spaced points)."""
        lrs = [self.lr_low * (self.lr_high / self.lr_low) ** (i / 4) for i in range(5)]
        return {"lr": lrs, **{name: list(values) for name, values in self.choices().items()}}

    def centred(self, lr: float) -> SearchSpace:
        """The same space with its lr range around `lr` (`lr-find`'s suggestion)."""
        low, high = lr_range(self.preset["lr"] if self.preset else lr, lr)
        return replace(self, lr_low=low, lr_high=high, lr_centre=lr)

    def matching(self, stored: dict[str, tuple[Any, ...]]) -> SearchSpace:
        """The space with the choices a study was started with (`stored`): Optuna
        keeps a parameter's choices for a whole study. The preset's point stays
        only if those choices hold it."""
        names = {"warmup_ratio": "warmups", "lora_r": "ranks", "alpha_ratio": "alpha_ratios", "lora_dropout": "dropouts"}
        space = replace(self, **{names[name]: tuple(values) for name, values in stored.items() if name in names})
        if space.preset is not None and not space.holds(space.preset):
            space = replace(space, preset=None)
        return space

    def holds(self, point: dict[str, Any]) -> bool:
        return self.lr_low <= point["lr"] <= self.lr_high and all(
            point.get(name) in values for name, values in self.choices().items())

    def describe(self) -> list[tuple[str, str]]:
        rows = [("learning rate", f"{self.lr_low:.1e} .. {self.lr_high:.1e} (log scale)")]
        if self.lr_centre is not None:
            widened = self.preset is not None and not (
                self.lr_centre / LR_FIND_SPAN <= self.preset["lr"] <= self.lr_centre * LR_FIND_SPAN)
            rows.append(("lr centred on", f"{self.lr_centre:.1e}, lr-find's suggestion (/{LR_FIND_SPAN:g} .. "
                                          f"x{LR_FIND_SPAN:g}" + (", widened to the preset's lr)" if widened else ")")))
        rows.append(("warmup fraction", ", ".join(f"{w:g}" for w in self.warmups)))
        if self.lora:
            ranks = ", ".join(map(str, self.ranks))
            if self.excluded_ranks:
                ranks += f" ({', '.join(map(str, self.excluded_ranks))} left out: they do not fit)"
            rows += [("LoRA rank", ranks), ("LoRA alpha / rank", ", ".join(f"{a:g}" for a in self.alpha_ratios)),
                     ("LoRA dropout", ", ".join(f"{d:g}" for d in self.dropouts))]
        if self.preset is not None:
            rows.append(("first trial", f"the preset's own values ({describe_point(self.preset)})"))
        return rows


def describe_point(params: dict[str, Any]) -> str:
    """`lr 2.0e-04, r 16, alpha/r 2, dropout 0.05, warmup 0.03`."""
    text = f"lr {params['lr']:.1e}"
    if "lora_r" in params:
        text += f", r {params['lora_r']}, alpha/r {params['alpha_ratio']:g}, dropout {params['lora_dropout']:g}"
    return text + f", warmup {params['warmup_ratio']:g}"


def lr_range(preset_lr: float, centre: float | None = None) -> tuple[float, float]:
    """The lr range: around the preset's lr, or around `centre` (`lr-find`'s
    suggestion) and widened to hold the preset's lr, its first trial."""
    middle, span = (preset_lr, LR_SPAN) if centre is None else (centre, LR_FIND_SPAN)
    high = min(LR_LIMITS[1], middle * span)
    low = min(max(LR_LIMITS[0], middle / span), high)
    return min(low, preset_lr), max(high, preset_lr)


def warmup_ratio(base: Plan) -> float:
    """The base plan's warmup as a fraction of its steps: the first of the
    searched fractions, or the shortest rounding, that gives its warmup steps
    (the planner rounds down), so the preset's point reads as its preset does."""
    exact = base.warmup_steps / max(1, base.total_steps)
    for ratio in (*WARMUPS, round(exact, 2), round(exact, 3), round(exact, 4)):
        if int(ratio * base.total_steps) == base.warmup_steps:
            return ratio
    return exact


def preset_point(base: Plan) -> dict[str, Any]:
    """The base plan's own values, as a trial's parameters."""
    point: dict[str, Any] = {"lr": base.lr, "warmup_ratio": warmup_ratio(base)}
    if base.lora is not None:
        point.update(lora_r=base.lora.r, alpha_ratio=base.lora.alpha / base.lora.r, lora_dropout=base.lora.dropout)
    return point


def _with(values: tuple[Any, ...], value: Any) -> tuple[Any, ...]:
    return values if value in values else tuple(sorted((*values, value)))


def search_space(base: Plan, hardware: Hardware, centre: float | None = None) -> SearchSpace:
    """The space around the base plan (its lr range around `centre` when given,
    `lr-find`'s suggestion), holding the preset's point; ranks the memory
    estimate rules out are dropped."""
    point = preset_point(base)
    low, high = lr_range(base.lr, centre)
    warmups = _with(WARMUPS, point["warmup_ratio"])
    if base.lora is None:
        return SearchSpace(low, high, ranks=(), warmups=warmups, lora=False, lr_centre=centre, preset=point)
    spec = find_model_spec(base.model, load_families())
    fitting, excluded = [], []
    for rank in RANKS:
        fits = True
        if spec is not None and base.memory:
            estimate = MemoryEstimator(spec, hardware.has_gpu, base.memory["budget_bytes"]).estimate(
                base.method, base.micro_batch_size, base.max_seq_len, base.mixed_precision,
                base.gradient_checkpointing, lora_rank=rank, lora_targets=base.lora.target_modules)
            fits = estimate.fits
        (fitting if fits or rank == base.lora.r else excluded).append(rank)  # the preset's rank was planned to fit
    if not fitting:
        raise ConfigError("No LoRA rank fits in memory with this plan.", "Try --method qlora or a smaller --max-seq-len.")
    return SearchSpace(low, high, ranks=_with(tuple(fitting), point["lora_r"]), excluded_ranks=tuple(excluded),
                       alpha_ratios=_with(ALPHA_RATIOS, point["alpha_ratio"]),
                       dropouts=_with(DROPOUTS, point["lora_dropout"]), warmups=warmups, lr_centre=centre, preset=point)


def trial_steps(base: Plan, max_steps: int | None, budget_tokens: int | None, mean_tokens: float) -> int:
    """Optimizer steps per trial: given, or from a token budget, or a default."""
    if max_steps:
        return max_steps
    if budget_tokens:
        return max(1, math.ceil(budget_tokens / (base.effective_batch_size * max(1.0, mean_tokens))))
    return min(base.total_steps, DEFAULT_TRIAL_STEPS)


def rungs(steps: int) -> tuple[int, ...]:
    """The steps of a trial of `steps` at which successive halving judges it:
    steps/9 and steps/3 (rounded up), those before its last step."""
    first = math.ceil(steps / REDUCTION ** RUNGS)
    return tuple(s for s in (first * REDUCTION ** k for k in range(RUNGS)) if s < steps)


# Each trial's eval loss at the rungs it reached, by step (a user attribute: the halving compares them).
RUNG_ATTR = "rung_losses"


def goes_on(study: Any, trial: Any, step: int, loss: float) -> bool:
    """Successive halving at a rung (`rungs`): records the trial's `loss` there
    and says whether it is among the best third of the losses every trial that
    reached the step had there (the first two there: the lowest goes on).
    Optuna's `SuccessiveHalvingPruner` rule, reduction factor 3, applied here:
    Optuna prunes no study of two objectives (`Trial.should_prune` refuses), and
    this one judges the first, held-out loss, alone (forgetting is judged at the
    pick, `tune_pareto.py`). Failed trials set no bar: one that diverged after a
    good start (a high lr, often) would stop the others for nothing."""
    from optuna.trial import TrialState

    if math.isnan(loss):
        return False
    key = str(step)  # user attributes are JSON: their keys are text
    trial.set_user_attr(RUNG_ATTR, {**trial.user_attrs.get(RUNG_ATTR, {}), key: loss})
    others = [t.user_attrs[RUNG_ATTR][key] for t in study.get_trials(deepcopy=False, states=(
        TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING))
        if t.number != trial.number and key in t.user_attrs.get(RUNG_ATTR, {})]
    competing = sorted([*others, loss])
    return loss <= competing[max(1, len(competing) // REDUCTION) - 1]


def _lora(base: Plan, params: dict[str, Any]) -> LoraSettings | None:
    if base.lora is None or "lora_r" not in params:
        return base.lora
    rank = params["lora_r"]
    return LoraSettings(r=rank, alpha=max(1, round(rank * params["alpha_ratio"])), dropout=params["lora_dropout"],
                        target_modules=base.lora.target_modules)


def trial_plan(base: Plan, params: dict[str, Any], steps: int) -> Plan:
    """The base plan with one trial's values, shortened to `steps` and evaluated
    at each rung's step (every steps/9), and after the last. It stops early
    where `train` would (`trial_patience`)."""
    judged = rungs(steps)
    eval_every = judged[0] if judged else steps
    return replace(base, lr=params["lr"], lora=_lora(base, params), total_steps=steps,
                   warmup_steps=int(params["warmup_ratio"] * steps), eval_every=eval_every,
                   early_stopping_patience=trial_patience(base, eval_every), save_every=steps + 1)


def trial_patience(base: Plan, eval_every: int) -> int:
    """Evaluations a trial waits for a lower eval loss before it stops: as many
    steps as `train` would wait (its patience times its interval), counted in
    the trial's own evaluations; 0 (never stop) when `train` would not stop.
    Past that point `train` would have stopped and kept its best, so a trial's
    score could not change: on code the preset's trial was best at step 18 of
    80 and spent the other 62 steps for nothing."""
    if not base.early_stopping_patience or not base.eval_every:
        return 0
    return math.ceil(base.early_stopping_patience * base.eval_every / eval_every)


def full_plan(base: Plan, params: dict[str, Any]) -> Plan:
    """The base plan with a trial's values, as long as `train` would run it."""
    return replace(base, lr=params["lr"], lora=_lora(base, params),
                   warmup_steps=int(params["warmup_ratio"] * base.total_steps))
