"""Draw each optimizer step's rows at random; split a step into micro-batches of
similar length, each padded to its own longest row.

A step's rows are a random draw, as in every trainer, never a group of rows
of similar length: the loss is normalised by the trained tokens of the whole
step, so in a step of short rows each token weighs more than in a step of
long ones. Steps grouped by length taught short rows several times harder
than long ones, which cost 1.9% held-out loss on code (mixed lengths) against
random steps (docs/benchmarks.md, "Steps drawn at random"). Within a step the
rows are sorted, so with gradient accumulation a micro-batch pads little;
with packing (GPUs) nothing is padded at all. The whole order is a pure
function of (seed, epoch), so a resumed run sees exactly the batches an
uninterrupted one would.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from llmcustoms.data.pair_rows import PairRows
from llmcustoms.data.token_store import TokenRows
from llmcustoms.data.tokenization import IGNORE_INDEX, TokenizedExample
from llmcustoms.losses.dpo_reference import ReferenceLogps
from llmcustoms.models.packing import pack

# A run's rows: memory-mapped (`TokenRows`; `PairRows` for preference pairs),
# or a list (tests, small tools).
Rows = TokenRows | PairRows | Sequence[TokenizedExample]


def as_token_rows(rows: Rows) -> TokenRows | PairRows:
    return rows if isinstance(rows, (TokenRows, PairRows)) else TokenRows.from_examples(list(rows))


# Which rows make up each optimizer step of an epoch: `epoch_steps` below, or
# what a caller passes to `FineTuner` instead (preference pairs, say).
StepRows = Callable[[list[int], int, int, int], list[list[int]]]


def epoch_steps(lengths: list[int], step_rows: int, seed: int, epoch: int) -> list[list[int]]:
    """The optimizer steps of one epoch: lists of row indices, in training order,
    each a random draw of the rows (see the module's docstring for why).

    Which rows make up a step depends only on (seed, epoch, step_rows), never
    on how a step is split into micro-batches, so halving the micro-batch and
    doubling accumulation (OOM recovery) trains on exactly the same steps.
    """
    order = np.random.default_rng([seed, epoch]).permutation(len(lengths)).tolist()
    steps = [order[i:i + step_rows] for i in range(0, len(order), step_rows)]
    # The step with the longest row goes first, so a batch that does not fit
    # in memory fails in the first seconds rather than hours in.
    longest = max(range(len(steps)), key=lambda s: max(lengths[i] for i in steps[s]))
    steps.insert(0, steps.pop(longest))
    return steps


def micro_batches(step: list[int], lengths: list[int], micro_batch_size: int) -> list[list[int]]:
    """Split one step's rows into micro-batches of similar length (longest first)."""
    ordered = sorted(step, key=lambda i: -lengths[i])
    return [ordered[i:i + micro_batch_size] for i in range(0, len(ordered), micro_batch_size)]


def eval_batches(lengths: list[int], micro_batch_size: int) -> list[list[int]]:
    """Evaluation order: sorted by length, so padding is minimal; no shuffling."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i:i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]


# On a CPU in bf16, oneDNN builds kernels for each sequence length it meets and keeps them: a run of mixed
# lengths grew by about 5 MB a step (tiny Llama on the example data, 136 steps: 0.15 -> 0.90 GiB resident,
# 6.6x its plan) where fp32 stayed flat. Lengths rounded up to a multiple bound them to max_seq_len / multiple:
# with 64, 0.32 GiB at the end (2.4x before the plan counted the kernels) and 22.1 s -> 17.4 s for the run,
# fewer kernels built (measured with 1, 32 and 64 on 2 idle cores).
# The head's rows, a new count each batch, are rounded likewise: `losses/sft.HEAD_ROWS_MULTIPLE`.
CPU_BF16_MULTIPLE = 64


def pad_multiple(plan: Any) -> int:
    """What a micro-batch's length is rounded up to: 8 on a GPU (tensor cores work on multiples of 8),
    CPU_BF16_MULTIPLE (or the largest power of two under it dividing max_seq_len) on a CPU in bf16,
    and 1 on a CPU in fp32, where padding only costs."""
    if torch.cuda.is_available():
        return 8
    if plan.mixed_precision != "bf16":
        return 1
    multiple = CPU_BF16_MULTIPLE
    while multiple > 1 and plan.max_seq_len % multiple:  # never past max_seq_len, which the plan's memory is for
        multiple //= 2
    return multiple


def collate(examples: list[TokenizedExample], pad_token_id: int, pad_to_multiple_of: int = 1) -> dict[str, torch.Tensor]:
    """Right-pad to the batch's longest row; labels are -100 on padding."""
    longest = max(len(e.input_ids) for e in examples)
    width = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids)
        labels[row, :n] = torch.tensor(example.labels)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def count_loss_tokens(labels: torch.Tensor) -> int:
    """Tokens that contribute to the loss: labels shift by one, so position 0 never counts."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


class TrainingRows:
    """A run's rows as the loop takes them: the steps of an epoch, a step's
    micro-batches collated, token counts, the evaluation batches.

    Step composition depends on the training rows' lengths as they came; those
    stay fixed when recovery shortens the rows (`cut`), so no row is skipped or
    seen twice in an epoch. With preference pairs a row is a pair: a batch
    holds its chosen and rejected sequences in turn, and the loss is
    normalised by pairs rather than tokens."""

    def __init__(self, train: Rows, evaluation: Rows, pad_token_id: int, pad_to_multiple_of: int = 1,
                 packing: bool = False, general: TokenRows | None = None):
        self.train = as_token_rows(train)
        self.evaluation = as_token_rows(evaluation)
        # The general rows forgetting is measured on (`general_text.py`), or None: evaluated beside the evaluation rows.
        self.general = general if general is not None and len(general) and len(self.evaluation) else None
        self.pairs = isinstance(self.train, PairRows)
        # DPO's (training, evaluation) reference log-probabilities, when computed up front (`losses/dpo_reference.py`).
        self.reference: tuple[ReferenceLogps, ReferenceLogps] | None = None
        self.lengths = self.train.lengths.tolist()
        self.current_lengths = self.train.lengths  # after any cut: what a step computes
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.packing = packing and not self.pairs  # training batches as one sequence (`models/packing.py`)

    def mix_in(self, replayed: TokenRows) -> None:
        """Replayed rows after the data's (`replay.py`): training positions len(train) on."""
        from llmcustoms.training.replay import MixedRows

        self.train = MixedRows(self.train, replayed)
        self.lengths = self.lengths + replayed.lengths.tolist()
        self.current_lengths = self.train.lengths

    def cut(self, max_len: int) -> None:
        self.train, self.evaluation = self.train.cut(max_len), self.evaluation.cut(max_len)
        self.general = self.general.cut(max_len) if self.general is not None else None
        self.current_lengths = self.train.lengths

    def collate(self, rows: list[int]) -> dict[str, torch.Tensor]:
        if self.packing:
            return pack(self.train.examples(rows))
        return self._batch(self.train, rows, 0)

    def collate_examples(self, examples: list[TokenizedExample]) -> dict[str, torch.Tensor]:
        return collate(examples, self.pad_token_id, self.pad_to_multiple_of)

    def _batch(self, rows: Rows, positions: list[int], which: int) -> dict[str, torch.Tensor]:
        """These rows collated; with DPO's reference log-probabilities when they were computed up front."""
        examples = rows.examples(positions)
        batch = self.collate_examples(examples)
        if self.reference is not None:
            halves = [2 * p + half for p in positions for half in (0, 1)]
            batch["reference_logps"] = self.reference[which].sums(halves, [len(e.input_ids) for e in examples])
        return batch

    def token_counts(self, rows: list[int]) -> tuple[int, int]:
        """(what the loss is normalised by: trained tokens, or pairs; input tokens) of these training rows."""
        units = len(rows) if self.pairs else self.train.trained_tokens(rows)
        return units, self.train.input_tokens(rows)

    def batch_units(self, batch: dict[str, torch.Tensor]) -> int:
        """What the loss of a collated batch is normalised by: trained tokens, or pairs."""
        return batch["labels"].shape[0] // 2 if self.pairs else count_loss_tokens(batch["labels"])

    def evaluation_batches(self, micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
        return [self._batch(self.evaluation, batch, 1)
                for batch in eval_batches(self.evaluation.lengths.tolist(), micro_batch_size)]

    def general_batches(self, micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
        """The general rows' batches (none without them): a language-model loss, never DPO's."""
        if self.general is None:
            return []
        return [self.collate_examples(self.general.examples(batch))
                for batch in eval_batches(self.general.lengths.tolist(), micro_batch_size)]
