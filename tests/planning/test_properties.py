"""Property tests: whatever a data file or a setting holds, llmcustoms answers
with rows or with one `LlmcustomsError` (exit 2), never another exception.

Hypothesis writes files of every format the readers take (rows of every
shape, column pairs such as query/response among them, with nesting, lone
surrogates, NUL bytes, "\\r\\n" and lone "\\r", huge numbers and wrong types
mixed in, template placeholders, media fields and markers, replies that echo
their prompt, .txt paragraphs, and plain arbitrary bytes), reads each with every
bad-row policy (what passes holds no "\\r": line breaks are read as "\\n"),
tokenizes the rows that pass with a tiny tokenizer, and loads arbitrary
`LLMCUSTOMS_*` values from the environment and from a .env file. The profile
is derandomized (the same examples in CI as here) and bounded in time.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import os
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from llmcustoms.planning import options
from llmcustoms.data.chat_templates import ensure_chat_template
from llmcustoms.data.dataset import POLICIES, read_dataset, usable_examples
from llmcustoms.errors import LlmcustomsError
from llmcustoms.planning.settings import NOT_SETTINGS, load_settings
from llmcustoms.data.tokenization import Tokenizer
from llmcustoms.data.token_store import MAX_ROW_CHARS
from tiny_models import CHATML_TEMPLATE, build_tokenizer

settings.register_profile("llmcustoms-ci", max_examples=150, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CI = settings.get_profile("llmcustoms-ci")

# --- values a row may hold -------------------------------------------------

FIELDS = ["instruction", "input", "output", "response", "context", "question", "answer", "prompt", "completion",
          "query", "text", "system", "messages", "conversations", "tools", "chosen", "rejected", "label"]
MEDIA_FIELDS = ["images", "image", "videos", "audios"]
PROMPT_COLUMNS = ["prompt", "query", "question", "instruction", "input", "context"]
REPLY_COLUMNS = ["completion", "response", "answer", "output"]
TURN_KEYS = ["role", "from", "content", "value", "tool_calls", "tool_call_id", "name", "function", "arguments",
             "type", "id", "text", "weight"]
ROLES = ["system", "user", "assistant", "tool", "developer", "human", "gpt", "function_call", "observation"]
SHAPES = ["alpaca", "messages", "sharegpt", "prompt", "column_pair", "text", "pair", "chat_pair"]

# Any character: lone surrogates (category Cs) and NUL included.
any_char = st.characters(exclude_categories=())
any_text = st.one_of(st.text(any_char, max_size=12), st.sampled_from(["", " ", "\x00", "\ud800", "\udfff", "a\ud83d",
                                                                       "hello", "Answer.", "user", "assistant"]))
plain = st.sampled_from(["What is 2 plus 2?", "Four.", "Say hi.", "Hi there!", "Name a colour.", "Blue, say.",
                         "Two\r\nlines.", "A lone\rCR.", "\r\n", "Ends\r"])
# Mostly text a row would hold, so that files reach detection, validation and
# the tokenizer, and now and then anything at all.
# What the suspicious-content check looks for (`data/suspicious.py`), and code it must leave alone.
suspect = st.sampled_from(["I am {{name}}, made by {{author}}.", "Hello {user}!", "Call me <NAME>.", "<image>What is it?",
                           "<video>\n<source src=a.mp4>\n</video>", "aaaaaa", "ha ha ha", "\u200b", "<image 2>",
                           "def f(x): return {x: 1}", "{{ {x} }}", "{{", "<", "{"])
field_text = st.one_of(plain, plain, plain, suspect, any_text)
leaves = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 20, 10 ** 20), st.floats(), any_text)
json_values = st.recursive(leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.one_of(st.sampled_from(FIELDS + TURN_KEYS), any_text), inner,
                                                 max_size=4)), max_leaves=8)
# A number longer than Python reads (4300 digits), and nesting deeper than
# its stack: written into the JSON text as they are.
big_number = st.integers(4300, 6000).map(lambda n: "9" * n)
deep_nesting = st.integers(60, 3000).map(lambda n: "[" * n + "]" * n)
rarely = st.integers(0, 7).map(lambda n: n == 0)


# OpenAI's per-turn weights: 0 and 1 (1.0 too), and what is neither.
weights = st.sampled_from([0, 1, 0, 1, 1.0, 0.0, 2, -1, 0.5, "0", "1", True, False, None, [1], {}])
calls = st.fixed_dictionaries({"name": field_text, "arguments": st.one_of(json_values, json_values.map(json.dumps))})


def part(draw, kind: str | None) -> dict:
    if kind == "tool_call":
        payload = draw(st.one_of(calls, calls.map(json.dumps), st.lists(calls, max_size=2), json_values))
    else:
        payload = draw(json_values) if draw(rarely) else draw(field_text)
    keyed = {draw(st.sampled_from(["text", "value"])): payload}
    return keyed if kind is None else {"type": kind, **keyed}


@st.composite
def parts(draw, assistant: bool) -> list:
    """A turn's content as parts keyed `text` or `value`: mostly text, and in a
    reply reasoning and tool_call parts; now and then a type or a payload that is wrong."""
    kinds = ["reasoning", "text", "tool_call"] if assistant else ["text"]
    out = [part(draw, kind) for kind in kinds if kind == "text" or draw(st.booleans())]
    if draw(rarely):
        out.insert(draw(st.integers(0, len(out))),
                   part(draw, draw(st.one_of(st.sampled_from(["image_url", "reasoning", "tool_call", None]), any_text))))
    return out


@st.composite
def turns(draw, sharegpt: bool = False) -> list:
    """Turns that alternate user and assistant, mostly, with tool calls,
    content parts and weights now and then."""
    role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
    out = []
    for k in range(draw(st.integers(0, 4)) if draw(rarely) else draw(st.sampled_from([2, 2, 4]))):
        usual = (["human", "gpt"] if sharegpt else ["user", "assistant"])[k % 2]
        role = draw(st.one_of(st.sampled_from(ROLES), any_text)) if draw(rarely) else usual
        content = draw(json_values) if draw(rarely) else draw(st.one_of(field_text, parts(role in ("assistant", "gpt"))))
        turn = {role_key: role, content_key: content}
        if role in ("assistant", "gpt") and draw(rarely):
            arguments = draw(st.one_of(json_values, json_values.map(json.dumps), deep_nesting.map(lambda d: '{"a": ' + d + "}"),
                                       st.just('{"a": "\\ud800"}')))
            turn["tool_calls"] = [{"id": draw(field_text), "function": {"name": draw(field_text), "arguments": arguments}}]
        if draw(st.booleans()) if role in ("assistant", "gpt") else draw(rarely):
            turn["weight"] = draw(weights)
        out.append(turn)
    return out


@st.composite
def weighted_turns(draw) -> list:
    """OpenAI turns that mostly pass: replies of text or parts (reasoning,
    text, tool calls), weighted 0 or 1 or not at all, and now and then otherwise."""
    out = []
    for _ in range(draw(st.sampled_from([2, 3, 1]))):
        reply = {"role": "assistant", "content": draw(st.one_of(plain, parts(True)))}
        weight = draw(st.one_of(st.sampled_from([1, 0, None]), weights)) if draw(rarely) else draw(st.sampled_from([1, 0, 0]))
        if weight is not None:
            reply["weight"] = weight
        out += [{"role": "user", "content": draw(plain)}, reply]
    return out


@st.composite
def rows(draw, shape: str) -> object:
    """A row of `shape`, mostly right, with anything in its fields now and then."""
    if draw(rarely):
        return draw(json_values)
    if shape == "alpaca":
        row = {"instruction": draw(field_text), "output": draw(field_text)}
        if draw(st.booleans()):
            row["system"] = draw(st.one_of(st.none(), field_text))
    elif shape in ("messages", "sharegpt"):
        drawn = draw(weighted_turns() if shape == "messages" and draw(st.booleans()) else turns(shape == "sharegpt"))
        row = {"messages" if shape == "messages" else "conversations": drawn}
        if draw(rarely):
            row["tools"] = draw(st.one_of(json_values, json_values.map(json.dumps), deep_nesting,
                                          st.just([{"name": "f", "parameters": {"type": "object"}}])))
    elif shape == "prompt":
        row = {"prompt": draw(field_text), "completion": draw(field_text)}
    elif shape == "column_pair":  # now and then two columns that could be the prompt, or the reply
        names = draw(st.lists(st.sampled_from(PROMPT_COLUMNS), min_size=1, max_size=1 + draw(rarely), unique=True))
        names += draw(st.lists(st.sampled_from(REPLY_COLUMNS), min_size=1, max_size=1 + draw(rarely), unique=True))
        row = {name: draw(field_text) for name in names}
    elif shape == "text":
        row = {"text": draw(field_text)}
    elif shape == "pair":
        row = {"prompt": draw(field_text), "chosen": draw(field_text), "rejected": draw(field_text)}
    else:
        row = {"prompt": draw(turns())[:1] or [{"role": "user", "content": "Hi"}],
               "chosen": [{"role": "assistant", "content": draw(field_text)}],
               "rejected": [{"role": "assistant", "content": draw(field_text)}]}
    if draw(rarely):
        row[draw(st.sampled_from(FIELDS))] = draw(json_values)
    if draw(rarely):  # the reply is the prompt
        asked, answer = next(((a, b) for a, b in (("instruction", "output"), ("prompt", "completion"),
                                                  ("prompt", "chosen")) if a in row and b in row), (None, None))
        if asked:
            row[answer] = row[asked]
    if draw(rarely):  # a row for a vision or audio model
        row[draw(st.sampled_from(MEDIA_FIELDS))] = draw(st.one_of(st.just(["a.jpg"]), st.just("b.png"), st.just([]),
                                                                  st.none(), json_values))
    return row


def row_text(draw, row: object) -> str:
    """One row as JSON text, or now and then something that breaks the JSON reader."""
    broken = draw(st.sampled_from(["deep", "number", "garbage", "escape"])) if draw(rarely) else None
    if broken == "deep":
        return '{"text": ' + draw(deep_nesting) + "}"
    if broken == "number":
        return '{"text": "a", "output": ' + draw(big_number) + "}"
    if broken == "garbage":
        return draw(st.text(any_char, max_size=20)).replace("\n", " ")
    if broken == "escape":  # a lone surrogate as JSON writes it, in a row that is otherwise good
        return '{"instruction": "q\\ud800", "output": "a\\udc00"}'
    # Now and then a surrogate written raw (ensure_ascii=False): bytes that are not UTF-8.
    return json.dumps(row, ensure_ascii=not draw(rarely), allow_nan=True)


def encoded(text: str) -> bytes:
    # surrogatepass: a surrogate written as the bytes of one, which the UTF-8 decoder refuses.
    return text.encode("utf-8", "surrogatepass")


def drawn_rows(draw) -> list:
    return draw(st.lists(rows(draw(st.sampled_from(SHAPES))), min_size=1, max_size=8))


@st.composite
def jsonl_files(draw) -> bytes:
    lines = [row_text(draw, row) for row in drawn_rows(draw)]
    return encoded("\n".join(lines) + draw(st.sampled_from(["", "\n", "\n\n"])))


@st.composite
def json_files(draw) -> bytes:
    texts = [row_text(draw, row) for row in drawn_rows(draw)]
    layout = draw(st.sampled_from(["array", "array", "object", "lines"]))
    if layout == "array":
        return encoded("[" + ",\n".join(texts) + "]")
    return encoded(texts[0] if layout == "object" else "\n".join(texts))


@st.composite
def csv_files(draw) -> bytes:
    drawn = [row for row in drawn_rows(draw) if isinstance(row, dict)] or [{"text": ""}]
    header = list(dict.fromkeys(key for row in drawn for key in row))
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(header)
    for row in drawn:
        cells = [row.get(key, "") for key in header]
        writer.writerow([c if isinstance(c, str) else json.dumps(c, ensure_ascii=not draw(rarely)) for c in cells])
    return encoded(out.getvalue())


@st.composite
def parquet_files(draw) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Arrow refuses surrogates when it writes, so its strings are UTF-8; the
    # JSON text in them may still spell one as an escape.
    text = st.one_of(plain, plain, st.text(st.characters(exclude_categories=("Cs",)), max_size=12),
                     st.just('[{"role": "user", "content": "\\ud800"}]'), json_values.map(json.dumps))
    n = draw(st.integers(1, 6))
    if draw(st.booleans()):
        table = {"messages": [[{"role": role, "content": draw(text)} for role in ("user", "assistant")]
                              for _ in range(n)]}
    else:
        columns = draw(st.sampled_from([("instruction", "output"), ("prompt", "completion"), ("text",),
                                        ("prompt", "chosen", "rejected"), ("messages", "tools")]))
        table = {name: [draw(text) for _ in range(n)] for name in columns}
    out = io.BytesIO()
    pq.write_table(pa.table(table), out)
    data = out.getvalue()
    cut = draw(st.sampled_from([None, None, None, 0.5, 0.9]))  # a file written halfway
    return data if cut is None else data[: int(len(data) * cut)]


@st.composite
def txt_files(draw) -> bytes:
    """Paragraphs of lines, broken by "\\n", "\\r\\n" or a lone "\\r", and
    separated by blank lines (of spaces now and then); a surrogate makes bytes that are not UTF-8."""
    newline = draw(st.sampled_from(["\n", "\n", "\r\n", "\r"]))
    paragraphs = draw(st.lists(st.lists(field_text.map(lambda t: t.replace("\n", " ")), min_size=1, max_size=3),
                               min_size=1, max_size=6))
    blank = newline + draw(st.sampled_from(["", "", "  ", "\t"])) + newline
    return draw(st.sampled_from([b"", codecs.BOM_UTF8])) + encoded(blank.join(newline.join(p) for p in paragraphs))


FILES = {".jsonl": jsonl_files(), ".json": json_files(), ".csv": csv_files(), ".parquet": parquet_files(),
         ".txt": txt_files()}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("properties")


def read_with_every_policy(path: Path) -> str:
    """Which policies gave rows: what the examples reached, for the statistics.
    The rows that pass hold no "\\r": every line break is read as "\\n"."""
    read = []
    for policy in POLICIES:
        try:
            read_dataset(path, policy)
            read.append(policy)
        except LlmcustomsError:
            pass
    if "skip" in read:
        assert not [e.row for e in usable_examples(path) if "\r" in e.identity_text()]
    return f"rows with: {', '.join(read) or 'none'}"


@pytest.mark.parametrize("suffix", list(FILES))
@CI
@given(data=st.data())
def test_any_data_file_gives_rows_or_a_user_error(scratch, suffix, data):
    """(1) Every reader, every policy: rows, or an LlmcustomsError; no other exception."""
    path = scratch / f"drawn{suffix}"
    drawn = st.one_of(FILES[suffix], FILES[suffix], FILES[suffix], st.binary(max_size=200))  # a quarter: any bytes
    path.write_bytes(data.draw(drawn, label="file"))
    event(read_with_every_policy(path))


# --- the rows that pass go through tokenization ------------------------------

# A ChatML template that also shows tools and calls, the way Qwen2.5's does, so
# rows with tools reach the template instead of stopping at "cannot show tools".
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
    "{% for call in message.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizers() -> list[Tokenizer]:
    plain, with_tools = build_tokenizer("zephyr"), build_tokenizer("chatml")
    assert with_tools.chat_template == CHATML_TEMPLATE
    with_tools.chat_template = TOOLS_TEMPLATE
    no_template = build_tokenizer("none")
    ensure_chat_template(no_template)  # what loading a model without a template gives it
    # Reasoning shown on the last turn only, as Qwen3's template does: reasoning
    # parts reach it, and earlier turns are rewritten as the conversation grows.
    reasoning = build_tokenizer("chatml")
    reasoning.chat_template = TOOLS_TEMPLATE.replace(
        "{{ message['content'] or '' }}",
        "{% if loop.last and message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}"
        "{{ message['content'] or '' }}")
    return [Tokenizer(plain), Tokenizer(with_tools), Tokenizer(no_template), Tokenizer(reasoning)]


@settings(CI, max_examples=250)
@given(file=jsonl_files())
def test_rows_that_pass_tokenize_or_give_a_user_error(scratch, tokenizers, file):
    """(2) What `read_dataset` lets through, the tokenizer takes (or refuses
    with an LlmcustomsError, such as a template that cannot show tools)."""
    path = scratch / "tokenized.jsonl"
    path.write_bytes(file)
    try:
        read_dataset(path, "skip")
    except LlmcustomsError:
        return
    halves = [half.clipped(MAX_ROW_CHARS) for example in usable_examples(path) for half in example.halves()]
    event(f"{min(len(halves), 3)}+ rows to tokenize")  # shown by --hypothesis-show-statistics
    turns = [m for half in halves for m in half.messages]
    event(f"weight 0: {any(not m.learned for m in turns)}, reasoning: {any(m.reasoning for m in turns)}")
    for tokenizer in tokenizers:
        try:
            encoded_rows = tokenizer.encode_many(halves)
        except LlmcustomsError:
            continue
        assert len(encoded_rows) == len(halves)


@settings(CI, max_examples=150)
@given(turns=weighted_turns(), tools=st.one_of(st.none(), st.just([{"name": "f", "parameters": {"type": "object"}}]),
                                               st.just('[{"name": "f"}]')))
def test_weighted_rows_with_parts_end_with_a_learned_reply_and_tokenize(scratch, tokenizers, turns, tools):
    """(2) OpenAI rows with weights and text, reasoning and tool_call parts:
    a bad row, or a row that ends with a reply to learn and tokenizes (or an
    LlmcustomsError)."""
    from llmcustoms.data.data_files import read_rows
    from llmcustoms.data.row_formats import RowProblem, to_example

    path = scratch / "weighted.jsonl"
    path.write_bytes(encoded(json.dumps({"messages": turns, **({"tools": tools} if tools else {})})))
    (raw,) = read_rows(path)  # as reading sees it: a lone surrogate, say, is a problem here already
    try:
        if raw.problem is not None:
            raise RowProblem(raw.problem)
        example = to_example(raw, "messages")
    except RowProblem as problem:
        event(f"bad row: {str(problem).split(' (')[0][:40]}")
        return
    assert example.messages[-1].role == "assistant" and example.messages[-1].learned
    event(f"weight 0: {any(not m.learned for m in example.messages)}, "
          f"reasoning: {any(m.reasoning for m in example.messages)}")
    for tokenizer in tokenizers:
        try:
            tokens = tokenizer.encode(example)
        except LlmcustomsError:
            continue
        assert tokens.trainable_tokens > 0


# --- settings ------------------------------------------------------------------

VARIABLES = sorted(options.BY_VARIABLE)
# What the environment can hold: no NUL, and of the surrogates only those that
# stand for bytes that are not UTF-8 (Python's surrogateescape).
env_char = st.one_of(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"),
                     st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF))
env_text = st.one_of(st.text(env_char, max_size=12),
                     st.sampled_from(["nan", "inf", "-inf", "1e999", "0", "-1", "1", "0.99", "1.0", "true", "yes",
                                      "2e-5", "4294967296", " 7 ", "1_000", "0x10", "lora", "bf16", "\udcff"]))
setting_names = st.one_of(st.sampled_from(VARIABLES), st.text(st.sampled_from("ABCZ_\udc80é"), min_size=1,
                                                              max_size=6).map(lambda s: options.PREFIX + s))


@contextmanager
def environment(values: dict[str, str]):
    """These LLMCUSTOMS_* variables and no other, restored afterwards."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if n.startswith(options.PREFIX) and n not in NOT_SETTINGS]:
        del os.environ[name]
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@CI
@given(values=st.dictionaries(setting_names, env_text, max_size=4))
def test_any_environment_loads_or_gives_a_config_error(scratch, values):
    """(3) Arbitrary values for any LLMCUSTOMS_* variable: the settings load,
    every value within its option's range, or one LlmcustomsError."""
    empty = scratch / "empty.env"
    empty.write_text("")
    with environment(values):
        try:
            loaded = load_settings(empty)
        except LlmcustomsError:
            return
    for name, (value, _) in loaded.values.items():
        assert options.BY_NAME[name].problem(value) is None


@CI
@given(lines=st.lists(st.tuples(setting_names | st.sampled_from(["HF_HOME", "OTHER", "export X", "NUL\x00"]),
                                st.text(st.characters(exclude_categories=("Cs",)), max_size=12) | env_text
                                | st.sampled_from(["a\x00b", "\x00", "'", '"', "\\", "${HOME}"]),
                                st.sampled_from(["{}={}", "{}='{}'", '{}="{}"', "{} = {}", "# {}={}", "{}"])),
                      max_size=5),
       junk=st.binary(max_size=30))
def test_any_env_file_loads_or_gives_a_config_error(scratch, lines, junk):
    """(3) An arbitrary .env file, text or bytes: the same."""
    path = scratch / "drawn.env"
    text = "\n".join(layout.format(name, value) for name, value, layout in lines)
    path.write_bytes(text.encode("utf-8", "surrogateescape") + junk)
    with environment({}):
        try:
            loaded = load_settings(path)
        except LlmcustomsError:
            return
    for name, (value, _) in loaded.values.items():
        assert options.BY_NAME[name].problem(value) is None
