"""Hostile data and settings (issue 19): each case the issue found, and the
limits beside them, end in exit 2 with the file and line, or in a bad row
that the bad-row policy skips (by default a few, with --skip-bad-rows any
number, with --strict none), never in a traceback, and never with the row's
content in the output. Through `llmcustoms plan` with a tiny local model,
which reads, checks and tokenizes the data; `read_dataset` for the rest."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmcustoms.planning import options

from llmcustoms.data import raw_rows
from llmcustoms.cli import app
from llmcustoms.data.dataset import read_dataset, usable_examples
from llmcustoms.errors import ConfigError, DataError
from llmcustoms.planning.presets import validate_preset_values
from llmcustoms.planning.settings import load_settings
from llmcustoms.data.tokenization import Tokenizer
from tiny_models import build_tokenizer

SECRET = "SECRET-ROW-CONTENT-12345"
GOOD_ROWS = 40  # one bad row in 41 is under the 5% skipped without asking
DEEP = "[" * 10_000 + "]" * 10_000


def alpaca(i: int) -> dict:
    return {"instruction": f"What is {i} plus {i}?", "output": f"{i} plus {i} is {2 * i}."}


def chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}, said."}]}


def pair(i: int) -> dict:
    return {"prompt": f"What is {i} plus {i}?", "chosen": f"{2 * i}.", "rejected": f"{2 * i + 1}."}


def jsonl(good, bad: str, bad_rows: int = 1) -> bytes:
    """GOOD_ROWS good rows, then the bad row's JSON text (lines 41, ...)."""
    return ("".join(json.dumps(good(i)) + "\n" for i in range(GOOD_ROWS)) + (bad + "\n") * bad_rows).encode()


# A lone surrogate, as JSON writes one: "\ud800".
SURROGATE = "\\ud800"
# name -> (file name, content, the reason said, where)
BAD_ROWS = {
    "nested 10,000 deep": ("deep.jsonl", jsonl(alpaca, '{"instruction": "' + SECRET + '", "output": ' + DEEP + "}"),
                           "not valid JSON (nested too deeply, or holds a number too long)", "line 41"),
    "a number of 5,000 digits": ("number.jsonl", jsonl(alpaca, '{"instruction": "' + SECRET + '", "output": '
                                                       + "9" * 5000 + "}"),
                                 "not valid JSON (nested too deeply, or holds a number too long)", "line 41"),
    "a surrogate in the reply": ("reply.jsonl", jsonl(alpaca, f'{{"instruction": "{SECRET}", "output": "a{SURROGATE}"}}'),
                                 raw_rows.NOT_UNICODE, "line 41"),
    "a surrogate in the system field": ("system.jsonl", jsonl(alpaca, f'{{"instruction": "{SECRET}", "output": "ok", '
                                                                      f'"system": "{SURROGATE}"}}'),
                                        raw_rows.NOT_UNICODE, "line 41"),
    "a surrogate in a message": ("messages.jsonl", jsonl(chat, '{"messages": [{"role": "user", "content": "' + SECRET
                                                         + SURROGATE + '"}, {"role": "assistant", "content": "ok"}]}'),
                                 raw_rows.NOT_UNICODE, "line 41"),
    "a surrogate in a prompt": ("prompt.jsonl", jsonl(lambda i: {"prompt": f"q{i}", "completion": f"a{i}."},
                                                      f'{{"prompt": "\\udfff{SECRET}", "completion": "ok"}}'),
                                raw_rows.NOT_UNICODE, "line 41"),
    "a surrogate in a rejected reply": ("pairs.jsonl", jsonl(pair, f'{{"prompt": "{SECRET}", "chosen": "yes", '
                                                                   f'"rejected": "no{SURROGATE}"}}'),
                                        raw_rows.NOT_UNICODE, "line 41"),
    "a surrogate in a field name": ("key.jsonl", jsonl(alpaca, f'{{"{SURROGATE}": "{SECRET}", "instruction": "q", '
                                                               '"output": "a"}'),
                                    raw_rows.NOT_UNICODE, "line 41"),
    "a surrogate in tool arguments held as text": (
        "arguments.jsonl", jsonl(chat, json.dumps({"messages": [
            {"role": "user", "content": SECRET},
            {"role": "assistant", "content": None, "tool_calls": [
                {"function": {"name": "f", "arguments": '{"a": "' + SURROGATE + '"}'}}]}]})),
        "tool call arguments: " + raw_rows.NOT_UNICODE, "line 41"),
    "tool schemas nested 100 deep": (
        "tools.jsonl", jsonl(chat, json.dumps({**chat(0), "tools": [{"name": SECRET, "parameters": json.loads(
            "[" * 100 + "]" * 100)}]})),
        "field 'tools' is nested more than 64 levels deep", "line 41"),
    "a surrogate in a JSON array": (
        "array.json", ("[" + ",".join(json.dumps(alpaca(i)) for i in range(GOOD_ROWS))
                       + f',{{"instruction": "{SECRET}", "output": "{SURROGATE}"}}]').encode(),
        raw_rows.NOT_UNICODE, "row 41 at line 1"),
}


def csv_file(bad_messages: str) -> bytes:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["messages"])
    writer.writerows([json.dumps(chat(i)["messages"])] for i in range(GOOD_ROWS))
    writer.writerow([bad_messages])
    return out.getvalue().encode()


BAD_ROWS |= {
    "a surrogate in a CSV messages column": (
        "surrogate.csv", csv_file('[{"role": "user", "content": "' + SECRET + SURROGATE + '"}, '
                                  '{"role": "assistant", "content": "ok"}]'),
        "column 'messages': " + raw_rows.NOT_UNICODE, "row 41 at line 42"),
    "a CSV messages column nested 10,000 deep": (
        "deep.csv", csv_file(DEEP), "column 'messages': not valid JSON (nested too deeply", "row 41 at line 42"),
}


def flat(text: str) -> str:
    return " ".join(text.split())


def plan(path: Path, model: Path, *flags: str):
    result = CliRunner().invoke(app, ["plan", str(path), "--model", str(model), *flags])
    out = flat(result.output)
    assert "Traceback" not in out and SECRET not in out, out
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result.exit_code, out


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_a_hostile_row_is_one_bad_row_under_every_policy(clean_environment, tiny_models, tmp_path, case):
    name, content, reason, where = BAD_ROWS[case]
    path = tmp_path / name
    path.write_bytes(content)
    model = tiny_models["llama"]

    code, out = plan(path, model)
    assert code == 0, out
    assert "1 bad row skipped" in out and f"{reason.split(' (')[0]}: 1 row ({where})" in out, out

    code, out = plan(path, model, "--strict")
    row, _, line = where.partition(" at ")
    said = f"{name}, {row} ({line}): {reason}" if line else f"{name}, {row}: {reason}"
    assert code == 2 and said in out, out

    code, out = plan(path, model, "--skip-bad-rows")
    assert code == 0 and "1 bad row skipped (--skip-bad-rows)" in out, out


@pytest.mark.parametrize("case", ["nested 10,000 deep", "a surrogate in the reply", "a surrogate in tool arguments held as text"])
def test_many_hostile_rows_stop_the_run_unless_skipped(clean_environment, tiny_models, tmp_path, case):
    """Ten bad rows in fifty are more than 5%: exit 2 by default, skipped with --skip-bad-rows."""
    name, content, reason, _ = BAD_ROWS[case]
    bad_line = content.decode().splitlines()[-1]
    path = tmp_path / name
    path.write_bytes(content + (bad_line + "\n").encode() * 9)
    code, out = plan(path, tiny_models["llama"])
    assert code == 2 and "10 of 50 rows (20%) fail validation" in out and "--skip-bad-rows" in out, out
    code, out = plan(path, tiny_models["llama"], "--skip-bad-rows")
    assert code == 0 and "10 bad rows skipped (--skip-bad-rows)" in out and "10 rows (line 41, line 42, line 43, ...)" in out, out


def test_the_rows_left_tokenize(tmp_path):
    """What survives a hostile file reaches the tokenizer whole: no surrogate
    makes it there (the tokenizer would raise TypeError)."""
    tokenizer = Tokenizer(build_tokenizer("chatml"))
    for name, content, _, _ in BAD_ROWS.values():
        path = tmp_path / name
        path.write_bytes(content)
        assert read_dataset(path, "skip").rows == GOOD_ROWS
        halves = [half for example in usable_examples(path) for half in example.halves()]
        assert len(tokenizer.encode_many(halves)) == len(halves)


# --- whole files that cannot be read past the row: exit 2 naming the file ---------

FILE_ERRORS = {
    "a JSON array with a row nested 10,000 deep": (
        "deep.json", ("[" + ",".join(json.dumps(alpaca(i)) for i in range(GOOD_ROWS)) + ',{"output": ' + DEEP
                      + "}]").encode(),
        "deep.json, line 1: row 41 of the JSON array is nested too deeply, or holds a number too long. A JSON array "
        "cannot skip such a row"),
    "a JSON object nested 10,000 deep": (
        "object.json", ('{"instruction": "' + SECRET + '", "output": ' + DEEP + "}").encode(),
        "object.json, the JSON object: not valid JSON (nested too deeply, or holds a number too long)"),
    "a JSON object with a surrogate": (
        "object.json", f'{{"instruction": "{SECRET}", "output": "{SURROGATE}"}}'.encode(),
        f"object.json, the JSON object: {raw_rows.NOT_UNICODE}"),
    "a Parquet file cut short": ("cut.parquet", b"PAR1" + b"\x00" * 64, "cut.parquet: not a readable Parquet file"),
}


@pytest.mark.parametrize("case", list(FILE_ERRORS))
@pytest.mark.parametrize("policy", [(), ("--strict",), ("--skip-bad-rows",)], ids=["default", "strict", "skip"])
def test_a_file_that_cannot_be_read_on_exits_2_naming_it(clean_environment, tiny_models, tmp_path, case, policy):
    name, content, said = FILE_ERRORS[case]
    path = tmp_path / name
    path.write_bytes(content)
    code, out = plan(path, tiny_models["llama"], *policy)
    assert code == 2 and said in out, out


def test_parquet_text_that_is_not_utf8_is_an_error_at_its_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"row {i}".encode() for i in range(3)] + [b"\xed\xa0\x80"]  # a surrogate's bytes: not UTF-8
    offsets = [0]
    for text in texts:
        offsets.append(offsets[-1] + len(text))
    bad = pa.Array.from_buffers(pa.string(), len(texts), [None, pa.py_buffer(pa.array(offsets, pa.int32()).buffers()[1]),
                                                          pa.py_buffer(b"".join(texts))])
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": bad}), path)
    with pytest.raises(DataError, match=r"bad.parquet: cannot read past row 0 \(UnicodeDecodeError\)"):
        read_dataset(path, "skip")


# --- the size limit on one row (lowered here so the test writes kilobytes, not 64 MiB)

def test_a_jsonl_line_over_the_limit_is_a_bad_row_skipped_unread(monkeypatch, tmp_path):
    monkeypatch.setattr(raw_rows, "MAX_ROW_BYTES", 4096)
    long_row = json.dumps({"instruction": SECRET, "output": "x" * 10_000})
    path = tmp_path / "long.jsonl"
    path.write_bytes(jsonl(alpaca, long_row) + json.dumps(alpaca(99)).encode() + b"\n")
    found = read_dataset(path)
    assert found.rows == GOOD_ROWS + 1 and found.bad.lines() == [f"{raw_rows.TOO_LONG}: 1 row (line 41)"]
    with pytest.raises(DataError, match=f"long.jsonl, line 41: {raw_rows.TOO_LONG}"):
        read_dataset(path, "strict")


@pytest.mark.parametrize("name, content, said", [
    ("long.json", "[" + json.dumps(alpaca(1)) + "," + json.dumps({"instruction": "q", "output": "x" * 10_000}) + "]",
     "long.json, line 1: row 2 of the JSON array is longer than"),
    ("longer.json", "[" + json.dumps(alpaca(1)) + "," + json.dumps({"instruction": "q", "output": "x" * 3_000_000}) + "]",
     "longer.json, line 1: row 2 of the JSON array is longer than"),
    ("one.json", json.dumps({"instruction": "q", "output": "x" * 10_000}), "one.json, line 1: longer than"),
    ("indented.json", json.dumps({"instruction": "q", "output": "x" * 10_000}, indent=2),
     "indented.json: the JSON object is longer than"),
    ("long.csv", "instruction,output\nq," + "x" * 10_000 + "\n", "long.csv, line 2: longer than"),
    ("cell.csv", 'instruction,output\nq,"' + "x\n" * 3000 + '"\n', "cell.csv, line 2: longer than"),
])
def test_a_row_over_the_limit_where_the_next_cannot_be_found_is_an_error(monkeypatch, tmp_path, name, content, said):
    monkeypatch.setattr(raw_rows, "MAX_ROW_BYTES", 4096)
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError) as error:
        read_dataset(path, "skip")
    assert error.value.message.startswith(said), error.value.message


# --- settings: one range, whether from a flag, the environment, .env or a preset --------

BOUNDED = [o for o in options.OPTIONS if o.kind in (int, float) and not o.choices
           and (o.minimum is not None or o.maximum is not None)]


def just_outside(option: options.Option) -> list[str]:
    """The values nearest each bound that the option refuses, as text."""
    values = []
    if option.minimum is not None:
        step = 1 if option.kind is int else option.minimum - math.nextafter(option.minimum, -math.inf)
        values.append(option.minimum if option.min_open else option.minimum - step)
    if option.maximum is not None:
        step = 1 if option.kind is int else math.nextafter(option.maximum, math.inf) - option.maximum
        values.append(option.maximum if option.max_open else option.maximum + step)
    return [str(int(v)) if option.kind is int else repr(float(v)) for v in values]


def test_every_bounded_option_is_tested():
    assert {"lr", "eval_split", "seed", "epochs", "lora_dropout", "max_seq_len"} <= {o.name for o in BOUNDED}


def assert_refused_from_the_environment(option: options.Option, text: str) -> None:
    """From the process environment and from .env alike: a ConfigError naming
    the variable, and `train` exits 2 with it before anything else."""
    for in_file in (False, True):
        Path(".env").write_text(f"{option.variable}={text}\n" if in_file else "")
        with pytest.MonkeyPatch.context() as patch:
            if in_file:  # the process environment would win over .env (LLMCUSTOMS_REPLAY is set for tests)
                patch.delenv(option.variable, raising=False)
            else:
                patch.setenv(option.variable, text)
            with pytest.raises(ConfigError, match=option.variable):
                load_settings()
            result = CliRunner().invoke(app, ["train", "missing.jsonl"])
        out = flat(result.output)
        assert result.exit_code == 2 and option.variable in out and "Traceback" not in out, (text, out)


@pytest.mark.parametrize("option", BOUNDED, ids=lambda o: o.name)
def test_a_value_just_outside_the_range_is_refused_everywhere_with_exit_2(clean_environment, option):
    not_finite = ["nan", "inf", "-inf"] if option.kind is float else ["1.5", "nan"]
    for text in just_outside(option) + not_finite:
        with pytest.raises(ValueError):
            option.parse(text)
        if option.variable:
            assert_refused_from_the_environment(option, text)
        if option.flag and "train" in option.commands:
            result = CliRunner().invoke(app, ["train", "missing.jsonl", option.flag, text])
            assert result.exit_code == 2 and "Invalid value for" in flat(result.output), (text, result.output)
        if option.preset:  # a preset file's YAML gives numbers, .nan and .inf among them
            value = int(text) if option.kind is int and text.lstrip("-").isdigit() else float(text)
            assert validate_preset_values({option.preset: value}, "preset"), (option.name, text)


def test_the_eval_split_the_issue_found_is_one_range():
    """The issue: LLMCUSTOMS_EVAL_SPLIT=0.99 was taken where --eval-split stopped at 0.9."""
    option = options.BY_NAME["eval_split"]
    assert option.parse("0.99") == 0.99 and not validate_preset_values({"eval_split": 0.99}, "preset")
    result = CliRunner().invoke(app, ["train", "missing.jsonl", "--eval-split", "0.99"])
    assert "Invalid value" not in result.output and "not found" in flat(result.output)
    for refused in ("1", "1.0", "nan", "-0.01"):
        with pytest.raises(ValueError):
            option.parse(refused)


def test_an_unknown_variable_named_in_bytes_that_are_not_utf8_is_shown_escaped(clean_environment, monkeypatch):
    monkeypatch.setenv("LLMCUSTOMS_\udcff", "1")
    with pytest.raises(ConfigError) as error:
        load_settings()
    assert "unknown setting 'LLMCUSTOMS_\\udcff'" in error.value.message
    error.value.message.encode("utf-8")  # printable


def test_a_nul_in_the_env_file_is_a_config_error_naming_the_line(clean_environment):
    Path(".env").write_bytes(b"HF_HOME=/tmp\nOTHER=a\x00b\n")
    with pytest.raises(ConfigError, match=r"\.env, line 2: a NUL character"):
        load_settings()


def test_field_names_with_control_characters_are_shown_escaped(tmp_path):
    """An unknown field is named in the error; a terminal escape in its name is shown, not sent."""
    path = tmp_path / "odd.jsonl"
    path.write_text(json.dumps({"\x1b[31mred": "a", "two\nlines": "b"}) + "\n")
    with pytest.raises(DataError) as error:
        read_dataset(path)
    message = error.value.message
    assert "\\x1b[31mred" in message and "two\\nlines" in message and "\x1b" not in message
