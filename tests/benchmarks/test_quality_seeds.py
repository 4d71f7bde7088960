"""benchmarks/quality.py's seeds and its sentiment dataset, without training
anything: results stored per seed (an old file's entries read as seed 0), the
table's mean and spread, the rule that a configuration is ahead of the best
peer recipe only beyond both spreads, and the sentiment rows built from a
lexicon's text."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parent.parent.parent / "benchmarks"


def _load(name: str):
    # From its file, not by putting benchmarks/ on sys.path, where its other
    # scripts' names (common, quality, shapes) would shadow modules for later tests.
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


quality_table = _load("quality_table")
sentiment_data = _load("sentiment_data")

DATASETS = ("identity", "code", "sentiment")
CONFIGS = ("base", "highspeed", "quality", "bestaccuracy", "tune", "default", "unsloth", "trl", "equal-time")


def entry(loss: float, success: float | None = None, general: int = 40, minutes: float = 10.0) -> dict:
    measures = {"test_loss": loss, "test_ppl": 2.0, "general": general, "general_asked": 67,
                "wall_seconds": minutes * 60, "seconds": minutes * 50, "steps": 40, "kept_step": 20, "load": 2.0}
    if success is not None:
        measures["task_success"] = success
    return measures


def results_with(**by_config: list[float]) -> dict:
    results: dict = {}
    for config, losses in by_config.items():
        for seed, loss in enumerate(losses):
            quality_table.record(results, "code", config, seed, entry(loss))
    return results


def line(table: str, dataset: str, config: str) -> list[str]:
    [found] = [row for row in table.splitlines() if row.startswith(f"| {dataset} | {config} |")]
    return [cell.strip() for cell in found.strip("|").split("|")]


def test_mean_and_spread_are_the_sample_deviation_from_three_seeds_and_the_range_from_two():
    three = quality_table.summarize([0.70, 0.72, 0.77])
    assert three.n == 3 and three.mean == pytest.approx(0.73)
    assert three.spread == pytest.approx(statistics.stdev([0.70, 0.72, 0.77]))
    two = quality_table.summarize([0.70, 0.76])
    assert two.spread == pytest.approx(0.06) and (two.low, two.high) == (0.70, 0.76)
    assert quality_table.summarize([0.7]).spread is None and quality_table.summarize([]) is None
    assert quality_table.shown(three, 4) == f"0.7300 ± {statistics.stdev([0.70, 0.72, 0.77]):.4f}"
    assert quality_table.shown(two, 2) == "0.73 (0.70-0.76)"


def test_ahead_or_behind_only_beyond_the_larger_spread():
    peer = quality_table.summarize([0.80, 0.81, 0.79])  # sd 0.01
    wide = quality_table.summarize([0.70, 0.78, 0.86])  # mean 0.78, sd 0.08: 0.02 lower, inside its own spread
    assert quality_table.versus(wide, peer) == "within spread"
    tight = quality_table.summarize([0.770, 0.775, 0.780])  # 0.025 lower, spreads 0.005 and 0.01
    assert quality_table.versus(tight, peer) == "ahead"
    assert quality_table.versus(peer, tight) == "behind"
    # With one seed there is no spread to judge by: no verdict, however large the difference.
    assert quality_table.versus(quality_table.summarize([0.5]), peer) == "one seed: not judged"


def test_the_table_judges_each_configuration_against_the_best_peer():
    results = results_with(base=[0.92], quality=[0.780, 0.781, 0.782], default=[0.785, 0.795, 0.805],
                           unsloth=[0.80, 0.801, 0.802], trl=[0.90, 0.89, 0.91])
    shown = quality_table.table(results, DATASETS, CONFIGS)
    assert line(shown, "code", "quality")[-1] == "ahead (unsloth)"
    # 0.006 lower than Unsloth's mean, but its own seeds spread by 0.01: not ahead.
    assert line(shown, "code", "default")[-1] == "within spread (unsloth)"
    assert line(shown, "code", "trl")[-1] == "behind (unsloth)"
    assert line(shown, "code", "unsloth")[-1] == "best peer"
    assert line(shown, "code", "base")[-1] == "" and line(shown, "code", "base")[2] == "1"
    assert line(shown, "code", "quality")[2] == "3"


def test_the_table_shows_task_success_general_and_time_as_mean_and_spread():
    results: dict = {}
    for seed, (success, general, minutes) in enumerate([(0.8, 30, 10.0), (0.9, 34, 11.0), (1.0, 38, 12.0)]):
        quality_table.record(results, "sentiment", "quality", seed, entry(0.2, success, general, minutes))
    quality_table.record(results, "identity", "quality", 0, {**entry(0.15), "identity_accuracy": 0.83})
    shown = quality_table.table(results, DATASETS, CONFIGS)
    cells = line(shown, "sentiment", "quality")
    assert cells[4] == "11.0 ± 1.0" and cells[8] == "90 ± 10" and cells[9] == "34.0 ± 4.0 of 67"
    assert line(shown, "identity", "quality")[8] == "83"  # an older entry's identity_accuracy is its task success
    assert line(shown, "identity", "quality")[-1] == ""  # no peer measured: nothing to judge against


def test_an_old_results_file_reads_as_seed_0(tmp_path):
    old = {"note": "one run each", "code": {"unsloth": entry(0.79)},
           "identity": {"base": entry(3.1, 0.0), "quality": {**entry(0.155), "identity_accuracy": 0.83}}}
    results = quality_table.normalize(json.loads(json.dumps(old)))
    assert results["note"] == "one run each"
    assert quality_table.runs(results, "identity", "quality") == {0: old["identity"]["quality"]}
    assert set(quality_table.runs(results, "code", "unsloth")) == {0}
    # A later seed joins the old entry instead of replacing it, and reading twice changes nothing.
    quality_table.record(results, "code", "unsloth", 1, entry(0.80))
    again = quality_table.normalize(json.loads(json.dumps(results)))
    assert set(quality_table.runs(again, "code", "unsloth")) == {0, 1}
    shown = quality_table.table(again, DATASETS, CONFIGS)
    assert line(shown, "identity", "quality")[6] == "0.1550" and line(shown, "code", "unsloth")[2] == "2"


def test_the_repository_s_own_results_files_still_make_a_table():
    for path in sorted((BENCHMARKS / "results").glob("quality*.json")):
        shown = quality_table.table(quality_table.normalize(json.loads(path.read_text())), DATASETS, CONFIGS)
        assert shown.startswith("| data |"), path


FAKE_LEXICON = "\n".join([
    "$:\t-1.5\t0.8\t[-1, -1]",       # an emoticon: not a word
    "good\t1.9\t0.9\t[2, 2]",
    "bad\t-2.5\t0.7\t[-3, -2]",
    "okay\t0.9\t0.5\t[1, 1]",        # too close to neutral
    "meh\t-1.49\t0.5\t[-1, -2]",     # just under the threshold
    "great\t1.5\t0.5\t[1, 2]",       # exactly at it
    "can't\t-2.0\t0.5\t[-2, -2]",    # an apostrophe: not alphabetic
    "b4\t1.6\t0.5\t[2, 1]",          # a digit
    "café\t2.0\t0.5\t[2, 2]",        # not ASCII
    "awful\t-3.1\t0.4\t[-3, -3]",
])


def test_the_sentiment_rows_are_clear_alphabetic_words_with_their_labels():
    assert sentiment_data.clear_words(FAKE_LEXICON) == [("good", "Positive"), ("bad", "Negative"),
                                                        ("great", "Positive"), ("awful", "Negative")]
    rows = sentiment_data.rows(FAKE_LEXICON)
    assert rows == sentiment_data.rows(FAKE_LEXICON)  # a fixed shuffle
    labels = {}
    for row in rows:
        [human, gpt] = row["conversations"]
        assert human["from"] == "human" and gpt["from"] == "gpt"
        word = human["value"].split('"')[1]
        assert human["value"] == f'Is the word "{word}" positive or negative? Answer with one word.'
        labels[word] = gpt["value"]
    assert labels == {"good": "Positive", "bad": "Negative", "great": "Positive", "awful": "Negative"}


@pytest.mark.parametrize("reply,right", [("Negative", True), ("negative.", True), ("**Negative**, clearly", True),
                                         ("NEGATIVE!", True), ("Positive", False), ("The word is negative", False),
                                         ("", False), ("Neg", False)])
def test_a_sentiment_reply_counts_by_its_first_word(reply, right):
    assert sentiment_data.is_right(reply, "Negative") is right


def test_the_sentiment_file_is_built_in_the_work_directory_unless_the_data_directory_has_one(tmp_path, monkeypatch):
    monkeypatch.setattr(sentiment_data, "lexicon_text", lambda: FAKE_LEXICON)
    data, work = tmp_path / "data", tmp_path / "work"
    data.mkdir(), work.mkdir()
    built = sentiment_data.ensure_file(data, work)
    assert built == work / sentiment_data.FILE and len(json.loads(built.read_text())) == 4
    (data / sentiment_data.FILE).write_text("[]")
    assert sentiment_data.ensure_file(data, work) == data / sentiment_data.FILE


def test_equal_time_is_sized_from_the_fastest_runs_and_later_seeds_keep_seed_0s_steps():
    results: dict = {}
    slow_quality = {**entry(0.8), "wall_seconds": 2000.0, "step_seconds": 1500.0, "steps": 80}
    fast_quality = {**entry(0.8), "wall_seconds": 600.0, "step_seconds": 400.0, "steps": 80}  # 5 s a step, 200 s fixed
    for seed, measures in enumerate((slow_quality, fast_quality)):
        quality_table.record(results, "code", "quality", seed, measures)
    for seed, wall in enumerate((1800.0, 450.0)):
        quality_table.record(results, "code", "unsloth", seed, {**entry(0.8), "wall_seconds": wall})
    quality_table.record(results, "code", "trl", 0, {**entry(2.0), "wall_seconds": 700.0})
    assert quality_table.equal_time_steps(results, "code") == 50  # (450 - 200) / 5

    quality_table.record(results, "code", "equal-time", 0, {**entry(0.8), "planned_steps": 50})
    quality_table.record(results, "code", "unsloth", 2, {**entry(0.8), "wall_seconds": 300.0})
    assert quality_table.equal_time_steps(results, "code") == 50
    with pytest.raises(SystemExit, match="identity:quality:0"):
        quality_table.equal_time_steps(results, "identity")
