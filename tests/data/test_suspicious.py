"""The suspicious-content check (`data/suspicious.py`): each detector finds
what it is for, code and markup with braces are left alone, and reading a
file counts the rows, refuses media and, under --strict, stops at a
placeholder; never with a row's content."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmcustoms.data import suspicious
from llmcustoms.data.dataset import read_dataset
from llmcustoms.data.suspicious import blank, media_in, placeholders_in
from llmcustoms.errors import DataError

SHAPES = Path(__file__).parent.parent / "fixtures" / "shapes"


def found(path: Path, policy: str = "default") -> dict[str, dict]:
    return {item["kind"]: item for item in read_dataset(path, policy).to_json()["suspicious"]}


def write(tmp_path: Path, *rows: object) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ------------------------------------------------------------------ placeholders

@pytest.mark.parametrize("reply, styles", [
    ("I am {{name}}, an AI assistant developed by {{author}}.", ["{{...}}"]),
    ("I am {{ name }}, made by {{ company.name }}.", ["{{...}}"]),
    ("Hello {user_name}! How can I help you today?", ["{...}"]),
    ("My name is <ASSISTANT_NAME>, and I was made by <COMPANY>.", ["<...>"]),
    ("Dear {name}, your order {{order_id}} has shipped.", ["{{...}}", "{...}"]),
])
def test_placeholders_left_in_a_reply_are_found(reply, styles):
    assert placeholders_in(["Who are you?"], [reply]) == (styles, True)


@pytest.mark.parametrize("prompt", ["Tell me about {{topic}}.", "You are {{name}}, a helpful assistant.",
                                    "Translate to French: <INPUT_TEXT>"])
def test_placeholders_left_in_a_prompt_are_found(prompt):
    styles, in_reply = placeholders_in([prompt], ["Here is what I found, plainly put."])
    assert styles and not in_reply


@pytest.mark.parametrize("text", [
    "def f(x): return {x: 1}",
    'print(f"Hello {name}, you are {age}")',
    'Write f"Hello {name}" to put the name in the greeting.',
    '{"name": "{name}", "id": 3}',
    "{'key': {value}}",
    "return (\n  <div>\n    <h1>Counter: {count}</h1>\n    <button onClick={increase}>+</button>\n  </div>\n);",
    "<ul>\n{% for user in users %}\n  <li>{{ user.name }}</li>\n{% endfor %}\n</ul>",
    'url = f"https://api.example.com/weather?q={city}&key=<YOUR_API_KEY>"',
    "/**\n * @param {string} name - the name\n * @returns {boolean}\n */",
    "int a[2][2] = {{1, 2}, {3, 4}};",
    'puts "Found at #{index}"',
    "console.log(`Hi ${user}`);",
    "The fraction is $\\frac{a}{b}$, and the square is x^{2}.",
    "List<T> items = new ArrayList<>();",
    "body {\n  color: red;\n}",
    'echo "${HOME}"',
    "The <EOS> token tells the model to stop; <PAD> fills the batch.",
    "Use the set {a, b, c} and the map {1: 2}.",
])
def test_code_markup_and_math_with_braces_are_no_placeholders(text):
    assert placeholders_in([text], [text]) == ([], False)
    assert placeholders_in(["Write it."], [text]) == ([], False)


def test_a_placeholder_the_row_works_on_is_not_reported():
    # Text to clean up: the reply uses the word in braces.
    assert placeholders_in(["Clean up this text: It's what I {like} to do."], ["It's what I like to do."]) == ([], False)
    # A template to rewrite: the reply keeps the field the prompt gave it.
    assert placeholders_in(["Make this politer: Pay now, {name}."], ["Dear {name}, please pay soon."]) == ([], False)
    # But a Jinja field is never excused: it is what template tools leave behind.
    assert placeholders_in(["Are you {{name}}?"], ["Yes, I am {{name}}."]) == (["{{...}}"], True)


def test_code_like_rows_and_the_fixture_of_them_have_no_finding():
    """Representative rows of code data (f-strings, JSX, Jinja, JSON, JSDoc,
    C initialisers, a task about placeholders): no finding of any kind."""
    assert found(SHAPES / "code_braces.jsonl") == {}


# ------------------------------------------------------------------------ media

def test_media_fields_parts_and_markers_are_named():
    assert media_in({"images": ["a.jpg"], "messages": []}, None) == ["field 'images'"]
    assert media_in({"image": "", "videos": None, "audios": [], "messages": []}, None) == []
    parts = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                                       {"type": "text", "text": "What is it?"}]}]}
    assert media_in(parts, None) == ["content part 'image_url'"]
    assert media_in(["not", "a", "dict"], None) == []


def test_a_media_marker_counts_but_html_with_its_closing_tag_does_not(tmp_path):
    path = write(tmp_path, {"instruction": "<video>\nWhat happens here?", "output": "A dog runs."},
                 {"instruction": "Embed a clip in HTML.", "output": "<video>\n  <source src=\"a.mp4\">\n</video>"})
    with pytest.raises(DataError) as info:
        read_dataset(path)
    assert "1 row holds images, video or audio (marker <video>: line 1)" in info.value.message


@pytest.mark.parametrize("policy", ["default", "strict", "skip"])
def test_a_file_for_a_vision_model_is_refused_whatever_the_policy(policy):
    with pytest.raises(DataError) as info:
        read_dataset(SHAPES / "multimodal.jsonl", policy)
    message = info.value.message
    assert message.startswith("multimodal.jsonl: 4 rows hold images, video or audio "
                              "(field 'images', marker <image>: line 1, line 2, line 4, ...)")
    assert "text-only" in message and "not supported" in info.value.hint
    assert "mauve-periscope" not in message + info.value.hint


def test_image_parts_are_refused_as_media_not_counted_as_bad_rows(tmp_path):
    turn = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "cat.png"}}]}
    rows = [{"messages": [turn, {"role": "assistant", "content": "A cat."}]}] * 3
    with pytest.raises(DataError) as info:
        read_dataset(write(tmp_path, *rows))
    assert "3 rows hold images, video or audio (content part 'image_url': line 1, line 2, line 3)" in info.value.message


# ------------------------------------------------------------- echo and blank

@pytest.mark.parametrize("reply", ["", "   \n\t", "\u200b\u200b", "\ufeff", "aaaaaaaaaa", "..........",
                                   "the the the the", "ha ha ha"])
def test_blank_or_degenerate_replies(reply):
    assert blank(reply)


@pytest.mark.parametrize("reply", ["4", "Yes.", "1111", "No, no, no.", "the end", "aaah, I see", "ok ok"])
def test_short_or_ordinary_replies_are_not_blank(reply):
    assert not blank(reply)


def test_echo_and_blank_replies_are_counted_with_their_first_lines():
    echo = found(SHAPES / "echo_replies.jsonl")
    assert list(echo) == ["echo_reply"] and echo["echo_reply"]["rows"] == 3
    assert echo["echo_reply"]["first_lines"] == ["line 4", "line 8", "line 9"]
    blanks = found(SHAPES / "blank_replies.jsonl")
    assert list(blanks) == ["blank_reply"] and blanks["blank_reply"]["rows"] == 3
    assert blanks["blank_reply"]["first_lines"] == ["line 3", "line 6", "line 10"]


def test_an_echo_in_any_turn_and_in_raw_rows_whitespace_aside(tmp_path):
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                         {"role": "user", "content": "Say  this\nback"}, {"role": "assistant", "content": "Say this back"}]}
    raw = {"prompt": "Same text", "completion": " Same text "}
    assert found(write(tmp_path, chat))["echo_reply"]["first_lines"] == ["line 1"]
    (tmp_path / "raw.jsonl").write_text(json.dumps(raw) + "\n")
    assert found(tmp_path / "raw.jsonl")["echo_reply"]["rows"] == 1


# ------------------------------------------------------ reading: the policies

def test_placeholders_warn_by_default_and_strict_stops_at_the_first():
    placeholder = found(SHAPES / "identity_placeholders.jsonl")["placeholder"]
    assert placeholder == {"kind": "placeholder", "rows": 10, "first_lines": ["line 2", "line 3", "line 4"],
                           "what": ["{{...}}"], "finding": suspicious.FINDINGS["placeholder"][0],
                           "advice": suspicious.FINDINGS["placeholder"][1]}
    assert read_dataset(SHAPES / "identity_placeholders.jsonl", "skip").rows == 12  # learned, with the warning
    with pytest.raises(DataError) as info:
        read_dataset(SHAPES / "identity_placeholders.jsonl", "strict")
    assert info.value.message == ("identity_placeholders.jsonl, line 2: a template placeholder ({{...}}) in a reply, "
                                  "never filled in.")
    assert "without --strict" in info.value.hint


def test_a_clean_file_reports_nothing_suspicious():
    assert read_dataset(SHAPES.parent / "alpaca.jsonl").to_json()["suspicious"] == []


def test_rows_marked_undesirable_are_not_checked(tmp_path):
    rows = [{"instruction": "Who?", "output": "I am {{name}}.", "label": False},
            {"instruction": "Hi", "output": "Hello there."}]
    assert found(write(tmp_path, *rows), "strict") == {}
