"""Which rows train and which are held out for evaluation.

A seeded split of the data file's usable rows (the same seed, the same split,
so `resume` rebuilds exactly the rows a run began with), or every row of a
second file (`--eval-data`). It is made before the model is chosen: the
choice plans on the training rows. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from llmcustoms.data.dataset import Dataset, read_dataset
from llmcustoms.data.pair_rows import PairRows
from llmcustoms.errors import DataError
from llmcustoms.planning.options import Overrides
from llmcustoms.planning.presets import TrainingPreset
from llmcustoms.planning.train_options import TrainOptions

# Held-out rows beyond this make each evaluation slower without making it
# more telling: a 2% split of a million rows is capped here.
MAX_EVAL_ROWS = 2000


def split_eval(n_rows: int, fraction: float, seed: int, most: int | None = MAX_EVAL_ROWS) -> tuple[list[int], list[int]]:
    """Seeded train/eval split of row indices; the same seed gives the same split."""
    if fraction <= 0 or n_rows < 2:
        return list(range(n_rows)), []
    n_eval = min(n_rows - 1, max(1, round(n_rows * fraction)), most or n_rows)
    order = np.random.default_rng(seed).permutation(n_rows)
    eval_idx = np.sort(order[:n_eval])
    keep = np.ones(n_rows, bool)
    keep[eval_idx] = False
    return np.flatnonzero(keep).tolist(), eval_idx.tolist()


def eval_fraction(preset: TrainingPreset, total_rows: int, overrides: Overrides) -> tuple[float, str]:
    """The share of rows held out for evaluation, and where it came from.
    Needed before planning proper, since the split decides the training rows;
    so before the model is known, which is why a preset cannot set it by model
    size (`NOT_BY_MODEL_SIZE`) and the dataset-size bucket alone decides it."""
    if "eval_split" in overrides:
        return overrides["eval_split"]
    values, bucket = preset.for_dataset_size(total_rows)
    return values["eval_split"], f"preset {preset.name} ({bucket} dataset)"


@dataclass
class Split:
    """Which rows train and which evaluate: positions in the data file's usable
    rows, or (with --eval-data) every usable row of a second file."""

    train: list[int]
    evaluation: list[int]
    eval_dataset: Dataset | None
    source: str
    fraction: float


def split_rows(options: TrainOptions, dataset: Dataset, preset: Any, progress: Callable[[str, int, "int | None"], None],
           most: int | None = MAX_EVAL_ROWS) -> Split:
    if options.eval_data:
        eval_set = read_dataset(options.eval_data, options.policy, lambda n: progress("read", n, None))
        kept = min(eval_set.rows, most or eval_set.rows)
        first = f", its first {kept:,} rows" if kept < eval_set.rows else ""
        return Split(list(range(dataset.rows)), list(range(kept)), eval_set,
                     f"from {Path(options.eval_data).name}{first}", 0.0)
    seed = options.override("seed", 42)
    fraction, fraction_source = eval_fraction(preset, dataset.rows, options.overrides)
    train_idx, eval_idx = split_eval(dataset.rows, fraction, seed, most)
    if not train_idx:
        raise DataError(f"{dataset.path.name}: no rows left for training after the evaluation split.",
                        "Lower --eval-split or add more rows.")
    if not eval_idx:
        return Split(train_idx, eval_idx, None, _why_none(dataset.rows, fraction, fraction_source), fraction)
    capped = f", at most {MAX_EVAL_ROWS:,} rows" if len(eval_idx) == MAX_EVAL_ROWS else ""
    return Split(train_idx, eval_idx, None, f"{fraction:.0%} split{capped}, seed {seed}, {fraction_source}", fraction)


def _why_none(rows: int, fraction: float, fraction_source: str) -> str:
    """Why a split holds no row out, in words for the data report."""
    if fraction <= 0:
        return f"eval split 0, {fraction_source}"
    return (f"{rows} row cannot be split into training and held-out rows: nothing measures how well the model "
            "generalises, and early stopping is off; add rows, or pass --eval-data FILE")


def rows_also_trained(train: Any, evaluation: Any) -> int:
    """How many evaluation rows (pairs, for preference data) have exactly the tokens
    of a training row: all of them when --eval-data names the training file, some
    when a row is written twice and the split puts one copy on each side."""
    if not len(train) or not len(evaluation):
        return 0
    group = 2 if isinstance(evaluation, PairRows) else 1
    held_shapes = _shapes(evaluation, group)
    held = _token_keys(evaluation, group, np.ones(len(held_shapes), bool))
    trained = set(_token_keys(train, group, np.isin(_shapes(train, group), held_shapes)))
    return sum(key in trained for key in held)


def _shapes(rows: Any, group: int) -> np.ndarray:
    """Each row's length (a pair's two lengths as one number): only rows of a shape the
    other side has can be equal, so only those are compared token by token."""
    halves = rows.rows if group == 2 else rows
    lengths = np.diff(halves.arrays.offsets)[halves.index]
    return lengths if group == 1 else lengths[0::2] * (1 << 32) + lengths[1::2]


def _token_keys(rows: Any, group: int, chosen: np.ndarray) -> list[bytes]:
    halves = rows.rows if group == 2 else rows
    offsets, ids = halves.arrays.offsets, halves.arrays.ids
    keys = []
    for row in np.flatnonzero(chosen):
        parts = halves.index[row * group:(row + 1) * group]
        keys.append(b"|".join(ids[offsets[k]:offsets[k + 1]].tobytes() for k in parts))
    return keys


def overlap_warning(overlap: int, rows: int) -> str:
    """What `rows_also_trained` found, for the plan's warnings (shown by train, kept in train.log)."""
    which = f"all {rows:,} evaluation rows are" if overlap == rows else f"{overlap:,} of the {rows:,} evaluation rows are"
    return (f"{which} training rows too (the same tokens): eval loss on them measures what the model remembers, "
            "not how it does on text it never saw, and early stopping and the weights kept follow it. Hold out rows "
            "the run does not train on: --eval-split, or an --eval-data file of other rows")
