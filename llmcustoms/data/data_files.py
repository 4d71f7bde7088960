"""Read the rows of a data file one at a time, each with its location.

Supported files: `.jsonl`, `.json` (an array, or JSON Lines saved as .json),
`.csv`, `.parquet`, `.txt` (plain text: a row per paragraph, `text` rows) and
a directory written by `datasets.save_to_disk`. Whatever the file, "\\r\\n" and a
lone "\\r" in a row's text are read as "\\n" (`raw_rows.unix_line_endings`).

Every reader streams: memory stays bounded by the largest row, not the file,
so a file larger than RAM can be read. A row that cannot be parsed is yielded
with its `problem` (the caller's bad-row policy decides); a file whose
structure is broken (a JSON array cut in half) raises `DataError` naming the
line. Nothing here shows a row's content: the data may be private. No torch.

The limits on one row are `data/raw_rows.py`'s: a row with a lone surrogate, or
nested too deeply for the json module, is a bad row. One longer than
`MAX_ROW_BYTES` (64 MiB) is a bad row in JSON Lines, skipped unread; in a
JSON array, a single JSON object or a CSV file it is a `DataError` (so is a
row of a JSON array nested too deeply), since where the next row starts
cannot be found without reading it. `data/table_files.py` reads CSV, Parquet and
the Arrow rows of saved datasets, a batch at a time.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import itertools
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import IO, Iterator

from llmcustoms.data import raw_rows
from llmcustoms.data.raw_rows import (
    NOT_UNICODE,
    TOO_DEEP,
    TOO_LONG,
    BeyondLimits,
    RawRow,
    lone_surrogate,
    parse_json,
    unix_line_endings,
)
from llmcustoms.data.table_files import read_arrow_rows, read_csv, read_parquet
from llmcustoms.errors import DataError

__all__ = ["RawRow", "SUPPORTED_SUFFIXES", "fingerprint", "read_rows"]

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt")
# Bytes read at a time from a JSON array; doubled while one row is larger.
JSON_CHUNK = 1 << 20
_SPACE = re.compile(r"[ \t\r\n]*")
# What ends a line of a .txt file: "\n", "\r\n", or a lone "\r" as old Macs write.
_LINE_BREAK = re.compile("\r\n|\r|\n")
JSON_HINT = "A .json file must hold one JSON array of objects, or one object per line."


def not_json(msg: str, column: int) -> str:
    """The problem of text the json module refused. Some of its messages end in
    "at" ("Invalid control character at"), which would read "at at column"."""
    return f"not valid JSON ({msg.removesuffix(' at')} at column {column})"


def _read_jsonl(path: Path) -> Iterator[RawRow]:
    row = 0
    with open(path, "rb") as f:
        for line_no, line in raw_rows.lines(f):
            if line is None:
                row += 1
                yield RawRow(row, line_no, problem=TOO_LONG)
                continue
            if line_no == 1 and line.startswith(codecs.BOM_UTF8):
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
                yield RawRow(row, line_no, value=parse_json(text))
            except json.JSONDecodeError as exc:
                yield RawRow(row, line_no, problem=not_json(exc.msg, exc.colno))
            except BeyondLimits as exc:
                yield RawRow(row, line_no, problem=str(exc))


def _text_lines(f: IO[bytes]) -> Iterator[tuple[int, str | None, str | None, bool, int]]:
    """A text file's lines: (line number, text or None, its problem, whether it
    ended in "\\r\\n" or held a lone "\\r", bytes read). A lone "\\r" breaks a line,
    as in an editor; a line that is not UTF-8 or is too long has a problem."""
    number = 0
    for line_no, line in raw_rows.lines(f):
        if line is None:
            number += 1
            yield number, None, TOO_LONG, False, 0
            continue
        line = line.removeprefix(codecs.BOM_UTF8) if line_no == 1 else line
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            number += 1
            yield number, None, f"not valid UTF-8 text (byte 0x{line[exc.start]:02x} at column {exc.start + 1})", False, 0
            continue
        pieces = _LINE_BREAK.split(text)
        if len(pieces) > 1 and not pieces[-1]:
            pieces.pop()  # what the last break ends is no line
        for piece in pieces:
            number += 1
            yield number, piece, None, "\r" in text, len(line) if len(pieces) == 1 else len(piece.encode()) + 1


def _read_txt(path: Path) -> Iterator[RawRow]:
    """Plain text, as `datasets`' text loader and LLaMA-Factory read it: a
    file with blank lines (a line of spaces counts as blank) is a row per
    paragraph, as sample_by="paragraph"; one without is a row per line (its
    default, sample_by="line"). Each row is a `text` row at its first line;
    a paragraph's lines are joined with "\\n". A row over TEXT_PIECE_CHARS is
    split into pieces (`_pieces`). A paragraph over the limit on one row, or
    with a line that is not UTF-8, is a bad row; the rest of it is not kept."""
    by_paragraph = _has_blank_line(path)
    row = 0
    with open(path, "rb") as f:
        lines = _text_lines(f)
        # A line that is not UTF-8 (its text None) is no blank line: it belongs to its paragraph.
        groups = (itertools.groupby(lines, key=lambda line: line[1] is not None and not line[1].strip())
                  if by_paragraph else ((line[1] is not None and not line[1].strip(), [line]) for line in lines))
        for blank, group in groups:
            if blank:
                continue
            for piece in _pieces(_paragraph(row + 1, group)):
                row += 1
                yield replace(piece, row=row)


def _has_blank_line(path: Path) -> bool:
    """Whether a text file holds a blank line between two lines of text."""
    seen_text = seen_blank = False
    with open(path, "rb") as f:
        for _, text, _, _, _ in _text_lines(f):
            blank = text is not None and not text.strip()
            if blank and seen_text:
                seen_blank = True
            elif not blank:
                if seen_blank:
                    return True
                seen_text = True
    return False


def _paragraph(row: int, lines: Iterator[tuple[int, str | None, str | None, bool, int]]) -> RawRow:
    kept, size, first, breaks = [], 0, 0, False
    for number, text, problem, other_break, read in lines:
        first, breaks, size = first or number, breaks or other_break, size + read
        if problem or size > raw_rows.MAX_ROW_BYTES:
            return RawRow(row, first, problem=problem or TOO_LONG)  # the rest of it is skipped unkept
        kept.append(text)
    return RawRow(row, first, value={"text": "\n".join(kept)}, line_endings=breaks)


# A text row longer than this is trained in pieces: a row is cut at the run's
# --max-seq-len, so one long document (a book pasted as one paragraph) would
# teach only its first page.
TEXT_PIECE_CHARS = 8192


def _pieces(paragraph: RawRow) -> list[RawRow]:
    """A long row split into pieces of at most TEXT_PIECE_CHARS, at a line
    break in a piece's second half, else at a space, else anywhere."""
    text = (paragraph.value or {}).get("text", "")
    if len(text) <= TEXT_PIECE_CHARS:
        return [paragraph]
    pieces, start = [], 0
    while start < len(text):
        end = min(len(text), start + TEXT_PIECE_CHARS)
        if end < len(text):
            cut = text.rfind("\n", start + TEXT_PIECE_CHARS // 2, end)
            cut = cut if cut >= 0 else text.rfind(" ", start, end)
            end = cut + 1 if cut > start else end
        pieces.append(replace(paragraph, value={"text": text[start:end].strip("\n")}))
        start = end
    return [piece for piece in pieces if piece.value["text"].strip()]


class _TextStream:
    """A UTF-8 file read in chunks. `buffer[pos:]` is what is not consumed yet
    and `line` the line number at `pos`; the consumed part is dropped only
    when more is read, so consuming a row costs no copy of the rest."""

    def __init__(self, path: Path, f: IO[bytes]):
        self.path, self.f = path, f
        self.decoder = codecs.getincrementaldecoder("utf-8-sig")()
        self.buffer, self.pos, self.line, self.eof = "", 0, 1, False
        self.column0 = 0  # the column of buffer[0], which need not start a line

    def more(self, size: int) -> bool:
        """Append up to `size` more bytes of text; False at the end of the file."""
        if self.eof:
            return False
        self.compact()
        raw = self.f.read(size)
        try:
            self.buffer += self.decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as exc:
            # exc.object holds the decoder's leftover bytes and then `raw`.
            line = self.line + self.buffer.count("\n") + exc.object[: exc.start].count(b"\n")
            raise DataError(f"{self.path.name}, line {line}: not valid UTF-8 text (byte 0x{exc.object[exc.start]:02x}"
                            f"{', and the file ends there' if not raw else ''}).",
                            "Save the file as UTF-8 (most editors offer this under 'Save as' / 'Encoding').") from None
        self.eof = not raw
        return bool(raw)

    def compact(self) -> None:
        """Drop what was consumed, keeping the column of what is left."""
        done = self.buffer[: self.pos]
        newline = done.rfind("\n")
        self.column0 = len(done) - newline - 1 if newline >= 0 else self.column0 + len(done)
        self.buffer, self.pos = self.buffer[self.pos:], 0

    def at(self, text: str) -> bool:
        return self.buffer.startswith(text, self.pos)

    def rest(self) -> bool:
        return self.pos < len(self.buffer)

    def consume_to(self, end: int) -> None:
        self.line += self.buffer.count("\n", self.pos, end)
        self.pos = end

    def skip_space(self) -> None:
        while True:
            self.consume_to(_SPACE.match(self.buffer, self.pos).end())
            if self.rest() or not self.more(JSON_CHUNK):
                return

    def fail(self, at: int, msg: str) -> DataError:
        line = self.line + self.buffer.count("\n", self.pos, at)
        newline = self.buffer.rfind("\n", 0, at)
        col = at - newline if newline >= 0 else self.column0 + at + 1
        return DataError(f"{self.path.name}, line {line}: {not_json(msg, col)}.",
                         "Check the file with a JSON validator; a missing comma or quote is the usual cause.")


def _cut_short(error: json.JSONDecodeError, buffer: str) -> bool:
    """Whether decoding failed because the text ends, not because it is wrong."""
    return error.pos >= len(buffer.rstrip()) - 1 or error.msg.startswith("Unterminated string")


def _array_elements(text: _TextStream) -> Iterator[RawRow]:
    """The elements of a JSON array, decoded one at a time from a stream."""
    decoder = json.JSONDecoder()
    text.consume_to(text.pos + 1)  # the "["
    text.skip_space()
    if text.at("]"):
        return
    row = 0
    while True:
        text.skip_space()
        size = JSON_CHUNK
        while True:
            try:
                value, end = decoder.raw_decode(text.buffer, text.pos)
                # A value that ends the buffer may be cut short (a number); a
                # whole row is always followed by "," or "]".
                if end < len(text.buffer) or text.eof:
                    break
            except json.JSONDecodeError as exc:
                # Read on only if the row may just be cut short by the chunk;
                # a mistake in the middle fails here, not after the whole file.
                if text.eof or not _cut_short(exc, text.buffer):
                    raise text.fail(exc.pos, exc.msg) from None
            except (ValueError, RecursionError):  # the json module's limits: nesting, digits
                raise _unreadable_row(text, row + 1, TOO_DEEP) from None
            if len(text.buffer) - text.pos > raw_rows.MAX_ROW_BYTES:
                raise _unreadable_row(text, row + 1, TOO_LONG)
            text.more(size)
            size *= 2
        if end - text.pos > raw_rows.MAX_ROW_BYTES:  # parsed whole, but too long all the same
            raise _unreadable_row(text, row + 1, TOO_LONG)
        row += 1
        # Parsed, so the array reads on past it: a bad row like any other.
        bad = lone_surrogate(value, text.buffer, text.pos, end)
        yield RawRow(row, text.line, problem=NOT_UNICODE) if bad else RawRow(row, text.line, value=value)
        text.consume_to(end)
        text.skip_space()
        if text.at(","):
            text.consume_to(text.pos + 1)
            continue
        if text.at("]"):
            text.consume_to(text.pos + 1)
            text.skip_space()
            if text.rest():
                raise text.fail(text.pos, "Extra data after the array")
            return
        raise text.fail(text.pos, "Expecting ',' or ']' between array elements")


def _unreadable_row(text: _TextStream, row: int, problem: str) -> DataError:
    # Where the next row starts cannot be found without reading this one whole.
    return DataError(f"{text.path.name}, line {text.line}: row {row} of the JSON array is {problem}.",
                     "A JSON array cannot skip such a row: fix it, or save the file as JSON Lines (one row per "
                     "line), where it is skipped as a bad row.")


def _is_json_lines(text: _TextStream) -> bool:
    """Whether a .json file that is not an array is JSON Lines (many are):
    a first line that is JSON, and more after it."""
    text.compact()
    while "\n" not in text.buffer and len(text.buffer) <= raw_rows.MAX_ROW_BYTES and text.more(JSON_CHUNK):
        pass
    first_line, _, rest = text.buffer.partition("\n")
    if len(first_line) > raw_rows.MAX_ROW_BYTES:
        return True  # too long for a row either way: JSON Lines reading says so, and reads on
    if not rest.strip() and text.more(JSON_CHUNK):
        rest = text.buffer.partition("\n")[2]
    try:
        json.loads(first_line)
    except json.JSONDecodeError:
        return False
    except (ValueError, RecursionError):
        pass  # JSON beyond the limits: a bad row if more lines follow
    return bool(rest.strip())


def _single_object(text: _TextStream) -> dict:
    """The one row of a .json file that holds a single object."""
    name = text.path.name
    while len(text.buffer) <= raw_rows.MAX_ROW_BYTES and text.more(JSON_CHUNK):
        pass
    if len(text.buffer) > raw_rows.MAX_ROW_BYTES:
        raise DataError(f"{name}: the JSON object is {TOO_LONG}.", JSON_HINT)
    try:
        value = parse_json(text.buffer)
    except json.JSONDecodeError as exc:
        raise DataError(f"{name}, line {exc.lineno}: {not_json(exc.msg, exc.colno)}.",
                        JSON_HINT) from None
    except BeyondLimits as exc:
        raise DataError(f"{name}, the JSON object: {exc}.", JSON_HINT) from None
    if not isinstance(value, dict):
        raise DataError(f"{name}: the file holds a JSON {type(value).__name__}, not an array of objects.", JSON_HINT)
    return value


def _read_json(path: Path) -> Iterator[RawRow]:
    with open(path, "rb") as f:
        text = _TextStream(path, f)
        text.skip_space()
        if text.at("["):
            yield from _array_elements(text)
            return
        if not _is_json_lines(text):
            yield RawRow(1, 1, value=_single_object(text))
            return
    yield from _read_jsonl(path)


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
    # Arrow files are memory-mapped: this streams.
    yield from map(unix_line_endings, read_arrow_rows(path, iter(loaded)))


def _is_empty(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096)
    return not head.removeprefix(codecs.BOM_UTF8).strip() and path.stat().st_size <= 4096


def read_rows(path: Path) -> Iterator[RawRow]:
    """Every row of a supported file, in order, with its location."""
    if not path.exists():
        raise DataError(f"Data file not found: {path}", "Check the path; it is relative to the current directory.")
    if path.is_dir():
        yield from _read_saved_dataset(path)
        return
    if not path.is_file():
        # A FIFO would wait forever for a writer; a device such as /dev/zero (or a
        # link to one) never ends and would fill the memory.
        raise DataError(f"{path} is not a regular file (a pipe, device or socket).",
                        "Save the data to a file first and pass that file.")
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise DataError(f"{path.name}: unsupported file type '{suffix or '(none)'}'.",
                        f"Use one of {', '.join(SUPPORTED_SUFFIXES)} or a saved `datasets` directory.")
    if suffix == ".parquet":
        yield from map(unix_line_endings, read_parquet(path))
        return
    try:
        empty = _is_empty(path)
    except OSError as exc:
        raise DataError(f"Cannot read {path}: {exc.strerror}.") from None
    if empty:
        raise DataError(f"{path.name} is empty.", "Add at least one row of data.")
    reader = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": read_csv, ".txt": _read_txt}[suffix]
    yield from map(unix_line_endings, reader(path))


def fingerprint(path: str | Path) -> str:
    """sha256 over a data file (or every file of a saved dataset directory), so
    `resume` can tell that the data it trains on is the data the run began with."""
    path = Path(path)
    if path.is_file():  # asked for more than once per command: remembered while the file is unchanged
        stat = path.stat()
        return _file_fingerprint(str(path.absolute()), stat.st_size, stat.st_mtime_ns)
    return _fingerprint(path)


@functools.lru_cache(maxsize=16)
def _file_fingerprint(path: str, size: int, mtime_ns: int) -> str:
    return _fingerprint(Path(path))


def _fingerprint(path: Path) -> str:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
