"""Read a data file once, validating each row as it comes, and say what it holds.

`read_dataset` streams the file (`data/data_files.py`), detects the row format
(`data/row_formats.py`) and keeps small per-row numbers (lengths, a hash for
duplicates), so a file larger than memory can be checked. The usable rows
themselves are kept too while they are small (`KEPT_CHARS`): tokenizing them,
drawing sample prompts and export's check prompts then read no file again
(`Dataset.examples`). Past that, `usable_examples` streams them again.

Bad rows follow the policy users expect: by default a few (at most
`BAD_ROW_SHARE` of the rows) are skipped and reported by reason, with the
first line numbers; more than that stops with exit 2, since the format was
probably misunderstood. `--strict` stops at the first bad row,
`--skip-bad-rows` skips any number. Rows that pass but look wrong
(`data/suspicious.py`: placeholders never filled in, echoed prompts, blank
replies) are counted; rows for a vision or audio model are refused once the
file is read, and under `--strict` a placeholder is a bad row. Nothing here
shows a row's content. No torch.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from llmcustoms.data.chat_turns import reasoning_parts
from llmcustoms.data.data_files import RawRow, read_rows
from llmcustoms.data.prompt_draws import opening_system
from llmcustoms.data.row_formats import DETECTION_ROWS, FORMAT_DESCRIPTIONS, Example, RowProblem, detect_format, to_example
from llmcustoms.data.suspicious import SuspiciousRows
from llmcustoms.errors import DataError

# The share of bad rows skipped without being asked to; more stops the run.
BAD_ROW_SHARE = 0.05
# A reply shorter than this (after stripping) teaches little: the advice says so.
NEAR_EMPTY_CHARS = 5
# How many locations of each kind of bad row are named.
LOCATIONS_SHOWN = 3
WHITESPACE = b" \t\n\r\x0b\x0c"
POLICIES = ("default", "strict", "skip")
# The usable rows are kept in memory while their text stays under this many
# characters (about 100 MB of Python objects at most): every file of a few
# thousand rows. A larger one is streamed again when its rows are needed.
KEPT_CHARS = 16_000_000

Progress = Callable[[int], None]  # called with the rows read so far


@dataclass
class BadRows:
    """Rows that failed validation: how many, why, and where the first few are."""

    count: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    where: dict[str, list[str]] = field(default_factory=dict)

    def add(self, raw: RawRow, problem: str) -> None:
        reason = _reason_kind(problem)
        self.count += 1
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
        places = self.where.setdefault(reason, [])
        if len(places) < LOCATIONS_SHOWN:
            places.append(raw.location())

    def lines(self) -> list[str]:
        """One line per reason: "field 'output' is empty: 2 rows (line 1187, line 9291)"."""
        out = []
        for reason, n in sorted(self.by_reason.items(), key=lambda item: -item[1]):
            places = ", ".join(self.where[reason]) + (", ..." if n > len(self.where[reason]) else "")
            out.append(f"{reason}: {n:,} row{'s' if n != 1 else ''} ({places})")
        return out

    def to_json(self) -> dict:
        return {"count": self.count, "by_reason": dict(self.by_reason), "where": {k: list(v) for k, v in self.where.items()}}


@dataclass
class Dataset:
    """What one pass over a data file found. Per usable row, only numbers."""

    path: Path
    format: str
    policy: str = "default"
    bad: BadRows = field(default_factory=BadRows)
    unlearned: int = 0  # rows marked undesirable (label: false): read, never learned
    total_chars: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    prompt_chars: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    turns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    replies: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # replies to learn, per row
    duplicates: int = 0  # rows whose text (whitespace normalised) repeats an earlier row
    near_empty: int = 0  # replies shorter than NEAR_EMPTY_CHARS characters
    reasoning_parts: int = 0  # left out by a chat template that does not show reasoning
    line_endings: int = 0  # rows whose "\r\n" or lone "\r" was read as "\n" (raw_rows.unix_line_endings)
    suspicious: SuspiciousRows = field(default_factory=SuspiciousRows)  # placeholders, echoed prompts, ...
    seconds: float = 0.0  # time spent reading and validating
    kept: list[Example] | None = field(default=None, repr=False)  # the usable rows, while under KEPT_CHARS
    system_prompt: str | None = None  # the one every usable row starts with, if they all share one

    def examples(self) -> Iterator[Example]:
        """The usable rows in order: those kept while reading, else the file streamed again."""
        return iter(self.kept) if self.kept is not None else usable_examples(self.path)

    @property
    def rows(self) -> int:
        return len(self.total_chars)

    @property
    def skipped(self) -> int:
        return self.bad.count

    @property
    def format_description(self) -> str:
        return FORMAT_DESCRIPTIONS[self.format]

    def to_json(self) -> dict:
        return {"format": self.format, "rows": self.rows, "bad_row_policy": self.policy, "bad_rows": self.bad.to_json(),
                "unlearned_rows": self.unlearned, "duplicates": self.duplicates, "near_empty_replies": self.near_empty,
                "reasoning_parts": self.reasoning_parts,
                "line_endings_normalised": self.line_endings,
                "suspicious": self.suspicious.to_json()}


def _validated(path: Path) -> tuple[str, Iterator[tuple[RawRow, Example | None, str | None]]]:
    """The format, and every row with its example or its problem."""
    rows = read_rows(path)
    head = list(itertools.islice(rows, 2 * DETECTION_ROWS))
    if not head:
        raise DataError(f"{path.name} has no rows.", "Add at least one row of data.")
    fmt = detect_format(head, path)

    def checked() -> Iterator[tuple[RawRow, Example | None, str | None]]:
        for raw in itertools.chain(head, rows):
            try:
                if raw.problem is not None:
                    raise RowProblem(raw.problem)
                yield raw, to_example(raw, fmt), None
            except RowProblem as problem:
                yield raw, None, str(problem)

    return fmt, checked()


def read_dataset(path: str | Path, policy: str = "default", progress: Progress | None = None) -> Dataset:
    """Read, detect and validate a data file, applying the bad-row policy:
    raises `DataError` naming the first bad row (strict), or when too many are
    bad (default); otherwise bad rows are counted by reason and skipped."""
    path = Path(path)
    started = time.perf_counter()
    fmt, rows = _validated(path)
    dataset = Dataset(path=path, format=fmt, policy=policy)
    total, prompt, turns, replies, hashes = array("q"), array("q"), array("i"), array("i"), array("Q")
    kept: list[Example] | None = []
    kept_chars = 0
    systems: set[str] = set()  # the rows' opening system prompts: one shared, or more (two are enough to tell)
    first_problem = ""
    for raw, example, problem in rows:
        if dataset.suspicious.holds_media(raw, example):
            continue  # refused below, once every such row is counted
        if problem is not None:
            if policy == "strict":
                raise DataError(f"{raw.where(path)}: {problem}.",
                                "Fix that row, or run without --strict to skip a few bad rows.")
            first_problem = first_problem or f"{raw.where(path)}: {problem}"
            dataset.bad.add(raw, problem)
            continue
        dataset.line_endings += raw.line_endings
        if not example.desirable:
            dataset.unlearned += 1
            continue
        placeholder = dataset.suspicious.check(raw, example)
        if placeholder and policy == "strict":
            raise DataError(f"{raw.where(path)}: {placeholder}.",
                            "Fill it in or remove the row, or run without --strict to train on it with a warning.")
        total.append(example.char_count())
        kept_chars += total[-1]
        if len(systems) < 2:
            systems.add(opening_system(example))
        if kept is not None and kept_chars <= KEPT_CHARS:
            kept.append(example)
        else:
            kept = None  # too large to hold: streamed again when needed
        prompt.append(example.prompt_chars())
        turns.append(len(example.messages))
        replies.append(example.replies())
        hashes.append(_duplicate_key(example))
        dataset.near_empty += len(example.reply().strip()) < NEAR_EMPTY_CHARS
        dataset.reasoning_parts += reasoning_parts(example.messages)
        if progress is not None and len(total) % 1000 == 0:
            progress(len(total) + dataset.bad.count)
    dataset.total_chars, dataset.prompt_chars = np.frombuffer(total, np.int64), np.frombuffer(prompt, np.int64)
    dataset.turns, dataset.replies = np.frombuffer(turns, np.int32), np.frombuffer(replies, np.int32)
    dataset.duplicates = len(hashes) - len(np.unique(np.frombuffer(hashes, np.uint64)))
    dataset.kept = kept
    dataset.system_prompt = next(iter(systems)) or None if len(systems) == 1 else None
    dataset.seconds = time.perf_counter() - started
    dataset.suspicious.refuse_media(path)
    _check_bad_share(dataset, first_problem)
    return dataset


def _check_bad_share(dataset: Dataset, first_problem: str) -> None:
    bad, usable = dataset.bad.count, dataset.rows
    everything = bad + usable + dataset.unlearned
    if not usable:
        if bad:
            raise DataError(f"{dataset.path.name}: no usable rows ({bad:,} bad; the first: {first_problem}).",
                            f"Check that the file holds {dataset.format_description} rows, and fix them.")
        raise DataError(f"{dataset.path.name}: every row is marked undesirable (label: false); none is left to learn.",
                        "Keep the rows whose replies the model should give, with label: true.")
    if dataset.policy == "default" and bad > BAD_ROW_SHARE * everything:
        raise DataError(
            f"{dataset.path.name}: {bad:,} of {everything:,} rows ({bad / everything:.0%}) fail validation, more than "
            f"the {BAD_ROW_SHARE:.0%} skipped without asking. The first: {first_problem}.",
            f"The format was probably misread (detected: {dataset.format_description}). Fix the file, or pass "
            f"--skip-bad-rows to train on the {usable:,} good rows anyway.")


def usable_examples(path: str | Path) -> Iterator[Example]:
    """The usable rows of a file already checked by `read_dataset`, in order:
    bad rows are skipped, rows marked undesirable left out."""
    _, rows = _validated(Path(path))
    for _, example, _ in rows:
        if example is not None and example.desirable:
            yield example


def _duplicate_key(example: Example) -> int:
    """Equal for rows that differ at most in whitespace. Whitespace is dropped
    rather than collapsed: as fast as hashing alone, where collapsing it
    (split and join) took half of reading a file."""
    text = example.identity_text().encode("utf-8", "surrogatepass").translate(None, WHITESPACE)
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def _reason_kind(problem: str) -> str:
    """A short category for the skip summary ('not valid JSON', 'missing field ...')."""
    return problem.split(" (")[0]
