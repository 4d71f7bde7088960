"""The token a reply ends with, and whether the tokenized rows teach it.

A model stops replying when it writes a token generation stops on: the
tokenizer's EOS, the stop tokens of the model's generation_config.json, and the
end-of-turn token its chat template writes right after an assistant reply
(ChatML's <|im_end|>, Llama 3's <|eot_id|>, Gemma's <end_of_turn>).
`end_of_turn` finds that last one by rendering a probe conversation; plain text
and raw prompt/completion rows end with EOS. A reply whose learned tokens hold
none of them teaches the model to go on after it: the most common reason a
fine-tuned model "never stops".

`tokenization.Tokenizer` always ends a row's last reply with a stop token, so
what can miss it is an earlier reply of a conversation whose template writes
the end token outside the reply (or not at all), or a reply masked some other
way. `end_token_facts` counts the rows with such a reply, over the store's
flat arrays a block at a time, for the data report (`planning/data_advice.py`
says what to do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from llmcustoms.data.pair_rows import PairRows
from llmcustoms.data.token_store import TokenRows

# The probe's reply: text no template changes, so what follows it is what the template adds after a reply.
PROBE_REPLY = "llmcustoms probe reply"
PROBE = ({"role": "user", "content": "Hello."}, {"role": "assistant", "content": PROBE_REPLY})
# Tokens scanned at a time: a few tens of MB of temporary arrays, whatever the data's size.
BLOCK_TOKENS = 1 << 22


@dataclass(frozen=True)
class EndOfTurn:
    """The token a reply ends with: the chat template's end-of-turn token, or EOS."""

    token_id: int
    name: str  # as the tokenizer writes it: "<|im_end|>"
    from_template: bool  # the template writes it right after a reply (else EOS, which llmcustoms adds to a row's last reply)


def special_ids(hf_tokenizer: Any) -> set[int]:
    """The ids of the tokenizer's special tokens: its named ones and the added tokens marked special."""
    added = {i for i, token in hf_tokenizer.added_tokens_decoder.items() if token.special}
    return set(hf_tokenizer.all_special_ids) | added


def end_of_turn(hf_tokenizer: Any, templated: bool) -> EndOfTurn:
    """The token a reply ends with, for rows shown through the chat template
    (`templated`, `chat_templates.prompts_use_template`) or not (EOS)."""
    eos = hf_tokenizer.eos_token_id
    found = _template_end(hf_tokenizer) if templated else None
    token = eos if found is None else found
    return EndOfTurn(token, str(hf_tokenizer.convert_ids_to_tokens(token)), found is not None)


def _template_end(hf_tokenizer: Any) -> int | None:
    """The first special token the chat template writes after an assistant reply, if any."""
    from jinja2 import TemplateError

    try:
        text = hf_tokenizer.apply_chat_template(list(PROBE), tokenize=False)
    except (TemplateError, TypeError, ValueError, KeyError):  # no template, or one that refuses the probe
        return None
    if not isinstance(text, str) or PROBE_REPLY not in text:
        return None
    after = text[text.rindex(PROBE_REPLY) + len(PROBE_REPLY):]
    special = special_ids(hf_tokenizer)
    return next((i for i in hf_tokenizer(after, add_special_tokens=False)["input_ids"] if i in special), None)


def stop_ids(hf_tokenizer: Any, generation_stops: set[int], templated: bool) -> set[int]:
    """Every token a reply may end with: EOS, the generation_config's stop tokens
    (`loading.stop_token_ids`) and the end-of-turn token."""
    return {hf_tokenizer.eos_token_id} | set(generation_stops) | {end_of_turn(hf_tokenizer, templated).token_id}


def rows_missing_stop(rows: TokenRows | PairRows, stop: set[int]) -> tuple[int, int]:
    """(data rows with a learned reply that holds none of `stop`, data rows), among
    `rows`. A reply is a run of learned tokens; a row's learned tokens are all one
    run with --train-on-prompt, so then only a row missing every stop token counts."""
    rows = rows.rows if isinstance(rows, PairRows) else rows
    missing = _store_rows_missing(rows.arrays, np.array(sorted(stop), np.int64))[rows.index]
    numbers = rows.row_numbers
    return len(np.unique(numbers[missing])), len(np.unique(numbers))


def _store_rows_missing(arrays: Any, stop: np.ndarray) -> np.ndarray:
    """Whether each row of a store has a run of learned tokens without a stop token."""
    offsets = np.asarray(arrays.offsets)
    count = len(offsets) - 1
    missing = np.zeros(count, bool)
    first = 0
    while first < count:
        last = min(count, max(first + 1, int(np.searchsorted(offsets, offsets[first] + BLOCK_TOKENS, "right")) - 1))
        start, end = int(offsets[first]), int(offsets[last])
        learned = np.asarray(arrays.learned[start:end]) != 0
        row_starts = offsets[first:last] - start
        row_starts = row_starts[row_starts < len(learned)]
        begins = learned.copy()  # where a run of learned tokens begins: after one not learned, or at a row's start
        begins[1:] &= ~learned[:-1]
        begins[row_starts] = learned[row_starts]
        runs = int(begins.sum())
        if runs:
            run_of = np.cumsum(begins) - 1  # the run each learned token belongs to
            stops = learned & np.isin(np.asarray(arrays.ids[start:end]), stop)
            ended = np.bincount(run_of[stops], minlength=runs) > 0
            owners = np.searchsorted(row_starts, np.flatnonzero(begins), "right") - 1 + first
            missing[owners[~ended]] = True
        first = last
    return missing


def end_token_facts(hf_tokenizer: Any, rows: TokenRows | PairRows, templated: bool,
                    generation_stops: set[int]) -> dict[str, Any]:
    """For the data report: the rows whose replies do not all learn a stop token
    (`replies_without_end_token`: how many, of how many, the end-of-turn token
    and whether the template writes it after a reply); empty when every reply does."""
    end = end_of_turn(hf_tokenizer, templated)
    missing, total = rows_missing_stop(rows, {hf_tokenizer.eos_token_id} | set(generation_stops) | {end.token_id})
    if not missing:
        return {}
    return {"replies_without_end_token": {"rows": missing, "of": total, "token": end.name,
                                          "template_ends_reply": end.from_template}}
