"""What matters about the data before training, with one-line advice.

Pure: from the counts reading found (`dataset.Dataset.to_json()`, its
suspicious rows first), the training rows' token lengths and the plan's
length and schedule to a dict that goes into plan.json (so `plan --json` has
it) and is shown before training. No torch.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

# Fewer training rows than this are easily memorised.
FEW_ROWS = 100
# A run with fewer optimizer steps than this learns little.
FEW_STEPS = 20


def length_percentiles(lengths: Sequence[int]) -> dict[str, int]:
    if not len(lengths):
        return {}
    values = np.percentile(np.asarray(lengths), [50, 90, 99])
    return {"p50": int(values[0]), "p90": int(values[1]), "p99": int(values[2]), "max": int(np.max(lengths))}


def advice(report: dict[str, Any], lengths: Sequence[int], max_seq_len: int, truncated: int, dropped: int,
           total_steps: int, epochs: float | None) -> list[str]:
    """One line per thing worth knowing, each saying what to do."""
    rows = max(1, int(report.get("rows", 0)))
    lines = [suspicious_line(found) for found in report.get("suspicious", ())]
    duplicates = int(report.get("duplicates", 0))
    if duplicates:
        lines.append(f"{duplicates:,} exact duplicates ({duplicates / rows:.0%}, whitespace ignored): consider "
                     "removing them; a repeated row is learned as if it mattered more")
    line_endings = int(report.get("line_endings_normalised", 0))
    if line_endings:
        lines.append(f"{line_endings:,} row{'s' if line_endings != 1 else ''} had Windows or old Mac line breaks "
                     "(\\r\\n or \\r): read as \\n, so no \\r is learned")
    near_empty = int(report.get("near_empty_replies", 0))
    if near_empty:
        lines.append(f"{near_empty:,} {'reply is' if near_empty == 1 else 'replies are'} under 5 characters: check "
                     f"{'it is' if near_empty == 1 else 'they are'} meant to be that short")
    reasoning = int(report.get("reasoning_parts_dropped", 0))
    if reasoning:
        lines.append(f"{reasoning:,} reasoning part{'s' if reasoning != 1 else ''} left out: this model's chat template "
                     "does not show reasoning (reasoning_content); a model whose template does would learn them")
    if report.get("replies_not_learned"):
        lines.append(unlearned_line(report["replies_not_learned"]))
    if report.get("replies_without_end_token"):
        lines.append(end_token_line(report["replies_without_end_token"]))
    if truncated:
        p99 = length_percentiles(lengths).get("p99", 0)
        lines.append(f"{truncated:,} rows are longer than {max_seq_len} tokens and lose the end of their reply"
                     + (f": --max-seq-len {p99} would keep 99% whole" if p99 > max_seq_len else ""))
    if dropped:
        lines.append(f"{dropped:,} rows have no reply left within {max_seq_len} tokens and are dropped: raise "
                     "--max-seq-len or shorten their prompts")
    train_rows = len(lengths)
    if train_rows < FEW_ROWS:
        lines.append(f"only {train_rows:,} training row{'s' if train_rows != 1 else ''}: the model may learn "
                     "them by heart; a few hundred varied rows teach better")
    if epochs is not None and total_steps < FEW_STEPS:
        lines.append(f"only {total_steps} optimizer steps ({epochs:g} epochs): expect little change; add rows, "
                     "raise --epochs, or lower --batch-size")
    return lines


def suspicious_line(found: dict[str, Any]) -> str:
    """One finding of `data/suspicious.py` (an item of the report's
    "suspicious"): what, how many rows and where, and what to do."""
    count = int(found["rows"])
    places = ", ".join(found["first_lines"]) + (", ..." if count > len(found["first_lines"]) else "")
    marks = f" ({', '.join(found['what'])})" if found.get("what") else ""
    return f"{found['finding']}{marks}: {count:,} row{'s' if count != 1 else ''} ({places}); {found['advice']}"


def unlearned_line(found: dict[str, Any]) -> str:
    """The replies no token of which is learned (`data/reply_counts.unlearned_replies`)."""
    replies, rows = int(found["replies"]), int(found["rows"])
    return (f"{replies:,} of {found['of']:,} replies are not learned, in {rows:,} row{'s' if rows != 1 else ''}: this "
            "model's chat template shows earlier turns otherwise than it writes them and where those replies end cannot "
            "be told, so only the last reply of each such conversation is learned. Split those conversations into one "
            "row per reply to learn every reply, or use a model whose template ends each reply with an end-of-turn token")


def end_token_line(found: dict[str, Any]) -> str:
    """The rows with a reply that never learns the end-of-turn token (`data/stop_tokens.end_token_facts`)."""
    count, token = int(found["rows"]), found["token"]
    why = ("the chat template writes it after a reply, but it is outside the learned tokens" if found.get("template_ends_reply")
           else "the chat template writes no end-of-turn token right after an assistant reply; llmcustoms adds "
                f"{token} only to a row's last reply")
    return (f"{count:,} row{'s have' if count != 1 else ' has'} a reply that never learns to end with {token} ({why}): "
            "after such a reply the model does not learn to stop, and may run on. Use a model whose chat template ends "
            "every assistant reply with its end-of-turn token, or split those conversations into one row per reply")


def data_facts(report: dict[str, Any], lengths: Sequence[int], length_source: str, max_seq_len: int,
               truncated: int, dropped: int, total_steps: int, epochs: float | None) -> dict[str, Any]:
    """Reading's counts plus token lengths and advice, for plan.json. `epochs`
    is None when the user set the number of steps: then it is not advised on."""
    return {**report, "train_token_lengths": length_percentiles(lengths), "length_source": length_source,
            "truncated_rows": truncated, "dropped_rows": dropped,
            "advice": advice(report, lengths, max_seq_len, truncated, dropped, total_steps, epochs)}
