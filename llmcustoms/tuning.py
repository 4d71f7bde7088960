"""`llmcustoms tune`: an Optuna study around the same `FineTuner` and `Plan` as `train`.

Each trial is a short real training run, scored by eval loss on one fixed,
seeded held-out split. The search space is learning rate (log scale), LoRA
rank, alpha as a ratio of rank, dropout and warmup fraction; ranks whose
estimated memory does not fit are left out before the study starts. Eval loss
is reported during each trial so a median pruner can stop poor trials early.
The study lives in a storage (SQLite in the output directory by default), so
running the same command again continues it, and several processes can share
one study through an RDB or journal storage.
"""

from __future__ import annotations

import csv
import re
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import yaml

from llmcustoms.reporting import SilentReporter
from llmcustoms.errors import ConfigError
from llmcustoms.hardware import Hardware
from llmcustoms.memory import MemoryOptimizer
from llmcustoms.plan import LoraSettings, Plan
from llmcustoms.preparation import PreparedRun
from llmcustoms.presets import TUNABLE_FIELDS, TrainingPreset, load_families, find_model_spec, parse_preset
from llmcustoms import runlock
from llmcustoms.rundir import RunDirectory

RANKS = (4, 8, 16, 32, 64)
ALPHA_RATIOS = (0.5, 1.0, 2.0, 4.0)
DROPOUTS = (0.0, 0.05, 0.1)
WARMUPS = (0.0, 0.03, 0.1)
LR_SPAN = 10.0  # search lr within [preset lr / 10, preset lr * 10]
DEFAULT_TRIAL_STEPS = 100
REPORTS_PER_TRIAL = 5


class TrialFailed(Exception):
    """A trial that could not finish (out of memory or divergence beyond recovery)."""


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

    def suggest(self, trial: Any) -> dict[str, Any]:
        params: dict[str, Any] = {"lr": trial.suggest_float("lr", self.lr_low, self.lr_high, log=True),
                                  "warmup_ratio": trial.suggest_categorical("warmup_ratio", list(self.warmups))}
        if self.lora:
            params["lora_r"] = trial.suggest_categorical("lora_r", list(self.ranks))
            params["alpha_ratio"] = trial.suggest_categorical("alpha_ratio", list(self.alpha_ratios))
            params["lora_dropout"] = trial.suggest_categorical("lora_dropout", list(self.dropouts))
        return params

    def grid(self) -> dict[str, list[Any]]:
        """The same space, discrete, for the grid sampler (lr on 5 log-spaced points)."""
        lrs = [self.lr_low * (self.lr_high / self.lr_low) ** (i / 4) for i in range(5)]
        grid: dict[str, list[Any]] = {"lr": lrs, "warmup_ratio": list(self.warmups)}
        if self.lora:
            grid.update(lora_r=list(self.ranks), alpha_ratio=list(self.alpha_ratios), lora_dropout=list(self.dropouts))
        return grid

    def describe(self) -> list[tuple[str, str]]:
        rows = [("learning rate", f"{self.lr_low:.1e} .. {self.lr_high:.1e} (log scale)")]
        if self.lr_centre is not None:
            rows.append(("lr centred on", f"{self.lr_centre:.1e}, lr-find's suggestion"))
        rows.append(("warmup fraction", ", ".join(f"{w:g}" for w in self.warmups)))
        if self.lora:
            ranks = ", ".join(map(str, self.ranks))
            if self.excluded_ranks:
                ranks += f" ({', '.join(map(str, self.excluded_ranks))} left out: they do not fit)"
            rows += [("LoRA rank", ranks), ("LoRA alpha / rank", ", ".join(f"{a:g}" for a in self.alpha_ratios)),
                     ("LoRA dropout", ", ".join(f"{d:g}" for d in self.dropouts))]
        return rows


def search_space(base: Plan, hardware: Hardware, centre: float | None = None) -> SearchSpace:
    """The space around the base plan (its lr range around `centre` when given,
    `lr-find`'s suggestion); ranks the memory estimate rules out are dropped."""
    middle = base.lr if centre is None else centre
    high = min(0.1, middle * LR_SPAN)
    low = min(max(1e-6, middle / LR_SPAN), high)
    if base.lora is None:
        return SearchSpace(low, high, ranks=(), lora=False, lr_centre=centre)
    families = load_families()
    spec = find_model_spec(base.model, families)
    fitting, excluded = [], []
    for rank in RANKS:
        fits = True
        if spec is not None and base.memory:
            estimate = MemoryOptimizer(spec, hardware.has_gpu, base.memory["budget_bytes"]).estimate(
                base.method, base.micro_batch_size, base.max_seq_len, base.mixed_precision,
                base.gradient_checkpointing, lora_rank=rank, lora_targets=base.lora.target_modules)
            fits = estimate.fits
        (fitting if fits else excluded).append(rank)
    if not fitting:
        raise ConfigError("No LoRA rank fits in memory with this plan.", "Try --method qlora or a smaller --max-seq-len.")
    return SearchSpace(low, high, ranks=tuple(fitting), excluded_ranks=tuple(excluded), lr_centre=centre)


def trial_steps(base: Plan, max_steps: int | None, budget_tokens: int | None, mean_tokens: float) -> int:
    """Optimizer steps per trial: given, or from a token budget, or a default."""
    if max_steps:
        return max_steps
    if budget_tokens:
        return max(1, math.ceil(budget_tokens / (base.effective_batch_size * max(1.0, mean_tokens))))
    return min(base.total_steps, DEFAULT_TRIAL_STEPS)


def trial_plan(base: Plan, params: dict[str, Any], steps: int) -> Plan:
    """The base plan with one trial's values, shortened to `steps` and evaluated often."""
    lora = base.lora
    if lora is not None and "lora_r" in params:
        rank = params["lora_r"]
        lora = LoraSettings(r=rank, alpha=max(1, round(rank * params["alpha_ratio"])), dropout=params["lora_dropout"],
                            target_modules=lora.target_modules)
    return replace(base, lr=params["lr"], lora=lora, total_steps=steps, warmup_steps=int(params["warmup_ratio"] * steps),
                   eval_every=max(1, steps // REPORTS_PER_TRIAL), early_stopping_patience=0, save_every=steps + 1)


@dataclass
class TuneSettings:
    trials: int
    steps: int
    study_name: str
    study_dir: Path
    storage: str | None = None
    sampler: str = "tpe"
    timeout: float | None = None
    seed: int = 42
    lr_centre: float | None = None  # the lr range's centre, from `lr-find` (`tune --lr-find`)


@dataclass(frozen=True)
class StudyRequest:
    """What `tune` was asked for, besides the plan's values."""

    trials: int
    max_steps: int | None = None
    budget_tokens: int | None = None
    timeout: float | None = None
    storage: str | None = None
    study_name: str | None = None
    sampler: str = "tpe"


@dataclass
class PreparedStudy:
    prepared: PreparedRun
    hardware: Hardware
    settings: TuneSettings
    space: SearchSpace
    tokens_per_trial: int


def prepare_study(options: Any, output_dir: Path, request: StudyRequest, progress: Any = None) -> PreparedStudy:
    """The base plan (as `train` would make it), the trial length and the study's name and place."""
    from llmcustoms.preflight import usable_hardware
    from llmcustoms.preparation import no_progress, prepare_run

    if request.max_steps and request.budget_tokens:
        raise ConfigError("--max-steps and --budget-tokens both set the length of a trial.", "Pass one of them.")
    hardware = usable_hardware()
    prepared = prepare_run(options, hardware, progress=progress or no_progress)
    base = prepared.plan
    mean_tokens = float(prepared.train.lengths.mean())
    steps = trial_steps(base, request.max_steps, request.budget_tokens, mean_tokens)
    default_name = f"{Path(options.data).stem}-{Path(base.model.rstrip('/')).name}"
    name = request.study_name or re.sub(r"[^A-Za-z0-9._-]+", "-", default_name).lower()
    settings = TuneSettings(trials=request.trials, steps=steps, study_name=name, study_dir=output_dir / f"tune-{name}",
                            storage=request.storage, sampler=request.sampler, timeout=request.timeout, seed=base.seed)
    return PreparedStudy(prepared, hardware, settings, search_space(base, hardware),
                         round(steps * base.effective_batch_size * mean_tokens))


def open_storage(url: str | None, study_dir: Path) -> Any:
    """An Optuna storage: the SQLite file in the study directory by default, any
    RDB URL, or `journal:PATH` for a journal file several processes can share."""
    if url is None:
        return f"sqlite:///{(study_dir / 'study.db').resolve()}"
    if url.startswith("journal:"):
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        return JournalStorage(JournalFileBackend(url[len("journal:"):]))
    return url


def make_sampler(name: str, space: SearchSpace, seed: int) -> Any:
    import optuna

    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        return optuna.samplers.GridSampler(space.grid(), seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


@dataclass
class StudyOutcome:
    study: Any
    trials_this_run: int
    steps_run: int
    steps_budgeted: int
    best_preset_path: Path | None
    interrupted: bool = False
    rows: list[dict[str, Any]] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Trials of the whole study by state: complete, pruned, fail."""
        return {state: sum(1 for r in self.rows if r["state"] == state) for state in ("complete", "pruned", "fail")}

    def best_row(self) -> dict[str, Any] | None:
        """The complete trial with the lowest eval loss, as its table row."""
        return next((r for r in self.rows if r["best"]), None)


def run_study(prepared: PreparedRun, preset: TrainingPreset, hardware: Hardware, settings: TuneSettings,
              on_update: Callable[[list[dict[str, Any]]], None] = lambda rows: None, faults: Any = None,
              warn: Callable[[str], None] = lambda text: None) -> StudyOutcome:
    """Run `settings.trials` more trials of the study (creating it if needed)."""
    import optuna

    from llmcustoms.faults import FaultInjector
    from llmcustoms.finetuner import FineTuner
    from llmcustoms.position import StopCause
    from llmcustoms.recovery import TrainingFailed, TrainingInterrupted

    base = prepared.plan
    if base.eval_rows == 0 or not prepared.evaluation:
        raise ConfigError("Tuning needs held-out rows to score trials, and this plan has none.",
                          "Pass --eval-split 0.1 (or more), or --eval-data FILE.")
    space = search_space(base, hardware, settings.lr_centre)
    study = open_study(settings, space)
    _check_same_study(study, base)
    faults = faults or FaultInjector.from_env()  # one injector: each fault fires once per process
    outcome = StudyOutcome(study=study, trials_this_run=0, steps_run=0, steps_budgeted=0, best_preset_path=None)

    def objective(trial: Any) -> float:
        # Trial numbers are unique in a shared study; the lock keeps a stray second `tune` out anyway.
        run_dir = RunDirectory(settings.study_dir / f"trial-{trial.number:04d}")
        with runlock.owning(run_dir.path, "running a trial in it"):
            return run_trial(trial, run_dir)

    def run_trial(trial: Any, run_dir: RunDirectory) -> float:
        params = space.suggest(trial)
        plan = trial_plan(base, params, settings.steps)
        run_dir.create(overwrite=True)
        run_dir.write_plan(plan)
        last: dict[str, float] = {}
        tuner = FineTuner(plan, prepared.tokenizer, prepared.train, prepared.evaluation, run_dir, SilentReporter(warn),
                          faults=faults, on_evaluate=_pruning_report(trial, study, on_update, last), save_artifacts=False,
                          baseline=False)  # every trial starts from the same base model
        started = time.perf_counter()
        try:
            result = tuner.run()
        except TrainingFailed as failed:
            trial.set_user_attr("reason", failed.report["reason"])
            raise TrialFailed(failed.report["reason"]) from None
        except TrainingInterrupted:
            trial.set_user_attr("reason", "interrupted")
            raise
        finally:
            outcome.steps_run += tuner.position.step
            outcome.steps_budgeted += settings.steps
            _note_trial(trial, run_dir, tuner.position.step, time.perf_counter() - started)
        if result.stop is not None and result.stop.cause is StopCause.CALLER:
            trial.set_user_attr("reason", f"pruned at step {tuner.position.step}")
            raise optuna.TrialPruned(f"pruned at step {tuner.position.step}")
        return last.get("eval_loss", float("nan"))

    def after_trial(study: Any, trial: Any) -> None:
        outcome.trials_this_run += 1
        _refresh(study, on_update)

    try:
        study.optimize(objective, n_trials=settings.trials, timeout=settings.timeout, catch=(TrialFailed,),
                       callbacks=[after_trial])
    except (KeyboardInterrupt, TrainingInterrupted):
        outcome.interrupted = True
    outcome.rows = trial_rows(study)
    write_trials_csv(outcome.rows, settings.study_dir / "trials.csv")
    if _best_trial(study) is not None:
        outcome.best_preset_path = write_best_preset(study, base, preset, prepared, settings)
    return outcome


def open_study(settings: TuneSettings, space: SearchSpace) -> Any:
    """The study in its storage, created if it is new."""
    import optuna

    settings.study_dir.mkdir(parents=True, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        return optuna.create_study(study_name=settings.study_name, storage=open_storage(settings.storage, settings.study_dir),
                                   sampler=make_sampler(settings.sampler, space, settings.seed),
                                   pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0),
                                   direction="minimize", load_if_exists=True)
    except (ValueError, ImportError, RuntimeError) as exc:
        raise ConfigError(f"Cannot open the study storage: {exc}",
                          "Use an Optuna storage URL such as sqlite:///study.db, postgresql://..., or journal:FILE.") from None


def _pruning_report(trial: Any, study: Any, on_update: Callable[[list[dict[str, Any]]], None],
                    last: dict[str, float]) -> Callable[[int, float], bool]:
    """The trial's `on_evaluate`: reports eval loss to Optuna (keeping the latest
    in `last`) and says whether the pruner stops the trial."""
    reported: set[int] = set()

    def report(step: int, eval_loss: float) -> bool:
        last["eval_loss"] = eval_loss
        if step not in reported:  # a rollback replays steps; each is reported once
            reported.add(step)
            trial.report(eval_loss, step)
        _refresh(study, on_update, running=(trial.number, step, eval_loss))
        return trial.should_prune()

    return report


def _note_trial(trial: Any, run_dir: RunDirectory, steps: int, seconds: float) -> None:
    """What a trial did, kept with it in the study: steps, time, recoveries."""
    trial.set_user_attr("steps", steps)
    trial.set_user_attr("seconds", round(seconds, 2))
    recoveries = run_dir.read_status().get("recoveries", [])
    if recoveries:
        trial.set_user_attr("recoveries", [f"{r['kind']} at step {r['step']}: {r['action']}" for r in recoveries])


def _check_same_study(study: Any, base: Plan) -> None:
    """A study compares trials on one dataset and model; refuse to mix others in."""
    identity = {"data": base.data, "model": base.model, "eval_rows": base.eval_rows}
    stored = study.user_attrs.get("identity")
    if stored is None:
        study.set_user_attr("identity", identity)
    elif stored != identity:
        raise ConfigError(f"The study '{study.study_name}' was started on other data or another model "
                          f"({stored['data']}, {stored['model']}).",
                          "Use another --study-name (or --output-dir) for this dataset and model.")


def _best_trial(study: Any) -> Any:
    from optuna.trial import TrialState

    complete = [t for t in study.trials if t.state == TrialState.COMPLETE and t.value is not None and math.isfinite(t.value)]
    return min(complete, key=lambda t: t.value) if complete else None


def trial_rows(study: Any) -> list[dict[str, Any]]:
    """One row per trial, for the live table and trials.csv; `best` marks the
    complete trial with the lowest eval loss."""
    rows = []
    for t in study.trials:
        rows.append({"trial": t.number, "state": t.state.name.lower(), "eval_loss": t.value,
                     **{k: t.params.get(k) for k in ("lr", "lora_r", "alpha_ratio", "lora_dropout", "warmup_ratio")},
                     "steps": t.user_attrs.get("steps"), "seconds": t.user_attrs.get("seconds"),
                     "reason": "; ".join(filter(None, [t.user_attrs.get("reason")] + t.user_attrs.get("recoveries", []))),
                     "best": False})
    done = [r for r in rows if r["state"] == "complete" and r["eval_loss"] is not None]
    if done:
        min(done, key=lambda r: r["eval_loss"])["best"] = True
    return rows


def _refresh(study: Any, on_update: Callable[[list[dict[str, Any]]], None],
             running: tuple[int, int, float] | None = None) -> None:
    rows = trial_rows(study)
    if running is not None:
        number, step, loss = running
        for row in rows:
            if row["trial"] == number:
                row.update(state="running", eval_loss=loss, steps=step)
    on_update(rows)


def write_trials_csv(rows: list[dict[str, Any]], path: Path) -> None:
    columns = ["trial", "state", "eval_loss", "lr", "lora_r", "alpha_ratio", "lora_dropout", "warmup_ratio",
               "steps", "seconds", "reason"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) for k in columns})


def write_best_preset(study: Any, base: Plan, preset: TrainingPreset, prepared: PreparedRun,
                      settings: TuneSettings) -> Path:
    """The best trial as a preset file `train --preset FILE` accepts. The preset's
    adjustments for this dataset's size and this model's size are folded in, so
    the tuned values are the ones that apply."""
    from llmcustoms.modeling import describe_model

    best = _best_trial(study)
    model = describe_model(base.model, load_families(), "plan", base.trust_remote_code)
    values = preset.resolve(prepared.dataset.rows, model.arch.params, base.objective).values
    params = best.params
    values.update(lr=float(params["lr"]), warmup_ratio=float(params["warmup_ratio"]))
    if "lora_r" in params:
        rank = int(params["lora_r"])
        values.update(lora_r=rank, lora_alpha=max(1, round(rank * params["alpha_ratio"])),
                      lora_dropout=float(params["lora_dropout"]))
    data = {"name": f"tuned-{settings.study_name}",
            "description": (f"Tuned by llmcustoms tune on {Path(base.data).name}"
                            f"{' for preference tuning (DPO)' if base.objective == 'dpo' else ''}: best of "
                            f"{len(study.trials)} trials, eval loss {best.value:.4f} (trial {best.number})."),
            "models": list(preset.models),
            **({"cpu_models": list(preset.cpu_models)} if preset.cpu_models else {}),
            **{k: values[k] for k in TUNABLE_FIELDS},
            "by_dataset_size": {}}
    families = {spec.hub_id for family in load_families().values() for spec in family.models}
    parse_preset(data, "best_preset.yaml", families)  # what we write must load
    path = settings.study_dir / "best_preset.yaml"
    header = (f"# Written by `llmcustoms tune` (study {settings.study_name}, trial {best.number}).\n"
              f"# Use it with: llmcustoms train DATA --preset {path}\n")
    path.write_text(header + yaml.safe_dump(data, sort_keys=False))
    return path
