"""The general chat rows used to choose while training (their loss, before and
after, tells forgetting): well formed, and kept apart from the forgetting
check's probe questions (general_questions.json), so the probe stays an
honest report."""

from __future__ import annotations

import json
import re
from pathlib import Path

import llmcustoms.training

HERE = Path(llmcustoms.training.__file__).parent
TEXT = json.loads((HERE / "general_text.json").read_text(encoding="utf-8"))
PROBE = json.loads((HERE / "general_questions.json").read_text(encoding="utf-8"))
ROWS = TEXT["rows"]
PROBE_QUESTIONS = [q["question"] for q in PROBE["questions"]]
QUESTIONS = [row["messages"][0]["content"] for row in ROWS]

# Probe answers that are everyday words may appear in plain chat without giving a probe away.
NUMBER_WORDS = {"one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
                "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty",
                "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety", "hundred", "thousand", "and"}
COMMON_WORDS = {"cold", "green", "heart", "honey", "print", "select", "commit", "anchor"}


def words(text: str) -> list[str]:
    return re.sub(r"[^\w\s]", " ", text.lower()).split()


def runs(text: str, n: int = 4) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def test_the_set_is_written_for_us_and_says_what_it_is_for():
    about = TEXT["about"]
    assert "written for llmcustoms" in about.lower() and "Apache-2.0" in about
    assert "general_questions.json" in about and "never trained on" in about


def test_48_rows_each_a_question_then_a_short_answer():
    assert len(ROWS) == 48
    for row in ROWS:
        messages = row["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"], row
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in messages), row
        assert 5 <= len(messages[1]["content"].split()) <= 60, row
        assert len(messages[0]["content"].split()) < 20, row
    folded = [q.casefold().strip() for q in QUESTIONS]
    assert len(set(folded)) == len(folded)  # no question twice


def test_no_question_shares_four_words_in_a_row_with_a_probe_question():
    probe_runs = {run: q for q in PROBE_QUESTIONS for run in runs(q)}
    clashes = [(q, probe_runs[run]) for q in QUESTIONS for run in runs(q) if run in probe_runs]
    assert not clashes, clashes
    assert not {tuple(words(q)) for q in QUESTIONS} & {tuple(words(q)) for q in PROBE_QUESTIONS}


def test_no_row_gives_away_a_probe_answer():
    text = " ".join(m["content"] for row in ROWS for m in row["messages"])
    telling = [a for q in PROBE["questions"] for a in q["answers"]
               if len(a) >= 4 and a.lower() not in COMMON_WORDS and not set(words(a)) <= NUMBER_WORDS]
    assert "Tokyo" in telling and "three" not in telling  # the filter keeps names and drops number words
    found = [a for a in telling if re.search(r"(?<!\w)" + re.escape(a) + r"(?!\w)", text, re.IGNORECASE)]
    assert not found, found
