"""What fits this machine, worked out for the UI to show: the `hardware`
command's table (per model and method, and grouped by family: `by_family`)
and the models `setup` offers.
(`planning/sizing.py` answers the planner's own question: which method and
micro-batch for the one model being planned, or why nothing fits.)

Pure, like the rest of planning: `MemoryEstimator` estimates only, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmcustoms.planning.hardware import Hardware
from llmcustoms.planning.memory import MemoryEstimator
from llmcustoms.planning.planner import MICRO_BATCH_CAP
from llmcustoms.planning.presets import Family

TABLE_METHODS = ("lora", "qlora", "full")
TABLE_SEQ_LEN = 1024


@dataclass(frozen=True)
class MethodFit:
    """One model trained one way: the largest micro-batch without gradient
    checkpointing (0 if none), whether checkpointing makes it fit, and, when
    nothing fits, what micro-batch 1 with checkpointing needs."""

    micro_batch: int
    needs_checkpointing: bool
    need_bytes: int

    @property
    def fits(self) -> bool:
        return self.micro_batch > 0 or self.needs_checkpointing


@dataclass(frozen=True)
class ModelFit:
    hub_id: str
    params: int
    methods: dict[str, MethodFit]
    family: str = ""


@dataclass(frozen=True)
class FamilyFit:
    """A family against this machine, method by method: the largest of its
    models that fits and how, or, when none does, its smallest model and what
    that needs. `hub_ids` are its models, smallest first."""

    family: str
    smallest_params: int
    largest_params: int
    hub_ids: tuple[str, ...]
    methods: dict[str, tuple[int, MethodFit]]  # method -> (params of the model shown, its fit)


@dataclass(frozen=True)
class FitTable:
    budget_bytes: int
    on_gpu: bool
    seq_len: int
    methods: tuple[str, ...]
    models: tuple[ModelFit, ...]


@dataclass(frozen=True)
class FittingModel:
    """A catalog model that fits, with the cheapest method that does and its estimate."""

    hub_id: str
    params: int
    method: str
    total_bytes: int


def _method_fit(memory: MemoryEstimator, method: str, seq_len: int, precision: str) -> MethodFit:
    # On a GPU full fine-tuning can take 8-bit AdamW, as the planner would where it helps
    # (`sizing.fit_with_optimizer`); for adapters the optimizer's state is too small to matter.
    optimizer = "adamw_8bit" if memory.on_gpu and method == "full" else "adamw"
    batch = memory.largest_micro_batch(method, seq_len, precision, False, MICRO_BATCH_CAP, optimizer=optimizer)
    if batch:
        return MethodFit(batch, False, 0)
    if memory.largest_micro_batch(method, seq_len, precision, True, MICRO_BATCH_CAP, optimizer=optimizer):
        return MethodFit(0, True, 0)
    return MethodFit(0, False, memory.estimate(method, 1, seq_len, precision, True, optimizer=optimizer).total_bytes)


def fit_table(hardware: Hardware, families: dict[str, Family], seq_len: int = TABLE_SEQ_LEN) -> FitTable:
    """Every catalog model against this machine's budget, method by method."""
    budget = hardware.memory_budget_bytes
    models = []
    for family in families.values():
        for spec in family.models:
            memory = MemoryEstimator(spec, hardware.has_gpu, budget)
            models.append(ModelFit(spec.hub_id, spec.params, {
                method: _method_fit(memory, method, seq_len, hardware.mixed_precision) for method in TABLE_METHODS},
                family.name))
    return FitTable(budget, hardware.has_gpu, seq_len, TABLE_METHODS, tuple(models))


def by_family(fits: FitTable) -> list[FamilyFit]:
    """`fits` a row per family, in catalog order: with a dozen families the
    table of every model would not fit a screen."""
    families: dict[str, list[ModelFit]] = {}
    for model in fits.models:
        families.setdefault(model.family, []).append(model)
    rows = []
    for name, models in families.items():
        models = sorted(models, key=lambda m: m.params)
        methods = {}
        for method in fits.methods:
            fitting = [m for m in models if m.methods[method].fits]
            shown = fitting[-1] if fitting else models[0]
            methods[method] = (shown.params, shown.methods[method])
        rows.append(FamilyFit(name, models[0].params, models[-1].params, tuple(m.hub_id for m in models), methods))
    return rows


def family_availability(hub_ids: tuple[str, ...], where: dict[str, str]) -> str:
    """Where a family's models would load from, in one cell: the one answer
    when all agree, else how many are cached or local ("2 of 4 cached")."""
    answers = [where.get(hub_id, "") for hub_id in hub_ids]
    if len(set(answers)) == 1:
        return answers[0]
    here = sum(answer in ("cached", "local") for answer in answers)
    return f"{here} of {len(answers)} cached" if here else answers[0]


def fitting_models(hardware: Hardware, families: dict[str, Family], seq_len: int) -> list[FittingModel]:
    """Every catalog model that fits this machine with LoRA or QLoRA at micro-batch 1
    (with checkpointing), smallest first."""
    fits = []
    for family in families.values():
        for spec in family.models:
            memory = MemoryEstimator(spec, hardware.has_gpu, hardware.memory_budget_bytes)
            for method in ("lora", "qlora"):
                estimate = memory.estimate(method, 1, seq_len, hardware.mixed_precision, True)
                if estimate.fits:
                    fits.append(FittingModel(spec.hub_id, spec.params, method, estimate.total_bytes))
                    break
    return sorted(fits, key=lambda choice: round(choice.params / 1e9, 1))
