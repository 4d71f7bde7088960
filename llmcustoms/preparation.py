"""From the user's options to a plan and tokenized data, before any weight loads.

Order matters: read and validate the data (cheap, fails fast on bad rows),
split off the evaluation rows, pick or describe the model, measure token
lengths with its tokenizer, then plan. `train`, `plan` and `tune` all start here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from llmcustoms.data import Dataset, Example, fingerprint, read_dataset
from llmcustoms.errors import ConfigError, DataError, ModelError
from llmcustoms.hardware import Hardware
from llmcustoms.planning import DataStats, ModelChoice, ParameterOptimizer, Plan, eval_fraction
from llmcustoms.presets import find_model_spec, load_families, load_preset
from llmcustoms.tokenization import TokenizedExample, Tokenizer, ensure_chat_template, first_loss_position, truncate

DEFAULT_PRESET = "quality"
# Without a tokenizer (planning offline), lengths are estimated from characters.
CHARS_PER_TOKEN = 3.6
TEMPLATE_TOKENS_PER_MESSAGE = 6


@dataclass
class TrainOptions:
    """What the user asked for. None means "not given": the plan decides."""

    data: str
    model: str | None = None
    preset: str | None = None
    eval_data: str | None = None
    skip_bad_rows: bool = False
    # field -> (value, source): plan values set by a flag or the environment
    overrides: dict[str, tuple[Any, str]] = field(default_factory=dict)
    model_source: str = "flag"
    preset_source: str = "default"

    def override(self, name: str, default: Any) -> Any:
        return self.overrides.get(name, (default, ""))[0]


@dataclass
class PreparedRun:
    plan: Plan
    tokenizer: Any  # None when planning offline without the model's tokenizer
    train: list[TokenizedExample]
    evaluation: list[TokenizedExample]
    dataset: Dataset
    eval_source: str
    truncated: int
    dropped: int
    used_fallback_template: bool


def split_eval(n_rows: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded train/eval split of row indices; the same seed gives the same split."""
    if fraction <= 0 or n_rows < 2:
        return list(range(n_rows)), []
    n_eval = min(n_rows - 1, max(1, round(n_rows * fraction)))
    order = np.random.default_rng(seed).permutation(n_rows)
    eval_idx = sorted(order[:n_eval].tolist())
    held_out = set(eval_idx)
    return [i for i in range(n_rows) if i not in held_out], eval_idx


def estimated_stats(train: list[Example], eval_rows: int, fmt: str) -> DataStats:
    """Token lengths guessed from characters, for planning without a tokenizer."""
    def tokens(text_chars: int, messages: int) -> int:
        return int(text_chars / CHARS_PER_TOKEN) + TEMPLATE_TOKENS_PER_MESSAGE * messages

    lengths, firsts = [], []
    for e in train:
        if e.is_chat:
            lengths.append(tokens(e.char_count(), len(e.messages)))
            firsts.append(tokens(sum(len(c) for _, c in e.messages[:-1]), len(e.messages) - 1) + 2)
        else:
            lengths.append(tokens(e.char_count(), 1))
            firsts.append(max(1, tokens(len(e.prompt), 0)))
    return DataStats(lengths=tuple(lengths), first_loss_positions=tuple(firsts), eval_rows=eval_rows, format=fmt,
                     length_source=f"characters (about {CHARS_PER_TOKEN} per token; the tokenizer is not available offline)")


def _split(options: TrainOptions, dataset: Dataset, preset: Any) -> tuple[list[Example], list[Example], str, float]:
    """Training and evaluation examples, a description of the split, and the fraction held out."""
    if options.eval_data:
        eval_set = read_dataset(options.eval_data, skip_bad_rows=options.skip_bad_rows)
        return dataset.examples, eval_set.examples, f"from {Path(options.eval_data).name}", 0.0
    seed = options.override("seed", 42)
    fraction, fraction_source = eval_fraction(preset, len(dataset.examples), options.overrides)
    train_idx, eval_idx = split_eval(len(dataset.examples), fraction, seed)
    train = [dataset.examples[i] for i in train_idx]
    if not train:
        raise DataError(f"{dataset.path.name}: no rows left for training after the evaluation split.",
                        "Lower --eval-split or add more rows.")
    return (train, [dataset.examples[i] for i in eval_idx], f"{fraction:.0%} split, seed {seed}, {fraction_source}",
            fraction)


def _tokenize(model_name: str, train: list[Example], evaluation: list[Example], train_on_prompt: bool,
              trust_remote_code: bool) -> tuple[Any, bool, list[TokenizedExample], list[TokenizedExample]]:
    """(tokenizer, used the fallback template, train rows, eval rows), untruncated."""
    from llmcustoms import modeling

    hf_tokenizer = modeling.load_tokenizer(model_name, trust_remote_code)
    used_fallback = ensure_chat_template(hf_tokenizer)
    tokenizer = Tokenizer(hf_tokenizer, train_on_prompt=train_on_prompt, stop_token_ids=modeling.stop_token_ids(model_name))
    return hf_tokenizer, used_fallback, [tokenizer.encode(e) for e in train], [tokenizer.encode(e) for e in evaluation]


def prepare_run(options: TrainOptions, hardware: Hardware, budget_bytes: int | None = None,
                tokenizer_required: bool = True) -> PreparedRun:
    """Read, split, choose, tokenize and plan. With `tokenizer_required=False`
    (the `plan` command) a model that is not downloaded is planned from preset
    facts and character-based length estimates instead of failing."""
    from llmcustoms import modeling

    dataset = read_dataset(options.data, skip_bad_rows=options.skip_bad_rows)
    preset = load_preset(options.preset or DEFAULT_PRESET)
    families = load_families()
    catalog = tuple(spec for family in families.values() for spec in family.models)
    optimizer = ParameterOptimizer(hardware, preset, budget_bytes, catalog)
    trust_remote_code = bool(options.override("trust_remote_code", False))
    train_examples, eval_examples, eval_source, fraction = _split(options, dataset, preset)

    candidates = [modeling.choice_from_spec(find_model_spec(m, families), families, "optimizer") for m in preset.models]
    choice_reason = None
    if options.model:
        model = modeling.describe_model(options.model, families, options.model_source, trust_remote_code)
    else:
        rough = estimated_stats(train_examples, len(eval_examples), dataset.format)
        model, choice_reason = optimizer.choose_model(candidates, rough, options.overrides)

    hf_tokenizer, used_fallback = None, False
    train_full: list[TokenizedExample] = []
    eval_full: list[TokenizedExample] = []
    try:
        # Untruncated first: planning picks max_seq_len from these lengths.
        hf_tokenizer, used_fallback, train_full, eval_full = _tokenize(
            model.name, train_examples, eval_examples, bool(options.override("train_on_prompt", False)), trust_remote_code)
    except ModelError:
        if tokenizer_required:
            raise
    if hf_tokenizer is None:
        stats = estimated_stats(train_examples, len(eval_examples), dataset.format)
    else:
        stats = DataStats(lengths=tuple(len(e.input_ids) for e in train_full),
                          first_loss_positions=tuple(first_loss_position(e) for e in train_full),
                          eval_rows=len(eval_full), format=dataset.format)

    plan = optimizer.plan(model, stats, options.overrides, preset_source=options.preset_source)
    if choice_reason:
        plan = replace(plan, reasons=(choice_reason,) + plan.reasons)
    plan = replace(plan, data=str(Path(options.data).resolve()), data_format=dataset.format,
                   data_sha256=fingerprint(options.data), row_max_len=plan.max_seq_len,
                   eval_data_sha256=fingerprint(options.eval_data) if options.eval_data else "",
                   skip_bad_rows=options.skip_bad_rows,
                   eval_data=str(Path(options.eval_data).resolve()) if options.eval_data else None, eval_split=fraction)
    train = truncate(train_full, plan.max_seq_len)
    evaluation = truncate(eval_full, plan.max_seq_len)
    if hf_tokenizer is not None:
        if plan.eval_rows != len(evaluation.examples):
            plan = plan.with_changes(eval_rows=len(evaluation.examples))
        if not train.examples:
            raise ConfigError(f"No training row keeps a response token within {plan.max_seq_len} tokens.",
                              "Raise --max-seq-len.")
    return PreparedRun(plan=plan, tokenizer=hf_tokenizer, train=train.examples, evaluation=evaluation.examples,
                       dataset=dataset, eval_source=eval_source, truncated=train.truncated + evaluation.truncated,
                       dropped=train.dropped + evaluation.dropped, used_fallback_template=used_fallback)


def prepare_resume(plan: Plan) -> PreparedRun:
    """The same rows, in the same split, tokenized the same way as when the run
    began: everything comes from the run's plan.json."""
    for path, expected in ((plan.data, plan.data_sha256), (plan.eval_data, plan.eval_data_sha256)):
        if path and expected:
            if not Path(path).exists():
                raise DataError(f"The run's data file {path} is gone.", "Put it back where it was to resume this run.")
            if fingerprint(path) != expected:
                raise DataError(f"{Path(path).name} has changed since the run started (its checksum differs).",
                                "Restore the original data file, or start a new run with `llmcustoms train`.")
    options = TrainOptions(data=plan.data, model=plan.model, eval_data=plan.eval_data, skip_bad_rows=plan.skip_bad_rows,
                           overrides={"seed": (plan.seed, "plan"), "eval_split": (plan.eval_split, "plan")})
    dataset = read_dataset(plan.data, skip_bad_rows=plan.skip_bad_rows)
    train_examples, eval_examples, eval_source, _ = _split(options, dataset, preset=None)
    hf_tokenizer, used_fallback, train_full, eval_full = _tokenize(
        plan.model, train_examples, eval_examples, plan.train_on_prompt, plan.trust_remote_code)
    # The rows as the run began; FineTuner cuts them further if recovery shortened them.
    train = truncate(train_full, plan.row_max_len or plan.max_seq_len)
    evaluation = truncate(eval_full, plan.row_max_len or plan.max_seq_len)
    if len(train.examples) != plan.train_rows:
        raise DataError(f"{Path(plan.data).name} has changed since the run started: it now gives "
                        f"{len(train.examples)} training rows, the run was planned for {plan.train_rows}.",
                        "Restore the original data file, or start a new run with `llmcustoms train`.")
    return PreparedRun(plan=plan, tokenizer=hf_tokenizer, train=train.examples, evaluation=evaluation.examples,
                       dataset=dataset, eval_source=eval_source, truncated=train.truncated + evaluation.truncated,
                       dropped=train.dropped + evaluation.dropped, used_fallback_template=used_fallback)
