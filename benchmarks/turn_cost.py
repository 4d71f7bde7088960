"""What learning every reply of a conversation costs, per chat template.

    python benchmarks/turn_cost.py DATA --tokenizer DIR [--template NAME ...] [--json OUT]

For each template (TRL's originals in `trl/chat_templates/`, by file name;
default: qwen3, qwen3_5_think, phi3_5, llama3_2, gemma3, qwen2_5) on the
tokenizer in DIR (a real one: SmolLM2's from ../shared/tools/make_real_model.py),
tokenizes the usable rows of DATA three ways and prints tokens per row and
replies learned:

  llmcustoms   one sequence per row, every reply learned as the model writes
               it (`chat_templates.chat_segments`)
  per reply    one sequence per learned reply, each its exact prompt as the
               template renders it: the only exact history for a template that
               rewrites earlier turns, at the price of repeating the history
  last reply   what llmcustoms did before for such templates: the row rendered
               once, its last reply learned
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_TEMPLATES = ["qwen3", "qwen3_5_think", "phi3_5", "llama3_2", "gemma3", "qwen2_5"]
# The special tokens each family's own tokenizer has and the given one may lack
# (SmolLM2's has ChatML's): without them no template could tell where a turn ends.
SPECIALS = {"phi3_5": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
            "llama3_2": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
            "gemma3": ["<start_of_turn>", "<end_of_turn>"]}


def trl_template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


def measure(examples: list, hf) -> dict:
    """Tokens per row and replies learned, each way, for the tokenizer's template."""
    from llmcustoms.data import chat_templates
    from llmcustoms.data.chat_templates import REPLY, supports_reasoning
    from llmcustoms.data.tokenization import Tokenizer

    ours = Tokenizer(hf)
    reasoning = supports_reasoning(hf)
    count = lambda text: len(hf(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    totals = {"rows": 0, "replies": 0, "llmcustoms_tokens": 0, "llmcustoms_learned": 0, "per_reply_tokens": 0,
              "last_reply_tokens": 0, "last_reply_learned": 0}
    for example in examples:
        if not example.is_chat or example.is_pair:
            continue
        segments = ours.segments(example)
        totals["rows"] += 1
        totals["replies"] += example.replies()
        totals["llmcustoms_tokens"] += sum(count(text) for text, _ in segments)
        totals["llmcustoms_learned"] += sum(kind == REPLY for _, kind in segments)
        messages, tools = example.messages, example.tool_schemas()
        for k, message in enumerate(messages):
            if message.role == "assistant" and message.learned:
                whole = chat_templates._render(hf, messages[:k + 1], tools, False, reasoning)
                totals["per_reply_tokens"] += count(whole)
        last = chat_templates._last_turn_segments(hf, messages, tools, reasoning)
        totals["last_reply_tokens"] += sum(count(text) for text, _ in last)
        totals["last_reply_learned"] += 1
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data")
    parser.add_argument("--tokenizer", required=True, help="a tokenizer directory (its own chat template is replaced)")
    parser.add_argument("--template", action="append", help="a TRL template name (repeatable)")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from llmcustoms.data.dataset import read_dataset, usable_examples

    read_dataset(args.data, "skip")
    examples = list(usable_examples(args.data))
    results = {}
    print(f"{args.data}: {len(examples):,} rows; tokens per row and replies learned")
    print(f"{'template':16} {'replies':>8} {'llmcustoms':>18} {'per reply':>10} {'last reply':>18} {'s':>5}")
    for name in args.template or DEFAULT_TEMPLATES:
        hf = AutoTokenizer.from_pretrained(args.tokenizer)
        hf.chat_template = trl_template(name)
        hf.add_special_tokens({"additional_special_tokens": SPECIALS.get(name, [])})
        started = time.perf_counter()
        t = measure(examples, hf)
        t["seconds"] = round(time.perf_counter() - started, 1)
        results[name] = t
        rows = max(1, t["rows"])
        print(f"{name:16} {t['replies']:>8,} {t['llmcustoms_tokens'] / rows:>8.1f} ({t['llmcustoms_learned']:>6,}) "
              f"{t['per_reply_tokens'] / rows:>10.1f} {t['last_reply_tokens'] / rows:>8.1f} "
              f"({t['last_reply_learned']:>6,}) {t['seconds']:>5.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"data": Path(args.data).name, "results": results}, indent=1))


if __name__ == "__main__":
    main()
