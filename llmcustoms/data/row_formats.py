"""The shapes a data row can take, and how each becomes an `Example`.

Supported row formats, detected from the fields of the first rows and checked
in this order (the first whose fields a row has wins):

  messages           messages: [{role: system|user|assistant|tool, content}]  (OpenAI;
                     content may be a list of text parts; tool_calls, tools)
  sharegpt           conversations: [{from: human|gpt|system|function_call|observation, value}]
                     (optional system and tools fields, as LLaMA-Factory writes them)
  alpaca             instruction, input (optional), output; optional system
                     and history ([[instruction, response], ...]: earlier turns)
  alpaca_response    instruction, input or context (optional), response   (Alpaca)
  question_answer    question, answer                                      (Alpaca)
  prompt_completion  prompt, completion
  input_output       input, output                             (prompt/completion)
  prompt_response    one prompt column (prompt, query, question, instruction,
  query_answer, ...  input) and one reply column (completion, response, answer,
                     output): every other such pair      (prompt/completion)
  text               text

A prompt/completion row (any of the pairs) is read only when its pair is the
row's only one: with two columns that could be the prompt (`context` counts),
or two that could be the reply, which to learn is not ours to guess, and the
row is refused (Alpaca's shapes, detected before, say what their extra column is).

Any of them may carry a KTO-style `label` (true/false, or that text from a
CSV): a row labelled false is read but never learned. Preference pairs
(`chosen` and `rejected`, `data/preference_pairs.py`) are recognised before anything
else: a pair file often has `messages` or `conversations` too, and read as
chat it would teach the rejected reply. A pair becomes one `Example` holding
both replies; `halves()` gives the two conversations that are tokenized.

A problem with a row raises `RowProblem` with a message that names the field,
never the content: the data may be private. No torch here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from llmcustoms.data.chat_turns import (
    OPENAI_ROLES,
    SHAREGPT_ROLES,
    Message,
    RowProblem,
    ToolCall,
    chat_turns,
    tools_field,
    with_call_ids,
)
from llmcustoms.data.data_files import RawRow
from llmcustoms.data.preference_pairs import PREFERENCE_FORMATS, preference_format, to_pair
from llmcustoms.errors import DataError

__all__ = ["Example", "Message", "RowProblem", "ToolCall", "FORMAT_DESCRIPTIONS", "FORMAT_REQUIRED_FIELDS",
           "base_format", "detect_format", "to_example"]

# Columns that are clearly a prompt, and clearly a reply. Any one of each is a
# prompt/completion row, except the pairs with a format of their own below.
PROMPT_COLUMNS = ("prompt", "query", "question", "instruction", "input")
REPLY_COLUMNS = ("completion", "response", "answer", "output")
COLUMN_PAIRS = {f"{p}_{r}": (p, r) for p in PROMPT_COLUMNS for r in REPLY_COLUMNS
                if f"{p}_{r}" not in ("instruction_output", "instruction_response", "question_answer",
                                      "prompt_completion", "input_output")}
# Dolly's `context` is no prompt of a pair, but beside one it leaves two candidates.
PROMPT_LIKE = (*PROMPT_COLUMNS, "context")

FORMAT_DESCRIPTIONS = {
    "messages": "OpenAI messages (messages: [{role, content}])",
    "sharegpt": "ShareGPT (conversations: [{from, value}])",
    "alpaca": "Alpaca (instruction, input, output)",
    "alpaca_response": "Alpaca (instruction, response)",
    "question_answer": "Alpaca (question, answer)",
    "prompt_completion": "prompt/completion (prompt, completion)",
    "input_output": "prompt/completion (input, output)",
    **{name: f"prompt/completion ({p}, {r})" for name, (p, r) in COLUMN_PAIRS.items()},
    "text": "plain text (text)",
    **PREFERENCE_FORMATS,
}
# Checked in this order: the first whose required fields a row has wins.
# Chat lists first (a chat row may have other fields too), then Alpaca before
# input/output, since an Alpaca row has both an input and an output.
FORMAT_REQUIRED_FIELDS = {
    "messages": {"messages"},
    "sharegpt": {"conversations"},
    "alpaca": {"instruction", "output"},
    "alpaca_response": {"instruction", "response"},
    "question_answer": {"question", "answer"},
    "prompt_completion": {"prompt", "completion"},
    "input_output": {"input", "output"},
    **{name: set(pair) for name, pair in COLUMN_PAIRS.items()},
    "text": {"text"},
}
# Variants read like the format they name here.
BASE_FORMATS = {"alpaca_response": "alpaca", "question_answer": "alpaca", "input_output": "prompt_completion",
                **dict.fromkeys(COLUMN_PAIRS, "prompt_completion")}
# Alpaca shapes: (instruction field, reply field). An optional `input` (or
# Dolly's `context`) follows the instruction after a blank line.
ALPACA_FIELDS = {"alpaca": ("instruction", "output"), "alpaca_response": ("instruction", "response"),
                 "question_answer": ("question", "answer")}
ALPACA_INPUT_FIELDS = ("input", "context")
PROMPT_FIELDS = {"prompt_completion": ("prompt", "completion"), "input_output": ("input", "output"), **COLUMN_PAIRS}
# How many leading rows to look at when detecting the format.
DETECTION_ROWS = 50


def base_format(fmt: str) -> str:
    """The format a variant reads like: 'alpaca', 'prompt_completion', ... ('' stays '')."""
    return BASE_FORMATS.get(fmt, fmt)


def is_preference(fmt: str) -> bool:
    """Whether rows of this format are preference pairs (trained with DPO)."""
    return fmt in PREFERENCE_FORMATS


@dataclass(frozen=True)
class Example:
    """One training row, normalised.

    Chat formats fill `messages` (and `tools`, JSON text of the tool schemas
    the row offers the model); raw formats fill `prompt` (not trained on by
    default) and `completion` (trained on). Plain text is all completion.
    """

    row: int
    messages: tuple[Message, ...] = ()
    prompt: str = ""
    completion: str = ""
    # False for rows a KTO-style file marks undesirable (label: false): never learned.
    desirable: bool = True
    tools: str = ""
    # A preference pair: `messages` end with the chosen reply, `rejected`
    # holds the other; turns from `learned_from` on are the reply (earlier
    # assistant turns are prompt).
    rejected: tuple[Message, ...] = ()
    learned_from: int = 0

    def __post_init__(self) -> None:
        # Plain (role, content) pairs are accepted, so code and tests that
        # build conversations by hand need not know about tool calls.
        if not all(isinstance(m, Message) for m in self.messages):
            object.__setattr__(self, "messages", tuple(m if isinstance(m, Message) else Message(*m) for m in self.messages))

    @property
    def is_chat(self) -> bool:
        return bool(self.messages)

    @property
    def is_pair(self) -> bool:
        return bool(self.rejected)

    def halves(self) -> tuple["Example", ...]:
        """What is tokenized: a pair's chosen and rejected conversations (in
        that order), or the row itself."""
        if not self.is_pair:
            return (self,)
        prompt = self.messages[:self.learned_from]
        return replace(self, rejected=()), replace(self, messages=prompt + self.rejected, rejected=())

    @property
    def uses_tools(self) -> bool:
        """Whether the row offers tools, calls one or holds a tool's result."""
        return bool(self.tools) or any(m.tool_calls or m.role == "tool" for m in self.messages)

    def tool_schemas(self) -> list[dict] | None:
        """The tools as `apply_chat_template(tools=...)` takes them; None without."""
        return json.loads(self.tools) if self.tools else None

    def as_conversation(self) -> "Example":
        """A prompt/completion row as one user turn and one assistant turn.
        The whitespace that joined them as raw text means nothing in a chat."""
        return replace(self, messages=(Message("user", self.prompt.strip()), Message("assistant", self.completion.strip())),
                       prompt="", completion="")

    def replies(self) -> int:
        """How many replies the row has to learn: its learned assistant turns
        (a pair's chosen half), or one."""
        if not self.is_chat:
            return 1
        return sum(m.role == "assistant" and m.learned and k >= self.learned_from for k, m in enumerate(self.messages))

    def char_count(self) -> int:
        return (sum(m.chars() for m in self.messages + self.rejected) + len(self.tools) + len(self.prompt)
                + len(self.completion))

    def prompt_chars(self) -> int:
        """Characters before the last reply: where learning starts, roughly."""
        if self.is_pair:
            return sum(m.chars() for m in self.messages[:self.learned_from])
        if self.is_chat:
            return sum(m.chars() for m in self.messages[:-1]) + len(self.tools)
        return len(self.prompt)

    def reply(self) -> str:
        """The text of the last learned reply (the completion for raw rows);
        a reply that calls tools includes the calls."""
        return self.messages[-1].text() if self.is_chat else self.completion

    def identity_text(self) -> str:
        """Everything that makes the row what it is (roles, text, calls, tools),
        for finding duplicates."""
        parts = [f"{m.role}\x00{m.tool_call_id}\x00{m.text()}" for m in self.messages + self.rejected]
        return "\x01".join(parts + [self.tools, self.prompt, self.completion])

    def clipped(self, max_chars: int) -> "Example":
        """The row cut to at most `max_chars` characters of text, from the end:
        what a tokenizer would cut later anyway, so one huge row costs little."""
        if self.char_count() <= max_chars:
            return self
        if not self.is_chat:
            prompt = self.prompt[:max_chars]
            return replace(self, prompt=prompt, completion=self.completion[:max_chars - len(prompt)])
        # The tools schema is never cut (a cut schema is not JSON); the turns are.
        kept, room = [], max_chars
        for message in self.messages:
            if room <= 0:
                break
            kept.append(message.clipped(room))
            room -= message.chars()
        return replace(self, messages=tuple(kept))


def detect_format(rows: list[RawRow], path: Path) -> str:
    seen_fields: list[str] = []
    objects = [raw for raw in rows if isinstance(raw.value, dict)]
    pairs = next((fmt for fmt in (preference_format(raw.value) for raw in objects[:DETECTION_ROWS]) if fmt), None)
    if pairs:
        return pairs
    ambiguous = ""
    for raw in objects[:DETECTION_ROWS]:
        keys = set(raw.value)
        doubt = _ambiguity(raw.value)
        for name, required in FORMAT_REQUIRED_FIELDS.items():
            if required <= keys and not (doubt and name in PROMPT_FIELDS):
                return name
        ambiguous = ambiguous or doubt
        seen_fields += [k for k in raw.value if k not in seen_fields]
    if not objects:
        unreadable = next((raw for raw in rows if raw.problem is not None), None)
        if unreadable is not None:
            # Nothing parsed: the first row's own problem is the useful message.
            raise DataError(f"{unreadable.where(path)}: {unreadable.problem}.",
                            "Each row must be one JSON object, such as {\"instruction\": ..., \"output\": ...}.")
        raise DataError(f"{path.name}: no row is a JSON object with fields.",
                        "Each row must be an object such as {\"instruction\": ..., \"output\": ...}.")
    if not seen_fields:
        raise DataError(f"{path.name}: the rows are empty objects.", "Each row needs fields such as instruction and output.")
    accepted = "; ".join(text for name, text in FORMAT_DESCRIPTIONS.items() if name not in COLUMN_PAIRS)
    raise DataError(
        # Field names only, shortened: in odd files the keys themselves could be content.
        f"{path.name}: cannot tell the data format from the fields found "
        f"({', '.join(_shown_field(f) for f in seen_fields[:10])}{', ...' if len(seen_fields) > 10 else ''})"
        f"{': ' + ambiguous if ambiguous else ''}.",
        f"Accepted formats: {accepted}; or one prompt column ({_either(PROMPT_COLUMNS)}) with one reply column "
        f"({_either(REPLY_COLUMNS)}). Rename your columns to one of these.",
    )


def _either(names: tuple[str, ...]) -> str:
    return f"{', '.join(names[:-1])} or {names[-1]}"


def _ambiguity(value: dict) -> str:
    """Why a row with a prompt column and a reply column is no one column pair
    ('' when it is one): more than one column could be the prompt, or the reply.
    Only our own column names are said."""
    prompts = [k for k in value if k in PROMPT_LIKE]
    replies = [k for k in value if k in REPLY_COLUMNS]
    if not replies or not any(k in PROMPT_COLUMNS for k in prompts) or (len(prompts) == 1 and len(replies) == 1):
        return ""
    prompt, reply = f"the prompt ({', '.join(prompts)})", f"the reply ({', '.join(replies)})"
    if len(replies) == 1:
        return f"more than one column could be {prompt}"
    if len(prompts) == 1:
        return f"more than one column could be {reply}"
    return f"more than one column could be {prompt} and more than one {reply}"


def _shown_field(name: str) -> str:
    """A field name as the user wrote it, shortened; control characters (a
    terminal's escape codes, a line break) escaped, since they would act."""
    short = str(name)[:30]
    return short if short.isprintable() else repr(short)[1:-1]


def _text_field(value: dict, name: str, required: bool = True) -> str:
    if name not in value or value[name] is None:
        if required:
            raise RowProblem(f"missing field '{name}'")
        return ""
    text = value[name]
    if not isinstance(text, str):
        raise RowProblem(f"field '{name}' must be text, found {type(text).__name__}")
    if required and not text.strip():
        raise RowProblem(f"field '{name}' is empty")
    return text


def _system_turn(value: dict) -> tuple[Message, ...]:
    system = _text_field(value, "system", required=False)
    return (Message("system", system),) if system.strip() else ()


def _alpaca(row: int, value: dict, fmt: str) -> Example:
    instruction_field, reply_field = ALPACA_FIELDS[fmt]
    instruction = _text_field(value, instruction_field)
    extra = next((text for text in (_text_field(value, name, required=False) for name in ALPACA_INPUT_FIELDS)
                  if text.strip()), "")
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    turns = (Message("user", prompt), Message("assistant", _text_field(value, reply_field)))
    return Example(row, messages=_system_turn(value) + _history(value) + turns)


def _history(value: dict) -> tuple[Message, ...]:
    """LLaMA-Factory's Alpaca `history`: earlier [instruction, response]
    pairs, read as the turns before the row's own (their replies learned too)."""
    history = value.get("history")
    if history is None:
        return ()
    if not isinstance(history, list):
        raise RowProblem(f"field 'history' must be a list of [instruction, response] pairs, found {type(history).__name__}")
    turns: list[Message] = []
    for i, pair in enumerate(history, start=1):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) and t.strip() for t in pair)):
            raise RowProblem(f"history[{i}] must be a pair of texts [instruction, response]")
        turns += [Message("user", pair[0]), Message("assistant", pair[1])]
    return tuple(turns)


def _conversation(row: int, value: dict, fmt: str) -> Example:
    if fmt == "messages":
        messages = chat_turns(value.get("messages"), "messages", "role", "content", OPENAI_ROLES)
    else:
        messages = with_call_ids(chat_turns(value.get("conversations"), "conversations", "from", "value", SHAREGPT_ROLES))
    system = _system_turn(value)  # LLaMA-Factory's ShareGPT keeps the system prompt in a field
    if system and messages[0].role == "system":
        raise RowProblem("both a 'system' field and a system turn")
    return Example(row, messages=system + messages, tools=tools_field(value))


def _conversational_completion(row: int, value: dict) -> Example:
    """TRL's conversational prompt/completion (and unpaired preference, with a
    `label`): `prompt` and `completion` as lists of turns, read as one
    conversation whose completion is learned; assistant turns in the prompt
    are its context."""
    prompt, completion = value.get("prompt"), value.get("completion")
    if not isinstance(completion, list) or not completion:
        raise RowProblem("field 'completion' must be a list of turns when 'prompt' is one")
    messages = chat_turns(prompt + completion, "prompt + completion", "role", "content", OPENAI_ROLES)
    if not any(m.role == "assistant" for m in messages[len(prompt):]):
        raise RowProblem("field 'completion' has no assistant turn to learn from")
    return Example(row, messages=messages, tools=tools_field(value), learned_from=len(prompt))


def _desirable(value: dict) -> bool:
    """A KTO-style `label`: False (or a CSV's "false") marks a reply not to
    learn. A label of another kind (a class name, a number) is some other
    column, as in a classification file, and changes nothing."""
    label = value.get("label")
    if isinstance(label, str):
        return label.strip().lower() != "false"
    return label is not False


def to_example(raw: RawRow, fmt: str) -> Example:
    """Validate one parsed row against the detected format."""
    value = raw.value
    if not isinstance(value, dict):
        raise RowProblem(f"the row is not a JSON object (found {type(value).__name__})")
    if fmt in ALPACA_FIELDS:
        example = _alpaca(raw.row, value, fmt)
    elif fmt in ("messages", "sharegpt"):
        example = _conversation(raw.row, value, fmt)
    elif fmt == "prompt_completion" and isinstance(value.get("prompt"), list):
        example = _conversational_completion(raw.row, value)
    elif fmt in PROMPT_FIELDS:
        if doubt := _ambiguity(value):
            raise RowProblem(doubt)  # which column is the prompt is not ours to guess
        prompt_field, completion_field = PROMPT_FIELDS[fmt]
        example = Example(raw.row, prompt=_text_field(value, prompt_field), completion=_text_field(value, completion_field))
    elif fmt == "text":
        example = Example(raw.row, completion=_text_field(value, "text"))
    elif fmt in PREFERENCE_FORMATS:
        pair = to_pair(raw.row, value, fmt)
        return Example(raw.row, messages=pair.chosen_conversation(), rejected=pair.rejected,
                       learned_from=len(pair.prompt), tools=tools_field(value))
    else:
        raise AssertionError(f"unknown format {fmt}")
    desirable = _desirable(value)
    return example if desirable else replace(example, desirable=False)
