"""What is shown about the data: the progress of preparing it, and the findings."""

from __future__ import annotations

import io

from rich.console import Console

from llmcustoms.ui import data_view as dataview


def test_preparation_progress_shows_rows_and_their_rate(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(dataview, "console", Console(file=out, force_terminal=True, width=80))
    monkeypatch.setattr(dataview, "QUIET_SECONDS", 0.0)
    with dataview.PreparationProgress() as progress:
        progress("read", 1000, None)
        progress("tokenize", 50, 100)
    text = out.getvalue()
    assert "Reading the data" in text and "Tokenizing" in text and "50/100" in text


def test_a_quick_preparation_shows_no_progress(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(dataview, "console", Console(file=out, force_terminal=True, width=80))
    with dataview.PreparationProgress() as progress:
        progress("tokenize", 5, 10)
    assert out.getvalue() == ""


def test_findings_show_lengths_and_advice(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(dataview, "console", Console(file=out, width=200))
    dataview._show_facts({"train_token_lengths": {"p50": 10, "p90": 20, "p99": 30, "max": 40},
                          "length_source": "tokenizer", "advice": ["3 exact duplicates (1%): consider removing them"]})
    assert out.getvalue().splitlines() == [
        "Tokens per training row: median 10, 90% under 20, 99% under 30, longest 40",
        "Data: 3 exact duplicates (1%): consider removing them"]
