"""How often the sample replies stop, before training and after, and what it means.

A sample reply stopped when it ended with a token generation stops on (EOS,
the chat template's end-of-turn token) before the token limit (samples.jsonl's
`stopped`, from `training/samples.py`). The stop rate is the share of the
prompts' replies that did, for the base model and the trained one ("3/3"):
the end-of-training summary, `llmcustoms report` and the model card show it;
none of them shows a reply. A trained model that stops less often than its
base has not learned where a reply ends, the complaint "it never stops": the
report says so, with what the run recorded of why (status.json's
`stop_tokens`: the end-of-turn token and whether the base model's looked
untrained, `models/untrained_tokens.py`; the data report's
`replies_without_end_token`, `data/stop_tokens.py`). Runs written before
`stopped` existed have no stop rate, and nothing is said of it. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmcustoms.planning.data_advice import end_token_line

LABELS = {"base": "base model", "trained": "trained"}


@dataclass(frozen=True)
class StopRate:
    stopped: int
    replies: int

    @property
    def share(self) -> float:
        return self.stopped / self.replies

    def __str__(self) -> str:
        return f"{self.stopped}/{self.replies}"


def stop_rates(entries: list[dict[str, Any]]) -> dict[str, StopRate]:
    """The stop rate of "base" and "trained", from `samples.side_by_side`'s
    entries; a label none of whose replies says whether it stopped is left out."""
    rates = {}
    for label in LABELS:
        known = [entry[f"{label}_stopped"] for entry in entries if isinstance(entry.get(f"{label}_stopped"), bool)]
        if known:
            rates[label] = StopRate(sum(known), len(known))
    return rates


def stop_rate_line(entries: list[dict[str, Any]]) -> str | None:
    """"base model 0/3, trained 3/3 stopped before the token limit", or None without stop rates."""
    rates = stop_rates(entries)
    if not rates:
        return None
    return ", ".join(f"{LABELS[label]} {rate}" for label, rate in rates.items()) + " stopped before the token limit"


def end_token(status: dict[str, Any]) -> str:
    """The end-of-turn token the run recorded ("<|im_end|>"), or words for it."""
    recorded = status.get("stop_tokens")
    name = recorded.get("end_of_turn") if isinstance(recorded, dict) else None
    return name if isinstance(name, str) and name else "the end-of-turn token"


def untrained_warnings(status: dict[str, Any]) -> list[str]:
    """What the run found untrained among the base model's stop tokens (`untrained_tokens.check_stop_tokens`)."""
    recorded = status.get("stop_tokens")
    found = recorded.get("untrained") if isinstance(recorded, dict) else None
    return [text for text in found if isinstance(text, str)] if isinstance(found, list) else []


def stop_findings(entries: list[dict[str, Any]], status: dict[str, Any], data_report: dict[str, Any],
                  epochs: float, forgot: bool = False) -> tuple[list[tuple[str, str, str]], list[tuple[str, str]]]:
    """`report`'s findings (topic, verdict, detail) on stopping, and its advice
    (what it changes, text): the stop rate, the rows whose replies do not learn
    the end token, and the stop tokens the base model had not learned. `forgot`:
    the run answers clearly fewer general questions than its base model, so the
    advice asks for more rows, never more epochs (they would wear away more)."""
    token, missing = end_token(status), _rows_without_end_token(data_report)
    findings = [] if missing is None else [("end token", f"not learned by {missing['rows']:,} rows",
                                             end_token_line(missing))]
    findings += [("end token", "looks untrained", text) for text in untrained_warnings(status)]
    advice = [] if missing is None else [("end token", f"{missing['rows']:,} training rows have a reply that never "
                                          f"learns to end with {missing['token']}: split those conversations into one "
                                          "row per reply, or use a model whose chat template ends every assistant "
                                          "reply with its end-of-turn token")]
    rates = stop_rates(entries)
    if not rates:
        return findings, advice
    numbers = ", ".join(f"{LABELS[label]} {rate}" for label, rate in rates.items())
    detail = f"{numbers} sample replies ended with {token} (or EOS) before the token limit"
    base, trained = rates.get("base"), rates.get("trained")
    if base is None or trained is None or trained.share >= base.share:
        return [("stopping", f"{trained or base} stopped", detail), *findings], advice
    why = "; ".join(([f"{missing['rows']:,} training rows have a reply whose learned tokens do not include "
                      f"{missing['token']}"] if missing else [])
                    + (["a stop token of the base model looks untrained (see 'end token')"]
                       if untrained_warnings(status) else []))
    stopping = (f"the trained model ends fewer sample replies with {token} than the base model did ({trained} against "
                f"{base}): it has not learned where a reply ends, and may run on to the token limit. "
                + (f"Likely why: {why}. " if why else "")
                + f"Check that the data's replies end with {token} (`llmcustoms plan DATA` warns when a reply does not "
                f"learn it) and are not cut by --max-seq-len; then "
                + ("give it more rows rather than more epochs, which would also wear away more of what the base "
                   "model knew (see the general questions)" if forgot else f"train longer (--epochs {epochs * 2:g})"))
    return [("stopping", "stops less than the base model", detail), *findings], [("stopping", stopping), *advice]


def _rows_without_end_token(data_report: Any) -> dict[str, Any] | None:
    """The data report's rows whose replies do not learn a stop token (`data/stop_tokens.end_token_facts`), if whole."""
    found = data_report.get("replies_without_end_token") if isinstance(data_report, dict) else None
    if isinstance(found, dict) and isinstance(found.get("rows"), int) and isinstance(found.get("token"), str):
        return found
    return None
