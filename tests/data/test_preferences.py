"""Preference rows (DPO): each shape the field writes becomes the same pair of
conversations; pairs that teach nothing are bad rows."""

from __future__ import annotations

import pytest

from llmcustoms.data.chat_turns import Message, RowProblem
from llmcustoms.data.preference_pairs import preference_format, to_pair

USER, SYSTEM = Message("user", "What is water made of?"), Message("system", "Be brief.")
GOOD, BAD = Message("assistant", "Hydrogen and oxygen."), Message("assistant", "Cheese.")


def pair(value: dict):
    fmt = preference_format(value)
    assert fmt is not None
    return fmt, to_pair(7, value, fmt)


def test_trl_standard_shape():
    fmt, p = pair({"prompt": USER.content, "chosen": GOOD.content, "rejected": BAD.content})
    assert fmt == "preference"
    assert p.chosen_conversation() == (USER, GOOD) and p.rejected_conversation() == (USER, BAD) and p.row == 7


def test_trl_conversational_shape_keeps_the_system_and_earlier_turns():
    earlier = (Message("user", "Hi"), Message("assistant", "Hello."))
    turns = [{"role": m.role, "content": m.content} for m in (SYSTEM, *earlier, USER)]
    fmt, p = pair({"prompt": turns, "chosen": [{"role": "assistant", "content": GOOD.content}],
                   "rejected": [{"role": "assistant", "content": BAD.content}]})
    assert fmt == "preference_chat"
    assert p.prompt == (SYSTEM, *earlier, USER) and p.chosen == (GOOD,) and p.rejected == (BAD,)


def test_trl_implicit_prompt_is_the_shared_beginning():
    def conversation(reply):
        return [{"role": "user", "content": USER.content}, {"role": "assistant", "content": reply.content}]

    fmt, p = pair({"chosen": conversation(GOOD), "rejected": conversation(BAD)})
    assert fmt == "preference_chat" and p.prompt == (USER,) and p.chosen == (GOOD,) and p.rejected == (BAD,)


def test_llama_factory_sharegpt_shape():
    fmt, p = pair({"conversations": [{"from": "system", "value": SYSTEM.content}, {"from": "human", "value": USER.content}],
                   "chosen": {"from": "gpt", "value": GOOD.content}, "rejected": {"from": "gpt", "value": BAD.content}})
    assert fmt == "preference_sharegpt" and p.prompt == (SYSTEM, USER) and p.chosen == (GOOD,) and p.rejected == (BAD,)


@pytest.mark.parametrize("value,problem", [
    ({"prompt": "q", "chosen": "same", "rejected": " same "}, "chosen and rejected are the same reply"),
    ({"prompt": "q", "chosen": "", "rejected": "no"}, "field 'chosen' is empty"),
    ({"prompt": "q", "chosen": "yes", "rejected": None}, "missing field 'rejected'"),
    ({"prompt": "q", "chosen": [{"role": "assistant", "content": "yes"}], "rejected": 3},
     "field 'rejected' must be a list of turns, found int"),
    ({"prompt": [{"role": "assistant", "content": "a"}], "chosen": "yes", "rejected": "no"},
     "the prompt must end with a user turn"),
    ({"prompt": "q", "chosen": [{"role": "user", "content": "x"}], "rejected": "no"},
     "field 'chosen' must be the assistant's reply"),
    ({"prompt": [{"role": "robot", "content": "q"}], "chosen": "yes", "rejected": "no"}, "unsupported role"),
])
def test_pairs_that_teach_nothing_are_bad_rows_named_without_their_content(value, problem):
    with pytest.raises(RowProblem) as caught:
        pair(value)
    assert problem in str(caught.value)
    assert "same" not in str(caught.value).replace("the same reply", "")  # never the row's text


def test_rows_without_both_replies_are_not_preference_rows():
    assert preference_format({"prompt": "q", "chosen": "a"}) is None
    assert preference_format({"messages": []}) is None
