"""Preference rows (DPO): a prompt, a chosen reply and a rejected one.

Three shapes, as the field's tools write them (an assistant turn may carry
tool calls, as OpenAI's `tool_calls`, and the row a `tools` list):

  preference           prompt, chosen, rejected as text                 (TRL's standard shape;
                       without a prompt field, the prompt is the text chosen and
                       rejected begin with, as in Anthropic's hh-rlhf: TRL's implicit prompt)
  preference_chat      prompt, chosen, rejected as lists of turns       (TRL's conversational shape;
                       the prompt may hold a system turn and earlier turns)
                       or chosen and rejected as whole conversations with no
                       prompt field: the prompt is the turns they share (TRL's implicit prompt)
  preference_sharegpt  conversations (or messages) for the prompt, and chosen and
                       rejected as one reply turn each                  (LLaMA-Factory)

A pair whose chosen and rejected replies are the same, or either is empty,
teaches nothing and is a bad row. As everywhere, a problem names the field,
never the content. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmcustoms.data.chat_turns import OPENAI_ROLES, SHAREGPT_ROLES, Message, RowProblem, content_text, openai_calls

PREFERENCE_FORMATS = {
    "preference": "preference pairs (prompt, chosen, rejected as text)",
    "preference_chat": "preference pairs (prompt, chosen, rejected as turns)",
    "preference_sharegpt": "preference pairs (conversations, chosen, rejected)",
}
ROLES = {**OPENAI_ROLES, **SHAREGPT_ROLES}


@dataclass(frozen=True)
class PreferencePair:
    """One preference row, normalised: the prompt's turns (ending with the
    user's), and the assistant turns of each reply."""

    row: int
    prompt: tuple[Message, ...]
    chosen: tuple[Message, ...]
    rejected: tuple[Message, ...]

    def chosen_conversation(self) -> tuple[Message, ...]:
        return self.prompt + self.chosen

    def rejected_conversation(self) -> tuple[Message, ...]:
        return self.prompt + self.rejected


def preference_format(value: dict) -> str | None:
    """Which preference shape a row has, if any."""
    if not {"chosen", "rejected"} <= set(value):
        return None
    if "conversations" in value or "messages" in value:
        return "preference_sharegpt"
    if isinstance(value.get("chosen"), list) or isinstance(value.get("prompt"), list):
        return "preference_chat"
    return "preference"


def to_pair(row: int, value: dict, fmt: str) -> PreferencePair:
    """Validate one preference row against the detected shape."""
    if fmt == "preference" and "prompt" not in value:
        prompt, chosen, rejected = _shared_text(_text(value, "chosen"), _text(value, "rejected"))
    elif fmt == "preference":
        prompt = (Message("user", _text(value, "prompt")),)
        chosen, rejected = (Message("assistant", _text(value, "chosen")),), (Message("assistant", _text(value, "rejected")),)
    elif fmt == "preference_chat" and "prompt" not in value:
        prompt, chosen, rejected = _shared_prompt(_turns(value.get("chosen"), "chosen"),
                                                  _turns(value.get("rejected"), "rejected"))
    elif fmt == "preference_chat":  # the prompt may still be a text: the user's turn
        prompt = ((Message("user", _text(value, "prompt")),) if isinstance(value.get("prompt"), str)
                  else _turns(value.get("prompt"), "prompt"))
        chosen, rejected = _reply(value.get("chosen"), "chosen"), _reply(value.get("rejected"), "rejected")
    else:
        name = "conversations" if "conversations" in value else "messages"
        prompt = _turns(value.get(name), name)
        chosen, rejected = _reply(value.get("chosen"), "chosen"), _reply(value.get("rejected"), "rejected")
    return _checked(PreferencePair(row, prompt, chosen, rejected))


def _text(value: dict, name: str) -> str:
    text = value.get(name)
    if not isinstance(text, str):
        raise RowProblem(f"missing field '{name}'" if text is None else
                         f"field '{name}' must be text, found {type(text).__name__}")
    if not text.strip():
        raise RowProblem(f"field '{name}' is empty")
    return text


def _turns(turns: Any, name: str) -> tuple[Message, ...]:
    if isinstance(turns, dict):  # one turn, as LLaMA-Factory writes a reply
        turns = [turns]
    if not isinstance(turns, list) or not turns:
        raise RowProblem(f"field '{name}' must be a list of turns" + ("" if turns is None else
                                                                      f", found {type(turns).__name__}"))
    messages = []
    for i, turn in enumerate(turns, start=1):
        where = f"{name}[{i}]"
        if not isinstance(turn, dict):
            raise RowProblem(f"turn is not an object, found {type(turn).__name__} ({where})")
        role = turn.get("role", turn.get("from"))
        if not isinstance(role, str) or role not in ROLES or ROLES[role] not in ("system", "user", "assistant"):
            raise RowProblem(f"{'missing role' if role is None else 'unsupported role'} ({where}; "
                             "accepted in preference rows: system, user, assistant)")
        calls = openai_calls(turn.get("tool_calls"), where) if ROLES[role] == "assistant" else ()
        messages.append(Message(ROLES[role], content_text(turn.get("content", turn.get("value")), where,
                                                          may_be_null=bool(calls)), calls))
    return tuple(messages)


def _reply(value: Any, name: str) -> tuple[Message, ...]:
    """A reply: a text, one assistant turn, or a list of them."""
    if isinstance(value, str):
        return (Message("assistant", _text({name: value}, name)),)
    return _turns(value, name)


def _shared_prompt(chosen: tuple[Message, ...],
                   rejected: tuple[Message, ...]) -> tuple[tuple[Message, ...], tuple[Message, ...], tuple[Message, ...]]:
    """TRL's implicit prompt: the turns both conversations begin with, up to
    the last user turn they share."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    while shared and chosen[shared - 1].role != "user":
        shared -= 1
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _shared_text(chosen: str, rejected: str) -> tuple[tuple[Message, ...], tuple[Message, ...], tuple[Message, ...]]:
    """TRL's implicit prompt for text pairs: the text both begin with (less a
    space it ends with) is the prompt, the rest of each its reply."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared and chosen[shared - 1] == " ":
        shared -= 1
    if not chosen[:shared].strip():
        raise RowProblem("missing field 'prompt', and 'chosen' and 'rejected' begin with no shared prompt")
    return ((Message("user", chosen[:shared]),), (Message("assistant", chosen[shared:]),),
            (Message("assistant", rejected[shared:]),))


def _checked(pair: PreferencePair) -> PreferencePair:
    if not pair.prompt or pair.prompt[-1].role != "user":
        raise RowProblem("the prompt must end with a user turn")
    if any(m.role == "system" for m in pair.prompt[1:]):
        raise RowProblem("the prompt has a system turn that is not the first turn")
    for name, reply in (("chosen", pair.chosen), ("rejected", pair.rejected)):
        if not reply or any(m.role != "assistant" for m in reply):
            raise RowProblem(f"field '{name}' must be the assistant's reply")
        if not any(m.content.strip() or m.tool_calls for m in reply):
            raise RowProblem(f"field '{name}' is empty")
    if [(m.content.strip(), m.tool_calls) for m in pair.chosen] == [(m.content.strip(), m.tool_calls) for m in pair.rejected]:
        raise RowProblem("chosen and rejected are the same reply")
    return pair
