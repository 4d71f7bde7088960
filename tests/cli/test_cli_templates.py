"""Every assistant reply learned once, and nothing else, with the original
chat templates of today's families (TRL's copies: Qwen3, Qwen3.5, Llama 3.2,
Gemma 3, Phi-3.5), through the real command line: `plan --json` on a tiny
model of each family tokenizes the rows, and the tokens it cached are read
back and decoded, learned run by learned run.

Qwen3's template drops earlier turns' think blocks and Phi-3.5's writes EOS
after the last turn only, so neither renders a conversation as its prefixes;
every reply must still be learned as the model writes it after the
generation prompt, ending at its end-of-turn token.
"""

from __future__ import annotations

import json

import pytest

from llmcustoms.data.token_store import open_store
from test_tokenization import spans
from tiny_models import FIXTURES

SHAPES = FIXTURES / "shapes"

# What the model writes for a reply `c` without reasoning, after each family's generation prompt.
WRITTEN = {
    "qwen3": "<think>\n\n</think>\n\n{}<|im_end|>",  # an empty think block: the model's non-thinking answer
    "qwen3_5": "\n</think>\n\n{}<|im_end|>",  # the generation prompt already opened the think block
    "llama3_2": "{}<|eot_id|>",
    "gemma3": "{}<end_of_turn>",
    "phi3_5": "{}<|end|>",  # not "<|end|>\n<|endoftext|>": the model stops at <|end|>
}
# The cookbook's multi-turn shape: 5 rows, 8 replies.
COOKBOOK_REPLIES = {
    1: ["Paris.", "Paris, as if everyone doesn't know that already."],
    2: ["Shakespeare."],
    3: ["About 384,400 km.", "About 150 million km. Pack a lunch."],
    4: ["The Pacific."],
    5: ["Red.", "Blue, obviously."],
}


def planned(cli, tmp_path, model, data):
    """plan --json's data report, and the learned runs of every tokenized row, by row number."""
    from transformers import AutoTokenizer

    cache = tmp_path / "cache"
    result = cli("plan", str(data), "--model", str(model), "--cache-dir", str(cache), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)["data_report"]
    [store] = (cache / "tokenized").iterdir()
    tokenizer = AutoTokenizer.from_pretrained(model)
    learned = {int(number): spans(tokenizer, row.input_ids, row.labels, True)
               for number, row in zip(open_store(store).row_numbers, open_store(store))}
    return report, learned


@pytest.mark.parametrize("family", sorted(WRITTEN))
def test_every_reply_of_a_multi_turn_row_is_learned_once_as_the_model_writes_it(cli, tmp_path, family_models, family):
    report, learned = planned(cli, tmp_path, family_models[family], SHAPES / "multi_turn_chat.jsonl")
    assert learned == {row: [WRITTEN[family].format(c) for c in replies] for row, replies in COOKBOOK_REPLIES.items()}
    assert sum(map(len, learned.values())) == 8
    assert "replies_not_learned" not in report and "replies_without_end_token" not in report


QWEN3_TOOL_ROW = [
    '<think>\nParis first.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call><|im_end|>',
    '<think>\n\n</think>\n\nParis is sunny. Now Rome.\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Rome"}}\n</tool_call><|im_end|>',
    "<think>\n\n</think>\n\nSunny in Paris, rain in Rome.<|im_end|>",
    "<think>\n\n</think>\n\nOnly in Rome.<|im_end|>",
]
QWEN3_5_TOOL_ROW = [
    "Paris first.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call><|im_end|>",
    "\n</think>\n\nParis is sunny. Now Rome.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n"
    "</parameter>\n</function>\n</tool_call><|im_end|>",
    "\n</think>\n\nSunny in Paris, rain in Rome.<|im_end|>",
    "\n</think>\n\nOnly in Rome.<|im_end|>",
]
REASONING_AND_TOOLS = {
    "qwen3": {1: ["<think>\n17 has no divisor but 1 and itself.\n</think>\n\nYes.<|im_end|>",
                  "<think>\n21 is 3 times 7.\n</think>\n\nNo, 3 x 7.<|im_end|>",
                  "<think>\n\n</think>\n\nYou are welcome.<|im_end|>"],
              2: QWEN3_TOOL_ROW},
    "qwen3_5": {1: ["17 has no divisor but 1 and itself.\n</think>\n\nYes.<|im_end|>",
                    "21 is 3 times 7.\n</think>\n\nNo, 3 x 7.<|im_end|>",
                    "\n</think>\n\nYou are welcome.<|im_end|>"],
                2: QWEN3_5_TOOL_ROW},
    # Llama 3.2's template shows no reasoning (left out, and said) and one bare JSON call a turn.
    "llama3_2": {1: ["Yes.<|eot_id|>", "No, 3 x 7.<|eot_id|>", "You are welcome.<|eot_id|>"],
                 2: ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
                     '{"name": "get_weather", "parameters": {"city": "Rome"}}<|eot_id|>',
                     "Sunny in Paris, rain in Rome.<|eot_id|>", "Only in Rome.<|eot_id|>"]},
}


@pytest.mark.parametrize("family", sorted(REASONING_AND_TOOLS))
def test_reasoning_and_tool_calls_of_every_turn_are_learned_once(cli, tmp_path, family_models, family):
    report, learned = planned(cli, tmp_path, family_models[family], SHAPES / "multi_turn_reasoning_tools.jsonl")
    assert learned == REASONING_AND_TOOLS[family]
    assert "replies_not_learned" not in report
    dropped = [line for line in report["advice"] if "reasoning part" in line]
    assert bool(dropped) == (family == "llama3_2")


@pytest.mark.parametrize("family", ["gemma3", "phi3_5"])
def test_a_template_without_tool_calls_refuses_them_by_name(cli, tmp_path, family_models, family):
    result = cli("plan", str(SHAPES / "multi_turn_reasoning_tools.jsonl"), "--model", str(family_models[family]),
                 "--cache-dir", str(tmp_path / "cache"))
    assert result.returncode == 2
    assert "cannot show them" in result.stdout + result.stderr and "Traceback" not in result.stderr
