"""Read a user's data file, detect its format and turn each row into an `Example`.

Supported files: `.jsonl`, `.json` (an array, or JSON Lines saved as .json),
`.csv`, `.parquet`, and a directory written by `datasets.save_to_disk`.
Supported row formats (detected from the fields):

  alpaca             instruction, input (optional), output
  sharegpt           conversations: [{from: human|gpt|system, value}]
  messages           messages: [{role: system|user|assistant, content}]  (OpenAI)
  prompt_completion  prompt, completion
  text               text

Every problem names the file, the 1-based line (or row) and the reason, and
never the row's content: the data may be private. This module needs no torch.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from llmcustoms.errors import DataError

Message = tuple[str, str]  # (role, content); role is system | user | assistant

FORMAT_DESCRIPTIONS = {
    "messages": "OpenAI messages (messages: [{role, content}])",
    "sharegpt": "ShareGPT (conversations: [{from, value}])",
    "alpaca": "Alpaca (instruction, input, output)",
    "prompt_completion": "prompt/completion (prompt, completion)",
    "text": "plain text (text)",
}
# Checked in this order: the first whose required fields a row has wins.
FORMAT_REQUIRED_FIELDS = {
    "messages": {"messages"},
    "sharegpt": {"conversations"},
    "alpaca": {"instruction", "output"},
    "prompt_completion": {"prompt", "completion"},
    "text": {"text"},
}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
                  "system": "system"}
CHAT_ROLES = ("system", "user", "assistant")
SUPPORTED_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
# How many leading rows to look at when detecting the format.
DETECTION_ROWS = 50


@dataclass(frozen=True)
class Example:
    """One training row, normalised.

    Chat formats fill `messages`; raw formats fill `prompt` (not trained on by
    default) and `completion` (trained on). Plain text is all completion.
    """

    row: int
    messages: tuple[Message, ...] = ()
    prompt: str = ""
    completion: str = ""

    @property
    def is_chat(self) -> bool:
        return bool(self.messages)

    def char_count(self) -> int:
        return sum(len(c) for _, c in self.messages) + len(self.prompt) + len(self.completion)


@dataclass
class Dataset:
    path: Path
    format: str
    examples: list[Example]
    skipped: int = 0
    skip_reasons: Counter = field(default_factory=Counter)

    @property
    def format_description(self) -> str:
        return FORMAT_DESCRIPTIONS[self.format]


class RowProblem(Exception):
    """A problem with one row; the reader adds the file and line."""


@dataclass(frozen=True)
class RawRow:
    """A row as read from the file, before validation. `value` is None when
    the row could not even be parsed; `problem` then says why."""

    row: int
    line: int | None
    value: Any = None
    problem: str | None = None

    def where(self, path: Path) -> str:
        if self.line is not None and self.line != self.row:
            return f"{path.name}, row {self.row} (line {self.line})"
        if self.line is not None:
            return f"{path.name}, line {self.line}"
        return f"{path.name}, row {self.row}"


# ---------------------------------------------------------------- reading files

def _decode(path: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(
            f"{path.name}, line {line}: not valid UTF-8 text (byte 0x{raw[exc.start]:02x}).",
            "Save the file as UTF-8 (most editors offer this under 'Save as' / 'Encoding').",
        ) from None


def _read_jsonl(path: Path, raw: bytes) -> Iterator[RawRow]:
    row = 0
    for line_no, line in enumerate(raw.split(b"\n"), start=1):
        if line_no == 1 and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]
        if not line.strip():
            continue
        row += 1
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield RawRow(row, line_no, problem=f"not valid UTF-8 text (byte 0x{line[exc.start]:02x} at column {exc.start + 1})")
            continue
        try:
            yield RawRow(row, line_no, value=json.loads(text))
        except json.JSONDecodeError as exc:
            yield RawRow(row, line_no, problem=f"not valid JSON ({exc.msg} at column {exc.colno})")


def _read_json(path: Path, raw: bytes) -> Iterator[RawRow]:
    text = _decode(path, raw)
    stripped = text.lstrip()
    if not stripped.startswith("["):
        # Many ".json" files are really JSON Lines; a single object is one row.
        first_line = stripped.split("\n", 1)[0]
        try:
            json.loads(first_line)
            is_jsonl = "\n" in stripped.rstrip()
        except json.JSONDecodeError:
            is_jsonl = False
        if is_jsonl:
            yield from _read_jsonl(path, raw)
            return
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path.name}, line {exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno}).",
                            "A .json file must hold one JSON array of objects, or one object per line.") from None
        if isinstance(value, dict):
            yield RawRow(1, 1, value=value)
            return
        raise DataError(f"{path.name}: the file holds a JSON {type(value).__name__}, not an array of objects.",
                        "A .json file must hold one JSON array of objects, or one object per line.")
    # Walk the array element by element so each row keeps its line number.
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    row = 0

    def skip_space(p: int) -> int:
        while p < len(text) and text[p] in " \t\r\n":
            p += 1
        return p

    def fail(p: int, msg: str) -> DataError:
        line = text.count("\n", 0, p) + 1
        col = p - (text.rfind("\n", 0, p) + 1) + 1
        return DataError(f"{path.name}, line {line}: not valid JSON ({msg} at column {col}).",
                         "Check the file with a JSON validator; a missing comma or quote is the usual cause.")

    pos = skip_space(pos)
    if pos < len(text) and text[pos] == "]":
        return
    # Line numbers are counted on from the previous row, not from the start of
    # the file each time (that was quadratic in the file size).
    line, counted = 1, 0
    while True:
        pos = skip_space(pos)
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise fail(exc.pos, exc.msg) from None
        row += 1
        line += text.count("\n", counted, pos)
        counted = pos
        yield RawRow(row, line, value=value)
        pos = skip_space(end)
        if pos < len(text) and text[pos] == ",":
            pos += 1
            continue
        if pos < len(text) and text[pos] == "]":
            if text[pos + 1:].strip():
                raise fail(skip_space(pos + 1), "Extra data after the array")
            return
        raise fail(pos, "Expecting ',' or ']' between array elements")


def _read_csv(path: Path, raw: bytes) -> Iterator[RawRow]:
    text = _decode(path, raw)
    # csv.reader, not DictReader: DictReader skips blank lines without saying
    # so, and the line numbers of every later row would be off.
    # The csv module refuses cells over 128 KiB by default; long documents are normal here.
    csv.field_size_limit(2 ** 31 - 1)
    reader = csv.reader(io.StringIO(text, newline=""))
    header: list[str] | None = None
    row = 0
    start_line = 1
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            raise DataError(f"{path.name}, line {start_line}: not valid CSV ({exc}).",
                            "Check the quoting on that line; a cell with commas or line breaks needs double quotes.") from None
        line, start_line = start_line, reader.line_num + 1
        if not cells:
            continue
        if header is None:
            header = [name.strip() for name in cells]
            if len(set(header)) != len(header):
                raise DataError(f"{path.name}, line {line}: the header repeats a column name.",
                                "Give every column a unique name.")
            continue
        row += 1
        if len(cells) > len(header):
            yield RawRow(row, line, problem=f"has more cells than the header's {len(header)} columns")
            continue
        value, problem = {}, None
        for name, cell in zip(header, cells):
            # Chat columns in a CSV hold JSON text.
            if name in ("messages", "conversations") and cell.strip().startswith("["):
                try:
                    cell = json.loads(cell)
                except json.JSONDecodeError as exc:
                    problem = f"column '{name}' is not valid JSON ({exc.msg})"
                    break
            value[name] = cell
        yield RawRow(row, line, problem=problem) if problem else RawRow(row, line, value=value)


def _read_arrow_rows(rows: Iterator[dict]) -> Iterator[RawRow]:
    for i, value in enumerate(rows, start=1):
        yield RawRow(i, None, value=value)


def _read_parquet(path: Path) -> Iterator[RawRow]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise DataError(f"{path.name}: not a readable Parquet file ({type(exc).__name__}).",
                        "Check that the file was written completely.") from None
    yield from _read_arrow_rows(iter(table.to_pylist()))


def _read_saved_dataset(path: Path) -> Iterator[RawRow]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises FileNotFoundError or its own errors
        raise DataError(f"{path}: not a dataset saved with `datasets.save_to_disk` ({type(exc).__name__}).",
                        f"Pass a data file ({', '.join(SUPPORTED_SUFFIXES)}) or a saved dataset directory.") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"{path}: the saved DatasetDict has no 'train' split (splits: {', '.join(loaded)}).",
                            "Save the training rows under a split named 'train'.")
        loaded = loaded["train"]
    yield from _read_arrow_rows(iter(loaded))


def read_rows(path: Path) -> Iterator[RawRow]:
    """Every row of a supported file, in order, with its location."""
    if not path.exists():
        raise DataError(f"Data file not found: {path}", "Check the path; it is relative to the current directory.")
    if path.is_dir():
        yield from _read_saved_dataset(path)
        return
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise DataError(f"{path.name}: unsupported file type '{suffix or '(none)'}'.",
                        f"Use one of {', '.join(SUPPORTED_SUFFIXES)} or a saved `datasets` directory.")
    if suffix == ".parquet":
        yield from _read_parquet(path)
        return
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(f"Cannot read {path}: {exc.strerror}.") from None
    if not raw.strip() or raw.strip() == b"\xef\xbb\xbf":
        raise DataError(f"{path.name} is empty.", "Add at least one row of data.")
    reader = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv}[suffix]
    yield from reader(path, raw)


# ---------------------------------------------------------- format and validation

def detect_format(rows: list[RawRow], path: Path) -> str:
    seen_fields: list[str] = []
    objects = [raw for raw in rows if isinstance(raw.value, dict)]
    for raw in objects[:DETECTION_ROWS]:
        keys = set(raw.value)
        for name, required in FORMAT_REQUIRED_FIELDS.items():
            if required <= keys:
                return name
        seen_fields += [k for k in raw.value if k not in seen_fields]
    if not objects:
        unreadable = next((raw for raw in rows if raw.problem is not None), None)
        if unreadable is not None:
            # Nothing parsed: the first row's own problem is the useful message.
            raise DataError(f"{unreadable.where(path)}: {unreadable.problem}.",
                            "Each row must be one JSON object, such as {\"instruction\": ..., \"output\": ...}.")
        raise DataError(f"{path.name}: no row is a JSON object with fields.",
                        "Each row must be an object such as {\"instruction\": ..., \"output\": ...}.")
    if not seen_fields:
        raise DataError(f"{path.name}: the rows are empty objects.", "Each row needs fields such as instruction and output.")
    accepted = "; ".join(FORMAT_DESCRIPTIONS.values())
    raise DataError(
        # Field names only, shortened: in odd files the keys themselves could be content.
        f"{path.name}: cannot tell the data format from the fields found "
        f"({', '.join(str(f)[:30] for f in seen_fields[:10])}{', ...' if len(seen_fields) > 10 else ''}).",
        f"Accepted formats: {accepted}. Rename your columns to one of these.",
    )


def _text_field(value: dict, name: str, required: bool = True) -> str:
    if name not in value or value[name] is None:
        if required:
            raise RowProblem(f"missing field '{name}'")
        return ""
    text = value[name]
    if not isinstance(text, str):
        raise RowProblem(f"field '{name}' must be text, found {type(text).__name__}")
    if required and not text.strip():
        raise RowProblem(f"field '{name}' is empty")
    return text


def _chat_turns(turns: Any, field_name: str, role_key: str, content_key: str, roles: dict[str, str]) -> tuple[Message, ...]:
    if not isinstance(turns, list):
        raise RowProblem(f"field '{field_name}' must be a list of turns, found {type(turns).__name__}")
    messages = []
    for i, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict):
            raise RowProblem(f"{field_name}[{i}] must be an object, found {type(turn).__name__}")
        # ShareGPT exports sometimes use role/content; accept either spelling.
        role = turn.get(role_key, turn.get("role", turn.get("from")))
        content = turn.get(content_key, turn.get("content", turn.get("value")))
        if not isinstance(role, str) or role not in roles:
            raise RowProblem(f"{field_name}[{i}] has an unknown role (accepted: {', '.join(sorted(roles))})")
        if not isinstance(content, str):
            raise RowProblem(f"{field_name}[{i}] content must be text, found {type(content).__name__}")
        if not content.strip():
            raise RowProblem(f"{field_name}[{i}] ({roles[role]}) is empty")
        messages.append((roles[role], content))
    # Turns after the last assistant reply teach nothing; drop them.
    while messages and messages[-1][0] != "assistant":
        messages.pop()
    if not messages:
        raise RowProblem(f"field '{field_name}' has no assistant turn to learn from")
    if any(role == "system" for role, _ in messages[1:]):
        raise RowProblem(f"field '{field_name}' has a system turn that is not the first turn")
    return tuple(messages)


def to_example(raw: RawRow, fmt: str) -> Example:
    """Validate one parsed row against the detected format."""
    value = raw.value
    if not isinstance(value, dict):
        raise RowProblem(f"the row is not a JSON object (found {type(value).__name__})")
    if fmt == "alpaca":
        instruction = _text_field(value, "instruction")
        extra = _text_field(value, "input", required=False)
        prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        system = _text_field(value, "system", required=False)
        messages = ((("system", system),) if system.strip() else ()) + (("user", prompt), ("assistant", _text_field(value, "output")))
        return Example(raw.row, messages=messages)
    if fmt == "sharegpt":
        return Example(raw.row, messages=_chat_turns(value.get("conversations"), "conversations", "from", "value", SHAREGPT_ROLES))
    if fmt == "messages":
        return Example(raw.row, messages=_chat_turns(value.get("messages"), "messages", "role", "content", {r: r for r in CHAT_ROLES}))
    if fmt == "prompt_completion":
        return Example(raw.row, prompt=_text_field(value, "prompt"), completion=_text_field(value, "completion"))
    if fmt == "text":
        return Example(raw.row, completion=_text_field(value, "text"))
    raise AssertionError(f"unknown format {fmt}")


def read_dataset(path: str | Path, skip_bad_rows: bool = False) -> Dataset:
    """Read, detect and validate a data file. Raises `DataError` naming the first
    bad row, or with `skip_bad_rows` skips bad rows and counts them."""
    path = Path(path)
    rows = list(read_rows(path))
    if not rows:
        raise DataError(f"{path.name} has no rows.", "Add at least one row of data.")
    fmt = detect_format(rows, path)
    dataset = Dataset(path=path, format=fmt, examples=[])
    for raw in rows:
        try:
            if raw.problem is not None:
                raise RowProblem(raw.problem)
            dataset.examples.append(to_example(raw, fmt))
        except RowProblem as problem:
            if not skip_bad_rows:
                raise DataError(f"{raw.where(path)}: {problem}.",
                                "Fix that row, or pass --skip-bad-rows to skip rows like it.") from None
            dataset.skipped += 1
            dataset.skip_reasons[_reason_kind(str(problem))] += 1
    if not dataset.examples:
        raise DataError(f"{path.name}: no usable rows ({dataset.skipped} skipped as bad).",
                        "Fix the rows; run without --skip-bad-rows to see the first problem.")
    return dataset


def _reason_kind(problem: str) -> str:
    """A short category for the skip summary ('not valid JSON', 'missing field ...')."""
    return problem.split(" (")[0]


def fingerprint(path: str | Path) -> str:
    """sha256 over a data file (or every file of a saved dataset directory), so
    `resume` can tell that the data it trains on is the data the run began with."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
