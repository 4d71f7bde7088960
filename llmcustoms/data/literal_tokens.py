"""Text in a row that spells a special token is learned as text.

A reply that explains ChatML ("a turn ends with <|im_end|>") holds the text
of the tokenizer's end-of-turn token. Tokenized as it is, that text becomes
the real token: the model would learn to stop in the middle of that reply,
and a prompt could close its own turn. So before a row is rendered, every
special token's text in what the row says (turns, reasoning, tool calls, a
prompt, a completion, the tools list) is replaced by a placeholder of
private-use characters (`hide`); the template's own special tokens stay as
they are. When the pieces are tokenized, each placeholder is tokenized alone
as plain text, `split_special_tokens=True` (`encode_pieces`), and the rest as
usual. (A tokenizer that puts a space in front of every text it is given,
SentencePiece's, then writes one before the token's text and after it: a
rare row's small cost, against learning to stop mid-reply.)
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Sequence

from llmcustoms.data.row_formats import Example, Message, ToolCall

# A placeholder: these two around one character naming the token, all from
# the supplementary private-use planes, which no text a person writes holds
# (the Basic Multilingual Plane's private-use area has icon fonts in it).
_OPEN, _CLOSE, _FIRST = "\U0010FFFB", "\U0010FFFC", 0xF0000
_PLACEHOLDER = re.compile(f"{_OPEN}(.){_CLOSE}", re.DOTALL)


class LiteralTokens:
    """The special tokens of one tokenizer, and the placeholders for their text."""

    def __init__(self, hf_tokenizer: Any):
        specials = set(hf_tokenizer.all_special_tokens) | {
            str(token) for token in hf_tokenizer.added_tokens_decoder.values() if token.special}
        # Longest first: "<|im_end|>" before a "<|im" some tokenizer may also have; then by
        # text, so every process numbers them alike. Gemma's 6,000 and more all fit the plane.
        self.tokens = sorted((t for t in specials if t), key=lambda t: (-len(t), t))
        self.pattern = re.compile("|".join(map(re.escape, self.tokens))) if self.tokens else None
        # The characters special tokens start with ("<", "["): a row without any is passed by at once.
        self.starts = frozenset(t[0] for t in self.tokens)
        self.hf = hf_tokenizer

    def hide(self, example: Example) -> Example:
        """`example` with every special token's text in what it says replaced by its placeholder."""
        text = "\x00".join([example.identity_text(), *(r for m in example.messages + example.rejected
                                                       for r in m.reasoning)])
        if self.pattern is None or self.starts.isdisjoint(text) or not self.pattern.search(text):
            return example
        return replace(example, messages=tuple(self._message(m) for m in example.messages),
                       rejected=tuple(self._message(m) for m in example.rejected), tools=self._text(example.tools),
                       prompt=self._text(example.prompt), completion=self._text(example.completion))

    def _text(self, text: str) -> str:
        return self.pattern.sub(lambda m: f"{_OPEN}{chr(_FIRST + self.tokens.index(m.group()))}{_CLOSE}", text)

    def _message(self, message: Message) -> Message:
        calls = tuple(ToolCall(c.name, self._text(c.arguments), c.id) for c in message.tool_calls)
        return replace(message, content=self._text(message.content), tool_calls=calls,
                       reasoning=tuple(self._text(r) for r in message.reasoning))

    def encode_pieces(self, pieces: Sequence[str]) -> list[list[int]]:
        """Token ids of each piece, its placeholders tokenized as the plain
        text of their token. Pieces without one go to the tokenizer in one call."""
        ids: list[list[int]] = self.hf(list(pieces), add_special_tokens=False)["input_ids"] if pieces else []
        for i, piece in enumerate(pieces):
            if _OPEN in piece and any(self._token(m) for m in _PLACEHOLDER.finditer(piece)):
                ids[i] = self._encode_marked(piece)
        return ids

    def _token(self, match: re.Match) -> str | None:
        """The special token a placeholder stands for; None for text that only looks like one."""
        index = ord(match.group(1)) - _FIRST
        return self.tokens[index] if 0 <= index < len(self.tokens) else None

    def _encode_marked(self, piece: str) -> list[int]:
        out: list[int] = []
        start = 0
        for match in _PLACEHOLDER.finditer(piece):
            token = self._token(match)
            if token is None:
                continue
            if match.start() > start:
                out += self.hf(piece[start:match.start()], add_special_tokens=False)["input_ids"]
            out += self.hf(token, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            start = match.end()
        if start < len(piece):
            out += self.hf(piece[start:], add_special_tokens=False)["input_ids"]
        return out
