"""What each objective is, as every layer needs to know it: an `Objective` value.

A run's plan names its objective ("sft", "dpo"); the loss that trains it lives in
`losses/` (each `Loss` names its `Objective`), and everything else (planning,
the data's checks, the loop's extras, what is shown and reported) asks the
objective's properties here, never its name. A new objective is one value in
`OBJECTIVES` and one `Loss` in `losses/choice.LOSSES` (CONTRIBUTING.md, "A loss
or objective"): a pair loss such as SimPO or ORPO is `pairs=True` like DPO, and
every layer then treats it as pairs.

Part of planning: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmcustoms.errors import ConfigError


@dataclass(frozen=True)
class Objective:
    name: str  # the plan's and --objective's name
    learns: str  # what it learns, in a few words for the plan's reason line
    # Rows are preference pairs (a prompt, a chosen and a rejected reply), run as two
    # consecutive sequences through the model and never packed; else rows with one reply.
    pairs: bool = False
    # Its loss is the replies' mean next-token cross-entropy: evaluations show perplexity,
    # forgetting is measured on general text beside it, replay can mix general rows into
    # its steps, and its measured tokens/s are the speed the next plan's time is drawn from.
    token_loss: bool = True
    # It compares the model with itself before training (DPO's reference): a forward of
    # the frozen model beside each step's, or its log-probabilities computed up front.
    reference: bool = False
    # A step's and an evaluation's work against SFT's on as many rows (`planner.py`'s duration):
    # DPO's pair is two sequences and the reference's forward (a third of a training step each).
    step_work: float = 1.0
    evaluation_work: float = 1.0
    # Its `beta` (the plan's, --beta): how far the model may move from the reference.
    uses_beta: bool = False

    @property
    def sequences_per_row(self) -> int:
        return 2 if self.pairs else 1

    @property
    def packable(self) -> bool:
        """Whether its rows may run packed, as one sequence a micro-batch (`models/packing.py`)."""
        return not self.pairs

    @property
    def loss_label(self) -> str:
        """How its eval loss is named where it is not a perplexity ("dpo loss")."""
        return "eval loss" if self.token_loss else f"{self.name} loss"


SFT = Objective("sft", "the replies")
DPO = Objective("dpo", "to prefer each pair's chosen reply", pairs=True, token_loss=False, reference=True,
                step_work=8 / 3, evaluation_work=4, uses_beta=True)

# Every objective by name: --objective's choices, the presets' `by_objective` keys, what a plan names.
OBJECTIVES: dict[str, Objective] = {objective.name: objective for objective in (SFT, DPO)}


def objective_named(name: str) -> Objective:
    """The objective a plan or a flag names. An unknown name (a plan written by a version
    that had more) is refused, never trained or shown as another objective."""
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ConfigError(f"the objective '{name}' is not one this version of llmcustoms knows "
                          f"({', '.join(OBJECTIVES)}).",
                          "Use the llmcustoms version that wrote the run, or train again with --objective.") from None


def default_objective(pairs: bool) -> Objective:
    """What data trains with when no objective is given: pairs with DPO, other rows with SFT."""
    return DPO if pairs else SFT
