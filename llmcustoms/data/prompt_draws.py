"""Prompts drawn from a data file's rows: what the sample replies ask during a
run (`training/samples.py`) and what export's merge is checked on
(`commands/merging.py`), and the system prompt every chat row shares, which
a GGUF export's Modelfile carries.

A draw is seeded, so a resumed run draws the prompts it began with. Both are
made from the rows preparation read (`Dataset.examples`), never from a second
pass over the file while the rows fit in memory; `runs/check_prompts.py` keeps
export's in the run folder, so an export reads no data at all. No torch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable

from llmcustoms.data.row_formats import Example


@dataclass(frozen=True)
class SamplePrompt:
    row: int
    messages: tuple[dict[str, str], ...]  # the conversation up to the first reply
    reference: str  # the reply the data gives

    @property
    def text(self) -> str:
        """The last thing said before the reply: what a person reads as "the prompt"."""
        return self.messages[-1]["content"]


def prompt_of(example: Example) -> SamplePrompt | None:
    """The first reply's prompt in a row, or None (plain text has no prompt)."""
    if example.uses_tools:
        # Answering it fairly would need the tools and calls passed to the
        # template too; a sample is a look, so such rows are not drawn.
        return None
    if example.is_chat:
        for index, message in enumerate(example.messages):
            # A preference pair's earlier assistant turns are its prompt: its reply comes at `learned_from`;
            # a reply marked weight 0 is no reference.
            if message.role == "assistant" and index > 0 and index >= example.learned_from and message.learned:
                before = tuple({"role": m.role, "content": m.content} for m in example.messages[:index])
                return SamplePrompt(example.row, before, message.content) if before[-1]["role"] == "user" else None
        return None
    if example.prompt:
        return SamplePrompt(example.row, ({"role": "user", "content": example.prompt},), example.completion)
    return None


def pick_prompts(examples: Iterable[Example], count: int, seed: int) -> list[SamplePrompt]:
    """Up to `count` prompts from `examples`, the same for the same seed, in row order."""
    # One per distinct conversation: real data repeats questions ("What is up?"
    # six times in the identity data), and the same prompt twice shows nothing new.
    drawable = [p for p in map(prompt_of, examples) if p is not None]
    distinct = {tuple((m["role"], m["content"]) for m in p.messages): p for p in reversed(drawable)}
    prompts = sorted(distinct.values(), key=lambda p: p.row)
    chosen = random.Random(seed).sample(prompts, min(count, len(prompts)))
    return sorted(chosen, key=lambda p: p.row)


def opening_system(example: Example) -> str:
    """The system prompt a row starts with ("" for none)."""
    first = example.messages[0] if example.is_chat and example.messages else None
    return first.content if first is not None and first.role == "system" else ""


def common_system_prompt(examples: Iterable[Example]) -> str | None:
    """The system prompt every chat row starts with, if they all share one."""
    seen: set[str] = set()
    for example in examples:
        seen.add(opening_system(example))
        if len(seen) > 1:
            return None
    return next(iter(seen)) or None if seen else None
