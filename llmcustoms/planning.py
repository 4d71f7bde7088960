"""Turn hardware + preset + data statistics + user overrides into a frozen `Plan`.

Planning is pure: no torch, no files, no network. Every value in the plan
records where it came from (`sources`: flag, env, preset, optimizer, default)
and every automatic choice a one-line reason, so `plan` can explain itself and
tests can plan for machines we do not have by passing a `Hardware` value.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from llmcustoms.errors import ConfigError
from llmcustoms.hardware import Hardware
from llmcustoms.presets import TrainingPreset, validate_preset_values

DEFAULT_SEED = 42
DEFAULT_KEEP_CHECKPOINTS = 3
# A micro-batch this size keeps per-step overhead low without a memory model.
DEFAULT_MICRO_BATCH = 4
# Sequence length is chosen to cover this share of rows, rounded up to a multiple of 64.
LENGTH_PERCENTILE = 99


@dataclass(frozen=True)
class ModelChoice:
    """The model to train, as far as planning needs to know it."""

    name: str  # hub id or local path, as given
    family: str
    model_type: str
    target_modules: tuple[str, ...]
    max_context: int
    source: str  # where the choice came from: flag, env, preset


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


@dataclass(frozen=True)
class LoraSettings:
    r: int
    alpha: int
    dropout: float
    target_modules: tuple[str, ...]


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
    reasons: tuple[str, ...] = ()
    sources: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["reasons"] = list(self.reasons)
        if self.lora is not None:
            data["lora"]["target_modules"] = list(self.lora.target_modules)
        return data

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Plan":
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if values.get("lora") is not None:
            lora = dict(values["lora"])
            lora["target_modules"] = tuple(lora["target_modules"])
            values["lora"] = LoraSettings(**lora)
        values["reasons"] = tuple(values.get("reasons", ()))
        return cls(**values)

    def with_changes(self, reason: str | None = None, **changes: Any) -> "Plan":
        """A copy with some values changed by the optimizer, noting why."""
        sources = dict(self.sources)
        sources.update({name: "optimizer" for name in changes})
        reasons = self.reasons + ((reason,) if reason else ())
        return replace(self, sources=sources, reasons=reasons, **changes)


# Values a user may set with a flag (or, later, an environment variable).
OVERRIDABLE = (
    "method", "micro_batch_size", "grad_accum", "max_seq_len", "gradient_checkpointing",
    "mixed_precision", "lr", "lr_scheduler", "warmup_ratio", "weight_decay", "max_grad_norm",
    "epochs", "max_steps", "eval_every", "early_stopping_patience", "save_every",
    "keep_checkpoints", "seed", "train_on_prompt", "trust_remote_code", "lora_r",
    "lora_alpha", "lora_dropout", "eval_split",
)


class _Resolver:
    """Picks each value from overrides, then the preset, then a default, noting the source."""

    def __init__(self, overrides: dict[str, tuple[Any, str]], preset_values: dict[str, Any], preset_label: str):
        unknown = set(overrides) - set(OVERRIDABLE)
        if unknown:
            raise ValueError(f"unknown override(s): {sorted(unknown)}")
        self.overrides = overrides
        self.preset_values = preset_values
        self.preset_label = preset_label
        self.sources: dict[str, str] = {}
        self.reasons: list[str] = []

    def given(self, name: str) -> bool:
        return name in self.overrides

    def get(self, name: str, default: Any = None, plan_field: str | None = None) -> Any:
        key = plan_field or name
        if name in self.overrides:
            value, source = self.overrides[name]
            self.sources[key] = source
            return value
        if name in self.preset_values:
            self.sources[key] = self.preset_label
            return self.preset_values[name]
        self.sources[key] = "default"
        return default

    def chose(self, name: str, value: Any, reason: str) -> Any:
        self.sources[name] = "optimizer"
        self.reasons.append(reason)
        return value


def _choose_max_seq_len(r: _Resolver, stats: DataStats, model: ModelChoice) -> int:
    if r.given("max_seq_len"):
        value = r.get("max_seq_len")
        if value > model.max_context:
            raise ConfigError(f"--max-seq-len {value} is longer than the model's context of {model.max_context} tokens.",
                              f"Use --max-seq-len {model.max_context} or less.")
        return value
    cap = min(r.get("max_seq_len"), model.max_context)
    covering = stats.percentile(LENGTH_PERCENTILE)
    rounded = -(-covering // 64) * 64
    if rounded < cap:
        return r.chose("max_seq_len", rounded,
                       f"max_seq_len {rounded}: covers {LENGTH_PERCENTILE}% of rows "
                       f"(p{LENGTH_PERCENTILE} = {covering} tokens, from the {stats.length_source}); shorter batches run faster")
    r.reasons.append(f"max_seq_len {cap}: capped by the "
                     f"{'preset' if cap < model.max_context else 'model context'}; "
                     f"p{LENGTH_PERCENTILE} of the data is {covering} tokens")
    return cap


def _batch_shape(r: _Resolver, preset_effective: int, train_rows: int) -> tuple[int, int]:
    if r.given("micro_batch_size") and r.given("grad_accum"):
        return r.get("micro_batch_size"), r.get("grad_accum")
    # Never ask for a bigger batch than there are rows.
    target = max(1, min(preset_effective, train_rows))
    if r.given("micro_batch_size"):
        micro = r.get("micro_batch_size")
    elif r.given("grad_accum"):
        accum = r.get("grad_accum")
        micro = r.chose("micro_batch_size", max(1, target // accum),
                        f"micro-batch {max(1, target // accum)}: preset effective batch {target} / accumulation {accum}")
        return micro, accum
    else:
        micro = r.chose("micro_batch_size", min(DEFAULT_MICRO_BATCH, target),
                        f"micro-batch {min(DEFAULT_MICRO_BATCH, target)}: default without a memory estimate")
    accum = max(1, -(-target // micro))
    r.chose("grad_accum", accum, f"gradient accumulation {accum}: reaches the effective batch of {target}")
    return micro, accum


def steps_per_epoch(train_rows: int, micro_batch_size: int, grad_accum: int) -> int:
    """Optimizer steps in one pass; the last step of an epoch may be short."""
    return max(1, -(-train_rows // (micro_batch_size * grad_accum)))


def eval_fraction(preset: TrainingPreset, total_rows: int, overrides: dict[str, tuple[Any, str]]) -> tuple[float, str]:
    """The share of rows held out for evaluation, and where it came from.
    Needed before planning proper, since the split decides the training rows."""
    if "eval_split" in overrides:
        return overrides["eval_split"]
    values, bucket = preset.for_dataset_size(total_rows)
    return values["eval_split"], f"preset {preset.name} ({bucket} dataset)"


def make_plan(hardware: Hardware, preset: TrainingPreset, model: ModelChoice, stats: DataStats,
              overrides: dict[str, tuple[Any, str]], preset_source: str = "default") -> Plan:
    """The plan in force for these inputs. Raises `ConfigError` naming every bad value at once."""
    preset_values, bucket = preset.for_dataset_size(stats.train_rows + stats.eval_rows)
    r = _Resolver(overrides, preset_values, f"preset {preset.name} ({bucket} dataset)")
    problems = validate_preset_values({k: v for k, (v, _) in overrides.items() if k in preset_values}, "flag")
    if problems:
        raise ConfigError("Invalid value(s):\n  " + "\n  ".join(p.removeprefix("flag: ") for p in problems))

    method = r.get("method")
    if overrides.get("mixed_precision", (None,))[0] == "fp16" and not hardware.has_gpu:
        raise ConfigError("fp16 mixed precision needs a GPU.", "Use --mixed-precision no or bf16 on a CPU.")
    if method == "qlora" and not hardware.has_gpu:
        r.reasons.append("QLoRA on CPU: bitsandbytes runs 4-bit on the CPU, slowly; fine for small models")
    mixed_precision = r.get("mixed_precision", hardware.mixed_precision)
    if not r.given("mixed_precision"):
        r.chose("mixed_precision", mixed_precision,
                f"precision {mixed_precision}: " + ("bf16 autocast, supported by this GPU" if mixed_precision == "bf16"
                                                    else "fp16 autocast, this GPU has no bf16" if mixed_precision == "fp16"
                                                    else "fp32, no GPU found"))
    max_seq_len = _choose_max_seq_len(r, stats, model)
    train_rows = stats.rows_kept(max_seq_len)
    if train_rows == 0:
        raise ConfigError(f"No row has a response token within max_seq_len {max_seq_len}.",
                          "Raise --max-seq-len, or shorten the prompts in the data.")
    micro, accum = _batch_shape(r, r.get("effective_batch_size"), train_rows)
    effective = micro * accum
    r.sources["effective_batch_size"] = "optimizer" if not (r.given("micro_batch_size") and r.given("grad_accum")) else "flag"

    per_epoch = steps_per_epoch(train_rows, micro, accum)
    epochs = r.get("epochs")
    max_steps = r.get("max_steps")
    total = max_steps if max_steps else max(1, math.ceil(epochs * per_epoch))
    r.sources["total_steps"] = r.sources.pop("max_steps") if max_steps else "optimizer"
    warmup_steps = int(r.get("warmup_ratio") * total)
    r.sources["warmup_steps"] = r.sources.pop("warmup_ratio")

    evals_per_epoch = preset_values.get("evals_per_epoch", 1)
    if stats.eval_rows == 0:
        eval_every = 0
        r.sources["eval_every"] = "optimizer"
    elif r.given("eval_every"):
        eval_every = r.get("eval_every")
    else:
        eval_every = r.chose("eval_every", max(1, per_epoch // max(1, evals_per_epoch)) if evals_per_epoch else total,
                             f"evaluate every {max(1, per_epoch // max(1, evals_per_epoch))} steps: "
                             f"{evals_per_epoch} evaluation(s) per epoch")
    save_every = r.get("save_every")
    if not save_every:
        save_every = r.chose("save_every", min(500, max(1, total // 10)),
                             f"checkpoint every {min(500, max(1, total // 10))} steps: about 10 per run, at most 500 steps apart")

    lora = None
    if method != "full":
        lora = LoraSettings(r=r.get("lora_r"), alpha=r.get("lora_alpha"), dropout=r.get("lora_dropout"),
                            target_modules=model.target_modules)
        for name in ("lora_r", "lora_alpha", "lora_dropout"):
            r.sources[f"lora.{name.removeprefix('lora_')}"] = r.sources.pop(name)
    truncated = stats.rows_truncated(max_seq_len)
    if truncated:
        r.reasons.append(f"{truncated} of {stats.train_rows} rows are longer than {max_seq_len} tokens and will be truncated"
                         + (f"; {stats.train_rows - train_rows} keep no response and will be dropped" if train_rows < stats.train_rows else ""))

    r.sources["model"] = model.source
    r.sources["preset"] = preset_source
    r.sources.pop("eval_split", None)
    return Plan(
        model=model.name, family=model.family, model_type=model.model_type, preset=preset.name,
        method=method, micro_batch_size=micro, grad_accum=accum, effective_batch_size=effective,
        max_seq_len=max_seq_len, gradient_checkpointing=bool(r.get("gradient_checkpointing", False)),
        mixed_precision=mixed_precision, lr=float(r.get("lr")), lr_scheduler=r.get("lr_scheduler"),
        warmup_steps=warmup_steps, weight_decay=float(r.get("weight_decay")),
        max_grad_norm=float(r.get("max_grad_norm")), epochs=float(epochs), steps_per_epoch=per_epoch,
        total_steps=total, eval_every=eval_every,
        early_stopping_patience=r.get("early_stopping_patience"), save_every=save_every,
        keep_checkpoints=r.get("keep_checkpoints", DEFAULT_KEEP_CHECKPOINTS), seed=r.get("seed", DEFAULT_SEED),
        train_on_prompt=bool(r.get("train_on_prompt", False)),
        trust_remote_code=bool(r.get("trust_remote_code", False)),
        train_rows=train_rows, eval_rows=stats.eval_rows, lora=lora,
        reasons=tuple(r.reasons), sources=r.sources,
    )
