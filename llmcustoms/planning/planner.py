"""Turn hardware + preset + data statistics + user overrides into a frozen `Plan`.

Planning is pure: no torch, no files, no network. Every value in the plan
records where it came from (`sources`: flag, env, preset, planner, default)
and every automatic choice a one-line reason, so `plan` can explain itself and
tests can plan for machines we do not have by passing a `Hardware` value.

`Planner.plan` checks the given values first (every problem in one
error), then runs its steps in order: precision and length; method and batch;
accumulation; memory; schedule; evaluation and saving; LoRA settings; what to
expect. Each step returns its values and notes its reasons on the `Resolver`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from llmcustoms.errors import ConfigError
from llmcustoms.planning.cpu_share import choose_threads
from llmcustoms.planning.duration import cpu_choice, expected_seconds, replayed_per_step
from llmcustoms.planning.hardware import Hardware
from llmcustoms.planning.memory import SAFETY_MARGIN, MemoryEstimate, MemoryEstimator, parameter_counts
from llmcustoms.planning.objective_kinds import SFT, objective_named
from llmcustoms.planning.objectives import DEFAULT_BETA
from llmcustoms.planning.options import Overrides
from llmcustoms.planning.plan import DEFAULT_FORGETTING_LIMIT, DataStats, LoraSettings, ModelChoice, Plan, total_steps
from llmcustoms.planning.presets import ModelSpec, TrainingPreset, validate_preset_values
from llmcustoms.planning.resolver import Resolver
from llmcustoms.planning.sizing import best_fit, does_not_fit, fit_with_optimizer
from llmcustoms.planning.step_choices import choose_compile, choose_distributed, choose_packing, choose_replay

DEFAULT_SEED, DEFAULT_KEEP_CHECKPOINTS = 42, 3
MIN_EVALUATIONS, MIN_SAVE_EVERY = 4, 5  # evaluations of even a short run; fewest steps between checkpoints
MICRO_BATCH_CAP = 16  # larger micro-batches add little speed; memory is better spent elsewhere
# On a CPU a forward pass of more tokens runs no faster per token, and a step's rows, drawn at random, pad
# to their micro-batch's longest: more rows, more padding. Code (max-seq-len 384, SmolLM2-135M, bf16, 2 idle
# cores, effective batch 16): micro-batch 16 trained 88 real tokens/s in 13.2 GiB, 8: 206 (7.1 GiB),
# 4: 247 (3.9 GiB), 2: 233 (2.4 GiB). So at most this many tokens a micro-batch, in a power of two of rows.
CPU_MICRO_BATCH_TOKENS = 2048
# Sequence length is chosen to cover this share of rows, rounded up to a multiple of 64.
LENGTH_PERCENTILE = 99


@dataclass(frozen=True)
class _Problem:
    """One thing wrong with the given values; `hint` says what to do instead."""

    message: str
    hint: str | None = None


def _raise_problems(problems: list[_Problem]) -> None:
    """One ConfigError naming every problem; a lone problem with a hint keeps its own wording."""
    if not problems:
        return
    if len(problems) == 1 and problems[0].hint:
        raise ConfigError(problems[0].message, problems[0].hint)
    hints = " ".join(dict.fromkeys(p.hint for p in problems if p.hint))
    raise ConfigError("Invalid value(s):\n  " + "\n  ".join(p.message for p in problems), hints or None)


def _distributed_method_problems(method: str | None, distributed: str | None) -> list[_Problem]:
    if distributed != "fsdp" or method in (None, "full"):
        return []
    return [_Problem(f"--distributed fsdp shards full fine-tuning; --method {method} trains adapters that every "
                     "process can hold whole.",
                     "Use --method full with --distributed fsdp, or --distributed ddp for LoRA and QLoRA.")]


def check_distributed_method(method: str | None, distributed: str | None) -> None:
    """FSDP is for full fine-tuning: a ConfigError for an adapter method (cheap: checked before any process starts)."""
    _raise_problems(_distributed_method_problems(method, distributed))


def _given_value_problems(r: Resolver, hardware: Hardware, model: ModelChoice, stats: DataStats,
                          world_size: int) -> list[_Problem]:
    """Everything wrong with the given values, before any choice is made. Each
    check reads only given values and facts, so one run reports them all; a value
    out of range is not checked further."""
    problems, invalid = [], set()
    for name, value in r.given_values().items():
        found = validate_preset_values({name: value}, "flag") if r.in_preset(name) else []
        invalid.update([name] if found else [])
        problems += [_Problem(p.removeprefix("flag: ")) for p in found]
    if r.given_value("mixed_precision") == "fp16" and not hardware.has_gpu:
        problems.append(_Problem("fp16 mixed precision needs a GPU.", "Use --mixed-precision no or bf16 on a CPU."))
    length = r.given_value("max_seq_len")
    if length is not None and "max_seq_len" not in invalid:
        if length > model.max_context:
            problems.append(_Problem(f"--max-seq-len {length} is longer than the model's context of "
                                     f"{model.max_context} tokens.", f"Use --max-seq-len {model.max_context} or less."))
        elif stats.rows_kept(length) == 0:
            problems.append(_no_row_problem(length))
    evaluates = stats.eval_rows > 0 and r.given_value("eval_every") != 0
    if r.given_value("early_stopping_patience") and "early_stopping_patience" not in invalid and not evaluates:
        problems.append(_Problem("Early stopping needs evaluation rows, and this plan has none.",
                                 "Pass --eval-split 0.1 (or --eval-data FILE), or drop --early-stopping-patience."))
    if world_size > 1 and "method" not in invalid:  # with one process --distributed is ignored
        problems += _distributed_method_problems(r.given_value("method"), r.given_value("distributed"))
    return problems


def _no_row_problem(max_seq_len: int) -> _Problem:
    return _Problem(f"No row has a response token within max_seq_len {max_seq_len}.",
                    "Raise --max-seq-len, or shorten the prompts in the data.")


def _choose_max_seq_len(r: Resolver, stats: DataStats, model: ModelChoice) -> int:
    if r.given("max_seq_len"):
        return r.get("max_seq_len")  # checked against the model's context with the other given values
    cap = min(r.get("max_seq_len"), model.max_context)
    covering = stats.percentile(LENGTH_PERCENTILE)
    rounded = -(-covering // 64) * 64
    if rounded < cap:
        return r.chose("max_seq_len", rounded,
                       f"max_seq_len {rounded}: covers {LENGTH_PERCENTILE}% of rows "
                       f"(p{LENGTH_PERCENTILE} = {covering} tokens, from the {stats.length_source}); shorter batches run faster")
    r.note(f"max_seq_len {cap}: capped by the "
                     f"{'preset' if cap < model.max_context else 'model context'}; "
                     f"p{LENGTH_PERCENTILE} of the data is {covering} tokens")
    return cap


def cpu_micro_batch_cap(max_seq_len: int) -> int:
    """The most rows a CPU's micro-batch takes: a power of two, CPU_MICRO_BATCH_TOKENS at most."""
    rows = max(1, CPU_MICRO_BATCH_TOKENS // max_seq_len)
    return 1 << (rows.bit_length() - 1)


def steps_per_epoch(train_rows: int, micro_batch_size: int, grad_accum: int) -> int:
    """Optimizer steps in one pass; the last step of an epoch may be short."""
    return max(1, -(-train_rows // (micro_batch_size * grad_accum)))


# ------------------------------------------------------------- plan steps


def _precision_and_length(r: Resolver, hardware: Hardware, stats: DataStats, model: ModelChoice) -> tuple[str, int, int]:
    """(mixed precision, max_seq_len, training rows that keep a trained token)."""
    if hardware.torch_note:  # GPUs found that torch cannot use
        r.warn(hardware.torch_note)
    precision = r.get("mixed_precision", hardware.mixed_precision)
    if not r.given("mixed_precision"):
        r.chose("mixed_precision", precision, hardware.precision_reason)  # plan.json keeps "no" for fp32
    elif precision == "bf16" and not hardware.has_gpu and not hardware.cpu_bf16:
        r.warn("bf16 on this CPU is emulated (no AVX512-BF16 or AMX): slower than --mixed-precision no")
    max_seq_len = _choose_max_seq_len(r, stats, model)
    train_rows = stats.rows_kept(max_seq_len)
    if train_rows == 0:
        # Only a chosen length gets here (a given one was checked with the other
        # values); with no row to train on, no later step means anything.
        _raise_problems([_no_row_problem(max_seq_len)])
    return precision, max_seq_len, train_rows


@dataclass(frozen=True)
class _Batch:
    """The method-and-batch step's choice: what one process trains and holds."""

    distributed: str
    method: str
    micro_batch_size: int
    gradient_checkpointing: bool
    memory_shape: dict[str, Any]  # the rest of the memory estimate's arguments: LoRA rank, targets, shards


def _accumulation(r: Resolver, target: int, micro: int, world_size: int) -> tuple[int, int]:
    """(gradient accumulation, effective batch): the effective batch of `target` rows."""
    if r.given("grad_accum"):
        accum = r.get("grad_accum")
    else:
        accum = max(1, -(-target // (micro * world_size)))
        world = f" x {world_size} processes" if world_size > 1 else ""
        r.chose("grad_accum", accum, f"gradient accumulation {accum}: {micro} x {accum}{world} reaches the "
                                     f"effective batch of {target}")
    r.record("effective_batch_size", "flag" if r.given("micro_batch_size") and r.given("grad_accum") else "planner")
    return accum, micro * accum * world_size


@dataclass(frozen=True)
class _Schedule:
    steps_per_epoch: int
    epochs: float
    total_steps: int
    warmup_steps: int


def _schedule(r: Resolver, train_rows: int, micro: int, accum_over_processes: int) -> _Schedule:
    per_epoch = steps_per_epoch(train_rows, micro, accum_over_processes)
    epochs = r.get("epochs")
    max_steps = r.get("max_steps")
    total = max_steps if max_steps else total_steps(epochs, per_epoch)
    if max_steps:
        r.rename("max_steps", "total_steps")
    else:
        r.record("total_steps", "planner")
    warmup_steps = int(r.get("warmup_ratio") * total)
    r.rename("warmup_ratio", "warmup_steps")
    return _Schedule(per_epoch, epochs, total, warmup_steps)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _evaluation_and_saving(r: Resolver, eval_rows: int, schedule: _Schedule) -> tuple[int, int, int]:
    """(eval_every, early-stopping patience, save_every)."""
    evals_per_epoch = r.get("evals_per_epoch", 1)
    r.forget("evals_per_epoch")  # not a plan value: eval_every is
    if eval_rows == 0:
        eval_every = 0
        r.record("eval_every", "planner")
    elif r.given("eval_every"):
        eval_every = r.get("eval_every")
    else:
        per_epoch = max(1, schedule.steps_per_epoch // max(1, evals_per_epoch)) if evals_per_epoch else schedule.total_steps
        # A run shorter than the preset's interval (--max-steps) still gets a few evaluations.
        fewest = max(1, math.ceil(schedule.total_steps / MIN_EVALUATIONS))
        every = min(per_epoch, fewest)
        # What the run will do, not what the preset asked: 2 per epoch of 3 steps is every step, 3 per epoch.
        evaluations = max(1, schedule.steps_per_epoch // every)
        why = (f"{_count(evaluations, 'evaluation')} per epoch of {_count(schedule.steps_per_epoch, 'step')}"
               if per_epoch <= fewest else f"{MIN_EVALUATIONS} evaluations in this {schedule.total_steps}-step run")
        eval_every = r.chose("eval_every", every, f"evaluate every {_count(every, 'step')}: {why}")
    patience = r.get("early_stopping_patience")
    if patience and not eval_every:  # from the preset: a given patience was refused with the given values
        r.note("early stopping off: there are no evaluation rows to watch")
        patience = 0
    save_every = r.get("save_every")
    if not save_every:
        # Not every step of a short run: that costs more than it could save, and the end is saved anyway.
        every = min(500, max(MIN_SAVE_EVERY, schedule.total_steps // 10))
        save_every = r.chose("save_every", every, f"checkpoint every {every} steps: about 10 per run, "
                             f"{MIN_SAVE_EVERY} to 500 steps apart")
    return eval_every, patience, save_every


def _lora_settings(r: Resolver, method: str, model: ModelChoice) -> LoraSettings | None:
    if method == "full":
        return None
    settings = LoraSettings(r=r.get("lora_r"), alpha=r.get("lora_alpha"), dropout=r.get("lora_dropout"),
                            target_modules=model.target_modules)
    for name in ("lora_r", "lora_alpha", "lora_dropout"):
        r.rename(name, f"lora.{name.removeprefix('lora_')}")
    return settings


class Planner:
    """Chooses model, method, batch shape, checkpointing and the rest for one machine.

    Every choice must fit `budget_bytes` (with `SAFETY_MARGIN` to spare) by the
    `MemoryEstimator`'s estimate; nothing is found out by crashing.
    """

    def __init__(self, hardware: Hardware, preset: TrainingPreset, budget_bytes: int | None = None,
                 catalog: tuple[ModelSpec, ...] = ()):
        self.hardware = hardware
        self.preset = preset
        self.machine_budget = budget_bytes if budget_bytes is not None else hardware.memory_budget_bytes
        self.budget = self.machine_budget  # per process: plan() divides it when CPU processes share the RAM
        # Known models, smallest first: what a refusal can suggest instead.
        self.catalog = tuple(sorted(catalog, key=lambda spec: sum(parameter_counts(spec))))

    def _memory_estimator(self, arch: ModelSpec) -> MemoryEstimator:
        return MemoryEstimator(arch, self.hardware.has_gpu, self.budget)

    # ------------------------------------------------------------ the plan

    def choose_model(self, candidates: list[ModelChoice], stats: DataStats,
                     overrides: Overrides, world_size: int = 1) -> tuple[ModelChoice, str]:
        """The preset's best model that fits, and why. Without a GPU, the first CPU
        model (`TrainingPreset.model_candidates`) to finish in time: `_choose_for_cpu`."""
        if not self.hardware.has_gpu:
            return self._choose_for_cpu(candidates, stats, overrides, world_size)
        for candidate in candidates:
            try:
                self.plan(candidate, stats, overrides, world_size=world_size)
            except ConfigError:
                continue
            return candidate, f"model {candidate.name}: the preset's first choice that fits this GPU"
        last = candidates[-1]
        raise does_not_fit(self._memory_estimator(last.arch), last, ["lora", "qlora"],
                           min(stats.percentile(LENGTH_PERCENTILE), 512), self.hardware.mixed_precision, {}, self.catalog)

    def _choose_for_cpu(self, candidates: list[ModelChoice], stats: DataStats,
                        overrides: Overrides, world_size: int) -> tuple[ModelChoice, str]:
        """The first candidate whose plan is estimated to finish within
        `CPU_TIME_LIMIT_S`, else the smallest: on a CPU time, not memory, is short.
        With no candidate that plans, the smallest, whose plan then says why not."""
        estimates = {}
        for candidate in candidates:
            try:
                estimates[candidate.name] = self.plan(candidate, stats, overrides, world_size=world_size).estimated_seconds
            except ConfigError:
                continue
        smallest = min([c for c in candidates if c.name in estimates] or candidates, key=lambda c: c.arch.params)
        name, why = cpu_choice(list(estimates.items()), smallest.name)
        return next(c for c in candidates if c.name == name), f"model {name}: no GPU found; {why}"

    def _method_and_batch(self, r: Resolver, model: ModelChoice, stats: DataStats, precision: str, max_seq_len: int,
                          target: int, world_size: int) -> _Batch:
        """The method and micro-batch (per process) with the most rows per step,
        and gradient checkpointing only where the micro-batch needs it."""
        trained_share = 1.0 if r.get("train_on_prompt", False) else stats.trained_fraction(max_seq_len)
        distributed = choose_distributed(r, world_size)
        shape = {"lora_rank": r.get("lora_r"), "lora_targets": model.target_modules, "trained_fraction": trained_share,
                 "lora_dropout": r.get("lora_dropout") or 0.0}
        # A pair's chosen and rejected replies go through in one forward.
        shape["sequences_per_row"] = objective_named(r.given_value("objective") or SFT.name).sequences_per_row
        if distributed == "fsdp" and world_size > 1:
            shape["shards"] = world_size
        preferred = r.get("method")
        methods = list(dict.fromkeys([preferred] if r.given("method") or preferred == "full" else [preferred, "qlora"]))
        cap = min(MICRO_BATCH_CAP, -(-target // world_size))
        cap_reason = ""
        if r.given("micro_batch_size"):
            cap = r.given_value("micro_batch_size")
        elif not self.hardware.has_gpu and cap > (cpu_cap := cpu_micro_batch_cap(max_seq_len)):
            cap = cpu_cap
            cap_reason = (f" (on a CPU, {CPU_MICRO_BATCH_TOKENS:,} tokens a forward pass at most: more run no faster "
                          "and pad more)")
        memory = self._memory_estimator(model.arch)
        checkpointing = r.given_value("gradient_checkpointing")
        r.get("optimizer", "adamw")  # its source; the value is chosen with the batch
        fit, why_8bit = fit_with_optimizer(memory, methods, max_seq_len, precision, cap, checkpointing, shape,
                                           r.given_value("optimizer"), self.hardware.has_gpu)
        if why_8bit:
            r.chose("optimizer", shape["optimizer"], why_8bit)
        if fit is None and r.given("micro_batch_size"):
            fit = best_fit(memory, methods, max_seq_len, precision, 1, checkpointing, shape)
        if fit is None:
            # Raised at once: with nothing that fits, the later steps have nothing to build on.
            raise does_not_fit(memory, model, methods, max_seq_len, precision, shape, self.catalog)
        method, micro, checkpointing, per_method = fit
        if method != preferred:
            why = (f"{preferred} does not fit" if per_method[preferred] == 0
                   else f"{preferred} fits only micro-batch {per_method[preferred]}")
            r.chose("method", method, f"method {method}: {why}; with a 4-bit base micro-batch {micro} fits")
        if r.given("micro_batch_size"):
            micro = r.get("micro_batch_size", plan_field="micro_batch_size")
        else:
            r.chose("micro_batch_size", micro, f"micro-batch {micro}: the largest up to {cap}{cap_reason} that fits "
                                               f"with a {int(SAFETY_MARGIN * 100)}% margin")
        if r.given("gradient_checkpointing"):
            checkpointing = r.get("gradient_checkpointing")
        elif checkpointing:
            r.chose("gradient_checkpointing", True,
                    f"gradient checkpointing on: without it the micro-batch would be under {cap}; costs about 30% more compute")
        else:
            r.record("gradient_checkpointing", "planner")
        return _Batch(distributed, method, micro, bool(checkpointing), shape)

    def _memory(self, r: Resolver, model: ModelChoice, batch: _Batch, max_seq_len: int, precision: str) -> MemoryEstimate:
        """The estimated peak of one process; a warning, not a refusal, over the safe budget (the user may know better)."""
        memory = self._memory_estimator(model.arch).estimate(
            batch.method, batch.micro_batch_size, max_seq_len, precision, batch.gradient_checkpointing,
            **batch.memory_shape)
        if memory.fits:
            r.note(f"estimated peak memory {memory.summary()}")
        else:
            r.warn(f"the estimated peak ({memory.summary()}) exceeds the safe budget; out-of-memory is likely")
        return memory

    def plan(self, model: ModelChoice, stats: DataStats, overrides: Overrides,
             preset_source: str = "default", world_size: int = 1) -> Plan:
        """The plan in force for these inputs. Raises `ConfigError` naming every bad value at once.
        With several processes the micro-batch is per process, and accumulation
        shrinks as the world grows so the preset's effective batch is kept."""
        hardware, preset = self.hardware, self.preset
        # CPU processes share the machine's RAM; each GPU process has its own card.
        self.budget = self.machine_budget // world_size if not hardware.has_gpu else self.machine_budget
        objective = objective_named(overrides.get("objective", (SFT.name, ""))[0])
        preset_values = preset.resolve(stats.train_rows + stats.eval_rows, model.arch.params, objective.name)
        r = Resolver(overrides, preset_values)
        _raise_problems(_given_value_problems(r, hardware, model, stats, world_size))
        for reason in preset_values.model_size_reasons(set(overrides), model.arch.params):
            r.note(reason)

        precision, max_seq_len, train_rows = _precision_and_length(r, hardware, stats, model)
        target = max(1, min(r.get("effective_batch_size"), train_rows))
        batch = self._method_and_batch(r, model, stats, precision, max_seq_len, target, world_size)
        micro = batch.micro_batch_size
        accum, effective = _accumulation(r, target, micro, world_size)
        memory = self._memory(r, model, batch, max_seq_len, precision)
        packing, compiled, replay = choose_packing(r, hardware, objective, precision), choose_compile(r), choose_replay(r, objective, world_size)
        schedule = _schedule(r, train_rows, micro, accum * world_size)
        eval_every, patience, save_every = _evaluation_and_saving(r, stats.eval_rows, schedule)
        lora = _lora_settings(r, batch.method, model)
        evaluations = -(-schedule.total_steps // eval_every) + 1 if eval_every and stats.eval_rows else 0  # +the base's
        work, evaluation_work = objective.step_work, objective.evaluation_work  # DPO: two sequences, a reference
        threads = choose_threads(r, hardware, world_size)  # CPU threads, from the machine's load
        duration = expected_seconds(r.reasons, hardware.as_used(precision), stats, model.arch, batch.method,
                                    batch.gradient_checkpointing, max_seq_len, train_rows,
                                    round(schedule.total_steps * effective * work), evaluations * evaluation_work,
                                    threads * world_size, micro, memory.to_json(), -(-schedule.total_steps // save_every),
                                    schedule.total_steps * replayed_per_step(replay, effective), schedule.total_steps)

        r.record("model", model.source)
        r.record("preset", preset_source)
        r.forget("eval_split")
        return Plan(
            model=model.name, family=model.family, model_type=model.model_type, preset=preset.name,
            method=batch.method, micro_batch_size=micro, grad_accum=accum, effective_batch_size=effective,
            max_seq_len=max_seq_len, gradient_checkpointing=batch.gradient_checkpointing,
            mixed_precision=precision, lr=float(r.get("lr")), lr_scheduler=r.get("lr_scheduler"),
            warmup_steps=schedule.warmup_steps, weight_decay=float(r.get("weight_decay")),
            max_grad_norm=float(r.get("max_grad_norm")), epochs=float(schedule.epochs),
            steps_per_epoch=schedule.steps_per_epoch, total_steps=schedule.total_steps, eval_every=eval_every,
            early_stopping_patience=patience, save_every=save_every,
            forgetting_limit=float(r.get("forgetting_limit", DEFAULT_FORGETTING_LIMIT)), replay=replay,
            keep_checkpoints=r.get("keep_checkpoints", DEFAULT_KEEP_CHECKPOINTS), seed=r.get("seed", DEFAULT_SEED),
            train_on_prompt=bool(r.get("train_on_prompt", False)), raw_prompts=bool(r.get("raw_prompts", False)),
            objective=objective.name, beta=float(r.get("beta", DEFAULT_BETA)),
            trust_remote_code=bool(r.get("trust_remote_code", False)),
            allow_pickle_weights=bool(r.get("allow_pickle_weights", False)),
            train_rows=train_rows, eval_rows=stats.eval_rows, lora=lora,
            memory=memory.to_json(), **duration.plan_fields(world_size), world_size=world_size,
            distributed=batch.distributed, optimizer=batch.memory_shape["optimizer"], packing=packing,
            compile=compiled, cpu_threads=threads, reasons=tuple(r.reasons), warnings=tuple(r.warnings), sources=r.sources,
        )
