"""What a run learns, from its data and the flags: `sft` (the replies) or `dpo`
(to prefer the chosen reply of each preference pair).

Preference data trains with DPO unless told otherwise; the two contradictions
are refused before anything loads: `--objective dpo` on data without pairs,
and `--objective sft` on pairs, which as plain replies would teach the
rejected ones too. Part of planning: no torch, and the data is described to
it (whether it holds pairs, its name and format), not read here.
"""

from __future__ import annotations

from typing import Any

from llmcustoms.errors import ConfigError, DataError
from llmcustoms.planning.objective_kinds import default_objective, objective_named
from llmcustoms.planning.options import Overrides

# DPO's beta: TRL's, LLaMA-Factory's and the paper's default.
DEFAULT_BETA = 0.1


def with_objective(overrides: Overrides, pairs: bool, name: str, description: str) -> Overrides:
    """`overrides` with the objective set: as given, or from the data ("data").
    `pairs`: whether the data file `name` (rows of `description`) holds preference pairs."""
    given = overrides.get("objective", (None, ""))[0]
    objective = objective_named(given) if given is not None else default_objective(pairs)
    if objective.pairs and not pairs:
        raise DataError(f"--objective {objective.name} needs preference pairs, and {name} holds {description} rows.",
                        "Give rows with a prompt, a chosen and a rejected reply (docs/preference-tuning.md in "
                        "the llmcustoms repository), or drop --objective to fine-tune on the replies.")
    if pairs and not objective.pairs:
        raise ConfigError(
            f"{name} holds preference pairs: training on them as plain replies would teach the "
            "rejected ones too.",
            f"Drop --objective {objective.name} to train with DPO; to fine-tune on the preferred replies only, write "
            "each row as the prompt plus its chosen reply (e.g. {\"prompt\": ..., \"completion\": <chosen>}).")
    if objective.pairs and overrides.get("train_on_prompt", (False, ""))[0]:
        raise ConfigError(f"--train-on-prompt does not apply to preference tuning: {objective.name} compares the two "
                          "replies of a pair, whose prompt is the same.", "Drop --train-on-prompt.")
    if given is None:
        return {**overrides, "objective": (objective.name, "data")}
    return overrides


def needs_cached_reference(plan: Any) -> bool:
    """Whether a run's reference log-probabilities (DPO's) are computed up front
    (`losses/dpo_reference.py`): its model has no adapter to switch off to get them."""
    return plan.objective_kind.reference and (plan.method == "full" or bool(plan.from_run))


def preference_reason(plan: Any, source: str) -> str:
    """The plan's reason line for a pair objective; `source`: where the objective came from."""
    objective = plan.objective_kind
    given = {"data": "the data holds preference pairs"}.get(source, source)
    reference = ("its log-probabilities computed once up front" if needs_cached_reference(plan) else
                 "the same weights with the adapter off")
    return (f"objective {objective.name} ({given}): learns {objective.learns}"
            + (f"; beta {plan.beta:g}" if objective.uses_beta else "")
            + (f"; reference: the model before this training, {reference}" if objective.reference else "")
            + "; a micro-batch of N pairs puts 2N sequences through the model")


def check_eval_data(objective: str, pairs: bool, name: str, description: str) -> None:
    """--eval-data (the file `name`, of `description` rows) must hold the same kind of rows as the training data."""
    wants_pairs = objective_named(objective).pairs
    if pairs == wants_pairs:
        return
    wanted = "preference pairs" if wants_pairs else "rows with replies, not preference pairs"
    raise DataError(f"{name} (--eval-data) holds {description} rows; "
                    f"this run needs {wanted} there too, as in the training data.",
                    "Pass an evaluation file in the training data's shape, or drop --eval-data to hold out a "
                    "share of the training file.")
