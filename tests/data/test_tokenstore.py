"""The memory-mapped store of tokenized rows: what goes in comes out exactly,
a damaged or half-written store is never used, and a huge row costs little."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmcustoms.data import token_store as tokenstore
from llmcustoms.data.dataset import read_dataset, usable_examples
from llmcustoms.data.tokenization import IGNORE_INDEX, Tokenizer
from llmcustoms.data.token_store import TokenRows, build_store, open_store
from tiny_models import FIXTURES


@pytest.fixture
def encoder(tiny_models):
    from transformers import AutoTokenizer

    return Tokenizer(AutoTokenizer.from_pretrained(tiny_models["qwen2"]))


def test_rows_come_back_exactly_as_encoded(tmp_path, encoder):
    path = FIXTURES / "sharegpt.json"
    rows = build_store(tmp_path / "store", usable_examples(path), encoder, {}, chunk_rows=5)
    expected = [encoder.encode(e) for e in usable_examples(path)]
    assert len(rows) == len(expected) == read_dataset(path).rows
    assert list(rows) == expected
    assert list(open_store(tmp_path / "store")) == expected  # memory-mapped from disk again
    assert rows.first_loss.tolist() == [next(i for i in range(1, len(e.labels)) if e.labels[i] != IGNORE_INDEX)
                                        for e in expected]


def test_views_select_and_cut_without_copying_the_store(tmp_path, encoder):
    rows = build_store(tmp_path / "store", usable_examples(FIXTURES / "messages.jsonl"), encoder, {})
    picked = rows.select([3, 1])
    assert [e.row for e in picked] == [rows[3].row, rows[1].row]
    first = int(picked.first_loss[0])
    kept, truncated, dropped = picked.truncated(first + 2)
    assert truncated == 2 and len(kept) + dropped == 2
    assert all(len(e.input_ids) <= first + 2 for e in kept)
    assert kept.lengths.tolist() == [len(e.input_ids) for e in kept]
    assert kept.arrays is rows.arrays


def test_a_list_of_rows_and_a_store_give_the_same_view(encoder):
    examples = [encoder.encode(e) for e in usable_examples(FIXTURES / "alpaca.jsonl")][:6]
    rows = TokenRows.from_examples(examples)
    assert list(rows) == examples
    assert rows.trained_tokens(range(6)) == sum(e.trainable_tokens for e in examples)


def test_a_damaged_or_unfinished_store_is_not_used(tmp_path, encoder):
    directory = tmp_path / "store"
    build_store(directory, usable_examples(FIXTURES / "text.jsonl"), encoder, {})
    ids = directory / "ids.bin"
    ids.write_bytes(ids.read_bytes()[:-8])  # cut short, as by a full disk
    assert open_store(directory) is None
    (directory / "meta.json").write_text(json.dumps({"format": "older"}))
    assert open_store(directory) is None
    assert open_store(tmp_path / "missing") is None


def test_an_interrupted_build_leaves_nothing_that_looks_whole(tmp_path, encoder):
    def rows_then_ctrl_c():
        yield from list(usable_examples(FIXTURES / "text.jsonl"))[:3]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_store(tmp_path / "store", rows_then_ctrl_c(), encoder, {}, chunk_rows=1)
    assert list(tmp_path.iterdir()) == []


def test_a_huge_row_is_clipped_before_tokenizing(tmp_path, encoder, monkeypatch):
    monkeypatch.setattr(tokenstore, "MAX_ROW_TOKENS", 64)
    monkeypatch.setattr(tokenstore, "MAX_ROW_CHARS", 64 * 8)
    data = tmp_path / "huge.jsonl"
    data.write_text(json.dumps({"prompt": "Summarise: " + "word " * 200_000, "completion": "Short."}) + "\n"
                    + json.dumps({"prompt": "Hi", "completion": "Hello."}) + "\n")
    seen = []
    original = encoder.encode_many
    monkeypatch.setattr(encoder, "encode_many", lambda chunk: seen.extend(chunk) or original(chunk))
    rows = build_store(tmp_path / "store", usable_examples(data), encoder, {})
    assert max(e.char_count() for e in seen) <= 64 * 8
    assert rows.full_lengths.tolist()[0] == 64 and len(rows[1].input_ids) < 64
    assert np.array_equal(rows.row_numbers, [1, 2])


def test_worker_processes_give_the_same_store(tmp_path, encoder):
    path = FIXTURES / "alpaca.jsonl"
    alone = build_store(tmp_path / "one", usable_examples(path), encoder, {}, chunk_rows=7)
    shared = build_store(tmp_path / "two", usable_examples(path), encoder, {}, chunk_rows=7, workers=2)
    assert list(shared) == list(alone)
    assert (tmp_path / "two" / "ids.bin").read_bytes() == (tmp_path / "one" / "ids.bin").read_bytes()


def test_a_store_of_no_rows_opens(tmp_path, encoder):
    rows = build_store(tmp_path / "empty", iter(()), encoder, {})
    assert len(rows) == 0 and rows.lengths.tolist() == []


def test_rows_with_nothing_learned_are_dropped_not_trained_as_empty(encoder):
    from llmcustoms.data.tokenization import TokenizedExample

    prompt_only = TokenizedExample(1, [5, 6, 7], [IGNORE_INDEX] * 3)  # a reply clipped away
    empty = TokenizedExample(2, [], [])
    fine = TokenizedExample(3, [5, 6, 7], [IGNORE_INDEX, 6, 7])
    kept, truncated, dropped = TokenRows.from_examples([prompt_only, empty, fine]).truncated(512)
    assert [e.row for e in kept] == [3] and dropped == 2 and truncated == 0


def test_long_documents_are_tokenized_in_chunks_of_bounded_text(monkeypatch):
    from llmcustoms.data.row_formats import Example

    monkeypatch.setattr(tokenstore, "CHUNK_CHARS", 1000)
    rows = [Example(i, prompt="p", completion="x" * 400) for i in range(1, 8)]
    chunks = list(tokenstore._chunks(iter(rows), 256))
    assert [len(c) for c in chunks] == [3, 3, 1] and [e.row for c in chunks for e in c] == list(range(1, 8))


def test_workers_that_cannot_start_leave_the_work_to_this_process(tmp_path, encoder, monkeypatch):
    from concurrent.futures.process import BrokenProcessPool

    class Broken:
        def __init__(self, *args, **kwargs):
            pass

        def submit(self, *args):
            raise BrokenProcessPool("a worker died")

        def shutdown(self, **kwargs):
            pass

    monkeypatch.setattr(tokenstore, "ProcessPoolExecutor", Broken)
    path = FIXTURES / "alpaca.jsonl"
    rows = build_store(tmp_path / "store", usable_examples(path), encoder, {}, chunk_rows=5, workers=2)
    assert list(rows) == [encoder.encode(e) for e in usable_examples(path)]


def test_a_damaged_cached_store_is_replaced_by_the_next_run(tmp_path, tiny_models, monkeypatch):
    from llmcustoms.planning.hardware import Hardware
    from llmcustoms.planning.train_options import TrainOptions
    from llmcustoms.preparation.preparing import prepare_run

    monkeypatch.setenv("LLMCUSTOMS_CACHE_DIR", str(tmp_path))
    options = TrainOptions(data=str(FIXTURES / "sharegpt.json"), model=str(tiny_models["qwen2"]))
    first = list(prepare_run(options, Hardware.cpu_only()).train)  # read before the file is damaged under its map
    [store] = (tmp_path / "tokenized").iterdir()
    ids = store / "ids.bin"
    ids.write_bytes(ids.read_bytes()[:-8])
    again = prepare_run(options, Hardware.cpu_only())
    assert not again.cached and list(again.train) == first
    assert open_store(store) is not None and prepare_run(options, Hardware.cpu_only()).cached
