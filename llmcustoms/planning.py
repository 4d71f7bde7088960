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
from llmcustoms.hardware import GIB, Hardware
from llmcustoms.memory import SAFETY_MARGIN, MemoryEstimate, MemoryOptimizer, parameter_counts
from llmcustoms.presets import ModelSpec, TrainingPreset, validate_preset_values

DEFAULT_SEED = 42
DEFAULT_KEEP_CHECKPOINTS = 3
# Larger micro-batches than this add little speed; memory is better spent elsewhere.
MICRO_BATCH_CAP = 16
# Share of the GPU's tensor-core peak a fine-tuning step reaches (model FLOPs utilisation).
GPU_MFU = 0.35
# Effective FLOP/s per CPU core in fp32 training steps: 42-44 GFLOP/s measured
# on the reference machine (2 AVX-512 cores; LoRA and full fine-tuning of a
# 45M-parameter Llama at 512 tokens). Rounded down for smaller machines.
CPU_FLOPS_PER_CORE = 40e9
# Extra time QLoRA spends dequantising 4-bit weights in every forward and backward.
QLORA_SLOWDOWN = 1.3
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
    source: str  # where the choice came from: flag, env, preset, optimizer
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
    estimated_seconds: float | None = None
    # Processes training together; effective batch = micro x accumulation x world size.
    world_size: int = 1
    # How the processes share the work: "none" (one process), "ddp" (each holds
    # the whole model) or "fsdp" (weights, gradients and optimizer state sharded).
    distributed: str = "none"
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
    skip_bad_rows: bool = False
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
        if "distributed" not in values and values.get("world_size", 1) > 1:
            values["distributed"] = "ddp"  # written before FSDP existed: several processes meant DDP
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
    "lora_alpha", "lora_dropout", "eval_split", "distributed",
)


class _Resolver:
    """Picks each value from overrides, then the preset, then a default, noting the source."""

    def __init__(self, overrides: dict[str, tuple[Any, str]], preset_values: dict[str, Any], preset_label: str):
        unknown = set(overrides) - set(OVERRIDABLE)
        if unknown:
            raise ValueError(f"unknown override(s): {sorted(unknown)}")
        self.overrides = dict(overrides)  # the caller's stay as given
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



def _memory_summary(estimate: MemoryEstimate) -> str:
    return f"{estimate.total_bytes / GIB:.1f} of {estimate.budget_bytes / GIB:.1f} GiB"


def check_distributed_method(method: str | None, distributed: str | None) -> None:
    """FSDP is for full fine-tuning; a ConfigError for an adapter method.
    Cheap, so the launching process checks it before starting any other."""
    if distributed == "fsdp" and method not in (None, "full"):
        raise ConfigError(f"--distributed fsdp shards full fine-tuning; --method {method} trains "
                          "adapters that every process can hold whole.",
                          "Use --method full with --distributed fsdp, or --distributed ddp for LoRA and QLoRA.")


class ParameterOptimizer:
    """Chooses model, method, batch shape, checkpointing and the rest for one machine.

    Every choice must fit `budget_bytes` (with `SAFETY_MARGIN` to spare) by the
    `MemoryOptimizer`'s estimate; nothing is found out by crashing.
    """

    def __init__(self, hardware: Hardware, preset: TrainingPreset, budget_bytes: int | None = None,
                 catalog: tuple[ModelSpec, ...] = ()):
        self.hardware = hardware
        self.preset = preset
        self.machine_budget = budget_bytes if budget_bytes is not None else hardware.memory_budget_bytes
        self.budget = self.machine_budget  # per process: plan() divides it when CPU processes share the RAM
        # Known models, smallest first: what a refusal can suggest instead.
        self.catalog = tuple(sorted(catalog, key=lambda spec: sum(parameter_counts(spec))))

    # -------------------------------------------------------- memory choices

    def _micro_batch(self, memory: MemoryOptimizer, method: str, seq_len: int, precision: str, cap: int,
                     checkpointing: bool | None, lora: dict[str, Any]) -> tuple[int, bool]:
        """(micro-batch, gradient checkpointing) for one method; micro-batch 0 if nothing fits.

        Checkpointing is used only when the micro-batch could not reach `cap`
        without it. Both options grow with the budget, so the result does too.
        """
        def largest(ckpt: bool) -> int:
            return memory.largest_micro_batch(method, seq_len, precision, ckpt, cap, **lora)

        if checkpointing is not None:
            return largest(checkpointing), checkpointing
        plain = largest(False)
        if plain >= cap:
            return plain, False
        with_ckpt = largest(True)
        return (with_ckpt, True) if with_ckpt > plain else (plain, False)

    def _fit(self, r: _Resolver, model: ModelChoice, methods: list[str], seq_len: int, precision: str,
             cap: int, lora: dict[str, Any]) -> tuple[str, int, bool, dict[str, int]] | None:
        """The method and micro-batch to use: the largest micro-batch over the allowed
        methods (the preferred method wins ties), and each method's micro-batch.
        None if no method fits."""
        memory = MemoryOptimizer(model.arch, self.hardware.has_gpu, self.budget)
        checkpointing = r.overrides["gradient_checkpointing"][0] if r.given("gradient_checkpointing") else None
        options = []
        for method in methods:
            micro, ckpt = self._micro_batch(memory, method, seq_len, precision, cap, checkpointing, lora)
            options.append((micro, method, ckpt))
        micro, method, ckpt = max(options, key=lambda o: o[0])  # max keeps the first (preferred) on ties
        if micro == 0:
            return None
        return method, micro, ckpt, {m: mb for mb, m, _ in options}

    def _does_not_fit(self, model: ModelChoice, methods: list[str], seq_len: int, precision: str,
                      lora: dict[str, Any]) -> ConfigError:
        memory = MemoryOptimizer(model.arch, self.hardware.has_gpu, self.budget)
        smallest = min(methods, key=lambda m: memory.estimate(m, 1, seq_len, precision, True, **lora).total_bytes)
        need = memory.estimate(smallest, 1, seq_len, precision, True, **lora)
        usable = self.budget * (1 - SAFETY_MARGIN)
        where = "GPU memory" if self.hardware.has_gpu else "RAM"
        suggestions = []
        shards = lora.get("shards", 1)
        if shards == 1 and "qlora" not in methods and memory.estimate("qlora", 1, seq_len, precision, True, **lora).fits:
            suggestions.append("--method qlora")
        if "full" in methods and self.hardware.has_gpu:  # sharded over more GPUs
            for more in (2 * shards, 4 * shards, 8 * shards):
                if memory.estimate("full", 1, seq_len, precision, True, **{**lora, "shards": more}).fits:
                    suggestions.append(f"--num-processes {more} --distributed fsdp (full fine-tuning sharded "
                                       f"over {more} GPUs)")
                    break
        for shorter in (1024, 512, 256):
            if shorter < seq_len and memory.estimate(smallest, 1, shorter, precision, True, **lora).fits:
                suggestions.append(f"--max-seq-len {shorter}")
                break
        smaller = self._largest_smaller_model(model.arch, seq_len, precision)
        if smaller:
            spec, length = smaller
            suggestions.append(f"a smaller model such as --model {spec.hub_id}"
                               + (f" with --max-seq-len {length}" if length < seq_len else ""))
        gib_needed = math.ceil(need.total_bytes / (1 - SAFETY_MARGIN) / GIB)
        suggestions.append(f"a machine with at least {gib_needed} GiB of {where}")
        return ConfigError(
            f"{model.name} does not fit in {self.budget / GIB:.1f} GiB of {where}: even {smallest} with micro-batch 1, "
            f"gradient checkpointing and {seq_len}-token sequences needs about {need.total_bytes / GIB:.1f} GiB "
            f"({max(0.0, need.total_bytes - usable) / GIB:.1f} GiB more than can be used).",
            "What would fit: " + "; or ".join(suggestions) + ".",
        )

    def _largest_smaller_model(self, arch: ModelSpec, seq_len: int, precision: str) -> tuple[ModelSpec, int] | None:
        """The largest known model smaller than `arch` that fits with QLoRA, at
        this sequence length or the longest shorter one that works."""
        size = sum(parameter_counts(arch))
        for spec in reversed(self.catalog):
            if sum(parameter_counts(spec)) >= size:
                continue
            memory = MemoryOptimizer(spec, self.hardware.has_gpu, self.budget)
            for length in [seq_len] + [n for n in (1024, 512, 256) if n < seq_len]:
                if memory.estimate("qlora", 1, length, precision, True).fits:
                    return spec, length
        return None

    # ------------------------------------------------------------ the plan

    def choose_model(self, candidates: list[ModelChoice], stats: DataStats,
                     overrides: dict[str, tuple[Any, str]], world_size: int = 1) -> tuple[ModelChoice, str]:
        """The preset's best model that fits, and why. On a CPU-only machine the
        smallest: training there is slow, so size matters more than quality."""
        if not self.hardware.has_gpu:
            return candidates[-1], f"model {candidates[-1].name}: no GPU found, so the preset's smallest model"
        for candidate in candidates:
            try:
                self.plan(candidate, stats, overrides, world_size=world_size)
            except ConfigError:
                continue
            return candidate, f"model {candidate.name}: the preset's first choice that fits this GPU"
        raise self._does_not_fit(candidates[-1], ["lora", "qlora"], min(stats.percentile(LENGTH_PERCENTILE), 512),
                                 self.hardware.mixed_precision, {})

    @staticmethod
    def _distributed(r: _Resolver, world_size: int) -> str:
        """"none", "ddp" or "fsdp"; FSDP means full fine-tuning (it sets the method
        when none was given, and refuses LoRA, whose few trained weights gain nothing
        from sharding while every layer would pay for gathering)."""
        if world_size == 1:
            if r.given("distributed"):
                r.reasons.append(f"--distributed {r.get('distributed')} ignored: one process")
                r.sources.pop("distributed", None)
            return "none"
        if not r.given("distributed"):
            r.sources["distributed"] = "optimizer"
            return "ddp"
        choice = r.get("distributed")
        if choice == "fsdp":
            check_distributed_method(r.get("method") if r.given("method") else None, choice)
            if not r.given("method"):
                r.overrides["method"] = ("full", r.sources["distributed"])
                r.reasons.append("method full: --distributed fsdp shards full fine-tuning over the processes")
        return choice

    def plan(self, model: ModelChoice, stats: DataStats, overrides: dict[str, tuple[Any, str]],
             preset_source: str = "default", world_size: int = 1) -> Plan:
        """The plan in force for these inputs. Raises `ConfigError` naming every bad value at once.
        With several processes the micro-batch is per process, and accumulation
        shrinks as the world grows so the preset's effective batch is kept."""
        hardware, preset = self.hardware, self.preset
        # CPU processes share the machine's RAM; each GPU process has its own card.
        self.budget = self.machine_budget // world_size if not hardware.has_gpu else self.machine_budget
        preset_values, bucket = preset.for_dataset_size(stats.train_rows + stats.eval_rows)
        r = _Resolver(overrides, preset_values, f"preset {preset.name} ({bucket} dataset)")
        problems = validate_preset_values({k: v for k, (v, _) in overrides.items() if k in preset_values}, "flag")
        if problems:
            raise ConfigError("Invalid value(s):\n  " + "\n  ".join(p.removeprefix("flag: ") for p in problems))
        if overrides.get("mixed_precision", (None,))[0] == "fp16" and not hardware.has_gpu:
            raise ConfigError("fp16 mixed precision needs a GPU.", "Use --mixed-precision no or bf16 on a CPU.")

        precision = r.get("mixed_precision", hardware.mixed_precision)
        if not r.given("mixed_precision"):
            r.chose("mixed_precision", precision,
                    f"precision {precision}: " + {"bf16": "bf16 autocast, supported by this GPU",
                                                  "fp16": "fp16 autocast, this GPU has no bf16",
                                                  "no": "fp32, no GPU found"}[precision])
        max_seq_len = _choose_max_seq_len(r, stats, model)
        train_rows = stats.rows_kept(max_seq_len)
        if train_rows == 0:
            raise ConfigError(f"No row has a response token within max_seq_len {max_seq_len}.",
                              "Raise --max-seq-len, or shorten the prompts in the data.")
        target = max(1, min(r.get("effective_batch_size"), train_rows))
        trained_share = 1.0 if r.get("train_on_prompt", False) else stats.trained_fraction(max_seq_len)
        distributed = self._distributed(r, world_size)
        shards = world_size if distributed == "fsdp" else 1
        lora = {"lora_rank": r.get("lora_r"), "lora_targets": model.target_modules, "trained_fraction": trained_share}
        if shards > 1:
            lora["shards"] = shards

        preferred = r.get("method")
        methods = [preferred] if r.given("method") or preferred == "full" else [preferred, "qlora"]
        methods = list(dict.fromkeys(methods))
        cap = min(MICRO_BATCH_CAP, -(-target // world_size))
        if r.given("micro_batch_size"):
            cap = r.overrides["micro_batch_size"][0]
        fit = self._fit(r, model, methods, max_seq_len, precision, cap, lora)
        if fit is None:
            if r.given("micro_batch_size"):
                fit = self._fit(r, model, methods, max_seq_len, precision, 1, lora)
            if fit is None:
                raise self._does_not_fit(model, methods, max_seq_len, precision, lora)
        method, micro, checkpointing, per_method = fit
        if method != preferred:
            why = (f"{preferred} does not fit" if per_method[preferred] == 0
                   else f"{preferred} fits only micro-batch {per_method[preferred]}")
            r.chose("method", method, f"method {method}: {why}; with a 4-bit base micro-batch {micro} fits")
        if r.given("micro_batch_size"):
            micro = r.get("micro_batch_size", plan_field="micro_batch_size")
        else:
            r.chose("micro_batch_size", micro, f"micro-batch {micro}: the largest up to {cap} that fits "
                                               f"with a {int(SAFETY_MARGIN * 100)}% margin")
        if r.given("gradient_checkpointing"):
            checkpointing = r.get("gradient_checkpointing")
        elif checkpointing:
            r.chose("gradient_checkpointing", True,
                    f"gradient checkpointing on: without it the micro-batch would be under {cap}; costs about 30% more compute")
        else:
            r.sources["gradient_checkpointing"] = "optimizer"

        if r.given("grad_accum"):
            accum = r.get("grad_accum")
        else:
            accum = max(1, -(-target // (micro * world_size)))
            world = f" x {world_size} processes" if world_size > 1 else ""
            r.chose("grad_accum", accum, f"gradient accumulation {accum}: {micro} x {accum}{world} reaches the "
                                         f"effective batch of {target}")
        effective = micro * accum * world_size
        r.sources["effective_batch_size"] = "flag" if r.given("micro_batch_size") and r.given("grad_accum") else "optimizer"
        memory = MemoryOptimizer(model.arch, hardware.has_gpu, self.budget).estimate(
            method, micro, max_seq_len, precision, checkpointing, optimizer="adamw", **lora)
        if not memory.fits:
            r.reasons.append(f"warning: the estimated peak ({_memory_summary(memory)}) exceeds the safe budget; "
                             "out-of-memory is likely")
        else:
            r.reasons.append(f"estimated peak memory {_memory_summary(memory)}")

        per_epoch = steps_per_epoch(train_rows, micro, accum * world_size)
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
            every = max(1, per_epoch // max(1, evals_per_epoch)) if evals_per_epoch else total
            eval_every = r.chose("eval_every", every, f"evaluate every {every} steps: {evals_per_epoch} evaluation(s) per epoch")
        patience = r.get("early_stopping_patience")
        if patience and not eval_every:
            if r.given("early_stopping_patience"):
                raise ConfigError("Early stopping needs evaluation rows, and this plan has none.",
                                  "Pass --eval-split 0.1 (or --eval-data FILE), or drop --early-stopping-patience.")
            r.reasons.append("early stopping off: there are no evaluation rows to watch")
            patience = 0
        save_every = r.get("save_every")
        if not save_every:
            every = min(500, max(1, total // 10))
            save_every = r.chose("save_every", every, f"checkpoint every {every} steps: about 10 per run, at most 500 steps apart")

        lora_settings = None
        if method != "full":
            lora_settings = LoraSettings(r=r.get("lora_r"), alpha=r.get("lora_alpha"), dropout=r.get("lora_dropout"),
                                         target_modules=model.target_modules)
            for name in ("lora_r", "lora_alpha", "lora_dropout"):
                r.sources[f"lora.{name.removeprefix('lora_')}"] = r.sources.pop(name)
        truncated = stats.rows_truncated(max_seq_len)
        if truncated:
            r.reasons.append(f"{truncated} of {stats.train_rows} rows are longer than {max_seq_len} tokens and will be truncated"
                             + (f"; {stats.train_rows - train_rows} keep no response and will be dropped"
                                if train_rows < stats.train_rows else ""))
        mean_tokens = stats.mean_length(max_seq_len)
        seconds = estimate_seconds(model.arch, method, checkpointing, total * effective * mean_tokens, hardware)
        r.reasons.append(duration_reason(seconds, hardware))

        r.sources["model"] = model.source
        r.sources["preset"] = preset_source
        r.sources.pop("eval_split", None)
        return Plan(
            model=model.name, family=model.family, model_type=model.model_type, preset=preset.name,
            method=method, micro_batch_size=micro, grad_accum=accum, effective_batch_size=effective,
            max_seq_len=max_seq_len, gradient_checkpointing=bool(checkpointing),
            mixed_precision=precision, lr=float(r.get("lr")), lr_scheduler=r.get("lr_scheduler"),
            warmup_steps=warmup_steps, weight_decay=float(r.get("weight_decay")),
            max_grad_norm=float(r.get("max_grad_norm")), epochs=float(epochs), steps_per_epoch=per_epoch,
            total_steps=total, eval_every=eval_every,
            early_stopping_patience=patience, save_every=save_every,
            keep_checkpoints=r.get("keep_checkpoints", DEFAULT_KEEP_CHECKPOINTS), seed=r.get("seed", DEFAULT_SEED),
            train_on_prompt=bool(r.get("train_on_prompt", False)),
            trust_remote_code=bool(r.get("trust_remote_code", False)),
            train_rows=train_rows, eval_rows=stats.eval_rows, lora=lora_settings,
            memory=memory.to_json(), estimated_seconds=seconds / world_size, world_size=world_size,
            distributed=distributed, reasons=tuple(r.reasons), sources=r.sources,
        )



def flops_per_token(arch: ModelSpec, method: str, gradient_checkpointing: bool) -> float:
    """Forward 2N; backward 4N when every weight gets a gradient, about 2N when
    the base is frozen (only activation gradients); checkpointing adds a forward."""
    linear, other = parameter_counts(arch)
    n = linear + arch.vocab_size * arch.hidden_size  # the embedding lookup is free, the head is not
    backward = 4 * n if method == "full" else 2 * n
    return 2 * n + backward + (2 * n if gradient_checkpointing else 0)


def estimate_seconds(arch: ModelSpec, method: str, gradient_checkpointing: bool, tokens: float, hardware: Hardware) -> float:
    if hardware.has_gpu:
        rate = hardware.peak_tflops * 1e12 * GPU_MFU
    else:
        rate = CPU_FLOPS_PER_CORE * hardware.cpu_cores
    seconds = tokens * flops_per_token(arch, method, gradient_checkpointing) / rate
    return seconds * (QLORA_SLOWDOWN if method == "qlora" else 1.0)


def duration_reason(seconds: float, hardware: Hardware) -> str:
    hours = seconds / 3600
    text = f"estimated duration {_human_duration(seconds)}"
    if not hardware.has_gpu and hours >= 1:
        return (text + ": long, because there is no GPU. A single consumer GPU (e.g. 16-24 GB) would take "
                "minutes to an hour; on this machine try --preset highspeed, a smaller model or --max-steps")
    return text


def _human_duration(seconds: float) -> str:
    if seconds < 90:
        return f"about {max(1, round(seconds))} s"
    if seconds < 5400:
        return f"about {round(seconds / 60)} min"
    return f"about {seconds / 3600:.1f} h"
