"""From the user's options to a plan and tokenized data, before any weight loads.

Order matters: read and validate the data (cheap, fails fast on bad rows),
look at the model's config and tokenizer, measure token lengths, split off the
evaluation rows, then plan. `train`, `plan` and `tune` all start here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llmcustoms.data import Dataset, read_dataset
from llmcustoms.errors import ConfigError, DataError
from llmcustoms.hardware import Hardware
from llmcustoms.planning import DataStats, Plan, eval_fraction, make_plan
from llmcustoms.presets import load_families, load_preset
from llmcustoms.tokenization import TokenizedExample, Tokenizer, ensure_chat_template, first_loss_position, truncate

DEFAULT_PRESET = "quality"


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


@dataclass
class PreparedRun:
    plan: Plan
    tokenizer: Any
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


def prepare_run(options: TrainOptions, hardware: Hardware) -> PreparedRun:
    from llmcustoms import modeling

    dataset = read_dataset(options.data, skip_bad_rows=options.skip_bad_rows)
    preset_name = options.preset or DEFAULT_PRESET
    preset = load_preset(preset_name)
    families = load_families()
    trust_remote_code = bool(options.overrides.get("trust_remote_code", (False, ""))[0])
    model_name, model_source = (options.model, "flag") if options.model else (preset.default_model, f"preset {preset.name}")
    model = modeling.describe_model(model_name, families, model_source, trust_remote_code)
    hf_tokenizer = modeling.load_tokenizer(model_name, trust_remote_code)
    used_fallback = ensure_chat_template(hf_tokenizer)
    train_on_prompt = bool(options.overrides.get("train_on_prompt", (False, ""))[0])
    tokenizer = Tokenizer(hf_tokenizer, train_on_prompt=train_on_prompt, stop_token_ids=modeling.stop_token_ids(model_name))
    seed = options.overrides.get("seed", (42, ""))[0]

    if options.eval_data:
        eval_set = read_dataset(options.eval_data, skip_bad_rows=options.skip_bad_rows)
        train_examples, eval_examples = dataset.examples, eval_set.examples
        eval_source = f"from {Path(options.eval_data).name}"
    else:
        fraction, fraction_source = eval_fraction(preset, len(dataset.examples), options.overrides)
        train_idx, eval_idx = split_eval(len(dataset.examples), fraction, seed)
        train_examples = [dataset.examples[i] for i in train_idx]
        eval_examples = [dataset.examples[i] for i in eval_idx]
        eval_source = f"{fraction:.0%} split, seed {seed}, {fraction_source}"
    if not train_examples:
        raise DataError(f"{dataset.path.name}: no rows left for training after the evaluation split.",
                        "Lower --eval-split or add more rows.")

    # Tokenize untruncated first: planning picks max_seq_len from these lengths.
    train_full = [tokenizer.encode(e) for e in train_examples]
    eval_full = [tokenizer.encode(e) for e in eval_examples]
    stats = DataStats(lengths=tuple(len(e.input_ids) for e in train_full),
                      first_loss_positions=tuple(first_loss_position(e) for e in train_full),
                      eval_rows=len(eval_full), format=dataset.format)
    preset_source = "flag" if options.preset else "default"
    plan = make_plan(hardware, preset, model, stats, options.overrides, preset_source=preset_source)
    train = truncate(train_full, plan.max_seq_len)
    evaluation = truncate(eval_full, plan.max_seq_len)
    if plan.eval_rows != len(evaluation.examples):
        plan = plan.with_changes(eval_rows=len(evaluation.examples))
    if not train.examples:
        raise ConfigError(f"No training row keeps a response token within {plan.max_seq_len} tokens.",
                          "Raise --max-seq-len.")
    return PreparedRun(plan=plan, tokenizer=hf_tokenizer, train=train.examples, evaluation=evaluation.examples,
                       dataset=dataset, eval_source=eval_source, truncated=train.truncated + evaluation.truncated,
                       dropped=train.dropped + evaluation.dropped, used_fallback_template=used_fallback)
