"""The plan and what planning reads: the frozen `Plan` a run trains by (saved
as plan.json), the model choice, the data statistics and the LoRA settings.

Values and the arithmetic on them (plan.json in and out, percentiles of row
lengths); the choices themselves are made in `planning/planner.py`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from llmcustoms.errors import ConfigError
from llmcustoms.planning.objective_kinds import Objective, objective_named
from llmcustoms.planning.plan_values import PlanDamaged, plan_problem
from llmcustoms.planning.presets import ModelSpec

# Older plan.json files kept warnings among the reasons with this prefix.
_OLD_WARNING_PREFIX = "warning: "


def total_steps(epochs: float, steps_per_epoch: int) -> int:
    """Optimizer steps for `epochs` passes (a fraction of one counts as a step)."""
    return max(1, math.ceil(epochs * steps_per_epoch))


@dataclass(frozen=True)
class ModelChoice:
    """The model to train, as far as planning needs to know it."""

    name: str  # hub id or local path, as given
    family: str
    model_type: str
    target_modules: tuple[str, ...]
    max_context: int
    source: str  # where the choice came from: flag, env, preset, planner
    arch: ModelSpec  # architecture facts for the memory estimate


@dataclass(frozen=True)
class DataStats:
    """What planning needs to know about the data, per training row."""

    lengths: tuple[int, ...]  # tokens per row, before truncation
    first_loss_positions: tuple[int, ...]  # index of each row's first trained label
    eval_rows: int
    format: str = ""
    length_source: str = "tokenizer"

    @property
    def train_rows(self) -> int:
        return len(self.lengths)

    def percentile(self, q: float) -> int:
        ordered = sorted(self.lengths)
        return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]

    def rows_kept(self, max_seq_len: int) -> int:
        """Rows that still have a trained token after truncation to max_seq_len."""
        return sum(1 for p in self.first_loss_positions if p < max_seq_len)

    def rows_truncated(self, max_seq_len: int) -> int:
        return sum(1 for n in self.lengths if n > max_seq_len)

    def trained_fraction(self, max_seq_len: int) -> float:
        """Share of a row's positions that get logits (those predicting a trained
        token), at the 90th percentile over rows: the memory peak comes from the
        batch with the most, not the average one."""
        shares = sorted(max(0.0, (min(n, max_seq_len) - p) / max(1, min(n, max_seq_len)))
                        for n, p in zip(self.lengths, self.first_loss_positions) if p < max_seq_len)
        return shares[min(len(shares) - 1, int(0.9 * len(shares)))] if shares else 1.0

    def mean_length(self, max_seq_len: int) -> float:
        """Mean tokens per kept row after truncation: what a step really computes."""
        kept = [min(n, max_seq_len) for n, p in zip(self.lengths, self.first_loss_positions) if p < max_seq_len]
        return sum(kept) / max(1, len(kept))


@dataclass(frozen=True)
class LoraSettings:
    r: int
    alpha: int
    dropout: float
    target_modules: tuple[str, ...]


# No limit unless asked: forgetting is measured and reported, the weights kept chosen by eval loss.
# A 10% limit on SmolLM2-135M (identity data, lr 5e-4) kept 41 of 67 general questions instead
# of 32, but stopped at step 10 of 80: test loss 0.641 against 0.171, the taught name in 0% of
# answers against 83% (docs/benchmarks.md, "Forgetting"). A default must not cost what the data teaches.
DEFAULT_FORGETTING_LIMIT = 0.0
# Replay (`training/replay.py`) by default for supervised rows: on sentiment data (one-word labels)
# a quarter more rows a step of the base model's own replies kept 42 of the 67 general questions
# where the same run without it kept 10 (the base model: 47), at a lower test loss (0.072 against
# 0.098); docs/benchmarks.md, "Forgetting".
DEFAULT_REPLAY = 0.25


@dataclass(frozen=True)
class Plan:
    model: str
    family: str
    model_type: str
    preset: str
    method: str
    micro_batch_size: int
    grad_accum: int
    effective_batch_size: int
    max_seq_len: int
    gradient_checkpointing: bool
    mixed_precision: str
    lr: float
    lr_scheduler: str
    warmup_steps: int
    weight_decay: float
    max_grad_norm: float
    epochs: float
    steps_per_epoch: int
    total_steps: int
    eval_every: int
    early_stopping_patience: int
    save_every: int
    keep_checkpoints: int
    seed: int
    train_on_prompt: bool
    trust_remote_code: bool
    train_rows: int
    eval_rows: int
    lora: LoraSettings | None
    memory: dict[str, int] | None = None
    # How far the general text's loss may rise over the base model's in the weights kept
    # (`training/general_text.py`); 0: no limit, as in plans written before it.
    forgetting_limit: float = 0.0
    # Each step's share of replayed general rows, the base model's own replies (`training/replay.py`); 0: none.
    replay: float = 0.0
    estimated_seconds: float | None = None
    # What estimated_seconds is made of, by name ("training", "evaluations", ...: `duration.Duration`);
    # None in a plan written before the parts were kept.
    duration_parts: dict[str, float] | None = None
    # Processes training together; effective batch = micro x accumulation x world size.
    world_size: int = 1
    # How the processes share the work: "none" (one process), "ddp" (each holds
    # the whole model) or "fsdp" (weights, gradients and optimizer state sharded).
    distributed: str = "none"
    # "adamw", or bitsandbytes' "adamw_8bit", "paged_adamw", "paged_adamw_8bit".
    optimizer: str = "adamw"
    # A micro-batch's rows as one padding-free sequence (`models/packing.py`).
    packing: bool = False
    # torch.compile of the model.
    compile: bool = False
    # CPU threads of each process (`planning/cpu_share.py`); 0: torch's own (a GPU run,
    # or a plan written before it was chosen: one per physical core).
    cpu_threads: int = 0
    # Where the rows came from, so `resume` rebuilds exactly the same ones.
    data: str = ""
    data_format: str = ""
    data_sha256: str = ""
    eval_data_sha256: str = ""
    # The length rows were cut to when the run began (recovery may shorten
    # max_seq_len later; resume rebuilds the rows at this length first).
    row_max_len: int = 0
    eval_data: str | None = None
    eval_split: float = 0.0
    # Evaluation rows whose tokens are a training row's (--eval-data naming the training
    # file, or duplicates across the split): counted, so no verdict calls them held out.
    eval_overlap_rows: int = 0
    skip_bad_rows: bool = False
    # "default" (skip up to 5% of rows), "strict" or "skip"; and what reading found.
    bad_row_policy: str = "default"
    raw_prompts: bool = False
    # "sft" (learn the replies) or "dpo" (preference pairs): `objective_kind`; DPO's beta.
    objective: str = "sft"
    beta: float = 0.1
    # A finished run whose adapter this one starts from (`--from-run`), "" for none.
    from_run: str = ""
    # Whether weights may load from pickle files (--allow-pickle-weights). Only
    # the command that loads decides: `resume` sets it from its own flag.
    allow_pickle_weights: bool = False
    data_report: dict[str, Any] = field(default_factory=dict)
    # What the training rows' token ids depend on (`token_cache.tokenization_cache_key`):
    # resume refuses to go on with ids made another way.
    tokens_key: str = ""
    # The base model's files when the run began (`runs/model_files.py`): resume refuses
    # other weights unless told. Empty in plans written before it existed.
    model_fingerprint: dict[str, str] = field(default_factory=dict)
    reasons: tuple[str, ...] = ()
    # What is likely to go wrong with this plan (e.g. out of memory), apart from
    # the reasons so a caller can show them as warnings without parsing text.
    warnings: tuple[str, ...] = ()
    sources: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["reasons"] = list(self.reasons)
        data["warnings"] = list(self.warnings)
        if self.lora is not None:
            data["lora"]["target_modules"] = list(self.lora.target_modules)
        return data

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Plan":
        """The plan plan.json holds; `PlanDamaged` names the first field that is
        missing, of the wrong type or out of range (`plan_values`)."""
        problem = plan_problem(cls, data)
        if problem is not None:
            raise PlanDamaged(problem)
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if values.get("lora") is not None:
            lora = {f.name: values["lora"][f.name] for f in fields(LoraSettings)}  # a newer version's keys left out
            lora["target_modules"] = tuple(lora["target_modules"])
            values["lora"] = LoraSettings(**lora)
        reasons = list(values.get("reasons", ()))
        # Written before warnings had a field of their own: they were prefixed reasons.
        old_warnings = [r.removeprefix(_OLD_WARNING_PREFIX) for r in reasons if r.startswith(_OLD_WARNING_PREFIX)]
        values["reasons"] = tuple(r for r in reasons if not r.startswith(_OLD_WARNING_PREFIX))
        values["warnings"] = tuple(values.get("warnings", ())) + tuple(old_warnings)
        # Written when the planner was called the optimizer: that source is the planner's choice.
        values["sources"] = {k: "planner" if v == "optimizer" else v for k, v in values.get("sources", {}).items()}
        if "distributed" not in values and values.get("world_size", 1) > 1:
            values["distributed"] = "ddp"  # written before FSDP existed: several processes meant DDP
        return cls(**values)

    def with_changes(self, reason: str | None = None, **changes: Any) -> "Plan":
        """A copy with some values changed after planning (by recovery, or a resume
        with another number of processes), noting why: their source becomes the planner."""
        sources = dict(self.sources)
        sources.update({name: "planner" for name in changes})
        reasons = self.reasons + ((reason,) if reason else ())
        return replace(self, sources=sources, reasons=reasons, **changes)

    def with_warning(self, warning: str) -> "Plan":
        return replace(self, warnings=self.warnings + (warning,))

    @property
    def objective_kind(self) -> Objective:
        """What the objective is (`objective_kinds.py`): what every layer asks instead of its name."""
        return objective_named(self.objective)

    @property
    def evaluates_training_rows(self) -> bool:
        """Half the evaluation rows or more are training rows too: eval loss then says
        what the model remembers, not how it does on text it never saw."""
        return bool(self.eval_rows) and 2 * self.eval_overlap_rows >= self.eval_rows

    @property
    def epochs_planned(self) -> float:
        """The passes the plan's steps make: its epochs, or what --max-steps comes to."""
        return self.total_steps / self.steps_per_epoch if self.sources.get("total_steps") == "flag" else self.epochs

    def extended_to(self, epochs: float) -> "Plan":
        """The plan for `epochs` passes in all (`resume --epochs`), its steps counted
        as planning counts them; an error if that is no more steps than it has.

        Warmup keeps its steps: they are behind the run, and a longer warmup would
        rewrite what they were. The decay is stretched over the new length, so from
        the restored step on the learning rate is what a run planned this long (with
        this warmup) has there, the continuation a user asking for more epochs
        expects. After a finished cosine or linear decay that means the rate rises
        again at the restored step: kept near zero, the extra steps would learn nothing."""
        steps = total_steps(epochs, self.steps_per_epoch)
        if steps <= self.total_steps:
            raise ConfigError(f"--epochs {epochs:g} would not extend the run: it is planned for "
                              f"{self.epochs_planned:g} epochs ({self.total_steps} steps) already.",
                              f"Give more epochs than that, e.g. --epochs {math.floor(self.epochs_planned) + 1}.")
        seconds = self.estimated_seconds * steps / self.total_steps if self.estimated_seconds is not None else None
        reason = (f"extended to {epochs:g} epochs by `resume --epochs`: {self.total_steps} -> {steps} steps; the "
                  f"learning-rate decay is stretched over the new length (warmup kept at {self.warmup_steps} steps)")
        return replace(self, epochs=float(epochs), total_steps=steps, estimated_seconds=seconds,
                       reasons=self.reasons + (reason,),
                       sources={**self.sources, "epochs": "flag", "total_steps": "planner"})

    def with_max_steps(self, steps: int, done: int) -> "Plan":
        """The plan for `steps` optimizer steps in all (`resume --max-steps`), fewer or
        more than it has; an error unless more than the `done` steps the run goes on
        from. As with `extended_to`, warmup keeps its steps and the learning-rate
        decay follows the new length."""
        if steps <= done:
            raise ConfigError(f"The run is already at step {done}: --max-steps {steps} would not train it further.",
                              f"Give more than {done} steps; to use the run as it is, `generate` and `chat` "
                              "take --checkpoint latest.")
        seconds = self.estimated_seconds * steps / self.total_steps if self.estimated_seconds is not None else None
        reason = (f"set to {steps} steps by `resume --max-steps` (was {self.total_steps}); the learning-rate decay "
                  f"follows the new length (warmup kept at {self.warmup_steps} steps)")
        return replace(self, total_steps=steps, estimated_seconds=seconds, reasons=self.reasons + (reason,),
                       sources={**self.sources, "total_steps": "flag"})
