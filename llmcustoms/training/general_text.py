"""The forgetting measure a run chooses by: its loss on general chat rows it never trains on.

The forgetting check (`general_knowledge.py`) asks 67 questions before the
first step and after the last: a probe, reported to the user, and costly
(generation). To choose with, at every evaluation, a run needs a cheaper
signal that is not the probe itself, or the probe's numbers would flatter
the choice. So the package ships a second, separate set: 48 short general
chat rows written for llmcustoms (`general_text.json`: science, geography,
words, arithmetic, how-to, tech facts), none sharing a question with the
probe. At each evaluation the model's loss on their replies (teacher-forced,
in the run's own format, a forward only: about as much work as 48 short
evaluation rows) is measured beside the eval loss, as `general_loss` in
metrics.jsonl.

Forgetting is that loss's rise over the base model's, as a share (+0.05: 5%
higher). A run keeps, of its evaluations within `plan.forgetting_limit`, the
one of lowest eval loss, and early stopping counts only those as progress
(`position.Position.early_stop`); when none stays within it, the one that
forgot least is kept and the run says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TEXT_FILE = Path(__file__).with_name("general_text.json")


def general_messages(path: Path = TEXT_FILE) -> list[list[dict[str, str]]]:
    """The rows' conversations (a user turn, then the assistant's reply), in the file's order."""
    return [row["messages"] for row in json.loads(path.read_text(encoding="utf-8"))["rows"]]


def general_rows(hf_tokenizer: Any, plan: Any) -> Any:
    """The rows tokenized as the run's own rows are (its chat template, or its raw
    prompt and reply when it trains on raw text), the reply learned, cut to
    `plan.max_seq_len`; None for a run that measures no forgetting (preference
    pairs: their loss is not a language-model loss)."""
    return conversation_rows(hf_tokenizer, plan, general_messages())


def conversation_rows(hf_tokenizer: Any, plan: Any, conversations: list[list[dict[str, str]]]) -> Any:
    """Conversations of a user turn and a reply as the run's own rows (`general_rows`); also the
    replayed rows (`replay.py`). None for preference pairs, a stand-in tokenizer, or a template
    that refuses such turns."""
    from llmcustoms.data.chat_templates import prompts_use_template
    from llmcustoms.data.row_formats import Example
    from llmcustoms.data.token_store import TokenRows
    from llmcustoms.data.tokenization import Tokenizer
    from llmcustoms.models.loading import stop_token_ids

    if not plan.objective_kind.token_loss or getattr(hf_tokenizer, "eos_token_id", None) is None:
        return None  # no language-model loss, or a stand-in tokenizer (benchmarks time the loop with one)
    try:
        tokenizer = Tokenizer(hf_tokenizer, stop_token_ids=stop_token_ids(plan.model), raw_prompts=plan.raw_prompts)
        templated = prompts_use_template(hf_tokenizer, plan.data_format, plan.raw_prompts or not plan.data_report)
        examples = [Example(row, messages=tuple((m["role"], m["content"]) for m in messages)) if templated
                    else Example(row, prompt=messages[0]["content"] + "\n", completion=messages[1]["content"])
                    for row, messages in enumerate(conversations)]
        rows = TokenRows.from_examples([tokenizer.encode(example) for example in examples]).cut(plan.max_seq_len)
    except Exception:  # noqa: BLE001 - a template that refuses these turns: the run trains without them
        return None
    return rows


def forgetting(base_loss: float | None, loss: float | None) -> float | None:
    """The general loss's rise over the base model's, as a share; None when either is unknown."""
    if base_loss is None or loss is None or base_loss <= 0:
        return None
    return loss / base_loss - 1


def within_limit(base_loss: float | None, loss: float | None, limit: float) -> bool:
    """Whether an evaluation forgot no more than `limit` allows (0: no limit; unknown: within)."""
    rise = forgetting(base_loss, loss)
    return not limit or rise is None or rise <= limit
