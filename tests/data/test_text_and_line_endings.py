"""`.txt` files (a text row per paragraph) and line endings: "\\r\\n" and a lone
"\\r" are read as "\\n" in every row's text, whatever the file, and counted once
in the data report."""

from __future__ import annotations

import json

import pytest

from llmcustoms.data.data_files import read_rows
from llmcustoms.data.dataset import read_dataset, usable_examples
from llmcustoms.errors import DataError
from llmcustoms.planning.data_advice import advice
from tiny_models import FIXTURES

SHAPES = FIXTURES / "shapes"
SECRET = "SECRET-ROW-CONTENT-12345"
PARAGRAPHS = ["Bees make honey from the nectar of flowers.\nThey store it in wax combs.", "A spider has eight legs.",
              "The sky is blue on a clear day."]


def texts(path) -> list[str]:
    return [e.completion for e in usable_examples(path)]


# ------------------------------------------------------------------------ .txt

def test_a_text_file_is_a_row_per_paragraph_at_its_first_line():
    dataset = read_dataset(SHAPES / "paragraphs.txt")
    assert (dataset.format, dataset.rows, dataset.line_endings) == ("text", 3, 0)
    assert texts(SHAPES / "paragraphs.txt") == PARAGRAPHS
    # Blank lines (a line of spaces among them) separate; a row is where its paragraph starts.
    assert [(raw.row, raw.line) for raw in read_rows(SHAPES / "paragraphs.txt")] == [(1, 1), (2, 4), (3, 8)]


@pytest.mark.parametrize("newline", [b"\r\n", b"\r"])
def test_windows_and_old_mac_text_files_read_as_the_same_paragraphs(tmp_path, newline):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"\xef\xbb\xbf" + (SHAPES / "paragraphs.txt").read_bytes().replace(b"\n", newline))
    dataset = read_dataset(path)
    assert texts(path) == PARAGRAPHS and dataset.line_endings == 3
    assert [raw.line for raw in read_rows(path)] == [1, 4, 8]


@pytest.mark.parametrize("data", [b"", b"\n\n  \r\n\t\n", b"\xef\xbb\xbf"])
def test_an_empty_text_file_is_the_usual_error(tmp_path, data):
    path = tmp_path / "empty.txt"
    path.write_bytes(data)
    with pytest.raises(DataError) as info:
        read_dataset(path)
    assert info.value.message == "empty.txt is empty." and info.value.hint


def test_a_paragraph_that_is_not_utf8_is_a_bad_row_named_by_its_first_line(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"One.\n\nTwo starts here,\n" + SECRET.encode() + b" \xff\nand ends.\n\nThree.\n")
    with pytest.raises(DataError) as info:
        read_dataset(path, "strict")
    assert info.value.message == "notes.txt, row 2 (line 3): not valid UTF-8 text (byte 0xff at column 26)."
    assert SECRET not in str(info.value)
    dataset = read_dataset(path, "skip")
    assert dataset.rows == 2 and dataset.bad.where == {"not valid UTF-8 text": ["row 2 at line 3"]}
    assert texts(path) == ["One.", "Three."]


# ---------------------------------------------------------------- line endings

def test_crlf_inside_quoted_csv_cells_is_read_as_newlines_and_counted():
    path = SHAPES / "crlf_cells.csv"
    assert b"\r\n" in path.read_bytes() and b"carriage\rreturn" in path.read_bytes()
    dataset = read_dataset(path)
    assert dataset.rows == 2 and dataset.line_endings == 2 and dataset.to_json()["line_endings_normalised"] == 2
    assert [(e.prompt, e.completion) for e in usable_examples(path)] == [
        ("Write two lines.\nKeep them short.", "Roses are red.\nViolets are blue."), ("A lone carriage\nreturn.", "Fine.")]


def test_crlf_in_json_strings_is_read_as_newlines_in_every_shape(tmp_path):
    rows = [{"query": "Two\r\nlines", "response": "One\rtwo\r\n\r\nthree"},
            {"query": "Plain", "response": "No carriage return."}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\r\n" for r in rows))  # the file's own CRLF is no row's text
    dataset = read_dataset(path)
    assert dataset.line_endings == 1
    assert [(e.prompt, e.completion) for e in usable_examples(path)] == [("Two\nlines", "One\ntwo\n\nthree"),
                                                                          ("Plain", "No carriage return.")]
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"messages": [{"role": "system", "content": "Be\r\nbrief."},
                                              {"role": "user", "content": [{"type": "text", "text": "Hi\r"}]},
                                              {"role": "assistant", "content": "Hello\r\nthere."}]}]))
    [example] = usable_examples(chat)
    assert [m.content for m in example.messages] == ["Be\nbrief.", "Hi\n", "Hello\nthere."]
    assert read_dataset(chat).line_endings == 1


def test_crlf_in_parquet_is_read_as_newlines(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"instruction": ["Two\r\nlines", "One"], "answer": ["A\rB", "C"]}), path)
    assert [(e.prompt, e.completion) for e in usable_examples(path)] == [("Two\nlines", "A\nB"), ("One", "C")]
    assert read_dataset(path).line_endings == 1


def test_the_data_report_says_it_once_with_the_count():
    report = read_dataset(SHAPES / "crlf_cells.csv").to_json()
    lines = [line for line in advice(report, [10] * 200, 64, 0, 0, 100, None) if "\\r" in line]
    assert lines == ["2 rows had Windows or old Mac line breaks (\\r\\n or \\r): read as \\n, so no \\r is learned"]
    assert not [line for line in advice(read_dataset(SHAPES / "paragraphs.txt").to_json(), [10] * 200, 64, 0, 0, 100,
                                        None) if "\\r" in line]
