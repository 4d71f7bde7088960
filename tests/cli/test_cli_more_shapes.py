"""The shapes of issue 45 through the real command line (`plan --json` in a
subprocess): public files' shapes that were refused or trained wrong, each a
fixture under tests/fixtures/shapes/, read back token by token from the rows
`plan` tokenized and cached."""

from __future__ import annotations

import json
import shutil

from llmcustoms.data.token_store import open_store
from test_cli_data_shapes import SHAPES, planned
from test_tokenization import spans

USER, ASSISTANT, END = "<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>"


def turn(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text}{END}\n"


def test_a_txt_file_without_blank_lines_is_a_row_per_line(cli, tmp_path, tiny_models):
    report, rows = planned(cli, tmp_path, tiny_models, SHAPES / "lines.txt")
    assert (report["format"], report["rows"]) == ("text", 3)
    assert [learned for _, learned in rows.values()] == [
        [f"Bees make honey.{END}"], [f"A spider has eight legs.{END}"], [f"The sky is blue.{END}"]]


def test_one_long_text_is_trained_in_pieces_never_clipped_to_one_row(cli, tmp_path, tiny_models):
    book = tmp_path / "book.txt"
    book.write_text(" ".join(f"word{i % 1000}" for i in range(125_000)) + "\n")  # 1 MB, one paragraph
    report, rows = planned(cli, tmp_path, tiny_models, book)
    assert report["rows"] > 100
    text = " ".join(learned[0].removesuffix(END) for _, learned in rows.values())
    assert text.split() == [f"word{i % 1000}" for i in range(125_000)]  # every word, once, in order


def test_conversational_prompt_completion_learns_the_completion(cli, tmp_path, tiny_models):
    report, rows = planned(cli, tmp_path, tiny_models, SHAPES / "conv_prompt_completion.jsonl")
    assert (report["format"], report["rows"]) == ("prompt_completion", 2)
    assert rows == {1: ([USER + f"What do bees make?{END}\n" + ASSISTANT], [f"Honey.{END}"]),
                    2: ([turn("system", "Be brief.") + turn("user", "Sky colour?") + ASSISTANT], [f"Blue.{END}"])}


def test_unpaired_preference_with_turns_learns_the_desirable_completions(cli, tmp_path, tiny_models):
    report, rows = planned(cli, tmp_path, tiny_models, SHAPES / "conv_unpaired.jsonl")
    assert (report["rows"], report["unlearned_rows"]) == (1, 1)
    assert rows == {1: ([USER + f"What do bees make?{END}\n" + ASSISTANT], [f"Honey.{END}"])}


def test_a_preference_pair_without_a_prompt_takes_the_shared_text_as_it(cli, tmp_path, tiny_models):
    from transformers import AutoTokenizer

    cache = tmp_path / "cache"
    result = cli("plan", str(SHAPES / "preference_implicit_text.jsonl"), "--model", str(tiny_models["qwen2"]),
                 "--cache-dir", str(cache), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)["data_report"]
    assert (report["format"], report["rows"]) == ("preference", 2)
    [store] = (cache / "tokenized").iterdir()
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen2"])
    halves = [spans(tokenizer, row.input_ids, row.labels, True) for row in open_store(store)]
    assert halves == [[f" Honey.{END}"], [f" Milk.{END}"], [f" Blue.{END}"], [f" Green, obviously.{END}"]]


def test_a_null_weight_is_no_weight(cli, tmp_path, tiny_models):
    report, rows = planned(cli, tmp_path, tiny_models, SHAPES / "messages_weight_null.jsonl")
    assert report["rows"] == 2 and report["bad_rows"]["count"] == 0
    assert [learned for _, learned in rows.values()] == [[f"Hello.{END}"], [f"Bye.{END}"]]


def test_alpaca_history_is_the_earlier_turns_and_every_reply_is_learned(cli, tmp_path, tiny_models):
    report, rows = planned(cli, tmp_path, tiny_models, SHAPES / "alpaca_history.json")
    assert (report["format"], report["rows"]) == ("alpaca", 2)
    assert rows[1] == ([USER + f"How far is the Moon?{END}\n" + ASSISTANT, "\n" + turn("user", "And the Sun?") + ASSISTANT],
                       [f"About 384,400 km.{END}", f"About 150 million km.{END}"])


def test_text_rows_holding_template_tokens_are_warned_about_naming_messages(cli, tmp_path, tiny_models):
    report, _ = planned(cli, tmp_path, tiny_models, SHAPES / "text_with_template_tokens.jsonl")
    [found] = [f for f in report["suspicious"] if f["kind"] == "template_markup"]
    assert found["rows"] == 2 and found["what"] == ["<|im_start|>", "<|im_end|>"]
    assert any("messages row" in line for line in report["advice"])


def test_a_reply_that_writes_a_special_token_learns_it_as_text(cli, tmp_path, tiny_models):
    from transformers import AutoTokenizer

    _, rows = planned(cli, tmp_path, tiny_models, SHAPES / "messages_literal_special_tokens.jsonl")
    assert rows[1][1] == [f"With {END} after the text.{END}"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen2"])
    [store] = (tmp_path / "cache" / "tokenized").iterdir()
    first = next(iter(open_store(store)))
    end = tokenizer.convert_tokens_to_ids(END)
    assert first.input_ids.count(end) == 2  # the user turn's end and the reply's: the written one is text


def test_a_dataset_too_small_to_hold_a_row_out_says_so(cli, tmp_path, tiny_models):
    one = tmp_path / "one.jsonl"
    one.write_text('{"instruction": "What do bees make?", "output": "Honey."}\n')
    result = cli("plan", str(one), "--model", str(tiny_models["qwen2"]), "--cache-dir", str(tmp_path / "c"))
    assert result.returncode == 0, result.stderr
    said = " ".join(result.stdout.split())
    assert "1 row, " not in said and "detected format Alpaca (instruction, input, output), 1 row" in said
    assert "Evaluation: none (1 row cannot be split into training and held-out rows" in said
    assert "--eval-data FILE" in said


def test_line_ends_and_paths_that_once_failed_are_read(cli, tmp_path, tiny_models):
    report, rows = planned(cli, tmp_path / "a", tiny_models, SHAPES / "lone_cr.csv")  # lines end in a lone \r
    assert report["rows"] == 2 and rows[2][1] == [f"Blue.{END}"]
    report, _ = planned(cli, tmp_path / "b", tiny_models, SHAPES / "bom_crlf.json")  # a BOM, \r\n line ends
    assert (report["format"], report["rows"]) == ("alpaca", 3)
    odd = tmp_path / "dir [x]" / "data [1]\nnew line.csv"
    odd.parent.mkdir()
    shutil.copy(SHAPES / "lone_cr.csv", odd)
    report, _ = planned(cli, tmp_path / "c", tiny_models, odd)
    assert report["rows"] == 2


def test_turns_datasets_wrote_as_json_text_are_read_as_turns(cli, tmp_path, tiny_models):
    # datasets' on_mixed_types="use_json": content text in one row, a list of parts in the other.
    report, rows = planned(cli, tmp_path, tiny_models, SHAPES / "messages_json_turns.parquet")
    assert report["rows"] == 2
    assert rows == {1: ([USER + f"Hi{END}\n" + ASSISTANT], [f"Hello{END}"]),
                    2: ([USER + f"Bye{END}\n" + ASSISTANT], [f"Bye.{END}"])}


def test_tool_calls_in_a_preference_pair_are_read(cli, tmp_path, family_models):
    result = cli("plan", str(SHAPES / "preference_tool_calls.jsonl"), "--model", str(family_models["qwen3"]),
                 "--cache-dir", str(tmp_path / "cache"), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)["data_report"]
    assert (report["format"], report["rows"], report["bad_rows"]["count"]) == ("preference_chat", 2, 0)
    from transformers import AutoTokenizer

    [store] = (tmp_path / "cache" / "tokenized").iterdir()
    tokenizer = AutoTokenizer.from_pretrained(family_models["qwen3"])
    chosen, rejected = [spans(tokenizer, row.input_ids, row.labels, True) for row in list(open_store(store))[:2]]
    assert chosen == ['<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                      f'</tool_call>{END}']
    assert rejected == [f"<think>\n\n</think>\n\nI cannot know.{END}"]
