"""Evaluation rows that are training rows too (`splits.rows_also_trained`): counted exactly,
so no verdict passes them off as held out."""

from __future__ import annotations

from llmcustoms.data.pair_rows import PairRows
from llmcustoms.data.splits import overlap_warning, rows_also_trained
from llmcustoms.data.token_store import TokenRows
from llmcustoms.data.tokenization import TokenizedExample


def rows(*sequences: list[int]) -> TokenRows:
    return TokenRows.from_examples([TokenizedExample(i, ids, ids) for i, ids in enumerate(sequences)])


def test_only_rows_with_the_same_tokens_count():
    train = rows([1, 2, 3], [4, 5, 6], [7, 8])
    # the same length but other tokens, a prefix, a longer row, and two copies of training rows
    evaluation = rows([1, 2, 4], [1, 2], [4, 5, 6, 7], [7, 8], [4, 5, 6])
    assert rows_also_trained(train, evaluation) == 2
    assert rows_also_trained(train, rows([9, 9, 9])) == 0
    assert rows_also_trained(train, train) == 3  # --eval-data naming the training file


def test_a_selection_compares_the_rows_it_selects():
    everything = rows([1, 2], [3, 4], [5, 6], [1, 2])
    assert rows_also_trained(everything.select([0, 1]), everything.select([2, 3])) == 1  # row 3 repeats row 0
    assert rows_also_trained(everything.select([1, 2]), everything.select([0, 3])) == 0


def test_a_pair_counts_when_both_its_replies_are_a_training_pairs():
    train = PairRows(rows([1, 2], [1, 3], [4, 5], [4, 6]))
    evaluation = PairRows(rows([1, 2], [1, 3], [4, 5], [4, 7], [1, 3], [1, 2]))  # same, other rejected, swapped
    assert rows_also_trained(train, evaluation) == 1


def test_the_warning_says_how_many_and_what_to_do():
    assert "all 48 evaluation rows are training rows too" in overlap_warning(48, 48)
    assert "3 of the 200 evaluation rows" in overlap_warning(3, 200)
    assert "--eval-split" in overlap_warning(3, 200)
