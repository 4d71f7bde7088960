"""The turns of a chat row: `Message`, `ToolCall`, and how the turns of an
OpenAI `messages` list or a ShareGPT `conversations` list become them.

A turn's content is text, or a list of parts `{type, text}` (or `{type,
value}`): text parts are joined with a line break as OpenAI-compatible
servers join them; in an assistant turn, `reasoning` parts are its reasoning
(`Message.reasoning`, shown to templates that read `reasoning_content`) and
`tool_call` parts its calls, written as ShareGPT's function_call value is.
An OpenAI assistant turn may carry `weight` 0 (in the context, never learned:
`Message.learned`) or 1. Tool calling comes in two spellings:

  OpenAI     an assistant turn with `tool_calls: [{id, type, function: {name,
             arguments}}]` (content may be null), then `{role: tool, content,
             tool_call_id}` turns with the results
  ShareGPT   a `function_call` turn whose value is JSON text of {name,
             arguments} (or a list of them), then `observation` turns
             (LLaMA-Factory's shape)

A problem raises `RowProblem` with a message that names the field and says
where in the row it is, in parentheses, so the same kind of problem groups
under one reason; never the content. No torch here.
"""

from __future__ import annotations

import json
import re
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

from llmcustoms.data.raw_rows import DEEP_JSON, MAX_DEPTH, BeyondLimits, parse_json, too_deep

ROLES = ("system", "user", "assistant", "tool")
# "developer" is what newer OpenAI exports call the system turn.
OPENAI_ROLES = {**{role: role for role in ROLES}, "developer": "system"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system",
                  "function_call": "assistant", "observation": "tool", "tool": "tool"}
# A role or part type is shown in a message only if it looks like a name:
# anything else could be a piece of the row's content.
_NAME = re.compile(r"[\w.\-]+")
SHOWN_NAME_CHARS = 20


class RowProblem(Exception):
    """A problem with one row; the reader adds the file and line."""


@dataclass(frozen=True)
class ToolCall:
    """One call an assistant turn makes. `arguments` is JSON text of an object."""

    name: str
    arguments: str = "{}"
    id: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The call as chat templates read it (arguments as an object, not text)."""
        call: dict[str, Any] = {"type": "function", "function": {"name": self.name, "arguments": json.loads(self.arguments)}}
        if self.id:
            call["id"] = self.id
        return call

    def chars(self) -> int:
        return len(self.name) + len(self.arguments)


@dataclass(frozen=True)
class Message:
    """One turn: a role and its content; beside them, an assistant turn may
    carry `tool_calls`, its `reasoning` parts and whether it is `learned`,
    and a tool result its `tool_call_id` and `name`."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""
    # False for an assistant turn marked `weight: 0`: the context of later
    # turns, never learned. Templates never see it (`as_dict`).
    learned: bool = True
    reasoning: tuple[str, ...] = ()

    def chars(self) -> int:
        return (len(self.content) + sum(map(len, self.reasoning))
                + sum(call.chars() for call in self.tool_calls))

    def text(self) -> str:
        """The content and the calls as text: what this turn says."""
        calls = [f"{call.name}({call.arguments})" for call in self.tool_calls]
        return "\n".join(([self.content] if self.content else []) + calls)

    def as_dict(self, reasoning: bool = False) -> dict[str, Any]:
        """The turn as `apply_chat_template` takes it, with its reasoning as
        `reasoning_content` if `reasoning` (the template shows it). Keys a turn
        does not use are left out: some templates test `is defined`, not truthiness."""
        turn: dict[str, Any] = {"role": self.role, "content": self.content}
        if reasoning and self.reasoning:
            turn["reasoning_content"] = "\n".join(self.reasoning)
        if self.tool_calls:
            turn["tool_calls"] = [call.as_dict() for call in self.tool_calls]
        if self.tool_call_id:
            turn["tool_call_id"] = self.tool_call_id
        if self.name:
            turn["name"] = self.name
        return turn

    def clipped(self, room: int) -> "Message":
        """The reasoning, then the content, cut to `room` characters in all (as
        templates write them); calls are whole or gone, since a cut call is not valid JSON."""
        reasoning, left = [], room
        for part in self.reasoning:
            if left <= 0:
                break
            reasoning.append(part[:left])
            left -= len(reasoning[-1])
        content = self.content[:max(left, 0)]
        calls, left = [], left - len(content)
        for call in self.tool_calls:
            if call.chars() > left:
                break
            calls.append(call)
            left -= call.chars()
        return replace(self, content=content, tool_calls=tuple(calls), reasoning=tuple(reasoning))


def shown_name(value: Any) -> str:
    """A role or type as written, quoted and shortened, if it looks like a name."""
    if isinstance(value, str) and _NAME.fullmatch(value):
        return repr(value[:SHOWN_NAME_CHARS] + ("..." if len(value) > SHOWN_NAME_CHARS else ""))
    return "that is not a name" if isinstance(value, str) else f"of type {type(value).__name__}"


def reasoning_parts(messages: tuple[Message, ...]) -> int:
    """How many reasoning parts the turns hold: what a template that does not
    show reasoning leaves out."""
    return sum(len(message.reasoning) for message in messages)


def chat_turns(turns: Any, field_name: str, role_key: str, content_key: str,
               roles: dict[str, str]) -> tuple[Message, ...]:
    """The turns of a `messages` or `conversations` field, checked. Only
    OpenAI's shape (`role_key` "role") has per-turn weights."""
    if not isinstance(turns, list):
        raise RowProblem(f"field '{field_name}' must be a list of turns, found {type(turns).__name__}")
    other_role_key = "from" if role_key == "role" else "role"
    other_content_key = "value" if content_key == "content" else "content"
    messages = []
    for i, turn in enumerate(turns, start=1):
        where = f"{field_name}[{i}]"
        if not isinstance(turn, dict):
            raise RowProblem(f"turn is not an object, found {type(turn).__name__} ({where})")
        # Exports mix the spellings (role/content in ShareGPT files and back); accept either.
        role = turn.get(role_key, turn.get(other_role_key))
        content = turn.get(content_key, turn.get(other_content_key))
        if not isinstance(role, str) or role not in roles:
            found = "missing role" if role is None else f"unknown role {shown_name(role)}"
            raise RowProblem(f"{found} ({where}; accepted: {', '.join(sorted(roles))})")
        if role == "function_call":
            messages.append(Message("assistant", "", _calls_of(content, "function_call value", where)))
        else:
            message = _turn(roles[role], turn, content, where)
            if role_key == "role":  # OpenAI's shape
                message = replace(message, learned=_weight(turn, message.role, where))
            messages.append(message)
    return _checked(messages, field_name)


def _turn(role: str, turn: dict, content: Any, where: str) -> Message:
    assistant = role == "assistant"
    calls = openai_calls(turn.get("tool_calls"), where) if assistant else ()
    text, reasoning, part_calls = _content(content, where, ASSISTANT_PARTS if assistant else ("text",),
                                           may_be_null=bool(calls))
    calls += part_calls
    # A tool may return nothing; any other turn with nothing in it is a mistake.
    if not text.strip() and not calls and role != "tool":
        raise RowProblem(f"empty {role} turn ({where})")
    if role == "tool":
        return Message("tool", text, tool_call_id=_optional_text(turn, "tool_call_id", where),
                       name=_optional_text(turn, "name", where))
    return Message(role, text, calls, reasoning=reasoning)


def _weight(turn: dict, role: str, where: str) -> bool:
    """Whether an OpenAI turn is learned: its `weight`, 1 (or none) or 0. A
    null weight is none: Arrow, parquet and `Dataset.to_json` write one on
    every turn of a column where some turns have a weight."""
    if turn.get("weight") is None:
        return True
    weight = turn["weight"]
    if role != "assistant":
        # Only replies are learned or not; a weight elsewhere is a misunderstanding, not ignored.
        raise RowProblem(f"'weight' on a {role} turn; only assistant turns have one ({where})")
    # 1.0 is 1 (Parquet writes numbers as floats); True is not, though Python says it is.
    if isinstance(weight, (int, float)) and not isinstance(weight, bool) and weight in (0, 1):
        return weight == 1
    found = {bool: "true or false", str: "text", type(None): "null", int: "another number",
             float: "another number"}.get(type(weight), type(weight).__name__)
    raise RowProblem(f"'weight' must be 0 or 1, found {found} ({where})")


def _checked(messages: list[Message], field_name: str) -> tuple[Message, ...]:
    # Turns after the last learned reply teach nothing (a reply marked weight 0
    # among them): drop them, so a row always ends with the reply it teaches.
    had_reply = any(m.role == "assistant" for m in messages)
    while messages and not (messages[-1].role == "assistant" and messages[-1].learned):
        messages.pop()
    if not messages:
        if had_reply:
            raise RowProblem(f"every assistant turn in field '{field_name}' has weight 0: nothing to learn")
        raise RowProblem(f"field '{field_name}' has no assistant turn to learn from")
    if messages[0].role == "assistant":  # nothing asks for it: a template cannot render what comes before
        raise RowProblem(f"field '{field_name}' starts with an assistant turn: a user turn must come before the reply")
    if any(m.role == "system" for m in messages[1:]):
        raise RowProblem(f"field '{field_name}' has a system turn that is not the first turn")
    for i, message in enumerate(messages):
        before = messages[i - 1] if i else None
        if message.role == "tool" and not (before and (before.tool_calls or before.role == "tool")):
            raise RowProblem(f"tool result without a tool call before it ({field_name}[{i + 1}])")
    return tuple(messages)


# The parts an assistant turn's content may hold; other turns hold text only.
ASSISTANT_PARTS = ("text", "reasoning", "tool_call")


def content_text(content: Any, where: str, may_be_null: bool = False) -> str:
    """A turn's text: a string, or the text parts of a list joined by line breaks."""
    return _content(content, where, ("text",), may_be_null)[0]


def _content(content: Any, where: str, kinds: tuple[str, ...],
             may_be_null: bool = False) -> tuple[str, tuple[str, ...], tuple[ToolCall, ...]]:
    """A turn's text, reasoning parts and calls, from a string or a list of
    parts of the `kinds` given."""
    if content is None and may_be_null:
        return "", (), ()
    if isinstance(content, str):
        return content, (), ()
    if not isinstance(content, list):
        raise RowProblem(f"content must be text or a list of text parts, found {type(content).__name__} ({where})")
    texts, reasoning, calls = [], [], []
    for j, part in enumerate(content, start=1):
        at = f"{where}.content[{j}]"
        kind, key, payload = _part(part, kinds, at)
        if kind == "tool_call":
            calls += _calls_of(payload, f"tool_call part's '{key}'", at)
        elif kind == "reasoning":
            if payload.strip():  # an empty one says nothing, and is not counted as left out
                reasoning.append(payload)
        else:
            texts.append(payload)
    return "\n".join(texts), tuple(reasoning), tuple(calls)


def _part(part: Any, kinds: tuple[str, ...], where: str) -> tuple[str, str, Any]:
    """A content part's type, key and what it holds: under `text`, or `value`
    as some exports write it (for a tool_call part, an object or JSON text)."""
    if isinstance(part, str):
        return "text", "", part
    if not isinstance(part, dict):
        raise RowProblem(f"content part is not an object, found {type(part).__name__} ({where})")
    kind = part.get("type", "text")
    if kind not in ASSISTANT_PARTS:
        raise RowProblem(f"content part of type {shown_name(kind)} is not text ({where}; only text, reasoning and "
                         "tool_call parts can be trained on)")
    if kind not in kinds:
        raise RowProblem(f"content part of type '{kind}' is only read in an assistant turn of a chat row ({where})")
    key = next((key for key in ("text", "value") if key in part), None)
    if key is None:
        raise RowProblem(f"{kind} part without 'text' or 'value' ({where})")
    if kind != "tool_call" and not isinstance(part[key], str):
        raise RowProblem(f"{kind} part's '{key}' must be text, found {type(part[key]).__name__} ({where})")
    return kind, key, part[key]


def _optional_text(turn: dict, key: str, where: str) -> str:
    value = turn.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RowProblem(f"'{key}' must be text, found {type(value).__name__} ({where})")
    return value


def openai_calls(calls: Any, where: str) -> tuple[ToolCall, ...]:
    if calls is None:
        return ()
    if not isinstance(calls, list):
        raise RowProblem(f"'tool_calls' must be a list, found {type(calls).__name__} ({where})")
    return tuple(_tool_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls, start=1))


def _tool_call(call: Any, where: str) -> ToolCall:
    if not isinstance(call, dict):
        raise RowProblem(f"tool call is not an object, found {type(call).__name__} ({where})")
    # Hugging Face also takes {name, arguments} without the `function` wrapper.
    function = call.get("function", call)
    if not isinstance(function, dict):
        raise RowProblem(f"tool call 'function' is not an object, found {type(function).__name__} ({where})")
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        raise RowProblem(f"tool call without a name ({where})")
    call_id = call.get("id") or ""
    if not isinstance(call_id, str):
        raise RowProblem(f"tool call 'id' must be text, found {type(call_id).__name__} ({where})")
    return ToolCall(name, _arguments(function.get("arguments"), where), call_id)


def _arguments(arguments: Any, where: str) -> str:
    # OpenAI writes arguments as JSON text, Hugging Face as an object; templates
    # print them with `tojson`, so they are kept as an object (text here, to stay hashable).
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        arguments = {}
    if isinstance(arguments, str):
        arguments = _json_text(arguments, "tool call arguments are", where)
    if not isinstance(arguments, dict):
        raise RowProblem(f"tool call arguments must be an object, found {type(arguments).__name__} ({where})")
    if too_deep(arguments):  # json.dumps and the template recurse through them
        raise RowProblem(f"tool call arguments are nested more than {MAX_DEPTH} levels deep ({where})")
    return json.dumps(arguments, ensure_ascii=False)


def _json_text(text: str, subject: str, where: str = "") -> Any:
    """JSON held as text in a field, parsed within the limits on a row."""
    place = f" ({where})" if where else ""
    try:
        return parse_json(text)
    except json.JSONDecodeError:
        raise RowProblem(f"{subject} not valid JSON{place}") from None
    except BeyondLimits as exc:
        if str(exc) == DEEP_JSON:
            raise RowProblem(f"{subject} {exc}{place}") from None
        raise RowProblem(f"{subject.rsplit(' ', 1)[0]}: {exc}{place}") from None  # "tool call arguments: text that..."


def _calls_of(value: Any, subject: str, where: str) -> tuple[ToolCall, ...]:
    """Calls written as ShareGPT's function_call value (or a tool_call part)
    holds them: {name, arguments}, a list of them, or JSON text of either."""
    if isinstance(value, str):
        value = _json_text(value, f"{subject} is", where)
    calls = value if isinstance(value, list) else [value]
    if not calls:
        raise RowProblem(f"{subject} without a call ({where})")
    return tuple(_tool_call(call, where) for call in calls)


def with_call_ids(messages: tuple[Message, ...]) -> tuple[Message, ...]:
    """ShareGPT names no call ids, and some templates need them (Mistral's
    checks them): number the calls, and give each result the id and name of
    the oldest call not yet answered."""
    out, waiting, count = [], deque(), 0
    for message in messages:
        if message.tool_calls:
            calls = []
            for call in message.tool_calls:
                count += 1
                # Nine letters and digits: the shape Mistral's template insists on.
                call = call if call.id else replace(call, id=f"call{count:05d}")
                waiting.append(call)
                calls.append(call)
            message = replace(message, tool_calls=tuple(calls))
        elif message.role == "tool" and not message.tool_call_id and waiting:
            call = waiting.popleft()
            message = replace(message, tool_call_id=call.id, name=message.name or call.name)
        out.append(message)
    return tuple(out)


def tools_field(value: dict) -> str:
    """The row's `tools` (a list of schemas, or JSON text of one) as JSON text,
    each schema in OpenAI's {type: function, function: {...}} shape."""
    tools = value.get("tools")
    if tools is None or (isinstance(tools, str) and not tools.strip()):
        return ""
    if isinstance(tools, str):
        tools = _json_text(tools, "field 'tools' is")
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise RowProblem(f"field 'tools' must be a list of tool schemas, found {type(tools).__name__}")
    if too_deep(tools):  # json.dumps and the template recurse through them
        raise RowProblem(f"field 'tools' is nested more than {MAX_DEPTH} levels deep")
    # A bare {name, description, parameters} is wrapped the way OpenAI-compatible
    # servers pass tools to the template, so training and serving agree.
    wrapped = [tool if "function" in tool else {"type": "function", "function": tool} for tool in tools]
    return json.dumps(wrapped, ensure_ascii=False) if wrapped else ""
