"""The data shapes of issue 34 through the real command line (`python -m
llmcustoms plan` in a subprocess): what is learned from a column pair and from a
.txt file, token by token, read back from the tokenized rows `plan` caches; that
no "\\r" reaches a token; and the refusal of an ambiguous column set."""

from __future__ import annotations

import json

from llmcustoms.data.token_store import open_store
from test_tokenization import spans
from tiny_models import FIXTURES

SHAPES = FIXTURES / "shapes"


def planned(cli, tmp_path, tiny_models, data, *flags):
    """plan --json's data report, and (masked, learned) text of every tokenized row, by row number."""
    from transformers import AutoTokenizer

    cache = tmp_path / "cache"
    result = cli("plan", str(data), "--model", str(tiny_models["qwen2"]), "--cache-dir", str(cache), "--json", *flags)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    [store] = (cache / "tokenized").iterdir()
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen2"])
    rows = open_store(store)
    decoded = {}
    for number, encoded in zip(rows.row_numbers, rows):
        assert "\r" not in tokenizer.decode(encoded.input_ids)
        decoded[int(number)] = (spans(tokenizer, encoded.input_ids, encoded.labels, False),
                                spans(tokenizer, encoded.input_ids, encoded.labels, True))
    return plan["data_report"], decoded


def test_a_column_pair_learns_only_the_reply_through_the_chat_template(cli, tmp_path, tiny_models):
    report, rows = planned(cli, tmp_path, tiny_models, SHAPES / "prompt_response.csv")
    assert report["format"] == "prompt_response" and report["rows"] == 2
    assert rows == {
        1: (["<|im_start|>user\nWhat do bees make?<|im_end|>\n<|im_start|>assistant\n"], ["Honey.<|im_end|>"]),
        2: (["<|im_start|>user\nName the colour of the sky.\nOne word.<|im_end|>\n<|im_start|>assistant\n"],
            ["Blue.<|im_end|>"]),
    }


def test_a_text_file_learns_each_paragraph_whole(cli, tmp_path, tiny_models):
    report, rows = planned(cli, tmp_path, tiny_models, SHAPES / "paragraphs.txt")
    assert report["format"] == "text" and report["rows"] == 3
    assert rows == {1: ([], ["Bees make honey from the nectar of flowers.\nThey store it in wax combs.<|im_end|>"]),
                    2: ([], ["A spider has eight legs.<|im_end|>"]),
                    3: ([], ["The sky is blue on a clear day.<|im_end|>"])}


def test_crlf_in_csv_cells_never_reaches_a_token_and_is_said_once(cli, tmp_path, tiny_models):
    report, rows = planned(cli, tmp_path, tiny_models, SHAPES / "crlf_cells.csv")
    assert report["line_endings_normalised"] == 2
    assert [line for line in report["advice"] if "line breaks" in line] == [
        "2 rows had Windows or old Mac line breaks (\\r\\n or \\r): read as \\n, so no \\r is learned"]
    assert rows[1] == (["<|im_start|>user\nWrite two lines.\nKeep them short.<|im_end|>\n<|im_start|>assistant\n"],
                       ["Roses are red.\nViolets are blue.<|im_end|>"])
    assert rows[2][1] == ["Fine.<|im_end|>"] and "A lone carriage\nreturn." in rows[2][0][0]


def test_a_weight_0_reply_stays_in_the_context_and_is_never_learned(cli, tmp_path, tiny_models):
    report, rows = planned(cli, tmp_path, tiny_models, SHAPES / "messages_weight.jsonl", "--skip-bad-rows")
    learned = {number: " ".join(pieces) for number, (_, pieces) in rows.items()}
    masked = {number: " ".join(pieces) for number, (pieces, _) in rows.items()}
    assert "Milk." in masked[1] and "Milk." not in learned[1] and learned[1] == "Honey.<|im_end|>"
    assert learned[3] == "Eight legs.<|im_end|>" and "And an ant?" not in masked[3] + learned[3]  # after the last learned reply
    assert 2 not in rows and report["bad_rows"]["count"] >= 1  # weight 2: a bad row, skipped as asked


def test_content_parts_keyed_value_are_learned_like_text(cli, tmp_path, tiny_models):
    # The first row (text and reasoning parts); the tiny model's template shows no tool calls
    # (tool_call parts are learned as calls in tests/data/test_formats.py).
    data = tmp_path / "parts.jsonl"
    data.write_text((SHAPES / "messages_value_parts.jsonl").read_text().splitlines()[0] + "\n")
    report, rows = planned(cli, tmp_path, tiny_models, data)
    masked, learned = rows[1]
    assert "What do bees make?\nOne word." in " ".join(masked) and " ".join(learned) == "Honey.<|im_end|>"
    assert "Bees make honey from nectar." not in " ".join(masked + learned)  # reasoning this template cannot show
    assert report["reasoning_parts_dropped"] == 1


def test_an_ambiguous_column_set_is_refused_with_exit_2(cli, tmp_path):
    result = cli("plan", str(SHAPES / "ambiguous_pairs.csv"), "--json", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    message = ("ambiguous_pairs.csv: cannot tell the data format from the fields found (query, prompt, response, "
               "answer): more than one column could be the prompt (query, prompt) and more than one the reply "
               "(response, answer).")
    hint = "; or one prompt column (prompt, query, question, instruction or input) with one reply column " \
           "(completion, response, answer or output). Rename your columns to one of these."
    printed = json.loads(result.stdout)  # one JSON object, and nothing else
    assert list(printed) == ["error"] and (printed["error"]["message"], printed["error"]["exit_code"]) == (message, 2)
    assert printed["error"]["hint"].startswith("Accepted formats: OpenAI messages") and printed["error"]["hint"].endswith(hint)
    assert message in " ".join(result.stderr.split()) and hint in " ".join(result.stderr.split())
