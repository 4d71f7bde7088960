"""Every row shape: detected and named, turned into the right `Example`, and
masked exactly, token by token.

The masks are checked by decoding the learned and the masked tokens
separately and comparing them with text written out by hand for each
template, so the test does not trust the code under test to say where the
boundaries are. Tool calling is checked with a tiny tokenizer carrying a copy
of Qwen2.5-Instruct's chat template (tests/fixtures/shapes/).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmcustoms.data.chat_templates import ensure_chat_template, supports_tools
from llmcustoms.data.dataset import read_dataset
from llmcustoms.data.data_files import RawRow, read_rows
from llmcustoms.errors import DataError, ModelError
from llmcustoms.data.row_formats import (COLUMN_PAIRS, FORMAT_DESCRIPTIONS, Example, Message, RowProblem, base_format,
                                   detect_format, to_example)
from llmcustoms.data.tokenization import IGNORE_INDEX, Tokenizer
from test_tokenization import spans as decoded_spans
from tiny_models import FIXTURES, build_tokenizer

SHAPES = FIXTURES / "shapes"
SECRET = "SECRET-ROW-CONTENT-12345"
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


@pytest.fixture(scope="module")
def chatml():
    return build_tokenizer("chatml")


@pytest.fixture(scope="module")
def qwen():
    tokenizer = build_tokenizer("chatml")
    tokenizer.chat_template = (SHAPES / "qwen2_5_chat_template.jinja").read_text()
    return tokenizer


@pytest.fixture(scope="module")
def no_template():
    tokenizer = build_tokenizer("none")
    ensure_chat_template(tokenizer)
    return tokenizer


def examples_of(path: Path) -> tuple[str, list[Example]]:
    rows = list(read_rows(path))
    fmt = detect_format(rows, path)
    return fmt, [to_example(raw, fmt) for raw in rows]


def row(value: dict, fmt: str) -> Example:
    return to_example(RawRow(1, 1, value=value), fmt)


def problem(value: dict, fmt: str) -> str:
    with pytest.raises(RowProblem) as info:
        row(value, fmt)
    assert SECRET not in str(info.value)
    return str(info.value)


def spans(tokenizer, encoded, trained: bool) -> list[str]:
    """Decode maximal runs of tokens that are (or are not) learned."""
    assert all(label in (IGNORE_INDEX, token) for token, label in zip(encoded.input_ids, encoded.labels))
    return decoded_spans(tokenizer, encoded.input_ids, encoded.labels, trained)


def masks(tokenizer, example: Example, **options) -> tuple[list[str], list[str]]:
    """(masked spans, learned spans) of one encoded example; it must end in EOS."""
    encoded = Tokenizer(tokenizer, **options).encode(example)
    assert encoded.input_ids[-1] == encoded.labels[-1] == tokenizer.eos_token_id
    return spans(tokenizer, encoded, trained=False), spans(tokenizer, encoded, trained=True)


def chatml_turn(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


# ------------------------------------------------------------------ detection

@pytest.mark.parametrize("name, fmt, description", [
    ("messages_parts.jsonl", "messages", "OpenAI messages (messages: [{role, content}])"),
    ("messages_tools.jsonl", "messages", "OpenAI messages (messages: [{role, content}])"),
    ("messages_value_parts.jsonl", "messages", "OpenAI messages (messages: [{role, content}])"),
    ("sharegpt_system.jsonl", "sharegpt", "ShareGPT (conversations: [{from, value}])"),
    ("sharegpt_tools.json", "sharegpt", "ShareGPT (conversations: [{from, value}])"),
    ("alpaca_system.jsonl", "alpaca", "Alpaca (instruction, input, output)"),
    ("alpaca_response.csv", "alpaca_response", "Alpaca (instruction, response)"),
    ("question_answer.jsonl", "question_answer", "Alpaca (question, answer)"),
    ("input_output.csv", "input_output", "prompt/completion (input, output)"),
    ("kto.jsonl", "prompt_completion", "prompt/completion (prompt, completion)"),
    ("kto.csv", "messages", "OpenAI messages (messages: [{role, content}])"),
    ("prompt_response.csv", "prompt_response", "prompt/completion (prompt, response)"),
    ("query_response.jsonl", "query_response", "prompt/completion (query, response)"),
    ("crlf_cells.csv", "prompt_completion", "prompt/completion (prompt, completion)"),
    ("paragraphs.txt", "text", "plain text (text)"),
])
def test_each_shape_is_detected_and_named(name, fmt, description):
    detected, examples = examples_of(SHAPES / name)
    assert detected == fmt
    assert FORMAT_DESCRIPTIONS[detected] == description
    assert len(examples) >= 1


def test_variants_read_like_their_base_format():
    assert [base_format(f) for f in ("alpaca_response", "question_answer", "input_output", "messages", "text")] == \
        ["alpaca", "alpaca", "prompt_completion", "messages", "text"]
    _, examples = examples_of(SHAPES / "input_output.csv")
    assert examples[0] == Example(1, prompt="Question: What do bees make?\nAnswer:", completion=" Honey.")
    _, examples = examples_of(SHAPES / "alpaca_response.csv")  # Dolly's context follows the instruction
    assert examples[1].messages == (Message("user", "Name the colour.\n\nThe sky on a clear day."), Message("assistant", "Blue."))


def test_detection_order_puts_chat_lists_first_and_alpaca_before_input_output(tmp_path):
    path = tmp_path / "mixed.jsonl"
    cases = [({"messages": [], "instruction": "i", "output": "o"}, "messages"),
             ({"conversations": [], "text": "t"}, "sharegpt"),
             ({"instruction": "i", "input": "x", "output": "o"}, "alpaca"),
             ({"input": "x", "output": "o"}, "input_output"),
             ({"question": "q", "answer": "a", "text": "t"}, "question_answer")]
    for value, fmt in cases:
        assert detect_format([RawRow(1, 1, value=value)], path) == fmt, value


# ------------------------------------------------------------- column pairs

@pytest.mark.parametrize("prompt_field, reply_field", [
    ("prompt", "response"), ("query", "response"), ("input", "response"), ("question", "response"),
    ("instruction", "answer"), ("query", "answer"), ("prompt", "answer"), ("question", "completion"),
    ("query", "completion"), ("input", "answer"), ("prompt", "output"), ("query", "output"),
])
def test_a_column_pair_is_read_as_prompt_completion_and_named(tmp_path, prompt_field, reply_field):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({prompt_field: "What do bees make?", reply_field: "Honey.", "label": True}) + "\n")
    fmt, [example] = examples_of(path)
    assert fmt == f"{prompt_field}_{reply_field}" and base_format(fmt) == "prompt_completion"
    assert FORMAT_DESCRIPTIONS[fmt] == f"prompt/completion ({prompt_field}, {reply_field})"
    assert example == Example(1, prompt="What do bees make?", completion="Honey.")


def test_every_pair_of_a_prompt_column_and_a_reply_column_is_read():
    prompts, replies = ("prompt", "query", "question", "instruction", "input"), ("completion", "response", "answer", "output")
    own_format = {("instruction", "output"): "alpaca", ("instruction", "response"): "alpaca_response",
                  ("question", "answer"): "question_answer", ("prompt", "completion"): "prompt_completion",
                  ("input", "output"): "input_output"}
    for p in prompts:
        for r in replies:
            fmt = detect_format([RawRow(1, 1, value={p: "q", r: "a"})], Path("x.jsonl"))
            assert fmt == own_format.get((p, r), f"{p}_{r}"), (p, r)
    assert len(COLUMN_PAIRS) == len(prompts) * len(replies) - len(own_format)


def test_column_pairs_keep_the_detection_order():
    cases = [({"instruction": "i", "input": "x", "output": "o"}, "alpaca"),  # Alpaca's input is no second prompt
             ({"instruction": "i", "context": "c", "response": "r"}, "alpaca_response"),
             ({"question": "q", "input": "x", "answer": "a"}, "question_answer"),
             ({"messages": [], "prompt": "p", "response": "r"}, "messages"),
             ({"conversations": [], "query": "q", "answer": "a"}, "sharegpt"),
             ({"prompt": "p", "completion": "c", "label": False}, "prompt_completion"),
             ({"text": "t", "query": "q", "answer": "a"}, "query_answer"),
             ({"query": "q", "response": "r", "source": "s", "id": 3}, "query_response")]
    for value, fmt in cases:
        assert detect_format([RawRow(1, 1, value=value)], Path("x.jsonl")) == fmt, value


@pytest.mark.parametrize("value, why", [
    ({"query": SECRET, "prompt": SECRET, "response": SECRET, "answer": SECRET},
     "more than one column could be the prompt (query, prompt) and more than one the reply (response, answer)"),
    ({"instruction": SECRET, "input": SECRET, "answer": SECRET}, "more than one column could be the prompt (instruction, input)"),
    ({"instruction": SECRET, "context": SECRET, "answer": SECRET}, "more than one column could be the prompt (instruction, context)"),
    ({"query": SECRET, "response": SECRET, "output": SECRET}, "more than one column could be the reply (response, output)"),
    ({"prompt": SECRET, "completion": SECRET, "query": SECRET}, "more than one column could be the prompt (prompt, query)"),
])
def test_an_ambiguous_column_set_is_refused_naming_the_columns_and_the_pairs(value, why):
    with pytest.raises(DataError) as info:
        detect_format([RawRow(1, 1, value=value)], Path("data.jsonl"))
    assert info.value.message == f"data.jsonl: cannot tell the data format from the fields found ({', '.join(value)}): {why}."
    assert info.value.hint.endswith("; or one prompt column (prompt, query, question, instruction or input) with one reply "
                                    "column (completion, response, answer or output). Rename your columns to one of these.")
    assert SECRET not in str(info.value)


def test_a_row_with_a_second_prompt_column_in_a_pair_file_is_a_bad_row():
    # The first row decides the format; a later row that could be read two ways is not guessed at.
    assert problem({"query": SECRET, "input": SECRET, "response": SECRET}, "query_response") == \
        "more than one column could be the prompt (query, input)"
    assert row({"query": "q", "response": "r", "category": "x"}, "query_response").completion == "r"


# --------------------------------------------------------- messages and parts

def test_content_parts_are_joined_and_masked_like_text(chatml):
    _, examples = examples_of(SHAPES / "messages_parts.jsonl")
    assert examples[0].messages == (Message("system", "Answer briefly."), Message("user", "What do bees make?\nOne word."),
                                    Message("assistant", "Honey."))
    masked, learned = masks(chatml, examples[0])
    assert masked == [chatml_turn("system", "Answer briefly.") + chatml_turn("user", "What do bees make?\nOne word.")
                      + "<|im_start|>assistant\n"]
    assert learned == ["Honey.<|im_end|>"]


def test_a_part_that_is_not_text_is_named_not_shown():
    value = {"messages": [{"role": "user", "content": [{"type": "text", "text": SECRET},
                                                       {"type": "image_url", "image_url": {"url": SECRET}}]},
                          {"role": "assistant", "content": SECRET}]}
    message = problem(value, "messages")
    assert message.startswith("content part of type 'image_url' is not text (messages[1].content[2];")


def test_unknown_role_is_named_and_the_accepted_roles_listed():
    value = {"messages": [{"role": "user", "content": SECRET}, {"role": "function", "content": SECRET},
                          {"role": "assistant", "content": SECRET}]}
    assert problem(value, "messages") == "unknown role 'function' (messages[2]; accepted: assistant, developer, system, tool, user)"
    long_role = {"conversations": [{"from": "a_very_long_role_name_indeed", "value": SECRET}]}
    assert problem(long_role, "sharegpt").startswith("unknown role 'a_very_long_role_nam...' (conversations[1]; accepted: ")
    # Something that is not a name could be content: it is described, never echoed.
    sentence = {"messages": [{"role": f"{SECRET} and more", "content": "x"}, {"role": "assistant", "content": "y"}]}
    assert problem(sentence, "messages").startswith("unknown role that is not a name (messages[1];")


def test_a_conversation_that_starts_with_the_reply_is_a_bad_row_not_a_crash():
    """No turn asks for it, so no template can render what comes before it (transformers refuses
    an empty conversation): a row problem, for either spelling, even with a later system turn dropped."""
    sharegpt = {"conversations": [{"from": "gpt", "value": SECRET}, {"from": "system", "value": SECRET}]}
    openai = {"messages": [{"role": "assistant", "content": SECRET}]}
    for value, fmt, field in ((sharegpt, "sharegpt", "conversations"), (openai, "messages", "messages")):
        assert problem(value, fmt) == f"field '{field}' starts with an assistant turn: a user turn must come before the reply"


# ------------------------------------------------------------------- ShareGPT

def test_sharegpt_system_field_becomes_the_system_turn(chatml):
    _, examples = examples_of(SHAPES / "sharegpt_system.jsonl")
    assert examples[0].messages == (Message("system", "Answer briefly."), Message("user", "What do bees make?"),
                                    Message("assistant", "Honey."))
    assert examples[1].messages[0] == Message("system", "Be kind.")
    masked, learned = masks(chatml, examples[0])
    assert masked == [chatml_turn("system", "Answer briefly.") + chatml_turn("user", "What do bees make?")
                      + "<|im_start|>assistant\n"]
    assert learned == ["Honey.<|im_end|>"]
    both = {"system": "s", "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "h"},
                                             {"from": "gpt", "value": "g"}]}
    assert problem(both, "sharegpt") == "both a 'system' field and a system turn"


def test_sharegpt_function_call_and_observation_learn_the_call_not_the_result(qwen):
    _, (example,) = examples_of(SHAPES / "sharegpt_tools.json")
    call = example.messages[2]
    assert call.role == "assistant" and call.content == ""
    assert [(c.name, json.loads(c.arguments), c.id) for c in call.tool_calls] == [("get_weather", {"city": "Paris"}, "call00001")]
    assert (example.messages[3].role, example.messages[3].tool_call_id, example.messages[3].name) == \
        ("tool", "call00001", "get_weather")
    masked, learned = masks(qwen, example)
    schema = ('{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", '
              '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}')
    assert masked == [
        "<|im_start|>system\nYou are a weather bot.\n\n# Tools\n\nYou may call one or more functions to assist with the "
        "user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{schema}\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
        "</tool_call><|im_end|>\n" + chatml_turn("user", "What is the weather in Paris?") + "<|im_start|>assistant\n",
        "\n<|im_start|>user\n<tool_response>\n{\"celsius\": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    ]
    assert learned == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                       "It is 21 degrees in Paris.<|im_end|>"]


# ---------------------------------------------------------- OpenAI tool calls

def test_openai_tool_calls_are_learned_and_tool_results_are_not(qwen):
    _, examples = examples_of(SHAPES / "messages_tools.jsonl")
    first, second = examples
    assert first.messages[1].content == "" and first.messages[1].tool_calls[0].id == "call_1"
    masked, learned = masks(qwen, second)
    assert masked[0].startswith("<|im_start|>system\nUse the tools.\n\n# Tools\n")
    assert masked[0].endswith("</tool_call><|im_end|>\n" + chatml_turn("user", "Weather and time in Rome?")
                              + "<|im_start|>assistant\n")
    assert '"name": "get_time"' in masked[0]  # a bare schema, wrapped as OpenAI's {type, function}
    assert masked[1:] == ["\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon\n"
                          "</tool_response><|im_end|>\n<|im_start|>assistant\n"]
    assert learned == ['Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
                       '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>',
                       "Sunny, and it is noon.<|im_end|>"]


def test_without_the_tools_list_the_calls_are_still_learned(qwen):
    _, (first, _) = examples_of(SHAPES / "messages_tools.jsonl")
    masked, learned = masks(qwen, Example(first.row, messages=first.messages))
    assert masked[0] == "<|im_start|>system\n" + QWEN_DEFAULT_SYSTEM + "<|im_end|>\n" + \
        chatml_turn("user", "What is the weather in Paris?") + "<|im_start|>assistant\n"
    assert learned[0] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'


@pytest.mark.parametrize("style", ["chatml", "no_template"])
def test_a_template_without_tool_support_is_refused_clearly(request, qwen, style):
    tokenizer = request.getfixturevalue(style)
    assert supports_tools(qwen) and not supports_tools(tokenizer)
    _, examples = examples_of(SHAPES / "messages_tools.jsonl")
    tools_only = Example(3, messages=(("user", "Hi"), ("assistant", "Hello.")), tools=examples[0].tools)
    for example in (examples[1], tools_only):
        with pytest.raises(ModelError) as info:
            Tokenizer(tokenizer).encode(example)
        assert "tool calls (role 'tool' / tool_calls" in info.value.message
        assert f"row {example.row}" in info.value.message
        assert "Qwen2.5 Instruct" in info.value.hint and "Mistral-7B-Instruct-v0.3" in info.value.hint
        assert info.value.exit_code == 2


@pytest.mark.parametrize("value, expected", [
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
     "tool call arguments are not valid JSON (messages[2].tool_calls[1])"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]},
     "tool call without a name (messages[2].tool_calls[1])"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
     "tool call arguments must be an object, found list (messages[2].tool_calls[1])"),
    ({"role": "assistant", "content": None}, "content must be text or a list of text parts, found NoneType (messages[2])"),
])
def test_bad_tool_calls_are_row_problems(value, expected):
    turns = [{"role": "user", "content": SECRET}, value, {"role": "tool", "content": SECRET},
             {"role": "assistant", "content": SECRET}]
    assert problem({"messages": turns}, "messages") == expected


def test_a_tool_result_needs_a_call_before_it():
    turns = [{"role": "user", "content": SECRET}, {"role": "tool", "content": SECRET}, {"role": "assistant", "content": "x"}]
    assert problem({"messages": turns}, "messages") == "tool result without a tool call before it (messages[2])"
    assert problem({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
                    "tools": "[not json"}, "messages") == "field 'tools' is not valid JSON"


# ------------------------------------------------------------- Alpaca shapes

@pytest.mark.parametrize("name, index, prompt, reply", [
    ("alpaca_system.jsonl", 0, chatml_turn("system", "You translate.") + chatml_turn("user", "Translate to French.\n\ncat"),
     "chat"),
    ("alpaca_system.jsonl", 1, chatml_turn("user", "What do bees make?"), "Honey."),  # an empty system is no turn
    ("alpaca_response.csv", 1, chatml_turn("user", "Name the colour.\n\nThe sky on a clear day."), "Blue."),
    ("question_answer.jsonl", 1, chatml_turn("user", "How many legs does a spider have?"), "Eight."),
])
def test_alpaca_shapes_learn_only_the_reply(chatml, name, index, prompt, reply):
    _, examples = examples_of(SHAPES / name)
    masked, learned = masks(chatml, examples[index])
    assert masked == [prompt + "<|im_start|>assistant\n"]
    assert learned == [reply + "<|im_end|>"]


# ---------------------------------------------------------- prompt/completion

def test_prompt_completion_goes_through_the_models_own_template(chatml):
    _, examples = examples_of(SHAPES / "input_output.csv")
    masked, learned = masks(chatml, examples[0])
    assert masked == [chatml_turn("user", "Question: What do bees make?\nAnswer:") + "<|im_start|>assistant\n"]
    assert learned == ["Honey.<|im_end|>"]


def test_prompt_completion_is_raw_when_asked_or_when_the_template_is_the_fallback(chatml, no_template):
    _, examples = examples_of(SHAPES / "input_output.csv")
    masked, learned = masks(chatml, examples[0], raw_prompts=True)
    assert masked == ["Question: What do bees make?\nAnswer:"] and learned == [" Honey.<|im_end|>"]
    masked, learned = masks(no_template, examples[0])
    assert masked == ["Question: What do bees make?\nAnswer:"] and learned == [" Honey.<|endoftext|>"]
    masked, learned = masks(chatml, examples[0], has_own_template=False)
    assert masked == ["Question: What do bees make?\nAnswer:"]


@pytest.mark.parametrize("name, index, prompt, reply", [
    ("prompt_response.csv", 1, "Name the colour of the sky.\nOne word.", "Blue."),
    ("query_response.jsonl", 0, "What do bees make?", "Honey."),
    ("crlf_cells.csv", 0, "Write two lines.\nKeep them short.", "Roses are red.\nViolets are blue."),
    ("crlf_cells.csv", 1, "A lone carriage\nreturn.", "Fine."),
])
def test_column_pairs_learn_only_the_reply_through_the_template(chatml, no_template, name, index, prompt, reply):
    _, examples = examples_of(SHAPES / name)
    masked, learned = masks(chatml, examples[index])
    assert masked == [chatml_turn("user", prompt) + "<|im_start|>assistant\n"]
    assert learned == [reply + "<|im_end|>"]
    masked, learned = masks(no_template, examples[index])  # raw without a template of its own
    assert masked == [prompt] and learned == [reply + "<|endoftext|>"]
    encoded = Tokenizer(chatml).encode(examples[index])
    assert "\r" not in chatml.decode(encoded.input_ids)


def test_text_file_paragraphs_are_learned_whole_and_raw(chatml):
    _, examples = examples_of(SHAPES / "paragraphs.txt")
    assert [e.completion for e in examples] == ["Bees make honey from the nectar of flowers.\nThey store it in wax combs.",
                                                "A spider has eight legs.", "The sky is blue on a clear day."]
    masked, learned = masks(chatml, examples[0])
    assert masked == [] and learned == ["Bees make honey from the nectar of flowers.\nThey store it in wax combs.<|im_end|>"]


def test_text_rows_stay_raw_even_with_a_template(chatml):
    masked, learned = masks(chatml, Example(1, completion="Bees make honey."))
    assert masked == [] and learned == ["Bees make honey.<|im_end|>"]


def test_generation_prompts_the_way_training_rendered(chatml, no_template):
    from llmcustoms.models.generation import prompt_ids

    messages = [{"role": "user", "content": "Question: What do bees make?\nAnswer:"}]
    report = {"rows": 1}  # a plan made since prompts go through the template
    plan = SimpleNamespace(data_format="input_output", raw_prompts=False, data_report=report)
    templated = chatml.decode(prompt_ids(chatml, plan, messages)[0])
    assert templated == chatml_turn("user", "Question: What do bees make?\nAnswer:") + "<|im_start|>assistant\n"
    older = SimpleNamespace(data_format="input_output", raw_prompts=False, data_report={})  # trained raw
    assert chatml.decode(prompt_ids(chatml, older, messages)[0]) == "Question: What do bees make?\nAnswer:"
    raw = SimpleNamespace(data_format="input_output", raw_prompts=True, data_report=report)
    assert chatml.decode(prompt_ids(chatml, raw, messages)[0]) == "Question: What do bees make?\nAnswer:"
    assert no_template.decode(prompt_ids(no_template, plan, messages)[0]) == "Question: What do bees make?\nAnswer:"


# --------------------------------------------------------- preference and KTO

@pytest.mark.parametrize("name,fmt", [("preference_prompt.jsonl", "preference"),
                                      ("preference_conversations.json", "preference_sharegpt")])
def test_preference_pairs_are_their_own_format_never_read_as_replies(name, fmt):
    detected, [example] = examples_of(SHAPES / name)
    assert detected == fmt and example.is_pair
    chosen, rejected = example.halves()
    assert [m.content for m in chosen.messages] == ["What do bees make?", "Honey."]
    assert [m.content for m in rejected.messages] == ["What do bees make?", "Milk."]


def test_a_file_mixing_plain_chat_rows_with_pairs_is_read_as_pairs_and_names_the_odd_row():
    # Read as chat, the pairs' rejected replies would be learned: the pairs decide the format.
    with pytest.raises(DataError) as info:
        read_dataset(SHAPES / "preference_messages.jsonl")
    assert "line 1: field 'chosen' must be a list of turns" in info.value.message
    assert "Honey" not in str(info.value) and "Milk" not in str(info.value)


@pytest.mark.parametrize("name", ["kto.jsonl", "kto.csv"])
def test_kto_rows_labelled_false_are_never_learned(name):
    _, examples = examples_of(SHAPES / name)
    assert [e.desirable for e in examples] == [True, False, True]
    dataset = read_dataset(SHAPES / name)
    assert dataset.unlearned == 1 and dataset.rows == 2 and dataset.skipped == 0


@pytest.mark.parametrize("label", [1, 0, "positive", ["true"], ""])
def test_a_label_that_is_not_true_or_false_is_another_column(label):
    # A classification file's label (a class, a number) is not a KTO judgement.
    raw = RawRow(1, 1, value={"prompt": "Q", "completion": "A", "label": label})
    assert to_example(raw, "prompt_completion").desirable


# ----------------------------------------------------------------- templates

def test_a_template_that_refuses_a_row_is_a_clear_error(chatml):
    strict = build_tokenizer("chatml")
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                            "{{ raise_exception('System role not supported') }}{% endif %}"
                            "{{ m['content'] }}{% endfor %}")
    example = Example(7, messages=(("system", SECRET), ("user", SECRET), ("assistant", SECRET)))
    with pytest.raises(ModelError) as info:
        Tokenizer(strict).encode(example)
    # Its refusal in our words: a template's own text may quote the row.
    assert info.value.message == "This model's chat template refused row 7: it does not accept a system turn."
    assert SECRET not in str(info.value)


# ------------------------------------------------------------------- Message

def test_messages_keep_their_calls_and_pickle():
    _, (first, _) = examples_of(SHAPES / "messages_tools.jsonl")
    call = first.messages[1]
    assert (call.role, call.content) == ("assistant", "") and call.tool_calls
    assert call != Message("assistant", "")  # the calls count in equality
    assert call != ("assistant", "")  # a Message is no pair
    assert pickle.loads(pickle.dumps(first)) == first
    assert Example(1, messages=(("user", "a"), ("assistant", "b"))).messages[1].role == "assistant"
    # The calls are part of the row's text: a row calling with other arguments is no duplicate.
    other = to_example(RawRow(1, 1, value={"messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"celsius\": 21}"},
        {"role": "assistant", "content": "It is 21 degrees in Paris."}], "tools": json.loads(first.tools)}), "messages")
    assert other.identity_text() != first.identity_text()
    assert first.char_count() > sum(len(m.content) for m in first.messages) + len(first.tools)  # calls are counted
    assert first.messages[1].text() == 'get_weather({"city": "Paris"})' and first.reply() == "It is 21 degrees in Paris."


def test_the_developer_role_is_the_system_turn():
    example = row({"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "Hello!"}]}, "messages")
    assert [m.role for m in example.messages] == ["system", "user", "assistant"]


# ------------------------------------------------------- per-turn weights

@pytest.fixture(scope="module")
def reasoning():
    """A ChatML template that shows an assistant turn's reasoning_content and tool calls."""
    tokenizer = build_tokenizer("chatml")
    tokenizer.chat_template = (SHAPES / "reasoning_chat_template.jinja").read_text()
    return tokenizer


def test_a_weight_0_turn_is_context_never_learned_and_a_weight_1_turn_is_learned(chatml):
    rows = list(read_rows(SHAPES / "messages_weight.jsonl"))
    example = to_example(rows[0], "messages")
    assert [m.learned for m in example.messages] == [True, True, False, True, True]
    assert example.messages[2].as_dict() == {"role": "assistant", "content": "Milk."}  # templates never see it
    masked, learned = masks(chatml, example)
    assert masked == [chatml_turn("system", "Answer briefly.") + chatml_turn("user", "What do bees make?")
                      + chatml_turn("assistant", "Milk.") + chatml_turn("user", "No. What do bees make?")
                      + "<|im_start|>assistant\n"]
    assert learned == ["Honey.<|im_end|>"]
    from llmcustoms.data.prompt_draws import prompt_of

    assert prompt_of(example).reference == "Honey."  # a sample answers where the data has a reply to learn
    # --train-on-prompt learns the prompts, never a reply the row marks weight 0: exactly its tokens stay masked.
    masked, learned = masks(chatml, example, train_on_prompt=True)
    assert masked == ["Milk.<|im_end|>"]
    assert learned == [chatml_turn("system", "Answer briefly.") + chatml_turn("user", "What do bees make?")
                       + "<|im_start|>assistant\n",
                       "\n" + chatml_turn("user", "No. What do bees make?") + "<|im_start|>assistant\nHoney.<|im_end|>"]


def test_turns_after_the_last_weight_1_reply_are_dropped(chatml):
    rows = list(read_rows(SHAPES / "messages_weight.jsonl"))
    example = to_example(rows[2], "messages")
    assert example.messages == (Message("user", "How many legs does a spider have?"), Message("assistant", "Eight legs."))
    assert masks(chatml, example) == ([chatml_turn("user", "How many legs does a spider have?") + "<|im_start|>assistant\n"],
                                      ["Eight legs.<|im_end|>"])
    # Built by hand, a row ending in an unlearned reply is rendered up to its last learned one.
    by_hand = Example(1, messages=example.messages + (Message("user", "And an ant?"),
                                                      Message("assistant", "Eight.", learned=False)))
    assert masks(chatml, by_hand) == masks(chatml, example)
    nothing = Tokenizer(chatml).encode(Example(1, messages=(("user", "Hi"), Message("assistant", "Yo.", learned=False))))
    assert nothing.trainable_tokens == 0  # dropped with the rows left with nothing to learn


def test_the_file_with_a_bad_weight_skips_that_row_and_names_the_field():
    dataset = read_dataset(SHAPES / "messages_weight.jsonl", "skip")
    assert dataset.rows == 2
    assert dataset.bad.where == {"'weight' must be 0 or 1, found another number": ["line 2"]}


@pytest.mark.parametrize("weight, found", [(2, "another number"), (0.5, "another number"), ("0", "text"),
                                           (True, "true or false"), ([1], "list"), ({"w": 1}, "dict")])
def test_a_weight_that_is_not_0_or_1_is_a_bad_row_naming_the_field_and_the_turn(weight, found):
    turns = [{"role": "user", "content": SECRET}, {"role": "assistant", "content": SECRET},
             {"role": "user", "content": SECRET}, {"role": "assistant", "content": SECRET, "weight": weight}]
    assert problem({"messages": turns}, "messages") == f"'weight' must be 0 or 1, found {found} (messages[4])"


def test_weights_elsewhere_are_refused_or_ignored_and_1_0_is_1():
    on_user = [{"role": "user", "content": SECRET, "weight": 1}, {"role": "assistant", "content": SECRET}]
    assert problem({"messages": on_user}, "messages") == "'weight' on a user turn; only assistant turns have one (messages[1])"
    floats = row({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0.0},
                               {"role": "user", "content": "q"}, {"role": "assistant", "content": "b", "weight": 1.0}]},
                 "messages")
    assert [m.learned for m in floats.messages] == [True, False, True, True]
    # ShareGPT has no weights: a `weight` key there is someone else's column.
    sharegpt = row({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a", "weight": 0}]},
                   "sharegpt")
    assert sharegpt.messages[-1].learned


def test_a_row_whose_every_reply_has_weight_0_is_a_bad_row():
    turns = [{"role": "user", "content": SECRET}, {"role": "assistant", "content": SECRET, "weight": 0},
             {"role": "user", "content": SECRET}, {"role": "assistant", "content": SECRET, "weight": 0}]
    assert problem({"messages": turns}, "messages") == \
        "every assistant turn in field 'messages' has weight 0: nothing to learn"


def test_a_template_that_rewrites_earlier_turns_learns_the_last_weight_1_reply(reasoning):
    # Like Qwen3's: reasoning shown on the last turn only, so per-turn cuts do not line up.
    rewriting = build_tokenizer("chatml")
    rewriting.chat_template = reasoning.chat_template.replace("message.reasoning_content is defined",
                                                              "message.reasoning_content is defined and loop.last")
    turns = [{"role": "user", "content": "Q1"},
             {"role": "assistant", "content": [{"type": "reasoning", "value": "R1"}, {"type": "text", "value": "A1"}],
              "weight": 0},
             {"role": "user", "content": "Q2"},
             {"role": "assistant", "content": [{"type": "reasoning", "value": "R2"}, {"type": "text", "value": "A2"}]},
             {"role": "user", "content": "Q3"},
             {"role": "assistant", "content": [{"type": "reasoning", "value": "R3"}, {"type": "text", "value": "A3"}],
              "weight": 0}]
    example = row({"messages": turns}, "messages")
    assert [m.content for m in example.messages] == ["Q1", "A1", "Q2", "A2"]  # the last reply has weight 0: dropped
    masked, learned = masks(rewriting, example)
    assert masked == [chatml_turn("user", "Q1") + chatml_turn("assistant", "A1") + chatml_turn("user", "Q2")
                      + "<|im_start|>assistant\n"]
    assert learned == ["<think>\nR2\n</think>\n\nA2<|im_end|>"]


# ------------------------------------------- content parts keyed value

def test_parts_keyed_value_are_read_like_text_and_tools_as_json_text():
    detected, (plain, calling) = examples_of(SHAPES / "messages_value_parts.jsonl")
    assert detected == "messages"
    assert plain.messages == (Message("system", "Answer briefly."), Message("user", "What do bees make?\nOne word."),
                              Message("assistant", "Honey.", reasoning=("Bees make honey from nectar.",)))
    assert [(c.name, json.loads(c.arguments)) for c in calling.messages[1].tool_calls] == [("get_weather", {"city": "Paris"})]
    assert calling.messages[1].content == "" and calling.messages[1].reasoning == ("I need the weather tool.",)
    assert json.loads(calling.tools)[0]["function"]["name"] == "get_weather"
    empty = row({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "reasoning", "value": " "}, {"type": "text", "value": "a"}]}]}, "messages")
    assert empty.messages[-1] == Message("assistant", "a")  # an empty reasoning part says nothing


def test_reasoning_parts_reach_a_template_that_reads_them_and_are_counted_otherwise(chatml, qwen, reasoning):
    from llmcustoms.data.chat_templates import supports_reasoning

    assert supports_reasoning(reasoning) and not supports_reasoning(qwen) and not supports_reasoning(chatml)
    _, (plain, _) = examples_of(SHAPES / "messages_value_parts.jsonl")
    prompt = chatml_turn("system", "Answer briefly.") + chatml_turn("user", "What do bees make?\nOne word.")
    assert masks(reasoning, plain) == ([prompt + "<|im_start|>assistant\n"],
                                       ["<think>\nBees make honey from nectar.\n</think>\n\nHoney.<|im_end|>"])
    assert masks(chatml, plain) == ([prompt + "<|im_start|>assistant\n"], ["Honey.<|im_end|>"])
    assert read_dataset(SHAPES / "messages_value_parts.jsonl").reasoning_parts == 2


def test_tool_call_parts_are_learned_as_calls(qwen, reasoning):
    _, (_, calling) = examples_of(SHAPES / "messages_value_parts.jsonl")
    masked, learned = masks(qwen, calling)  # Qwen2.5's template shows no reasoning: left out
    assert masked[0].startswith("<|im_start|>system\n" + QWEN_DEFAULT_SYSTEM + "\n\n# Tools\n")
    assert masked[1:] == ["\n<|im_start|>user\n<tool_response>\n{\"celsius\": 21}\n</tool_response><|im_end|>\n"
                          "<|im_start|>assistant\n"]
    assert learned == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                       "It is 21 degrees in Paris.<|im_end|>"]
    masked, learned = masks(reasoning, calling)
    assert learned == ['<think>\nI need the weather tool.\n</think>\n\n<tool_call>{"name": "get_weather", '
                       '"arguments": {"city": "Paris"}}</tool_call><|im_end|>', "It is 21 degrees in Paris.<|im_end|>"]
    assert masked[1] == "\n" + chatml_turn("tool", '{"celsius": 21}') + "<|im_start|>assistant\n"


@pytest.mark.parametrize("part, expected", [
    ({"type": "text", "value": 5}, "text part's 'value' must be text, found int (messages[2].content[1])"),
    ({"type": "reasoning"}, "reasoning part without 'text' or 'value' (messages[2].content[1])"),
    ({"type": "reasoning", "text": [SECRET]}, "reasoning part's 'text' must be text, found list (messages[2].content[1])"),
    ({"type": "tool_call", "value": "{" + SECRET}, "tool_call part's 'value' is not valid JSON (messages[2].content[1])"),
    ({"type": "tool_call", "value": []}, "tool_call part's 'value' without a call (messages[2].content[1])"),
    ({"type": "tool_call", "value": {"arguments": {"a": SECRET}}}, "tool call without a name (messages[2].content[1])"),
    ({"type": "tool_call", "value": {"name": "f", "arguments": SECRET}},
     "tool call arguments are not valid JSON (messages[2].content[1])"),
])
def test_a_part_that_cannot_be_read_names_its_type_and_key(part, expected):
    turns = [{"role": "user", "content": SECRET}, {"role": "assistant", "content": [part, {"type": "text", "value": SECRET}]}]
    assert problem({"messages": turns}, "messages") == expected


def test_reasoning_and_tool_call_parts_belong_to_assistant_turns():
    for kind in ("reasoning", "tool_call"):
        turns = [{"role": "user", "content": [{"type": kind, "value": SECRET}]}, {"role": "assistant", "content": "a"}]
        assert problem({"messages": turns}, "messages") == \
            f"content part of type '{kind}' is only read in an assistant turn of a chat row (messages[1].content[1])"
