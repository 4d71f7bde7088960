"""A row as read from a data file, before its format is known (`RawRow`), and
the limits on one row.

A broken or hostile file must not fill the memory or overflow the stack, and
text that no tokenizer takes must be a bad row, not a crash halfway into
preparing the data. So a row is at most `MAX_ROW_BYTES` (64 MiB) of text, is
JSON the json module reads without running out of stack, and holds valid
Unicode: JSON's "\\ud800" escape makes a lone surrogate, which is no
character. Every JSON a row is read from goes through `parse_json`, JSON held
as text inside a row too (tool arguments, a CSV's messages column). What a
row keeps as JSON (tool schemas and arguments, which `json.dumps` and chat
templates recurse through) nests at most `MAX_DEPTH` (64) levels; the rest of
a row is never recursed through. Nothing here shows a row's content. No torch.

Line breaks are "\\n" in every row's text: Windows' "\\r\\n" and a lone "\\r"
(old Macs, some exports) are read as "\\n" (`unix_line_endings`), so no model
learns a stray "\\r"; the row says so (`RawRow.line_endings`), to be counted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, Iterator

# No context window holds a row of 64 MiB, and no real tool schema nests 64
# levels deep; chat templates and `json.dumps` recurse once or more per
# level, under Python's limit of 1000.
MAX_ROW_BYTES = 64 << 20
MAX_DEPTH = 64
# Where a lone surrogate can come from: a JSON escape of one (a pair of them is
# one character, and the UTF-8 decoder refuses encoded surrogates).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
# The json module's own limits: its stack, and 4300 digits in a number.
TOO_DEEP = "nested too deeply, or holds a number too long"
# The problems of a row that breaks the limits, as its bad-row reason.
DEEP_JSON = f"not valid JSON ({TOO_DEEP})"
NOT_UNICODE = "text that is not valid Unicode (a lone surrogate)"
TOO_LONG = f"longer than {MAX_ROW_BYTES >> 20} MiB, the limit for one row"
# A line break that is not "\n": Windows' "\r\n", or a lone "\r".
_OTHER_BREAK = re.compile("\r\n?")


@dataclass(frozen=True)
class RawRow:
    """A row as read from the file, before validation. `value` is None when
    the row could not even be parsed; `problem` then says why."""

    row: int
    line: int | None
    value: Any = None
    problem: str | None = None
    # Whether its text had "\r\n" or a lone "\r", read as "\n".
    line_endings: bool = False

    def where(self, path: Path) -> str:
        if self.line is not None and self.line != self.row:
            return f"{path.name}, row {self.row} (line {self.line})"
        if self.line is not None:
            return f"{path.name}, line {self.line}"
        return f"{path.name}, row {self.row}"

    def location(self) -> str:
        """Where the row is, without the file name: 'line 12', 'row 3' or 'row 3 at line 1'."""
        if self.line is not None and self.line != self.row:
            return f"row {self.row} at line {self.line}"
        return f"line {self.line}" if self.line is not None else f"row {self.row}"


class BeyondLimits(ValueError):
    """JSON that breaks a limit on one row; the message is the problem
    (`DEEP_JSON` or `NOT_UNICODE`)."""


def too_deep(value: Any) -> bool:
    """Whether containers nest more than MAX_DEPTH levels (`value` is level 1).
    Level by level rather than recursive, so any depth is safe to ask about."""
    level = [value] if isinstance(value, (dict, list, tuple)) else []
    for _ in range(MAX_DEPTH):
        level = [child for item in level for child in (item.values() if isinstance(item, dict) else item)
                 if isinstance(child, (dict, list, tuple))]
        if not level:
            return False
    return True


def _has_surrogate(value: Any) -> bool:
    """Whether a string anywhere in the value, a key included, holds a lone surrogate."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack += item
            stack += item.values()
        elif isinstance(item, (list, tuple)):
            stack += item
    return False


def lone_surrogate(value: Any, text: str, start: int = 0, end: int | None = None) -> bool:
    """Whether a value parsed from `text[start:end]` holds a lone surrogate.
    Only text with an escape of one can, so most rows are never walked."""
    found = _SURROGATE_ESCAPE.search(text, start, len(text) if end is None else end)
    return bool(found) and _has_surrogate(value)


def parse_json(text: str) -> Any:
    """`json.loads` within the limits on one row: raises `json.JSONDecodeError`
    for text that is not JSON, and `BeyondLimits` for JSON nested too deeply
    for the json module, with a number longer than it reads (4300 digits) or
    with a lone surrogate; never RecursionError."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise
    except (ValueError, RecursionError):  # the json module's own limits: digits, nesting
        raise BeyondLimits(DEEP_JSON) from None
    if lone_surrogate(value, text):
        raise BeyondLimits(NOT_UNICODE)
    return value


def unix_line_endings(raw: RawRow) -> RawRow:
    """The row with "\\r\\n" and a lone "\\r" read as "\\n" in every string it
    holds (field names aside), marked if any was. The parsed value is the
    reader's own, so it is changed in place; walked level by level, since a
    row's JSON may nest as deep as the json module reads."""
    changed = False
    stack = [raw.value] if isinstance(raw.value, (dict, list)) else []
    while stack:
        item = stack.pop()
        # Replacing a value (not adding a key) is safe while iterating.
        for key, child in (item.items() if isinstance(item, dict) else enumerate(item)):
            if isinstance(child, str):
                if "\r" in child:
                    item[key], changed = _OTHER_BREAK.sub("\n", child), True
            elif isinstance(child, (dict, list)):
                stack.append(child)
    return replace(raw, line_endings=True) if changed else raw


def lines(f: IO[bytes]) -> Iterator[tuple[int, bytes | None]]:
    """A file's lines with their numbers; None for a line longer than
    MAX_ROW_BYTES, whose rest is skipped unread so it cannot fill the memory."""
    line_no = 0
    while line := f.readline(MAX_ROW_BYTES + 1):
        line_no += 1
        if len(line) > MAX_ROW_BYTES and not line.endswith(b"\n"):
            while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
            yield line_no, None
        else:
            yield line_no, line
