"""The forgetting check's scores, before training and after, and what they mean.

A run with evaluation rows asks the base model and the trained one the
general questions llmcustoms ships (`training/general_knowledge.py`:
arithmetic, capitals, science, units, words, one-line code facts) and keeps
how many each answered right in status.json:

    "general_knowledge": {"base": {"right": 41, "asked": 67, "seconds": 3.1}, "trained": {...}}

The end-of-training summary, `llmcustoms report` and the model card show the
numbers ("41/67 base -> 40/67 trained"); the replies stay in the run's
general.jsonl. A trained model that answers clearly fewer than its base (at
least `CLEARLY_FEWER` questions and `CLEARLY_SHARE` of the set: one or two
either way is the wobble of any change to the weights) has lost some of what
it knew outside the user's data: `report` says so, and what to change. Runs
without the field (written before it existed, or without evaluation rows)
say nothing of it. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CLEARLY_FEWER = 3
CLEARLY_SHARE = 0.05
TOPIC = "general questions"


@dataclass(frozen=True)
class Score:
    right: int
    asked: int

    @property
    def share(self) -> float:
        return self.right / self.asked

    def __str__(self) -> str:
        return f"{self.right}/{self.asked}"


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def general_scores(recorded: Any) -> dict[str, Score]:
    """status.json's `general_knowledge` as a score for "base" and for "trained",
    each left out when missing or damaged."""
    scores = {}
    for label in ("base", "trained"):
        entry = recorded.get(label) if isinstance(recorded, dict) else None
        if isinstance(entry, dict) and _count(entry.get("right")) and _count(entry.get("asked")) \
                and 0 < entry["asked"] and entry["right"] <= entry["asked"]:
            scores[label] = Score(entry["right"], entry["asked"])
    return scores


def general_line(recorded: Any) -> str | None:
    """"41/67 base -> 40/67 trained" (a run stopped before its end: "41/67 base"), or None without scores."""
    scores = general_scores(recorded)
    if not scores:
        return None
    return " -> ".join(f"{score} {label}" for label, score in scores.items())


def clearly_fewer(base: Score, trained: Score) -> int | None:
    """How many fewer questions the trained model answers, when clearly fewer:
    at least CLEARLY_FEWER and CLEARLY_SHARE of the set (as shares, should the sets differ)."""
    lost_share = base.share - trained.share
    lost = lost_share * trained.asked
    if lost >= CLEARLY_FEWER - 1e-9 and lost_share >= CLEARLY_SHARE - 1e-9:
        return round(lost)
    return None


def forgetting_findings(recorded: Any, plan: Any, measured: Any = None) -> tuple[list[tuple[str, ...]], list[tuple[str, str]]]:
    """`report`'s finding (topic, verdict, detail, and the verdict's short number) on the general questions, and
    its advice (what it changes, text) when the trained model answers clearly fewer. `measured`: status.json's
    `forgetting`, the kept weights' general loss rise (`training/general_text.py`), said beside the scores."""
    scores = general_scores(recorded)
    if not scores:
        return [], []
    base, trained = scores.get("base"), scores.get("trained")
    rise = f"; the loss on general text {measured:+.1%} against the base model's" if _number(measured) else ""
    detail = (f"{general_line(recorded)} of llmcustoms' general questions (arithmetic, capitals, science, units, "
              f"code) answered right, greedily: what the model knows outside your data{rise}")
    if base is None or trained is None:
        return [(TOPIC, f"{trained or base} right", detail)], []
    fewer = clearly_fewer(base, trained)
    if fewer is None:
        verdict = "kept" if trained.share >= base.share else "about as many as the base model"
        return [(TOPIC, verdict, detail, f"{base} -> {trained}")], []
    advice = (f"the trained model answers {fewer} fewer of the general questions than the base model ({trained} "
              f"against {base}{rise}): training wore away some of what it knew outside your data. To keep more "
              f"of it, try {', '.join(_ways_to_keep(plan, measured))}")
    return [(TOPIC, "fewer than the base model", detail, f"{base} -> {trained}")], [("forgetting", advice)]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _ways_to_keep(plan: Any, measured: Any) -> list[str]:
    """What keeps more of what the model knew, in the order the quality benchmark found them
    to work (docs/benchmarks.md, "Forgetting"): replaying the base model's own replies
    (`--replay`) kept 42 of 67 general questions instead of 10 on sentiment data, with a lower
    test loss; half the learning rate kept 38 instead of 32 on identity data at a cost in eval
    loss; a forgetting limit kept 41 but stopped before the data was learned, so it comes after,
    with that said, and only when the kept weights' general loss rose."""
    share = getattr(plan, "replay", 0.0) or 0.0
    replay = (f"replaying more of the base model's own replies (--replay {min(1.0, share * 2):g})" if share
              else "replaying the base model's own replies to general prompts while training (--replay 0.25)")
    smaller = (f"a smaller LoRA rank (--lora-r {max(plan.lora.r // 2, 1)})" if plan.lora is not None
               else "LoRA instead of full fine-tuning (--method lora)")
    limit = [f"weights kept within a forgetting limit (--forgetting-limit {max(0.01, round(measured / 2, 2)):g}; "
             "it may stop before your data is learned)"] if _number(measured) and measured > 0.02 else []
    return ([replay] if share < 1 else []) + [f"a lower learning rate (--lr {plan.lr / 2:.1e})"] + limit + [
        f"fewer epochs (--epochs {plan.epochs / 2:g})", smaller]
