"""Turn `Example`s into token ids and labels, with the loss masked on prompts.

`data/chat_templates.py` renders a row as text pieces, each marked prompt,
reply or unlearned reply (a turn marked `weight: 0`). Each piece is tokenized
on its own, so labels are -100 on exactly the prompt pieces (unless
--train-on-prompt) and the unlearned replies (always).

A special token's text in a chat row (a reply that writes "<|im_end|>") is
tokenized as text, never as the token (`literal_tokens.py`).

Every sequence ends with a token the model stops on: a reply whose template
ends with an end-of-turn token followed by whitespace (ChatML's
"<|im_end|>\\n") is cut after that token; one with no stop token gets EOS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from llmcustoms.data.chat_templates import (
    PROMPT,
    REPLY,
    Segments,
    chat_segments,
    raw_segments,
    supports_reasoning,
    supports_tools,
    template_refused,
    tool_support_error,
)
from llmcustoms.data.chat_templates import has_own_template as template_is_own
from llmcustoms.data.literal_tokens import LiteralTokens
from llmcustoms.data.row_formats import Example
from llmcustoms.errors import ModelError

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TokenizedExample:
    row: int
    input_ids: list[int]
    labels: list[int]

    @property
    def trainable_tokens(self) -> int:
        # Label i is predicted from position i-1, so the first label never counts.
        return sum(1 for label in self.labels[1:] if label != IGNORE_INDEX)


@dataclass
class TokenizedData:
    examples: list[TokenizedExample]
    truncated: int = 0
    dropped: int = 0


class Tokenizer:
    """Binds a Hugging Face tokenizer to the masking rules of one run."""

    def __init__(self, hf_tokenizer, train_on_prompt: bool = False, stop_token_ids: set[int] | None = None,
                 raw_prompts: bool = False, has_own_template: bool | None = None):
        """`raw_prompts` (--raw-prompts) joins prompt/completion rows as they
        are; otherwise they go through the chat template as a user and an
        assistant turn when it is the model's own. `has_own_template` says
        whether it is; None tells by comparing it with the fallback template
        that `ensure_chat_template` gives models without one."""
        if hf_tokenizer.eos_token_id is None:
            raise ModelError("The tokenizer has no EOS token, so the model could not learn where to stop.",
                             "Use a tokenizer that defines eos_token.")
        self.hf = hf_tokenizer
        self.train_on_prompt = train_on_prompt
        self.stop_token_ids = set(stop_token_ids or ()) | {hf_tokenizer.eos_token_id}
        own = template_is_own(hf_tokenizer) if has_own_template is None else has_own_template
        # The fallback template is a format the model never saw: a prompt the
        # user wrote out as text teaches more as it is.
        self.templated_prompts = own and not raw_prompts
        self.tools_supported: bool | None = None  # probed at the first row that uses tools
        # Reasoning parts reach a template that reads them; others never see them.
        self.shows_reasoning = supports_reasoning(hf_tokenizer)
        # A special token's text in a row rendered through the template is learned as text.
        self.literal = LiteralTokens(hf_tokenizer)

    def segments(self, example: Example) -> Segments:
        """The row as (text, PROMPT | REPLY | UNLEARNED) pieces, in order."""
        from jinja2 import TemplateError

        if example.uses_tools and not self.tools_supported:
            self.tools_supported = supports_tools(self.hf)
            if not self.tools_supported:
                raise tool_support_error(example)
        try:
            if example.is_chat:
                example = self.literal.hide(example)
                return chat_segments(self.hf, example.messages, example.tool_schemas(), example.learned_from,
                                     self.shows_reasoning)
            if example.prompt and self.templated_prompts:
                return chat_segments(self.hf, self.literal.hide(example).as_conversation().messages)
        except TemplateError as error:
            # What it refused, never the template's text: that may quote the row.
            raise template_refused(f"row {example.row}", error,
                                   "Check that row's turns against what the template accepts (some refuse a system turn, or "
                                   "need user and assistant turns to alternate), or fix the row or use another model.") from None
        return raw_segments(self.hf, example)

    def _end_with_stop_token(self, ids: list[int]) -> list[int]:
        """Cut after the first stop token that only whitespace and stop tokens
        follow (Phi-3.5's last reply ends "<|end|>\\n<|endoftext|>": the model
        stops at <|end|>), or add EOS where there is none."""
        end = None
        for i in range(len(ids) - 1, -1, -1):
            if ids[i] in self.stop_token_ids:
                end = i
            elif self.hf.decode(ids[i:i + 1]).strip():
                break
        return ids[: end + 1] if end is not None else ids + [self.hf.eos_token_id]

    def encode(self, example: Example) -> TokenizedExample:
        """Token ids and labels of one example, not truncated."""
        ids, learned = self.encode_many([example])[0]
        return TokenizedExample(example.row, ids.tolist(), np.where(learned != 0, ids, IGNORE_INDEX).tolist())

    def encode_many(self, examples: Sequence[Example]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(token ids, learned mask) of each example, not truncated. All pieces
        go to the tokenizer in one call: fast tokenizers spread a batch over the cores."""
        segments = [[(text, kind) for text, kind in self.segments(e) if text] for e in examples]
        pieces = self.literal.encode_pieces([text for row in segments for text, _ in row])
        out, k = [], 0
        for row in segments:
            out.append(self._assemble(row, pieces[k:k + len(row)]))
            k += len(row)
        return out

    def _assemble(self, segments: Segments, pieces: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        replies = [i for i, (_, kind) in enumerate(segments) if kind == REPLY]
        last_reply = replies[-1] if replies else -1  # none when clipping left no reply: the row is dropped later
        input_ids: list[int] = []
        learned: list[bool] = []
        for i, ((_, kind), ids) in enumerate(zip(segments, pieces)):
            ids = list(ids)
            if i == last_reply:
                ids = self._end_with_stop_token(ids)
            input_ids += ids
            learned += [kind == REPLY or (kind == PROMPT and self.train_on_prompt)] * len(ids)
        return np.array(input_ids, np.int32), np.array(learned, np.uint8)


def first_loss_position(example: TokenizedExample) -> int:
    """Index of the first label that counts towards the loss (len if none does)."""
    for i in range(1, len(example.labels)):
        if example.labels[i] != IGNORE_INDEX:
            return i
    return len(example.labels)


def truncate(examples: list[TokenizedExample], max_seq_len: int) -> TokenizedData:
    """Cut rows to max_seq_len; rows left with nothing to learn are dropped and counted."""
    out = TokenizedData(examples=[])
    for example in examples:
        if len(example.input_ids) <= max_seq_len:
            out.examples.append(example)
            continue
        out.truncated += 1
        cut = TokenizedExample(example.row, example.input_ids[:max_seq_len], example.labels[:max_seq_len])
        if cut.trainable_tokens == 0:
            out.dropped += 1
        else:
            out.examples.append(cut)
    return out
