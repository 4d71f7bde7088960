"""A preference run's rows: each a pair of store rows, chosen then rejected.

A pair file is tokenized into a store whose rows 2i and 2i+1 are row i's
chosen and rejected conversations (`row_formats.Example.halves`). `PairRows`
shows it as one row per pair, with what `TokenRows` offers the loop (lengths,
selection, cuts), so steps, micro-batches, splits and recovery work on pairs
exactly as on rows: a pair is never split between micro-batches or
processes. A pair's length is its longer half: what it costs a padded batch.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from llmcustoms.data.token_store import TokenRows
from llmcustoms.data.tokenization import TokenizedExample


def _halves(positions: Sequence[int] | np.ndarray) -> np.ndarray:
    pairs = np.asarray(positions, np.int64)
    return np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)


class PairRows:
    def __init__(self, rows: TokenRows):
        """`rows`: the halves, chosen and rejected of each pair in turn."""
        assert len(rows) % 2 == 0, "a pair store has an even number of rows"
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows) // 2

    @property
    def max_len(self) -> int | None:
        return self.rows.max_len

    @property
    def full_lengths(self) -> np.ndarray:
        return self.rows.full_lengths.reshape(-1, 2).max(axis=1)

    @property
    def lengths(self) -> np.ndarray:
        return self.rows.lengths.reshape(-1, 2).max(axis=1)

    @property
    def first_loss(self) -> np.ndarray:
        """Where the later of the two replies starts: both must fit for the pair to teach."""
        return self.rows.first_loss.reshape(-1, 2).max(axis=1)

    @property
    def row_numbers(self) -> np.ndarray:
        return self.rows.row_numbers[::2]

    def select(self, positions: Sequence[int] | np.ndarray) -> "PairRows":
        return PairRows(self.rows.select(_halves(positions)))

    def cut(self, max_len: int) -> "PairRows":
        return PairRows(self.rows.cut(max_len))

    def truncated(self, max_len: int) -> tuple["PairRows", int, int]:
        """(pairs cut to max_len without those where either reply is cut away
        entirely, pairs truncated, pairs dropped)."""
        halves = self.rows.first_loss < np.minimum(self.rows.full_lengths, max_len)
        keep = halves.reshape(-1, 2).all(axis=1)
        truncated = int((self.lengths > max_len).sum())
        kept = PairRows(self.rows.select(_halves(np.flatnonzero(keep))).cut(max_len))
        return kept, truncated, int((~keep).sum())

    def examples(self, positions: Sequence[int]) -> list[TokenizedExample]:
        """Chosen and rejected of each pair in turn: one forward takes both."""
        return self.rows.examples(_halves(positions).tolist())

    def input_tokens(self, positions: Sequence[int]) -> int:
        return self.rows.input_tokens(_halves(positions))

    def trained_tokens(self, positions: Sequence[int]) -> int:
        return self.rows.trained_tokens(_halves(positions).tolist())
