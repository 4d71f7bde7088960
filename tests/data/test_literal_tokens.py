"""A special token's text written in a row is learned as text
(`data/literal_tokens.py`): in a reply, its reasoning, a tool call, the
tools list; never the real token, and nothing else changes."""

from __future__ import annotations

import json

from llmcustoms.data.literal_tokens import LiteralTokens
from llmcustoms.data.row_formats import Example, Message, ToolCall
from llmcustoms.data.tokenization import Tokenizer
from tiny_models import build_family_tokenizer

END = "<|im_end|>"


def ends(hf, example: Example) -> int:
    """How many real <|im_end|> tokens the row's ids hold."""
    return Tokenizer(hf).encode(example).input_ids.count(hf.convert_tokens_to_ids(END))


def test_the_token_written_anywhere_in_a_turn_stays_text():
    hf = build_family_tokenizer("qwen3")
    plain = Example(1, messages=(Message("user", "Hi"), Message("assistant", "Answer")))
    assert ends(hf, plain) == 2  # the user turn's end and the reply's
    written = [Message("assistant", f"A turn ends with {END}."),
               Message("assistant", "Answer", reasoning=(f"a turn ends with {END} here",)),
               Message("assistant", "", (ToolCall("say", json.dumps({"text": END}), "call00001"),))]
    for reply in written:
        assert ends(hf, Example(1, messages=(Message("user", "Hi"), reply))) == 2, reply
    def tools(description: str) -> str:
        return json.dumps([{"type": "function", "function": {"name": "say", "description": description,
                                                             "parameters": {"type": "object"}}}])

    # The tools make a system turn, with its own end: three, whatever the description says.
    assert ends(hf, Example(1, messages=plain.messages, tools=tools(f"ends with {END}"))) == 3
    assert ends(hf, Example(1, messages=plain.messages, tools=tools("ends with a token"))) == 3


def test_rows_without_the_text_tokenize_as_before_and_look_alike_text_is_left_alone():
    hf = build_family_tokenizer("qwen3")
    literal = LiteralTokens(hf)
    row = Example(1, messages=(Message("user", "Hi"), Message("assistant", "Answer \U0010FFFBx\U0010FFFC \ue001")))
    assert literal.hide(row) is row
    pieces = ["Answer \U0010FFFBx\U0010FFFC \ue001", f"plain{END}"]
    assert literal.encode_pieces(pieces) == hf(pieces, add_special_tokens=False)["input_ids"]


def test_every_special_token_of_a_large_vocabulary_has_a_placeholder():
    hf = build_family_tokenizer("gemma3")
    hf.add_special_tokens({"additional_special_tokens": [f"<unused{i}>" for i in range(6242)]})
    literal = LiteralTokens(hf)
    assert "<eos>" in literal.tokens and len(literal.tokens) > 6242
    hidden = literal.hide(Example(1, messages=(Message("user", "Hi"), Message("assistant", "Then <eos> <unused9>."))))
    [ids] = literal.encode_pieces([hidden.messages[1].content])
    assert hf.convert_tokens_to_ids("<eos>") not in ids and hf.convert_tokens_to_ids("<unused9>") not in ids
    assert hf.decode(ids) == "Then <eos> <unused9>."
