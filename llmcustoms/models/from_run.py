"""`--from-run`: start from a finished run's weights, the SFT-then-DPO recipe.

A LoRA or QLoRA run's adapter goes on training (on its own base model, with
its own rank, alpha and targets), so what comes out is again one adapter on
the base model: `generate`, `chat` and `export --merge` take it like any
other. The reference of a DPO run started this way is the model the earlier
run made, adapter included, so its log-probabilities are computed once up
front (`losses/dpo_reference.py`). A full fine-tuning run's saved model is simply the
model to start from. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from llmcustoms.errors import ConfigError
from llmcustoms.models.loading import adapter_weights
from llmcustoms.planning.options import Overrides
from llmcustoms.planning.train_options import TrainOptions
from llmcustoms.runs.adapter_files import adapter_problem
from llmcustoms.runs.run_directory import RunDirectory


@dataclass(frozen=True)
class StartingPoint:
    """What a run started from another one takes from it."""

    model: str  # the model to load: the earlier run's base model, or its saved full model
    adapter: str  # the adapter that goes on training; "" when starting from a full model
    method: str | None  # the method the adapter needs (lora or qlora); None: any
    overrides: Overrides  # the adapter's shape, for the plan
    reason: str


def starting_point(path: str, trusted: bool = False) -> StartingPoint:
    """The finished run at `path`, checked; ConfigError says what is wrong.
    `trusted`: this command allows remote code (its plan.json alone never does)."""
    run = RunDirectory(Path(path))
    if not run.plan_path.exists():
        raise ConfigError(f"--from-run {path}: not a run directory (no plan.json).",
                          "Pass a directory made by `llmcustoms train`, such as runs/my-sft.")
    plan = run.read_plan()
    if plan.trust_remote_code and not trusted:
        raise ConfigError(f"--from-run {path}: its model ({plan.model}) runs code from its repository "
                          "(trust_remote_code).",
                          "Pass --trust-remote-code to allow it for this command, if you trust that repository.")
    if run.read_status().get("status") != "completed":
        raise ConfigError(f"--from-run {path}: that run has not finished, so it has no final weights to start from.",
                          f"Finish it first (`llmcustoms resume {path}`), then start from it.")
    weights = run.output_path(plan.method)
    if not weights.is_dir():
        raise ConfigError(f"--from-run {path}: its weights ({weights.name}/) are missing.",
                          "Point --from-run at a run whose weights are still there.")
    if plan.method == "full":
        return StartingPoint(str(weights.resolve()), "", None, {},
                             f"starts from {run.path.name}'s fully fine-tuned model ({weights})")
    assert plan.lora is not None
    adapter_weights(weights)  # safetensors only, refused now rather than once the model is loaded
    damaged = adapter_problem(weights)
    if damaged is not None:
        raise ConfigError(f"--from-run {path}: its adapter is damaged ({damaged}).",
                          "Train that run again, or put back its adapter/ from a copy; then start from it.")
    shape = {"lora_r": (plan.lora.r, "from-run"), "lora_alpha": (plan.lora.alpha, "from-run"),
             "lora_dropout": (plan.lora.dropout, "from-run")}
    return StartingPoint(plan.model, str(weights.resolve()), plan.method, shape,
                         f"starts from {run.path.name}: its {plan.method} adapter on {plan.model} goes on training "
                         "(rank and alpha as there)")


def with_starting_point(options: TrainOptions) -> tuple[Any, StartingPoint | None]:
    """`options` (a `TrainOptions`) with the model, method and adapter shape
    of its `from_run`, and what it starts from (None without --from-run)."""
    if not options.from_run:
        return options, None
    start = starting_point(options.from_run, bool(options.override("trust_remote_code", False)))
    if options.model and Path(options.model).resolve() != Path(start.model).resolve() and options.model != start.model:
        raise ConfigError(f"--model {options.model} and --from-run {options.from_run} disagree: that run trained "
                          f"{start.model}.", "Drop --model: --from-run brings its model.")
    given_method = options.overrides.get("method", (None, ""))[0]
    if start.method and given_method and given_method != start.method:
        raise ConfigError(f"--method {given_method} cannot go on with --from-run {options.from_run}'s "
                          f"{start.method} adapter.", f"Drop --method, or pass --method {start.method}.")
    overrides = {**options.overrides, **start.overrides}  # the adapter's shape is what it is
    if start.method:
        overrides["method"] = (start.method, "from-run")
    return replace(options, model=start.model, model_source="from-run", overrides=overrides), start
