"""From the user's options to a plan and tokenized data, before any weight loads.

Order matters: read and validate the data as it streams (cheap, fails fast
on too many bad rows), split off the evaluation rows, pick or describe the
model, tokenize into a memory-mapped store (cached), then plan from the
measured lengths. `train`, `plan` and `tune` all start here.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from llmcustoms.data.data_files import fingerprint
from llmcustoms.data.dataset import Dataset, read_dataset
from llmcustoms.data.pair_rows import PairRows
from llmcustoms.data.row_formats import is_preference
from llmcustoms.data.splits import MAX_EVAL_ROWS, overlap_warning, rows_also_trained, split_rows
from llmcustoms.data.token_cache import cache_dir, stored_rows, tokenization_cache_key
from llmcustoms.data.token_store import TokenRows
from llmcustoms.errors import ConfigError, DataError, ModelError
from llmcustoms.models import hub_access
from llmcustoms.models.from_run import with_starting_point
from llmcustoms.planning.data_advice import data_facts
from llmcustoms.planning.disk_space import disk_need
from llmcustoms.planning.hardware import GIB, Hardware
from llmcustoms.planning.memory import SAFETY_MARGIN, parameter_counts
from llmcustoms.planning.objectives import check_eval_data, preference_reason, with_objective
from llmcustoms.planning.plan import DataStats, Plan
from llmcustoms.planning.planner import Planner
from llmcustoms.planning.presets import find_model_spec, load_families, load_preset
from llmcustoms.planning.train_options import TrainOptions
from llmcustoms.preparation.model_choice import given_model
from llmcustoms.preparation.prepared_run import PreparedRun, Progress, Tokenized, estimated_stats, measured_stats, no_progress
from llmcustoms.runs.model_files import model_fingerprint, with_model_checked
from llmcustoms.runs.speeds import with_measured_speeds

DEFAULT_PRESET = "quality"


def _tokenize(model_name: str, hf_tokenizer: Any, options: TrainOptions, dataset: Dataset,
              eval_dataset: Dataset | None, train_on_prompt: bool, progress: Progress) -> Tokenized:
    """Every usable row of the data (and of --eval-data) tokenized, untruncated."""
    from llmcustoms.data.chat_templates import ensure_chat_template, prompts_use_template
    from llmcustoms.data.row_formats import base_format
    from llmcustoms.data.tokenization import Tokenizer
    from llmcustoms.models import loading

    used_fallback = ensure_chat_template(hf_tokenizer)
    stop_ids = loading.stop_token_ids(model_name)
    raw_prompts = bool(options.override("raw_prompts", False))
    tokenizer = Tokenizer(hf_tokenizer, train_on_prompt=train_on_prompt, stop_token_ids=stop_ids, raw_prompts=raw_prompts)
    started = time.perf_counter()
    stores, keys, all_cached, kept, notes = [], [], True, True, []
    for data in (dataset, eval_dataset):
        if data is None:
            stores.append(None)
            continue
        data_key = fingerprint(data.path)
        keys.append(tokenization_cache_key(hf_tokenizer, stop_ids, train_on_prompt, data_key, raw_prompts))
        stored = stored_rows(keys[-1], data_key, options.cache_dir, data, tokenizer,
                             lambda done, rows=data.rows: progress("tokenize", done, rows))
        stores.append(PairRows(stored.rows) if is_preference(data.format) else stored.rows)
        all_cached, kept = all_cached and stored.cached, kept and stored.kept
        notes += [stored.note] if stored.note and stored.note not in notes else []  # a reason said once
    return Tokenized(hf_tokenizer, used_fallback, stores[0], stores[1], time.perf_counter() - started, all_cached,
                     base_format(dataset.format) == "prompt_completion"
                     and prompts_use_template(hf_tokenizer, dataset.format, raw_prompts), keys[0], kept, tuple(notes))


def prepare_run(options: TrainOptions, hardware: Hardware, budget_bytes: int | None = None,
                tokenizer_required: bool = True, world_size: int = 1, progress: Progress = no_progress,
                dataset: Dataset | None = None) -> PreparedRun:
    """Read, split, choose, tokenize and plan. With `tokenizer_required=False`
    (the `plan` command) a model that is not downloaded is planned from preset
    facts and character-based length estimates instead of failing. `dataset`:
    `options.data` already read with `options.policy` (`setup` plans each model with it)."""
    from llmcustoms.models import loading

    options, start = with_starting_point(options)
    if dataset is None:
        dataset = read_dataset(options.data, options.policy, lambda n: progress("read", n, None))
    options = replace(options, overrides=with_objective(options.overrides, is_preference(dataset.format),
                                                        dataset.path.name, dataset.format_description))
    preset = load_preset(options.preset or DEFAULT_PRESET)
    families = load_families()
    catalog = tuple(spec for family in families.values() for spec in family.models)
    hardware = with_measured_speeds(hardware, cache_dir(options.cache_dir), world_size)  # a measured duration
    optimizer = Planner(hardware, preset, budget_bytes, catalog)
    trust_remote_code = bool(options.override("trust_remote_code", False))
    split = split_rows(options, dataset, preset, progress)
    if split.eval_dataset:
        check_eval_data(options.override("objective", "sft"), is_preference(split.eval_dataset.format),
                        split.eval_dataset.path.name, split.eval_dataset.format_description)
    read_seconds = dataset.seconds + (split.eval_dataset.seconds if split.eval_dataset else 0.0)

    candidates = [loading.choice_from_spec(find_model_spec(m, families), families, "planner")
                  for m in preset.model_candidates(hardware.has_gpu)]

    def estimate() -> DataStats:  # from characters: to choose the model, or to plan without its tokenizer
        return estimated_stats(dataset, split.train, len(split.evaluation))

    if options.model:
        model, choice_reason = given_model(options, families, trust_remote_code, progress)
    else:
        usable, offline_reason = hub_access.usable_candidates(candidates)
        model, choice_reason = optimizer.choose_model(usable, estimate(), options.overrides, world_size)
        choice_reason += offline_reason
    # Before the tokenizer and the data's tokens: a model train would refuse to load is refused now.
    loading.check_weight_files(model.name, bool(options.override("allow_pickle_weights", False)))

    tokenized = None
    try:
        hf_tokenizer = loading.load_tokenizer(model.name, trust_remote_code)
    except ModelError:  # not downloaded: `plan` goes on with estimated lengths
        if tokenizer_required:
            raise
    else:  # a row the model cannot take (tool calls, say) is an error for `plan` too
        tokenized = _tokenize(model.name, hf_tokenizer, options, dataset, split.eval_dataset,
                              bool(options.override("train_on_prompt", False)), progress)
    train_full = evaluation_full = None
    if tokenized is None:
        stats = estimate()
    else:
        train_full = tokenized.rows.select(split.train)
        evaluation_full = (tokenized.eval_rows or tokenized.rows).select(split.evaluation)
        stats = measured_stats(train_full, len(evaluation_full), dataset.format)

    plan = optimizer.plan(model, stats, options.overrides, preset_source=options.preset_source, world_size=world_size)
    plan = _with_run_facts(plan, options, dataset, split, choice_reason, start)
    prepared = PreparedRun(plan=plan, tokenizer=None, train=None, evaluation=None, dataset=dataset,
                           eval_source=split.source, truncated=0, dropped=0, used_fallback_template=False,
                           read_seconds=read_seconds, model_params=sum(parameter_counts(model.arch)),
                           eval_dataset=split.eval_dataset)
    if tokenized is None:
        cut, kept = stats.rows_truncated(plan.max_seq_len), stats.rows_kept(plan.max_seq_len)
        return replace(prepared, plan=replace(plan, data_report=_facts(dataset, stats.lengths, stats.length_source,
                                                                          plan, cut, stats.train_rows - kept)))
    return _cut_to_plan(prepared, tokenized, train_full, evaluation_full)


def _with_run_facts(plan: Plan, options: TrainOptions, dataset: Dataset, split: Any, choice_reason: str | None,
                    start: Any) -> Plan:
    """The plan with where its rows and model came from (for `resume`), and the reasons planning could not know."""
    reasons = ((start.reason,) if start else ()) + ((choice_reason,) if choice_reason else ()) + plan.reasons
    if plan.objective_kind.pairs:
        reasons += (preference_reason(replace(plan, from_run=start.adapter if start else ""),
                                      options.overrides["objective"][1]),)
    need = disk_need(plan)
    reasons += (need.reason(),) if need else ()  # checked against free space when `train` starts (`training/preflight.py`)
    return replace(plan, data=str(Path(options.data).resolve()), data_format=dataset.format,
                   model_fingerprint=model_fingerprint(plan.model),
                   data_sha256=fingerprint(options.data), row_max_len=plan.max_seq_len,
                   eval_data_sha256=fingerprint(options.eval_data) if options.eval_data else "",
                   skip_bad_rows=options.skip_bad_rows, bad_row_policy=options.policy, data_report=dataset.to_json(),
                   eval_data=str(Path(options.eval_data).resolve()) if options.eval_data else None,
                   eval_split=split.fraction, from_run=start.adapter if start else "", reasons=reasons)


def _facts(dataset: Dataset, lengths: Sequence[int], source: str, plan: Plan, truncated: int,
           dropped: int, reasoning_shown: bool = True, end_tokens: dict[str, Any] | None = None) -> dict[str, Any]:
    epochs = None if plan.sources.get("total_steps") == "flag" else plan.epochs
    report = {**dataset.to_json(), **(end_tokens or {})}  # end_tokens: replies not learned, or that do not learn to stop
    if not reasoning_shown:  # the model's chat template leaves the rows' reasoning parts out
        report["reasoning_parts_dropped"] = dataset.reasoning_parts
    return data_facts(report, lengths, source, plan.max_seq_len, truncated, dropped, plan.total_steps, epochs)


def _cut_to_plan(prepared: PreparedRun, tokenized: Tokenized, train_full: TokenRows,
                 evaluation_full: TokenRows) -> PreparedRun:
    plan = prepared.plan
    train, train_cut, train_dropped = train_full.truncated(plan.max_seq_len)
    evaluation, eval_cut, eval_dropped = evaluation_full.truncated(plan.max_seq_len)
    if plan.eval_rows != len(evaluation):
        plan = plan.with_changes(eval_rows=len(evaluation))
    if overlap := rows_also_trained(train, evaluation):  # never presented as held out
        plan = replace(plan, eval_overlap_rows=overlap).with_warning(overlap_warning(overlap, len(evaluation)))
    if not len(train):
        raise ConfigError(f"No training row keeps a response token within {plan.max_seq_len} tokens.",
                          "Raise --max-seq-len.")
    from llmcustoms.data.chat_templates import prompts_use_template, supports_reasoning
    from llmcustoms.data.stop_tokens import end_token_facts
    from llmcustoms.models.loading import stop_token_ids

    hf = tokenized.tokenizer
    end_tokens = end_token_facts(hf, train_full, prompts_use_template(hf, plan.data_format, plan.raw_prompts),
                                 stop_token_ids(plan.model))
    if isinstance(train_full, TokenRows) and not plan.train_on_prompt:
        # With --train-on-prompt a row is one run of learned tokens; a pair's replies are counted by DPO.
        from llmcustoms.data.reply_counts import unlearned_replies
        from llmcustoms.data.token_store import MAX_ROW_CHARS

        dataset = prepared.dataset
        end_tokens = {**end_tokens, **unlearned_replies(train_full, dataset.replies, dataset.total_chars > MAX_ROW_CHARS)}
    plan = replace(plan, data_report=_facts(prepared.dataset, train_full.full_lengths, "tokenizer", plan, train_cut,
                                            train_dropped, supports_reasoning(hf), end_tokens),
                   tokens_key=tokenized.key)
    if len(evaluation_full) and not len(evaluation):  # held out, then dropped: never a silent "no evaluation"
        prepared = replace(prepared, eval_source=f"the {len(evaluation_full):,} held-out row(s) keep no reply within "
                                                 f"{plan.max_seq_len} tokens; raise --max-seq-len")
    return replace(prepared, plan=plan, tokenizer=tokenized.tokenizer, train=train, evaluation=evaluation,
                   truncated=train_cut + eval_cut, dropped=train_dropped + eval_dropped,
                   used_fallback_template=tokenized.used_fallback, tokenize_seconds=tokenized.seconds,
                   cached=tokenized.cached, templated_prompts=tokenized.templated_prompts, kept=tokenized.kept,
                   cache_notes=tokenized.notes)


def _less_sharding_warning(plan: Plan, world_size: int) -> str | None:
    """A warning (for `Plan.warnings`) when an FSDP run resumes over fewer
    processes than it was planned for and the larger shards are unlikely to fit.
    From the plan's own estimate: weights, gradients and optimizer state grow by
    old/new world size."""
    memory = plan.memory
    if plan.distributed != "fsdp" or world_size >= plan.world_size or not memory:
        return None
    state = memory["weights_bytes"] + memory["gradients_bytes"] + memory["optimizer_bytes"]
    grown = memory["total_bytes"] + state * (plan.world_size / world_size - 1)
    if world_size == 1:
        grown -= memory.get("gathered_bytes", 0)  # nothing to gather from others
    if grown <= memory["budget_bytes"] * (1 - SAFETY_MARGIN):
        return None
    return (f"sharded over {plan.world_size} processes this run needs about "
            f"{memory['total_bytes'] / GIB:.1f} GiB per process; with {world_size} about {grown / GIB:.1f} GiB, more "
            f"than the {memory['budget_bytes'] / GIB:.1f} GiB planned for. Out of memory is likely; resume with "
            f"--num-processes {plan.world_size} to keep the sharding")


def prepare_resume(plan: Plan, world_size: int = 1, model_changed_ok: bool = False) -> PreparedRun:
    """The same rows, in the same split, tokenized the same way as when the run
    began: everything comes from the run's plan.json. With another number of
    processes, accumulation is recomputed so the effective batch (and so every
    step's rows) stays the same. A base model whose files changed is refused
    unless `model_changed_ok` (`model_files.with_model_checked`)."""
    if world_size != plan.world_size:
        accum = max(1, -(-plan.effective_batch_size // (plan.micro_batch_size * world_size)))
        # Sharding needs several processes; a checkpoint holds whole tensors either way.
        distributed = "none" if world_size == 1 else plan.distributed if plan.distributed != "none" else "ddp"
        warning = _less_sharding_warning(plan, world_size)
        plan = plan.with_changes(f"resumed with {world_size} process(es) instead of {plan.world_size}: "
                                 f"accumulation {plan.grad_accum} -> {accum}", world_size=world_size, grad_accum=accum,
                                 distributed=distributed)
        if warning:
            plan = plan.with_warning(warning)
    for path, expected in ((plan.data, plan.data_sha256), (plan.eval_data, plan.eval_data_sha256)):
        if path and expected:
            if not Path(path).exists():
                raise DataError(f"The run's data file {path} is gone.", "Put it back where it was to resume this run.")
            if fingerprint(path) != expected:
                raise DataError(f"{Path(path).name} has changed since the run started (its checksum differs).",
                                "Restore the original data file, or start a new run with `llmcustoms train`.")
    # "skip" for runs planned before the policy existed with --skip-bad-rows: the rows they trained on.
    policy = "skip" if plan.skip_bad_rows else plan.bad_row_policy
    # A plan without a data report was made before prompt/completion rows went
    # through the chat template and before the evaluation rows were capped:
    # its rows are rebuilt the way it made them.
    older = not plan.data_report
    options = TrainOptions(data=plan.data, model=plan.model, eval_data=plan.eval_data,
                           skip_bad_rows=policy == "skip", strict=policy == "strict",
                           overrides={"seed": (plan.seed, "plan"), "eval_split": (plan.eval_split, "plan"),
                                      "raw_prompts": (plan.raw_prompts or older, "plan"),
                                      "objective": (plan.objective, "plan")})
    dataset = read_dataset(plan.data, options.policy)
    split = split_rows(options, dataset, None, no_progress, most=None if older else MAX_EVAL_ROWS)
    from llmcustoms.models.loading import load_tokenizer

    hf_tokenizer = load_tokenizer(plan.model, plan.trust_remote_code)  # before the check: it may fetch a hub revision
    plan = with_model_checked(plan, model_changed_ok)
    tokenized = _tokenize(plan.model, hf_tokenizer, options, dataset, split.eval_dataset, plan.train_on_prompt,
                          no_progress)
    if plan.tokens_key and tokenized.key != plan.tokens_key:
        raise DataError("The rows would be tokenized differently from when the run began (the model's tokenizer or "
                        "chat template, or llmcustoms' reading of the data, has changed), so the resumed run would "
                        "not continue the same training.",
                        "Restore the model files the run began with, or start a new run with `llmcustoms train`.")
    # The rows as the run began; FineTuner cuts them further if recovery shortened them.
    row_max_len = plan.row_max_len or plan.max_seq_len
    train, train_cut, train_dropped = tokenized.rows.select(split.train).truncated(row_max_len)
    evaluation, eval_cut, eval_dropped = (tokenized.eval_rows or tokenized.rows).select(split.evaluation).truncated(row_max_len)
    if len(train) != plan.train_rows:
        raise DataError(f"{Path(plan.data).name} has changed since the run started: it now gives "
                        f"{len(train)} training rows, the run was planned for {plan.train_rows}.",
                        "Restore the original data file, or start a new run with `llmcustoms train`.")
    return PreparedRun(plan=plan, tokenizer=tokenized.tokenizer, train=train, evaluation=evaluation,
                       dataset=dataset, eval_source=split.source, truncated=train_cut + eval_cut,
                       dropped=train_dropped + eval_dropped, used_fallback_template=tokenized.used_fallback,
                       read_seconds=dataset.seconds, tokenize_seconds=tokenized.seconds, cached=tokenized.cached,
                       kept=tokenized.kept, cache_notes=tokenized.notes, eval_dataset=split.eval_dataset)
