"""What preparation gives a command: a `PreparedRun` (the plan, the tokenizer, the
training and evaluation rows as memory-mapped token stores, and what reading them
found), and the data's statistics planning draws on.

Below `training/`, `ui/` and `commands/` in the import order, so each takes the
record typed. Made by `preparing.prepare_run` and `preparing.prepare_resume`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from llmcustoms.data.dataset import Dataset
from llmcustoms.data.row_formats import Example
from llmcustoms.data.token_store import TokenRows
from llmcustoms.planning.plan import DataStats, Plan

# Without a tokenizer (planning offline), lengths are estimated from characters.
CHARS_PER_TOKEN = 3.6
TEMPLATE_TOKENS_PER_MESSAGE = 6
# Told how far preparation is: (stage "read" or "tokenize", rows done, rows in all or None).
Progress = Callable[[str, int, "int | None"], None]


def no_progress(stage: str, done: int, total: int | None) -> None:
    return None


@dataclass
class PreparedRun:
    plan: Plan
    tokenizer: Any  # None when planning offline without the model's tokenizer
    train: TokenRows | None  # None (with evaluation) when planning offline
    evaluation: TokenRows | None
    dataset: Dataset
    eval_source: str
    truncated: int
    dropped: int
    used_fallback_template: bool
    read_seconds: float = 0.0  # reading and validating the data files
    tokenize_seconds: float = 0.0  # tokenizing them (0 when the cache had them)
    cached: bool = False  # the tokenized rows came from the cache
    kept: bool = True  # the tokenized rows are in the cache for the next run
    cache_notes: tuple[str, ...] = ()  # what to say about the cache: a store rebuilt, or nothing kept and why
    templated_prompts: bool = False  # prompt/completion rows go through the model's own chat template
    model_params: int = 0  # every parameter of the model: what `export --merge` writes (0: not known)
    eval_dataset: Dataset | None = None  # what --eval-data's file held; None: the evaluation rows are the data's

    def eval_file_examples(self) -> Iterator[Example]:
        """The usable rows of the file the evaluation rows come from (--eval-data's, else the data's),
        as `Dataset.examples` gives them: kept from reading, or streamed again."""
        return (self.eval_dataset or self.dataset).examples()


def estimated_stats(dataset: Dataset, indices: Sequence[int] | None, eval_rows: int) -> DataStats:
    """Token lengths guessed from characters, for planning without a tokenizer."""
    idx = np.arange(dataset.rows) if indices is None else np.asarray(indices, np.int64)
    chars, prompt, turns = dataset.total_chars[idx], dataset.prompt_chars[idx], dataset.turns[idx].astype(np.int64)
    lengths = (chars / CHARS_PER_TOKEN).astype(np.int64) + TEMPLATE_TOKENS_PER_MESSAGE * np.maximum(turns, 1)
    prompt_tokens = (prompt / CHARS_PER_TOKEN).astype(np.int64)
    firsts = np.where(turns > 0, prompt_tokens + TEMPLATE_TOKENS_PER_MESSAGE * (turns - 1) + 2,
                      np.maximum(1, prompt_tokens))
    return DataStats(lengths=tuple(lengths.tolist()), first_loss_positions=tuple(firsts.tolist()), eval_rows=eval_rows,
                     format=dataset.format,
                     length_source=f"characters (about {CHARS_PER_TOKEN} per token; the tokenizer is not available offline)")


@dataclass
class Tokenized:
    tokenizer: Any
    used_fallback: bool
    rows: TokenRows
    eval_rows: TokenRows | None
    seconds: float
    cached: bool
    templated_prompts: bool  # prompt/completion rows go through the model's own chat template
    key: str  # the training data's store key: what its token ids depend on
    kept: bool = True
    notes: tuple[str, ...] = ()


def measured_stats(train: TokenRows, eval_rows: int, fmt: str) -> DataStats:
    return DataStats(lengths=tuple(train.full_lengths.tolist()), first_loss_positions=tuple(train.first_loss.tolist()),
                     eval_rows=eval_rows, format=fmt)
