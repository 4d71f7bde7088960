"""Replies a template cannot cut are counted and said, never dropped in silence.

Qwen3.5's no-thinking template prefills an empty think block in the
generation prompt, so a reply with reasoning is not what the model writes
after it: such a conversation is learned by its last reply only, and the data
report says how many replies that leaves out."""

from __future__ import annotations

import numpy as np

from llmcustoms.data.dataset import read_dataset, usable_examples
from llmcustoms.data.reply_counts import learned_runs, unlearned_replies
from llmcustoms.data.token_store import TokenRows
from llmcustoms.data.tokenization import Tokenizer
from llmcustoms.planning.data_advice import advice
from tiny_models import FIXTURES, build_family_tokenizer, trl_template

REASONING_AND_TOOLS = FIXTURES / "shapes" / "multi_turn_reasoning_tools.jsonl"


def tokenized(template: str) -> TokenRows:
    hf = build_family_tokenizer("qwen3_5")
    hf.chat_template = trl_template(template)
    tokenizer = Tokenizer(hf)
    return TokenRows.from_examples([tokenizer.encode(e) for e in usable_examples(REASONING_AND_TOOLS)])


def test_replies_a_template_cannot_cut_are_counted_by_row():
    dataset = read_dataset(REASONING_AND_TOOLS)
    assert dataset.replies.tolist() == [3, 4]
    rows = tokenized("qwen3_5_nothink")
    assert learned_runs(rows.arrays).tolist() == [1, 1]  # the last reply of each
    found = unlearned_replies(rows, dataset.replies, np.zeros(2, bool))
    assert found == {"replies_not_learned": {"replies": 5, "of": 7, "rows": 2}}
    [line] = [line for line in advice({"rows": 2, **found}, [10, 10], 512, 0, 0, 100, 1.0) if "not learned" in line]
    assert line.startswith("5 of 7 replies are not learned, in 2 rows: this model's chat template shows earlier turns")
    assert "one row per reply" in line


def test_a_template_that_cuts_every_reply_reports_nothing():
    rows = tokenized("qwen3_5_think")
    assert learned_runs(rows.arrays).tolist() == [3, 4]
    assert unlearned_replies(rows, read_dataset(REASONING_AND_TOOLS).replies, np.zeros(2, bool)) == {}
    # A selection counts only its own rows.
    assert unlearned_replies(tokenized("qwen3_5_nothink").select([1]), np.array([3, 4]), np.zeros(2, bool)) == \
        {"replies_not_learned": {"replies": 3, "of": 4, "rows": 1}}
    # A row clipped for its length loses later replies to that, which its own line says.
    assert unlearned_replies(tokenized("qwen3_5_nothink"), np.array([3, 4]), np.array([True, True])) == {}
