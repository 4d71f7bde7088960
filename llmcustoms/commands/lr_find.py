"""`llmcustoms lr-find`: the learning-rate range test (Leslie Smith, 2015; fastai's
`lr_find`, PyTorch Lightning's `Tuner.lr_find`).

A short training run on the plan's model, method and batch, whose learning
rate rises exponentially from `start_lr` to `end_lr`, one value per optimizer
step, recording each step's loss. It stops early once the smoothed loss
passes 4x its minimum (diverged) or the loss is not finite.

The suggestion is Lightning's and fastai's "steep" rule, bounded: the lr where
the smoothed loss (EMA, beta 0.98, bias-corrected) falls fastest against
log lr, looking only below the lr of its minimum. fastai's other common rule,
the minimum's lr / 10, is reported beside it. A curve whose smoothed loss never
falls by `MIN_DROP` gets no suggestion rather than a number read from noise.

The loop is its own, not `FineTuner`'s (FineTuner's recovery would fight a run
that is meant to diverge, and this one needs no checkpoints, evaluation or
schedule), but each step's gradients are taken as `train` takes them
(`training/step.py`: the same micro-batches, packed or not, and the run's loss). Out of memory is caught in one place, `_train`, and ends the
command with a hint. `tune --lr-find` centres its search on the suggestion
(`centre_study`).
"""

from __future__ import annotations

import json
import math
import re
import shlex
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from llmcustoms.errors import ConfigError
from llmcustoms.losses.choice import loss_for
from llmcustoms.losses.objective import LoopParts
from llmcustoms.models.loading import load_model
from llmcustoms.planning.objectives import needs_cached_reference
from llmcustoms.planning.train_options import TrainOptions
from llmcustoms.preparation.prepared_run import PreparedRun
from llmcustoms.preparation.preparing import prepare_run
from llmcustoms.runs.run_directory import write_json_atomic
from llmcustoms.training.batching import TrainingRows, epoch_steps, pad_multiple
from llmcustoms.training.optimization import make_optimizer
from llmcustoms.training.preflight import usable_hardware
from llmcustoms.training.processes import accelerator_for
from llmcustoms.training.step import accumulate_gradients, step_micro_batches
from llmcustoms.ui import tune_view
from llmcustoms.ui.data_view import PreparationProgress, show_prepared

DEFAULT_STEPS = 100
START_LR, END_LR = 1e-7, 1.0
BETA = 0.98  # the EMA of the loss: Lightning's and fastai's
DIVERGENCE = 4.0  # stop once the smoothed loss passes this many times its minimum
MIN_DROP = 0.05  # a fall smaller than this share of the starting loss is noise
# Fewer points than this are not a curve: 10 steps over lr 1e-7..1 suggested 6.0e-07,
# a dip between two batches (Lightning refuses 12 or fewer, fastai runs 100).
MIN_POINTS = 20
WHOLE_TABLE = 12  # a curve of at most this many steps is shown whole
RULE = "steepest descent of the smoothed loss, below the lr of its minimum"
OTHER_RULE = "the lr of the minimum smoothed loss / 10"
FORMAT = 1  # of the saved JSON

Row = dict[str, Any]


# ------------------------------------------------------------- pure pieces


def lr_sequence(start: float, end: float, steps: int) -> list[float]:
    """`steps` learning rates rising exponentially from `start` to `end`, both included."""
    if steps == 1:
        return [start]
    return [start * (end / start) ** (i / (steps - 1)) for i in range(steps)]


def smooth(losses: list[float], beta: float = BETA) -> list[float]:
    """The exponential moving average of `losses`, bias-corrected so the first
    values are not pulled towards zero."""
    average, smoothed = 0.0, []
    for i, loss in enumerate(losses, start=1):
        average = beta * average + (1 - beta) * loss
        smoothed.append(average / (1 - beta ** i))
    return smoothed


def stop_reason(smoothed: list[float], factor: float = DIVERGENCE) -> str | None:
    """Why the range test stops after the last point, or None to go on."""
    last = smoothed[-1]
    if not math.isfinite(last):
        return "the loss is not finite"
    if len(smoothed) > 1 and last > factor * min(smoothed):
        return f"the smoothed loss passed {factor:g}x its minimum"
    return None


@dataclass(frozen=True)
class Suggestion:
    """What the curve says. `lr` is None when it says nothing (`reason` says why)."""

    lr: float | None
    rule: str = RULE
    steepest_lr: float | None = None
    min_loss_lr: float | None = None
    min_loss_lr_over_10: float | None = None
    reason: str | None = None


def suggest(lrs: list[float], smoothed: list[float | None], min_drop: float = MIN_DROP) -> Suggestion:
    """The lr in the middle of the steepest fall of the smoothed loss against
    log lr, among the points before the minimum. The first tenth of the points
    is left out, as Lightning and fastai do: there the EMA has seen too little
    to be smooth. The fall is measured over a window of a tenth of the points,
    not from one point to the next: on real data one batch's loss differs from
    the next by more than the lr changes it early on, and a one-step dip would
    win (a 72-step test on SmolLM2 suggested 4.9e-07 that way)."""
    points = next((i for i, v in enumerate(smoothed) if v is None or not math.isfinite(v)), len(smoothed))
    if points == 0:
        return Suggestion(None, reason="no step had a finite loss")
    values = [float(v) for v in smoothed[:points]]  # type: ignore[arg-type]
    # The minimum of all the points: one that left out the first tenth once marked
    # step 4 the minimum where step 1 was lower.
    best = min(range(points), key=lambda i: values[i])
    if points < MIN_POINTS:
        return Suggestion(None, min_loss_lr=lrs[best],
                          reason=f"only {points} steps with a finite loss, too few to read a curve "
                                 f"(one batch's loss differs from the next by more than the lr changes it: "
                                 f"it takes {MIN_POINTS} or more)")
    skip = max(1, points // 10)
    start = values[skip]
    if best <= skip or start - values[best] < min_drop * abs(start):
        return Suggestion(None, min_loss_lr=lrs[best],
                          reason=f"the smoothed loss did not fall by {min_drop:.0%} or more "
                                 f"between lr {lrs[skip]:.1e} and {lrs[points - 1]:.1e}")
    window = max(1, min(points // 10, best - skip))
    slopes = {i: (values[i + window] - values[i]) / math.log(lrs[i + window] / lrs[i])
              for i in range(skip, best - window + 1)}
    steepest = min(slopes, key=lambda i: slopes[i]) + window // 2
    return Suggestion(lrs[steepest], steepest_lr=lrs[steepest], min_loss_lr=lrs[best],
                      min_loss_lr_over_10=lrs[best] / 10)


def table_stride(points: int, count: int = 8) -> int:
    """The table shows every this many steps: 1 for a curve short enough to show
    whole, else as many as keep it near `count` rows."""
    return 1 if points <= WHOLE_TABLE else math.ceil((points - 1) / max(1, count - 1))


def rows_shown(points: int, count: int = 8) -> str:
    """What the table's rows are, said under it: a user who finds step 3 missing
    should know it was left out on purpose (the whole curve is in the saved file)."""
    stride = table_stride(points, count)
    if stride == 1:
        return f"every step of {points}"
    return f"every {stride} steps from step 1 (of {points}), the last, the suggested and the smoothed minimum's"


def sample_rows(curve: list[Row], suggestion: Suggestion, count: int = 8) -> list[Row]:
    """A handful of the curve's rows for a table: every `table_stride` steps from
    the first, the last, and the suggested and the minimum's rows, each marked in `note`."""
    if not curve:
        return []
    marks = {suggestion.min_loss_lr: "smoothed minimum", suggestion.steepest_lr: "suggested"}
    marks.pop(None, None)
    picked = set(range(0, len(curve), table_stride(len(curve), count))) | {len(curve) - 1}
    picked |= {i for i, row in enumerate(curve) if row["lr"] in marks}
    return [{**curve[i], "note": marks.get(curve[i]["lr"], "")} for i in sorted(picked)]


def no_suggestion_error(suggestion: Suggestion, steps: int) -> ConfigError:
    if steps < MIN_POINTS:
        return ConfigError(f"No learning rate to suggest: {suggestion.reason}.",
                           f"Run `llmcustoms lr-find` with --steps {DEFAULT_STEPS} (at least {MIN_POINTS}; the rows "
                           "are used again when there are fewer than the steps take). Meanwhile the preset's lr is "
                           "a sound start.")
    return ConfigError(f"No learning rate to suggest: {suggestion.reason}.",
                       f"Run `llmcustoms lr-find` with more steps, so each lr is tried longer (--steps "
                       f"{max(2 * steps, DEFAULT_STEPS)}), or over a wider range (--start-lr 1e-8 --end-lr 1). "
                       "If the loss still does not fall, check the data. `tune` without --lr-find searches around "
                       "the preset's lr.")


# ---------------------------------------------------------------- results


@dataclass(frozen=True)
class RangeTest:
    """What `lr-find` was asked for: steps (None: the default) and the lr range."""

    steps: int | None = None
    start_lr: float = START_LR
    end_lr: float = END_LR

    def check(self) -> None:
        if not 0 < self.start_lr < self.end_lr:
            raise ConfigError(f"--start-lr {self.start_lr:g} must be above 0 and below --end-lr {self.end_lr:g}.",
                              "For example --start-lr 1e-7 --end-lr 1.")

    def steps_for(self, total_steps: int) -> int:
        """Given, or the default, or fewer when a whole training run is shorter."""
        return self.steps or max(MIN_POINTS, min(DEFAULT_STEPS, total_steps))


@dataclass
class RangeTestResult:
    model: str
    method: str
    data: str
    data_sha256: str
    start_lr: float
    end_lr: float
    steps: int  # planned; the curve may be shorter
    curve: list[Row]
    stopped: str | None
    suggestion: Suggestion
    settings: dict[str, Any] = field(default_factory=dict)  # the batch and LoRA shape it ran with

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RangeTestResult:
        values = {k: v for k, v in data.items() if k != "format"}
        return cls(**{**values, "suggestion": Suggestion(**values["suggestion"])})


def result_path(output_dir: Path, plan: Any) -> Path:
    """`<output-dir>/lr-find-<data stem>-<model short name>.json`."""
    name = f"{Path(plan.data).stem}-{Path(plan.model.rstrip('/')).name}"
    return Path(output_dir) / f"lr-find-{re.sub(r'[^A-Za-z0-9._-]+', '-', name).lower()}.json"


def save(result: RangeTestResult, path: Path) -> Path:

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result.to_json())
    return path


def load_saved(path: Path, plan: Any) -> RangeTestResult | None:
    """The saved result at `path` if it is for the plan's model and data (by
    checksum), trained the same way (LoRA and full fine-tuning want lrs far apart)."""
    try:
        data = json.loads(path.read_text())
        result = RangeTestResult.from_json(data)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # none, or unreadable: the range test runs again
    same = (result.model, result.data_sha256, result.method) == (plan.model, plan.data_sha256, plan.method)
    return result if data.get("format") == FORMAT and same else None


def next_commands(options: TrainOptions, output_dir: Path, lr: float) -> list[str]:
    """`train` with the suggested lr, and `tune` centred on it, with the flags that chose this model."""
    given = [("--model", options.model), ("--preset", options.preset),
             ("--method", options.override("method", None)),
             ("--output-dir", None if Path(output_dir) == Path("runs") else str(output_dir))]
    extra = [part for flag, value in given if value for part in (flag, str(value))]
    return [shlex.join(["llmcustoms", "train", options.data, "--lr", f"{lr:.1e}", *extra]),
            shlex.join(["llmcustoms", "tune", options.data, "--lr-find", *extra])]


# ------------------------------------------------------------ the commands


def find_learning_rate(options: TrainOptions, output_dir: Path, test: RangeTest) -> RangeTestResult:
    """The body of `lr-find`: prepare as `train` would, run the range test,
    save and show it. A curve with no suggestion ends in an error (exit 2),
    after the curve is shown and saved."""
    test.check()
    with PreparationProgress() as progress:
        prepared = prepare_run(options, usable_hardware(), progress=progress)
    show_prepared(prepared, options.data)
    result, path = _run_and_save(prepared, test, output_dir)
    lr = result.suggestion.lr
    tune_view.show_lr_find(result, sample_rows(result.curve, result.suggestion), path,
                          next_commands(options, output_dir, lr) if lr else [],
                          _notes(result, test, prepared.plan.total_steps),
                          shown=rows_shown(len(result.curve)))
    if lr is None:
        raise no_suggestion_error(result.suggestion, result.steps)
    return result


def _run_and_save(prepared: PreparedRun, test: RangeTest, output_dir: Path) -> tuple[RangeTestResult, Path]:

    with tune_view.RangeTestDisplay(test.steps_for(prepared.plan.total_steps)) as display:
        result = run_range_test(prepared, test, on_step=display.update)
    return result, save(result, result_path(output_dir, prepared.plan))


def _notes(result: RangeTestResult, test: RangeTest, total_steps: int) -> list[str]:
    if test.steps is None and result.steps < DEFAULT_STEPS:
        ran = ("so the range test ran that many" if total_steps >= MIN_POINTS
               else f"but the range test ran {MIN_POINTS}, the fewest that read as a curve")
        return [f"a whole training run is only {total_steps} steps, {ran}; --steps {DEFAULT_STEPS} gives a finer curve."]
    return []


def centre_study(study: Any, output_dir: Path, run_missing: bool = True) -> Any:
    """`tune`: the study (`tune.PreparedStudy`) with its lr range centred on the
    saved range test for this model and data; with none saved, on one run now
    (`run_missing`, `tune --lr-find`) or the study as it is."""
    plan = study.prepared.plan
    path = result_path(output_dir, plan)
    result = load_saved(path, plan)
    ran = result is None
    if result is None:
        if not run_missing:
            return study
        tune_view.show_lr_find_starting(path)
        result, path = _run_and_save(study.prepared, RangeTest(), output_dir)
    lr = result.suggestion.lr
    if lr is None:
        if not run_missing:
            return study
        raise no_suggestion_error(result.suggestion, result.steps)
    tune_view.show_lr_centre(path, lr, ran)
    return replace(study, settings=replace(study.settings, lr_centre=lr), space=study.space.centred(lr))


# -------------------------------------------------------------- the loop


def run_range_test(prepared: PreparedRun, test: RangeTest,
                   on_step: Callable[[Row], None] = lambda row: None) -> RangeTestResult:
    """The range test on a prepared run (`preparation.prepare_run`)."""
    import gc

    import torch

    plan = prepared.plan
    if needs_cached_reference(plan):
        raise ConfigError("The learning-rate range test cannot run DPO with --method full or --from-run: their "
                          "reference is computed before training, which the test does not do.",
                          "Run it with --method lora (the reference is the adapter switched off), or pick --lr by hand.")
    lrs = lr_sequence(test.start_lr, test.end_lr, test.steps_for(plan.total_steps))
    curve, stopped = _train(plan, prepared.tokenizer, prepared.train, lrs, on_step)
    gc.collect()  # the model and optimizer are gone; `tune --lr-find` trains next
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    settings = {"micro_batch_size": plan.micro_batch_size, "grad_accum": plan.grad_accum,
                "max_seq_len": plan.max_seq_len, "seed": plan.seed,
                "lora_r": plan.lora.r if plan.lora else None, "lora_alpha": plan.lora.alpha if plan.lora else None}
    return RangeTestResult(model=plan.model, method=plan.method, data=plan.data, data_sha256=plan.data_sha256,
                           start_lr=test.start_lr, end_lr=test.end_lr, steps=len(lrs), curve=curve, stopped=stopped,
                           suggestion=suggest([r["lr"] for r in curve], [r["smoothed"] for r in curve]),
                           settings=settings)


def _train(plan: Any, tokenizer: Any, rows: list[Any], lrs: list[float],
           on_step: Callable[[Row], None]) -> tuple[list[Row], str | None]:
    """One optimizer step per lr; the curve, and why it stopped early (None: it did not).

    The one place out of memory is caught; the exception is dropped before
    memory is freed, since its traceback holds the step's tensors."""
    import torch
    from accelerate.utils import set_seed


    accelerator = accelerator_for(plan.mixed_precision)
    set_seed(plan.seed)  # the LoRA init, and dropout, as `train` would draw them
    model = load_model(plan, 0 if torch.cuda.is_available() else None)
    if plan.method != "qlora" or not torch.cuda.is_available():  # 4-bit models are placed by their device_map
        model = model.to(accelerator.device)
    data = TrainingRows(rows, [], tokenizer.pad_token_id, pad_multiple(plan), packing=plan.packing)
    loss = loss_for(plan)
    # No run directory or other processes: a loss that needs them (DPO's cached reference) was refused before.
    loss.setup(model, LoopParts(plan, data, None, None, accelerator.autocast, lambda text: None))
    optimizer = accelerator.prepare_optimizer(make_optimizer(model, plan))
    model.train()
    curve: list[Row] = []
    losses: list[float] = []
    out_of_memory = False
    try:
        for lr, step in zip(lrs, _steps(data.lengths, plan)):
            started = time.perf_counter()
            losses.append(_step(model, loss, optimizer, accelerator, data, step, plan, lr))
            smoothed = smooth(losses)
            row = {"step": len(losses), "lr": lr, "loss": _finite(losses[-1]), "smoothed": _finite(smoothed[-1])}
            curve.append(row)
            # The step's own time for the display's ETA: the wait before step 1 held loading the model.
            on_step({**row, "seconds": time.perf_counter() - started})
            reason = stop_reason(smoothed)
            if reason is not None:
                return curve, f"stopped at step {len(losses)} (lr {lr:.1e}): {reason}"
    except torch.OutOfMemoryError:
        out_of_memory = True
    if out_of_memory:
        optimizer.zero_grad(set_to_none=True)
        model = optimizer = None
        raise ConfigError(f"Out of memory in step {len(losses) + 1} of the range test.",
                          "Pass a smaller --batch-size or --max-seq-len, or --method qlora.")
    return curve, None


def _steps(lengths: list[int], plan: Any) -> Iterator[list[int]]:
    """The rows of each optimizer step, as `train` takes them, epoch after epoch."""
    epoch = 0
    while True:
        yield from epoch_steps(lengths, plan.effective_batch_size, plan.seed, epoch)
        epoch += 1


def _step(model: Any, loss: Any, optimizer: Any, accelerator: Any, data: Any, rows: list[int], plan: Any,
          lr: float) -> float:
    """One optimizer step at `lr`, its gradients taken as `train` takes them;
    its loss (the update is skipped if that is not finite)."""
    import torch


    for group in optimizer.param_groups:
        group["lr"] = lr
    device = accelerator.device
    packed_to = plan.max_seq_len if data.packing else 0
    batches = [(data.collate(b), 1.0) for b in step_micro_batches(rows, data.lengths, plan.micro_batch_size, packed_to)]
    normaliser = torch.tensor(max(1, data.token_counts(rows)[0]), device=device)
    totals = accumulate_gradients(model, loss, batches, normaliser, device, accelerator.autocast, accelerator.backward)
    total = totals[0]
    trainable = [p for p in model.parameters() if p.requires_grad]
    accelerator.clip_grad_norm_(trainable, plan.max_grad_norm if plan.max_grad_norm > 0 else float("inf"))
    value = total.item()  # the one host sync per step
    if math.isfinite(value):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return value


def _finite(value: float) -> float | None:
    """JSON has no NaN: a non-finite loss is kept as null."""
    return value if math.isfinite(value) else None
