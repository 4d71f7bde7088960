"""Bad input through the real CLI (`python -m llmcustoms train ...` in a
subprocess): exit code 2, one clear message naming the file and line, no
traceback, no row content echoed, and no run directory left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent.parent / "fixtures"
SECRET = "SECRET-ROW-CONTENT-12345"


def jsonl(*rows: object) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8")


def good(i: int) -> dict:
    return {"instruction": f"What is {i} plus {i}?", "input": "", "output": f"{i} plus {i} is {2 * i}."}


def output_of(result) -> str:
    """stdout + stderr with whitespace collapsed, so Rich's line wrapping cannot split a phrase."""
    return " ".join((result.stdout + "\n" + result.stderr).split())


def assert_clean_user_error(result, *expected: str) -> str:
    out = output_of(result)
    assert result.returncode == 2, out
    assert "Traceback" not in out
    assert SECRET not in out
    for text in expected:
        assert text in out, out
    return out


# name -> (file content, or None for a file that does not exist; texts the output must contain)
BAD_DATA = {
    "malformed_json": (jsonl(good(1)) + ('{"instruction": "' + SECRET + '", "output": \n').encode() + jsonl(good(3)),
                       ["line 2", "not valid JSON"]),
    "non_utf8": (jsonl(good(1)) + b'{"instruction": "\xff' + SECRET.encode() + b'", "output": "x"}\n',
                 ["line 2", "UTF-8"]),
    "empty_file": (b"", ["is empty"]),
    "missing_file": (None, ["not found"]),
    "unknown_columns": (jsonl({"query": SECRET, "reply": SECRET}, {"query": SECRET, "reply": SECRET}),
                        ["cannot tell the data format", "query", "reply", "Alpaca"]),
    "empty_text_field": (jsonl(good(1), good(2), {"instruction": SECRET, "input": "", "output": "  "}),
                         ["line 3", "field 'output' is empty"]),
    "row_not_object": (jsonl(good(1), [SECRET, SECRET], good(3)),
                       ["line 2", "not a JSON object"]),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_exits_2_with_location(cli, tiny_models, tmp_path, case):
    content, expected = BAD_DATA[case]
    path = tmp_path / f"{case}.jsonl"
    if content is not None:
        path.write_bytes(content)
    runs = tmp_path / "runs"
    result = cli("train", str(path), "--model", str(tiny_models["llama"]), "--yes", "--output-dir", str(runs))
    assert_clean_user_error(result, path.name, *expected)
    assert not runs.exists() or not any(runs.iterdir())


def test_skip_bad_rows_trains(cli, tiny_models, tmp_path):
    rows = [good(i) for i in range(1, 9)]
    data = jsonl(*rows[:4]) + ('{"instruction": "' + SECRET + '",\n').encode() + jsonl(*rows[4:])
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(data)
    runs = tmp_path / "runs"
    result = cli("train", str(path), "--model", str(tiny_models["llama"]), "--skip-bad-rows", "--yes", "--quiet",
                 "--max-steps", "1", "--output-dir", str(runs), "--run-name", "skip")
    out = output_of(result)
    assert result.returncode == 0, out
    assert "Traceback" not in out
    assert SECRET not in out
    assert (runs / "skip" / "plan.json").exists()


def test_a_few_bad_rows_are_skipped_and_reported_many_stop_and_strict_stops_at_the_first(cli, tiny_models, tmp_path):
    rows = [good(i) for i in range(1, 41)]
    rows[6] = {"instruction": SECRET, "input": "", "output": ""}
    path = tmp_path / "few_bad.jsonl"
    path.write_bytes(jsonl(*rows))
    runs = tmp_path / "runs"
    model = ("--model", str(tiny_models["llama"]))
    result = cli("train", str(path), *model, "--yes", "--max-steps", "1", "--output-dir", str(runs), "--run-name", "few")
    out = output_of(result)
    assert result.returncode == 0 and SECRET not in out, out
    assert "1 bad row skipped" in out and "field 'output' is empty: 1 row (line 7)" in out
    for name in ("plan.json", "status.json"):
        saved = json.loads((runs / "few" / name).read_text())
        report = saved["data_report"] if name == "plan.json" else saved["data"]
        assert report["bad_rows"]["where"] == {"field 'output' is empty": ["line 7"]} and report["rows"] == 39
    strict = cli("train", str(path), *model, "--strict", "--yes", "--output-dir", str(runs), "--run-name", "strict")
    assert_clean_user_error(strict, "few_bad.jsonl, line 7: field 'output' is empty")
    many = tmp_path / "many_bad.jsonl"
    many.write_bytes(jsonl(*[good(i) if i % 10 >= 3 else rows[6] for i in range(1, 41)]))
    result = cli("plan", str(many), *model)
    assert_clean_user_error(result, "12 of 40 rows (30%) fail validation", "--skip-bad-rows")


def test_model_hub_id_not_cached_offline(cli, tmp_path):
    runs = tmp_path / "runs"
    result = cli("train", str(FIXTURES / "alpaca.jsonl"), "--model", "no-such-org/no-such-model", "--yes",
                 "--output-dir", str(runs))
    assert_clean_user_error(result, "no-such-org/no-such-model", "not in the local Hugging Face cache",
                            "the Hub cannot be reached", "--model PATH")
    assert not runs.exists()


def test_model_directory_not_found(cli, tmp_path):
    runs = tmp_path / "runs"
    result = cli("train", str(FIXTURES / "alpaca.jsonl"), "--model", "./does-not-exist-dir", "--yes",
                 "--output-dir", str(runs), cwd=tmp_path)
    assert_clean_user_error(result, "not found", "does-not-exist-dir")
    assert not runs.exists()


def test_bad_flag_value(cli, tmp_path):
    runs = tmp_path / "runs"
    result = cli("train", str(FIXTURES / "alpaca.jsonl"), "--batch-size", "0", "--yes", "--output-dir", str(runs))
    assert_clean_user_error(result, "--batch-size")
    assert not runs.exists()


def test_fsdp_with_an_adapter_method_is_refused_before_any_process_starts(cli, tiny_models, tmp_path):
    result = cli("train", str(FIXTURES / "alpaca.jsonl"), "--model", str(tiny_models["llama"]), "--num-processes", "2",
                 "--distributed", "fsdp", "--method", "lora", "--output-dir", str(tmp_path / "runs"), "--yes")
    out = assert_clean_user_error(result, "--distributed fsdp shards full fine-tuning", "--distributed ddp")
    assert out.count("Error:") == 1  # said once, by the launching process
    assert not (tmp_path / "runs").exists()


def test_bad_data_with_several_processes_is_refused_before_any_process_starts(cli, tiny_models, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(jsonl(good(1), [SECRET, SECRET], good(3)))
    result = cli("train", str(path), "--model", str(tiny_models["llama"]), "--num-processes", "2",
                 "--output-dir", str(tmp_path / "runs"), "--yes")
    out = assert_clean_user_error(result, "line 2", "not a JSON object")
    assert out.count("Error:") == 1 and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("seed", ["-1", "4294967296", "99999999999999999999"])
def test_a_seed_outside_what_the_generators_take_is_refused_before_anything_is_written(cli, tmp_path, seed):
    runs = tmp_path / "runs"
    result = cli("train", str(FIXTURES / "alpaca.jsonl"), "--seed", seed, "--yes", "--output-dir", str(runs))
    assert_clean_user_error(result, "--seed")
    assert not runs.exists()


@pytest.mark.parametrize("name, said", [("a" * 300, "too long"), ("two\nlines", "two\\nlines")])
def test_a_run_name_too_long_or_with_control_characters_is_refused_before_anything_is_written(cli, tmp_path, name,
                                                                                           said):
    runs = tmp_path / "runs"
    result = cli("train", str(FIXTURES / "alpaca.jsonl"), "--run-name", name, "--yes", "--output-dir", str(runs))
    out = assert_clean_user_error(result, "--run-name", said)
    assert "a" * 41 not in out  # the name is shown cut short, not whole
    assert not runs.exists()


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_data_that_is_not_a_regular_file_is_refused_at_once(cli, tmp_path, kind):
    """A FIFO would hang the reader forever; a link to /dev/zero would read until memory ran out."""
    import os

    data = tmp_path / "data.jsonl"
    if kind == "fifo":
        os.mkfifo(data)
    else:
        data.symlink_to("/dev/zero")
    runs = tmp_path / "runs"
    result = cli("train", str(data), "--yes", "--output-dir", str(runs), timeout=60)
    assert_clean_user_error(result, "is not a regular file")
    assert not runs.exists()


@pytest.mark.parametrize("args", [("plan", "--vram", "inf"), ("plan", "--vram", "nan"), ("lr-find", "--start-lr", "nan"),
                                  ("lr-find", "--end-lr", "inf"), ("tune", "--timeout", "inf")])
def test_a_float_flag_outside_the_options_table_refuses_nan_and_infinity(cli, tiny_models, tmp_path, args):
    command, *flag = args
    result = cli(command, str(FIXTURES / "alpaca.jsonl"), "--model", str(tiny_models["llama"]), *flag, cwd=tmp_path)
    assert_clean_user_error(result, f"Invalid value for '{flag[0]}'", "finite number")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_weight_that_is_not_0_or_1_is_a_bad_row_naming_the_field(cli, tiny_models, tmp_path):
    # messages_weight.jsonl: 3 rows, the second with `weight: 2` on its reply.
    path = FIXTURES / "shapes" / "messages_weight.jsonl"
    model = ("--model", str(tiny_models["qwen2"]))
    where = "messages_weight.jsonl, line 2: 'weight' must be 0 or 1, found another number (messages[2])"
    assert_clean_user_error(cli("plan", str(path), *model, "--json"), "1 of 3 rows (33%) fail validation", where,
                            "--skip-bad-rows")
    assert_clean_user_error(cli("plan", str(path), *model, "--strict", "--json"), where)
    skipped = cli("plan", str(path), *model, "--skip-bad-rows", "--json")
    assert skipped.returncode == 0, output_of(skipped)
    report = json.loads(skipped.stdout)["data_report"]
    assert report["rows"] == 2
    assert report["bad_rows"]["where"] == {"'weight' must be 0 or 1, found another number": ["line 2"]}
