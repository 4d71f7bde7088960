"""How many replies each tokenized row learns, against how many it has.

A chat row learns each of its replies as one run of learned tokens
(`chat_templates.chat_segments`). Where a chat template shows earlier turns
otherwise than it writes them and where an earlier reply ends cannot be told
(it writes no end-of-turn token, or the generation prompt prefills a think
block the history does not show), only a conversation's last reply is learned.
That must never pass unsaid: `unlearned_replies` counts, over the store's
flat arrays a block at a time, the replies that are not learned, for the data
report (`planning/data_advice.py` says what to do).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from llmcustoms.data.token_store import MAX_ROW_TOKENS, TokenRows

# Tokens scanned at a time: a few tens of MB of temporary arrays, whatever the data's size.
BLOCK_TOKENS = 1 << 22


def learned_runs(arrays: Any) -> np.ndarray:
    """The number of runs of learned tokens in each row of a store."""
    offsets = np.asarray(arrays.offsets)
    count = len(offsets) - 1
    runs = np.zeros(count, np.int64)
    first = 0
    while first < count:
        last = min(count, max(first + 1, int(np.searchsorted(offsets, offsets[first] + BLOCK_TOKENS, "right")) - 1))
        start, end = int(offsets[first]), int(offsets[last])
        learned = np.asarray(arrays.learned[start:end]) != 0
        begins = learned.copy()  # a run begins after a token not learned, or at a row's start
        begins[1:] &= ~learned[:-1]
        starts = offsets[first:last] - start
        inside = starts < len(learned)
        begins[starts[inside]] = learned[starts[inside]]
        owners = np.searchsorted(starts, np.flatnonzero(begins), "right") - 1
        runs[first:last] = np.bincount(owners, minlength=last - first)
        first = last
    return runs


def unlearned_replies(rows: TokenRows, replies: np.ndarray, clipped: np.ndarray) -> dict[str, Any]:
    """For the data report: the replies of `rows` (positions in the data's
    usable rows, one store row each) that are not learned, given how many
    each row has (`replies`, `Dataset.replies`); empty when all are. Rows
    `clipped` before tokenizing (over MAX_ROW_CHARS characters), or cut at
    MAX_ROW_TOKENS, lose their later replies to their length, not to the
    template: the truncation lines say that. Without --train-on-prompt only,
    whose replies are runs."""
    expected = np.asarray(replies)[rows.index]
    learned = np.minimum(learned_runs(rows.arrays)[rows.index], expected)
    whole = ~np.asarray(clipped)[rows.index] & (rows.full_lengths < MAX_ROW_TOKENS)
    short = (learned < expected) & whole
    if not short.any():
        return {}
    return {"replies_not_learned": {"replies": int((expected - learned)[short].sum()), "of": int(expected.sum()),
                                    "rows": int(short.sum())}}
