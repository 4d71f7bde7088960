"""Unit tests of `llmcustoms.data.dataset.read_dataset`: formats, file types, and the
error messages for bad input (file, 1-based line or row, reason; never the
row's content)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from types import SimpleNamespace

from llmcustoms.data import dataset as data
from llmcustoms.data.chat_turns import Message
from llmcustoms.errors import DataError
from llmcustoms.data.row_formats import COLUMN_PAIRS, FORMAT_DESCRIPTIONS

FIXTURES = Path(__file__).parent.parent / "fixtures"
SECRET = "SECRET-ROW-CONTENT-12345"


def write(tmp_path: Path, name: str, data: bytes | str) -> Path:
    path = tmp_path / name
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def jsonl(*rows: object) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8")


def good(i: int) -> dict:
    return {"instruction": f"Question {i}?", "input": "", "output": f"Answer {i}."}


def read_dataset(path: Path, skip_bad_rows: bool = False, policy: str | None = None) -> SimpleNamespace:
    """What `dataset.read_dataset` found, plus the usable rows themselves. Strict
    unless told otherwise: most tests here check the message for one bad row."""
    found = data.read_dataset(path, policy or ("skip" if skip_bad_rows else "strict"))
    return SimpleNamespace(format=found.format, format_description=found.format_description, skipped=found.skipped,
                           skip_reasons=found.bad.by_reason, bad=found.bad, unlearned=found.unlearned, found=found,
                           examples=list(data.usable_examples(path)))


def bad_input(path: Path, **kwargs) -> DataError:
    with pytest.raises(DataError) as info:
        read_dataset(path, **kwargs)
    err = info.value
    assert err.message, "a DataError needs a message"
    assert "Traceback" not in str(err)
    return err


# --------------------------------------------------------------- fixture files

@pytest.mark.parametrize("name, fmt, rows", [
    ("alpaca.jsonl", "alpaca", 48),
    ("sharegpt.json", "sharegpt", 24),
    ("messages.jsonl", "messages", 24),
    ("prompt_completion.csv", "prompt_completion", 24),
    ("text.jsonl", "text", 24),
])
def test_fixture_files_detected(name, fmt, rows):
    dataset = read_dataset(FIXTURES / name)
    assert dataset.format == fmt
    assert dataset.format_description == FORMAT_DESCRIPTIONS[fmt]
    assert len(dataset.examples) == rows
    assert dataset.skipped == 0
    assert [e.row for e in dataset.examples] == list(range(1, rows + 1))
    chat = fmt in ("alpaca", "sharegpt", "messages")
    assert all(e.is_chat == chat for e in dataset.examples)


def test_alpaca_fixture_normalised():
    raw = [json.loads(line) for line in (FIXTURES / "alpaca.jsonl").read_text().splitlines() if line.strip()]
    dataset = read_dataset(FIXTURES / "alpaca.jsonl")
    assert any(r["input"] for r in raw) and any(not r["input"] for r in raw)
    for row, example in zip(raw, dataset.examples):
        user = row["instruction"] + ("\n\n" + row["input"] if row["input"] else "")
        assert example.messages == (Message("user", user), Message("assistant", row["output"]))
        assert example.prompt == "" and example.completion == ""
    # Row 3 has an input: it follows the instruction after a blank line.
    assert dataset.examples[2].messages == (
        Message("user", "How many legs does a spider have?\n\nAnswer in one sentence."),
        Message("assistant", "A spider has eight legs."),
    )
    assert dataset.examples[0].messages[0] == Message("user", "What is the capital of France?")


def test_sharegpt_fixture_normalised():
    dataset = read_dataset(FIXTURES / "sharegpt.json")
    first = dataset.examples[0]
    assert first.messages == (
        Message("system", "You are a helpful assistant."),
        Message("user", "What is the capital of France?"),
        Message("assistant", "The capital of France is Paris."),
        Message("user", "What do bees make?"),
        Message("assistant", "Bees make honey."),
    )
    for example in dataset.examples:
        roles = [m.role for m in example.messages]
        assert set(roles) <= {"system", "user", "assistant"}
        assert "system" not in roles[1:]
        assert roles[-1] == "assistant"


def test_messages_fixture_normalised():
    dataset = read_dataset(FIXTURES / "messages.jsonl")
    assert dataset.examples[0].messages == (
        Message("system", "Answer briefly."),
        Message("user", "What is the capital of France?"),
        Message("assistant", "The capital of France is Paris."),
    )


def test_prompt_completion_fixture_normalised():
    dataset = read_dataset(FIXTURES / "prompt_completion.csv")
    first = dataset.examples[0]
    assert first.prompt == "Question: What is the capital of France?\nAnswer:"
    assert first.completion == " The capital of France is Paris."
    assert first.messages == ()
    assert all(e.prompt.startswith("Question: ") and e.completion.strip() for e in dataset.examples)


def test_text_fixture_normalised():
    dataset = read_dataset(FIXTURES / "text.jsonl")
    first = dataset.examples[0]
    assert first.completion == "What is the capital of France? The capital of France is Paris."
    assert first.prompt == "" and first.messages == ()


# ----------------------------------------------------------------- file types

ROWS = [
    {"prompt": "Question: one?\nAnswer:", "completion": " One."},
    {"prompt": "Question: two?\nAnswer:", "completion": " Two."},
    {"prompt": "Question: three?\nAnswer:", "completion": " Three."},
]


def check_rows(dataset):
    assert dataset.format == "prompt_completion"
    assert [(e.row, e.prompt, e.completion) for e in dataset.examples] == [
        (i, r["prompt"], r["completion"]) for i, r in enumerate(ROWS, start=1)
    ]


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    check_rows(read_dataset(path))


def test_parquet_bad_row_named_by_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = ROWS[:1] + [{"prompt": SECRET, "completion": "  "}] + ROWS[2:]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    err = bad_input(path)
    assert err.message.startswith("train.parquet, row 2: ")
    assert "field 'completion' is empty" in err.message
    assert SECRET not in str(err)


def test_saved_dataset_directory(tmp_path):
    import datasets

    directory = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(directory))
    check_rows(read_dataset(directory))


def test_saved_dataset_dict_uses_train_split(tmp_path):
    import datasets

    directory = tmp_path / "saved_dict"
    other = [{"prompt": "other", "completion": "split"}]
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list(ROWS),
        "test": datasets.Dataset.from_list(other),
    }).save_to_disk(str(directory))
    check_rows(read_dataset(directory))


def test_saved_dataset_dict_without_train_split(tmp_path):
    import datasets

    directory = tmp_path / "saved_dict"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(directory))
    err = bad_input(directory)
    assert "no 'train' split" in err.message and "test" in err.message


def test_directory_that_is_not_a_saved_dataset(tmp_path):
    err = bad_input(tmp_path)
    assert "save_to_disk" in err.message


def test_json_array_and_json_lines_in_a_json_file(tmp_path):
    as_array = write(tmp_path, "array.json", json.dumps(ROWS, indent=1))
    check_rows(read_dataset(as_array))
    as_lines = write(tmp_path, "lines.json", jsonl(*ROWS))
    check_rows(read_dataset(as_lines))


def test_single_object_json_file_is_one_row(tmp_path):
    path = write(tmp_path, "one.json", json.dumps(ROWS[0], indent=2))
    dataset = read_dataset(path)
    assert len(dataset.examples) == 1 and dataset.examples[0].prompt == ROWS[0]["prompt"]


def test_utf8_bom_and_crlf_are_accepted(tmp_path):
    path = write(tmp_path, "bom.jsonl", b"\xef\xbb\xbf" + jsonl(*ROWS).replace(b"\n", b"\r\n"))
    check_rows(read_dataset(path))
    csv_path = write(tmp_path, "bom.csv", b'\xef\xbb\xbfprompt,completion\r\n"Question: one?\nAnswer:", One.\r\n'
                                          b'"Question: two?\nAnswer:", Two.\r\n"Question: three?\nAnswer:", Three.\r\n')
    check_rows(read_dataset(csv_path))


def test_blank_lines_in_jsonl_give_row_and_line(tmp_path):
    path = write(tmp_path, "gaps.jsonl", jsonl(good(1)) + b"\n\n" + jsonl({"instruction": SECRET, "output": ""}))
    err = bad_input(path)
    assert err.message.startswith("gaps.jsonl, row 2 (line 4): ")
    assert "field 'output' is empty" in err.message
    assert SECRET not in str(err)


# ------------------------------------------------------------------ bad input

def test_malformed_json_line(tmp_path):
    data = jsonl(good(1)) + ('{"instruction": "' + SECRET + '", "output": "x"\n').encode() + jsonl(good(3))
    err = bad_input(write(tmp_path, "train.jsonl", data))
    assert err.message.startswith("train.jsonl, line 2: not valid JSON")
    assert "line 1" not in err.message and "line 3" not in err.message
    assert "--strict" in err.hint


def test_non_utf8_bytes_in_jsonl(tmp_path):
    data = jsonl(good(1)) + b'{"instruction": "\xff\xfe' + SECRET.encode() + b'", "output": "x"}\n' + jsonl(good(3))
    err = bad_input(write(tmp_path, "train.jsonl", data))
    assert err.message.startswith("train.jsonl, line 2: not valid UTF-8 text")
    assert "0xff" in err.message


def test_non_utf8_bytes_in_json_array(tmp_path):
    data = (b'[\n' + json.dumps(good(1)).encode() + b',\n'
            + json.dumps(good(2)).encode() + b',\n'
            + b'{"instruction": "caf\xe9 ' + SECRET.encode() + b'", "output": "x"}\n]\n')
    err = bad_input(write(tmp_path, "train.json", data))
    assert err.message.startswith("train.json, line 4: not valid UTF-8 text")
    assert "UTF-8" in err.hint


def test_non_utf8_bytes_in_csv(tmp_path):
    data = b"prompt,completion\nhello,world\n" + SECRET.encode() + b"\xff,x\n"
    err = bad_input(write(tmp_path, "train.csv", data))
    assert err.message.startswith("train.csv, line 3: not valid UTF-8 text")


@pytest.mark.parametrize("name, data", [
    ("empty.jsonl", b""),
    ("blank.jsonl", b"  \n\n\t \r\n"),
    ("empty.json", b""),
    ("blank.json", b"\n   \n"),
    ("empty.csv", b""),
    ("bom_only.jsonl", b"\xef\xbb\xbf\n"),
])
def test_empty_and_whitespace_only_files(tmp_path, name, data):
    err = bad_input(write(tmp_path, name, data))
    assert err.message == f"{name} is empty."
    assert err.hint


def test_empty_json_array_and_header_only_csv(tmp_path):
    err = bad_input(write(tmp_path, "none.json", b"[\n]\n"))
    assert err.message == "none.json has no rows."
    err = bad_input(write(tmp_path, "header.csv", b"prompt,completion\n"))
    assert err.message == "header.csv has no rows."


def test_missing_file(tmp_path):
    path = tmp_path / "nowhere" / "missing.jsonl"
    err = bad_input(path)
    assert "not found" in err.message
    assert "missing.jsonl" in err.message


def test_unsupported_extension(tmp_path):
    err = bad_input(write(tmp_path, "notes.tsv", jsonl(good(1))))
    assert err.message.startswith("notes.tsv: unsupported file type '.tsv'")
    for suffix in (".jsonl", ".json", ".csv", ".parquet", ".txt"):
        assert suffix in err.hint


def test_unknown_columns(tmp_path):
    rows = [{"query": SECRET, "reply": SECRET}, {"query": "q", "reply": "a", "source": SECRET}]
    err = bad_input(write(tmp_path, "qa.jsonl", jsonl(*rows)))
    assert err.message.startswith("qa.jsonl: cannot tell the data format")
    for name in ("query", "reply", "source"):
        assert name in err.message
    for name, description in FORMAT_DESCRIPTIONS.items():
        assert description in err.hint or name in COLUMN_PAIRS  # the pairs, in one sentence:
    assert ("or one prompt column (prompt, query, question, instruction or input) with one reply column "
            "(completion, response, answer or output)") in err.hint
    assert SECRET not in str(err)


def test_unknown_columns_in_csv(tmp_path):
    data = f"query,reply\n{SECRET},{SECRET}\n".encode()
    err = bad_input(write(tmp_path, "qa.csv", data))
    assert "query" in err.message and "reply" in err.message
    assert "Alpaca" in err.hint


def test_empty_text_field(tmp_path):
    rows = [good(1), good(2), {"instruction": SECRET, "input": SECRET, "output": "  "}, good(4)]
    err = bad_input(write(tmp_path, "train.jsonl", jsonl(*rows)))
    assert err.message == "train.jsonl, line 3: field 'output' is empty."


def test_missing_and_non_text_fields(tmp_path):
    rows = [good(1), {"instruction": SECRET, "input": ""}]
    err = bad_input(write(tmp_path, "missing.jsonl", jsonl(*rows)))
    assert err.message == "missing.jsonl, line 2: missing field 'output'."
    rows = [good(1), {"instruction": SECRET, "output": [SECRET]}]
    err = bad_input(write(tmp_path, "list.jsonl", jsonl(*rows)))
    assert err.message == "list.jsonl, line 2: field 'output' must be text, found list."


def test_row_that_is_not_an_object(tmp_path):
    data = jsonl(good(1), [SECRET, "not an object"], good(3))
    err = bad_input(write(tmp_path, "train.jsonl", data))
    assert err.message == "train.jsonl, line 2: the row is not a JSON object (found list)."


def test_row_that_is_not_an_object_in_json_array(tmp_path):
    data = ("[\n" + json.dumps(good(1)) + ",\n" + json.dumps(SECRET) + "\n]\n").encode()
    err = bad_input(write(tmp_path, "train.json", data))
    assert err.message == "train.json, row 2 (line 3): the row is not a JSON object (found str)."


def sharegpt_row(*turns: tuple[str, str]) -> dict:
    return {"conversations": [{"from": role, "value": value} for role, value in turns]}


def test_sharegpt_unknown_role(tmp_path):
    rows = [sharegpt_row(("human", "hi"), ("gpt", "hello")),
            sharegpt_row(("human", SECRET), ("robot", SECRET))]
    err = bad_input(write(tmp_path, "chat.jsonl", jsonl(*rows)))
    # The role is named (a field's name, not the row's text), and where it is.
    assert err.message.startswith("chat.jsonl, line 2: unknown role 'robot' (conversations[2]; accepted:")
    assert SECRET not in str(err)
    for role in ("human", "gpt", "system"):
        assert role in err.message


def test_conversation_without_assistant_turn(tmp_path):
    rows = [sharegpt_row(("human", "hi"), ("gpt", "hello")),
            sharegpt_row(("system", SECRET), ("human", SECRET))]
    err = bad_input(write(tmp_path, "chat.jsonl", jsonl(*rows)))
    assert err.message == "chat.jsonl, line 2: field 'conversations' has no assistant turn to learn from."
    messages = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
                {"messages": [{"role": "user", "content": SECRET}]}]
    err = bad_input(write(tmp_path, "messages.jsonl", jsonl(*messages)))
    assert err.message == "messages.jsonl, line 2: field 'messages' has no assistant turn to learn from."


def test_system_turn_not_first_and_empty_turn(tmp_path):
    rows = [sharegpt_row(("human", "hi"), ("gpt", "hello")),
            sharegpt_row(("human", SECRET), ("system", SECRET), ("gpt", SECRET))]
    err = bad_input(write(tmp_path, "chat.jsonl", jsonl(*rows)))
    assert err.message == "chat.jsonl, line 2: field 'conversations' has a system turn that is not the first turn."
    rows = [sharegpt_row(("human", "hi"), ("gpt", "hello")), sharegpt_row(("human", SECRET), ("gpt", " \n"))]
    err = bad_input(write(tmp_path, "empty_turn.jsonl", jsonl(*rows)))
    assert err.message == "empty_turn.jsonl, line 2: empty assistant turn (conversations[2])."


def test_json_array_missing_comma(tmp_path):
    data = ("[\n" + json.dumps(good(1)) + ",\n"
            + json.dumps({"instruction": SECRET, "output": SECRET}) + "\n"  # no comma here
            + json.dumps(good(3)) + "\n]\n").encode()
    err = bad_input(write(tmp_path, "train.json", data))
    # The missing comma is noticed where the next element starts: line 4.
    assert err.message.startswith("train.json, line 4: not valid JSON")
    assert "Expecting ',' or ']'" in err.message
    assert "comma" in err.hint


def test_json_array_broken_element(tmp_path):
    data = ("[\n" + json.dumps(good(1)) + ",\n"
            + '{"instruction": "' + SECRET + '" "output": "x"}\n]\n').encode()
    err = bad_input(write(tmp_path, "train.json", data))
    assert err.message.startswith("train.json, line 3: not valid JSON")
    assert "column" in err.message


def test_json_text_after_array(tmp_path):
    data = ("[\n" + json.dumps(good(1)) + "\n]\n\n" + SECRET + "\n").encode()
    err = bad_input(write(tmp_path, "train.json", data))
    assert err.message.startswith("train.json, line 5: not valid JSON (Extra data")


def test_csv_row_with_too_many_cells(tmp_path):
    data = ('prompt,completion\n'
            'one,two\n'
            '"multi\nline prompt",answer\n'
            f'{SECRET},{SECRET},{SECRET}\n'
            'three,four\n').encode()
    err = bad_input(write(tmp_path, "train.csv", data))
    assert err.message == "train.csv, row 3 (line 5): has more cells than the header's 2 columns."


def test_csv_line_number_after_blank_line(tmp_path):
    data = f"prompt,completion\none,two\n\n{SECRET},{SECRET},{SECRET}\n".encode()
    err = bad_input(write(tmp_path, "train.csv", data))
    # header = line 1, "one,two" = line 2, blank = line 3, bad row = line 4
    assert err.message == "train.csv, row 2 (line 4): has more cells than the header's 2 columns."


def test_csv_repeated_header(tmp_path):
    err = bad_input(write(tmp_path, "dup.csv", b"prompt,prompt\na,b\n"))
    assert err.message == "dup.csv, line 1: the header repeats a column name."


def test_only_row_malformed_names_line(tmp_path):
    data = ('{"instruction": "' + SECRET + '", "output": "x"\n').encode()
    err = bad_input(write(tmp_path, "one.jsonl", data))
    assert err.message.startswith("one.jsonl, line 1: not valid JSON")


def test_secret_never_echoed(tmp_path):
    """Every row-level error above keeps the row's content out; check a batch at once."""
    cases = {
        "a.jsonl": jsonl(good(1)) + ('{"output": "' + SECRET + '" ,,}\n').encode(),
        "b.jsonl": jsonl(good(1), {"instruction": SECRET, "output": 5}),
        "c.jsonl": jsonl(good(1), 12345, SECRET),
        "d.json": ("[" + json.dumps(good(1)) + ", {\"instruction\": \"" + SECRET + "\" \"x\"}]").encode(),
        "e.csv": f"instruction,output\n{SECRET},\n".encode(),
        "f.jsonl": jsonl({"messages": [{"role": "user", "content": SECRET}, {"role": "assistant", "content": 7}]}),
        "g.jsonl": jsonl({"messages": SECRET}),
        "h.jsonl": jsonl({"conversations": [SECRET]}),
    }
    for name, data in cases.items():
        err = bad_input(write(tmp_path, name, data))
        assert err.message.startswith(name), err.message
        assert SECRET not in err.message and SECRET not in (err.hint or ""), name
        assert "12345" not in err.message, name


# -------------------------------------------------------------- skip_bad_rows

def test_skip_bad_rows(tmp_path):
    data = (jsonl(good(1))
            + ('{"instruction": "' + SECRET + '"\n').encode()   # bad JSON
            + jsonl(good(3), {"instruction": SECRET, "output": " "}, [SECRET], good(6)))
    path = write(tmp_path, "mixed.jsonl", data)
    dataset = read_dataset(path, skip_bad_rows=True)
    assert dataset.format == "alpaca"
    assert [e.row for e in dataset.examples] == [1, 3, 6]
    assert [e.messages[1].content for e in dataset.examples] == ["Answer 1.", "Answer 3.", "Answer 6."]
    assert dataset.skipped == 3
    assert sum(dataset.skip_reasons.values()) == 3
    assert dataset.skip_reasons["not valid JSON"] == 1
    assert all(SECRET not in reason for reason in dataset.skip_reasons)
    # Without the flag the first bad row stops the read.
    assert bad_input(path).message.startswith("mixed.jsonl, line 2: not valid JSON")


def test_skip_bad_rows_all_bad_still_raises(tmp_path):
    rows = [{"instruction": SECRET, "output": ""}, {"instruction": "", "output": SECRET}]
    err = bad_input(write(tmp_path, "bad.jsonl", jsonl(*rows)), skip_bad_rows=True)
    assert err.message.startswith("bad.jsonl: no usable rows (2 bad; the first: bad.jsonl, line 1: ")
    assert SECRET not in str(err)


# --- regressions found in review

def test_a_csv_cell_longer_than_128_kib_is_read(tmp_path):
    long_text = "word " * 50_000  # 250 KB in one cell
    path = write(tmp_path, "big.csv", f'prompt,completion\nshort,"{long_text}"\n'.encode())
    dataset = read_dataset(path)
    assert dataset.examples[0].completion == long_text


def test_a_role_that_is_not_text_is_a_row_problem(tmp_path):
    data = b'{"messages": [{"role": ["user"], "content": "x"}, {"role": "assistant", "content": "y"}]}\n'
    err = bad_input(write(tmp_path, "role.jsonl", data))
    assert "line 1" in err.message and "unknown role" in err.message
    sharegpt = b'{"conversations": [{"from": {"a": 1}, "value": "x"}, {"from": "gpt", "value": "y"}]}\n' * 2
    assert read_dataset(write(tmp_path, "s.jsonl", sharegpt + b'{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}\n'),
                        skip_bad_rows=True).skipped == 2


def test_line_numbers_deep_into_a_json_array_are_exact(tmp_path):
    rows = [json.dumps({"text": f"row {i}"}, indent=1) for i in range(3000)]  # 3 lines per row
    rows[2500] = '{"text": ""}'
    text = "[\n" + ",\n".join(rows) + "\n]"
    err = bad_input(write(tmp_path, "big.json", text.encode()))
    assert err.message.startswith(f"big.json, row 2501 (line {2 + 2500 * 3}): field 'text' is empty")


# ------------------------------------------------------------ the bad-row policy

def test_a_few_bad_rows_are_skipped_by_default_and_reported_by_reason(tmp_path):
    rows = [good(i) for i in range(1, 41)]
    rows[4] = {"instruction": SECRET, "output": ""}
    rows[30] = {"instruction": SECRET, "output": "  "}
    path = write(tmp_path, "few.jsonl", jsonl(*rows))
    found = data.read_dataset(path)
    assert found.rows == 38 and found.skipped == 2
    assert found.bad.lines() == ["field 'output' is empty: 2 rows (line 5, line 31)"]
    assert found.to_json()["bad_rows"]["where"] == {"field 'output' is empty": ["line 5", "line 31"]}
    assert SECRET not in json.dumps(found.to_json())


def test_more_than_five_percent_bad_rows_stop_unless_told_to_skip(tmp_path):
    rows = [good(i) if i % 10 >= 3 else {"instruction": SECRET, "output": ""} for i in range(1, 41)]  # 30% bad
    path = write(tmp_path, "many.jsonl", jsonl(*rows))
    err = bad_input(path, policy="default")
    assert "12 of 40 rows (30%) fail validation" in err.message and "line 1" in err.message
    assert "--skip-bad-rows" in err.hint and SECRET not in str(err)
    assert data.read_dataset(path, "skip").rows == 28
    assert bad_input(path, policy="strict").message.startswith("many.jsonl, line 1: field 'output' is empty")


def test_strict_and_skip_bad_rows_together_are_refused():
    from llmcustoms.errors import ConfigError
    from llmcustoms.planning.train_options import bad_row_policy

    with pytest.raises(ConfigError):
        bad_row_policy(strict=True, skip_bad_rows=True)
    assert bad_row_policy(False, False) == "default" and bad_row_policy(True, False) == "strict"


def test_duplicates_and_near_empty_replies_are_counted(tmp_path):
    rows = [good(1), {"instruction": "Question  1?", "input": "", "output": "Answer 1. "}, good(2),
            {"instruction": "Say ok", "output": "ok"}]
    found = data.read_dataset(write(tmp_path, "dups.jsonl", jsonl(*rows)))
    assert found.duplicates == 1 and found.near_empty == 1 and found.rows == 4


def test_a_json_array_is_read_in_chunks_with_exact_lines(tmp_path, monkeypatch):
    from llmcustoms.data import data_files as datafiles

    monkeypatch.setattr(datafiles, "JSON_CHUNK", 7)  # every row spans several reads
    rows = [json.dumps({"text": f"row {i} " + "x" * (i * 13)}, indent=1) for i in range(60)]
    rows[45] = '{"text": 12}'
    path = write(tmp_path, "chunked.json", ("[\n" + ",\n".join(rows) + "\n]\n").encode())
    found = read_dataset(path, policy="skip")
    assert [e.row for e in found.examples] == [i + 1 for i in range(60) if i != 45]
    assert found.examples[59 - 1].completion == "row 59 " + "x" * (59 * 13)
    assert found.bad.where == {"field 'text' must be text, found int": [f"row 46 at line {2 + 45 * 3}"]}


def test_json_lines_saved_as_json_after_blank_lines(tmp_path):
    path = write(tmp_path, "lines.json", b"\n\n" + jsonl(good(1), good(2)))
    assert [e.row for e in read_dataset(path).examples] == [1, 2]


# --- found in review: malformed files fail clearly, and early

def test_a_stray_quote_in_a_csv_is_an_error_not_a_swallowed_file(tmp_path):
    rows = "".join(f"q{i},a{i}\n" for i in range(1, 60))
    data = f"prompt,completion\n{rows}q60,\"a60 with a stray quote\n{rows}".encode()
    err = bad_input(write(tmp_path, "quote.csv", data))
    assert err.message.startswith("quote.csv, line 61: not valid CSV")


def test_a_mistake_early_in_a_json_array_fails_before_reading_the_rest(tmp_path, monkeypatch):
    from llmcustoms.data import data_files as datafiles

    monkeypatch.setattr(datafiles, "JSON_CHUNK", 64)
    reads = []
    original = datafiles._TextStream.more
    monkeypatch.setattr(datafiles._TextStream, "more", lambda self, size: reads.append(size) or original(self, size))
    body = ",".join(json.dumps({"text": f"row {i}"}) for i in range(2000))
    path = write(tmp_path, "early.json", ("[" + json.dumps({"text": "a"}) + ",{bad}," + body + "]").encode())
    err = bad_input(path)
    assert err.message.startswith("early.json, line 1: not valid JSON (Expecting property name enclosed in double quotes at column 17)")
    assert sum(reads) < 1000  # the 40 KB after the mistake were never read


def test_json_errors_read_at_column_once(tmp_path):
    """The json module's messages ending in "at" ("Invalid control character at") are
    not followed by a second "at" (issue 46, 19b): in a JSON Lines row, an array, an object."""
    from llmcustoms.data.data_files import read_rows

    lines = write(tmp_path, "lines.jsonl", jsonl({"text": "a"}) + b'{"text": "b\tc"}\n')
    assert [r.problem for r in read_rows(lines)][1] == "not valid JSON (Invalid control character at column 12)"
    array = bad_input(write(tmp_path, "array.json", b'[{"text": "a"}, {"text": "b\x01"}]'))
    assert array.message == "array.json, line 1: not valid JSON (Invalid control character at column 28)."
    single = bad_input(write(tmp_path, "single.json", b'{"text": "never closed}'))
    assert single.message == "single.json, line 1: not valid JSON (Unterminated string starting at column 10)."


@pytest.mark.parametrize("data", [b'[{"text": "a"}]\xe9', b'[{"text": "\xe2\x82'])
def test_a_file_cut_in_the_middle_of_a_character_is_a_clear_error(tmp_path, data):
    assert "not valid UTF-8 text" in bad_input(write(tmp_path, "cut.json", data)).message


def test_rows_beyond_the_json_modules_limits_are_bad_rows(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    path = write(tmp_path, "deep.jsonl", jsonl(*[good(i) for i in range(1, 40)]) + ('{"text": ' + deep + "}\n").encode())
    found = data.read_dataset(path)
    assert found.rows == 39 and list(found.bad.by_reason) == ["not valid JSON"]
