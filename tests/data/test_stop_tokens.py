"""The token a reply ends with, and the plan's warning when a reply's learned
tokens leave it out (issue 35, item 4)."""

from __future__ import annotations

import numpy as np
import pytest

from llmcustoms.planning.train_options import TrainOptions

from llmcustoms.preparation.preparing import prepare_run
from llmcustoms.data.chat_templates import ensure_chat_template
from llmcustoms.data.pair_rows import PairRows
from llmcustoms.data.stop_tokens import end_of_turn, rows_missing_stop, stop_ids
from llmcustoms.data.token_store import TokenRows
from llmcustoms.data.tokenization import IGNORE_INDEX, TokenizedExample
from llmcustoms.planning.hardware import Hardware
from tiny_models import FIXTURES, build_model, build_tokenizer

# The end token is written only before the next turn (and in the generation
# prompt), never right after a reply: an earlier reply of a conversation learns no stop token.
END_BEFORE_NEXT_TURN = (
    "{% for message in messages %}{% if not loop.first %}</s>\n{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}</s>\n<|assistant|>\n{% endif %}"
)


@pytest.mark.parametrize("style, templated, token, from_template", [
    ("chatml", True, "<|im_end|>", True),   # Qwen's <|im_end|>, which is also its EOS
    ("zephyr", True, "</s>", True),         # the template writes EOS after each reply
    ("zephyr", False, "</s>", False),       # raw rows end with EOS
    ("none", True, "<|endoftext|>", True),  # the fallback template ends a reply with EOS
])
def test_the_end_of_turn_token_is_what_the_template_writes_after_a_reply(style, templated, token, from_template):
    tokenizer = build_tokenizer(style)
    ensure_chat_template(tokenizer)
    end = end_of_turn(tokenizer, templated)
    assert (end.name, end.from_template) == (token, from_template)
    assert end.token_id == tokenizer.convert_tokens_to_ids(token)


def test_a_template_end_token_that_is_not_eos_is_found_and_generation_stops_on_it():
    tokenizer = build_tokenizer("zephyr")
    tokenizer.chat_template = tokenizer.chat_template.replace("</s>", "<|im_end|>")
    end = end_of_turn(tokenizer, True)
    assert end.name == "<|im_end|>" and end.from_template and end.token_id != tokenizer.eos_token_id
    assert stop_ids(tokenizer, {7}, True) == {tokenizer.eos_token_id, 7, end.token_id}
    # A template that writes nothing special after a reply: EOS, which tokenization adds to a row's last reply.
    tokenizer.chat_template = END_BEFORE_NEXT_TURN
    assert (end_of_turn(tokenizer, True).name, end_of_turn(tokenizer, True).from_template) == ("</s>", False)


def _row(row: int, learned: list[tuple[list[int], bool]]) -> TokenizedExample:
    ids = [t for piece, _ in learned for t in piece]
    labels = [t if learns else IGNORE_INDEX for piece, learns in learned for t in piece]
    return TokenizedExample(row, ids, labels)


def test_rows_are_counted_when_one_of_their_replies_learns_no_stop_token(monkeypatch):
    stop = {2}
    rows = TokenRows.from_examples([
        _row(1, [([1, 10, 11], False), ([12, 2], True)]),                                # one reply, ends with a stop
        _row(2, [([1, 10], False), ([12, 13], True), ([14], False), ([15, 2], True)]),   # the first reply runs on
        _row(3, [([12, 13], True)]),                  # learned from its first token, no stop: starts a run there
        _row(4, [([2, 12, 2], True)]),                # learned from its first token, right after row 3's run
        _row(5, [([1, 10], False), ([12, 2, 9], True), ([14], False), ([15, 2], True)]),  # "<|im_end|>\n": still ends
    ])
    assert rows_missing_stop(rows, stop) == (2, 5)
    assert rows_missing_stop(rows.select([0, 3, 4]), stop) == (0, 3)
    # Blocks of a few tokens give the same answer as one block.
    monkeypatch.setattr("llmcustoms.data.stop_tokens.BLOCK_TOKENS", 3)
    assert rows_missing_stop(rows, stop) == (2, 5)
    # A pair's two halves are one data row.
    pairs = PairRows(TokenRows.from_examples([_row(7, [([1], False), ([12], True)]), _row(7, [([1], False), ([2], True)]),
                                              _row(8, [([1], False), ([2], True)]), _row(8, [([1], False), ([2], True)])]))
    assert rows_missing_stop(pairs, stop) == (1, 2)


def _plan_advice(model_dir, tmp_path, data: str = "sharegpt.json") -> tuple[dict, list[str]]:
    options = TrainOptions(data=str(FIXTURES / data), model=str(model_dir), cache_dir=str(tmp_path / "cache"),
                           overrides={"max_steps": (2, "flag")})
    report = prepare_run(options, Hardware.cpu_only()).plan.data_report
    return report, [line for line in report["advice"] if "never learns to end" in line]


def test_the_plan_warns_when_a_template_leaves_the_end_token_out_of_a_reply(tmp_path):
    model_dir = build_model("llama", tmp_path / "llama")
    report, warned = _plan_advice(model_dir, tmp_path)  # multi-turn rows, a template that ends every reply with </s>
    assert not warned and "replies_without_end_token" not in report

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = END_BEFORE_NEXT_TURN
    tokenizer.save_pretrained(model_dir)
    report, warned = _plan_advice(model_dir, tmp_path)
    found = report["replies_without_end_token"]
    multi_turn = found["rows"]
    assert (found["token"], found["template_ends_reply"]) == ("</s>", False)
    assert 0 < multi_turn < found["of"]  # the rows of one reply still learn to stop
    (line,) = warned
    assert line.startswith(f"{multi_turn:,} rows have a reply that never learns to end with </s>")
    assert "one row per reply" in line and "writes no end-of-turn token" in line
    # One reply a row: the last reply always learns a stop token, whatever the template.
    assert not _plan_advice(model_dir, tmp_path, "messages.jsonl")[1]


def test_rows_whose_end_token_is_masked_are_counted(tmp_path, monkeypatch):
    masked_end_token(monkeypatch)
    model_dir = build_model("qwen2", tmp_path / "qwen")
    report, (line,) = _plan_advice(model_dir, tmp_path, "messages.jsonl")
    found = report["replies_without_end_token"]
    assert found["rows"] == found["of"] and found["token"] == "<|im_end|>" and found["template_ends_reply"]
    assert "it is outside the learned tokens" in line


def masked_end_token(monkeypatch) -> None:
    """Tokenization as it would be if the labels left every stop token out (the tokens stay in the rows)."""
    from llmcustoms.data.tokenization import Tokenizer

    assemble = Tokenizer._assemble

    def masked(self, segments, pieces):
        ids, learned = assemble(self, segments, pieces)
        return ids, np.where(np.isin(ids, sorted(self.stop_token_ids)), 0, learned).astype(np.uint8)

    monkeypatch.setattr(Tokenizer, "_assemble", masked)
