"""Read the rows of a data file one at a time, each with its location.

Supported files: `.jsonl`, `.json` (an array, or JSON Lines saved as .json),
`.csv`, `.parquet`, and a directory written by `datasets.save_to_disk`.

Every reader streams: memory stays bounded by the largest row, not the file,
so a file larger than RAM can be read. A row that cannot be parsed is yielded
with its `problem` (the caller's bad-row policy decides); a file whose
structure is broken (a JSON array cut in half) raises `DataError` naming the
line. Nothing here shows a row's content: the data may be private. No torch.
"""

from __future__ import annotations

import codecs
import csv
import functools
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator

from llmcustoms.errors import DataError

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
# Bytes read at a time from a JSON array; doubled while one row is larger.
JSON_CHUNK = 1 << 20
_SPACE = re.compile(r"[ \t\r\n]*")
TOO_DEEP = "nested too deeply, or a number too long"
JSON_HINT = "A .json file must hold one JSON array of objects, or one object per line."


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

    def location(self) -> str:
        """Where the row is, without the file name: 'line 12', 'row 3' or 'row 3 at line 1'."""
        if self.line is not None and self.line != self.row:
            return f"row {self.row} at line {self.line}"
        return f"line {self.line}" if self.line is not None else f"row {self.row}"


def _read_jsonl(path: Path) -> Iterator[RawRow]:
    row = 0
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
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
                yield RawRow(row, line_no, value=json.loads(text))
            except json.JSONDecodeError as exc:
                yield RawRow(row, line_no, problem=f"not valid JSON ({exc.msg} at column {exc.colno})")
            except (ValueError, RecursionError):  # the json module's limits: digits, nesting
                yield RawRow(row, line_no, problem=f"not valid JSON ({TOO_DEEP})")


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
        return DataError(f"{self.path.name}, line {line}: not valid JSON ({msg} at column {col}).",
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
            except (ValueError, RecursionError):  # the json module's limits
                raise text.fail(text.pos, TOO_DEEP) from None
            text.more(size)
            size *= 2
        row += 1
        yield RawRow(row, text.line, value=value)
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


def _read_json(path: Path) -> Iterator[RawRow]:
    with open(path, "rb") as f:
        text = _TextStream(path, f)
        text.skip_space()
        if text.at("["):
            yield from _array_elements(text)
            return
        # Many ".json" files are really JSON Lines; a single object is one row.
        text.compact()
        while "\n" not in text.buffer and text.more(JSON_CHUNK):
            pass
        first_line, _, rest = text.buffer.partition("\n")
        if not rest.strip() and text.more(JSON_CHUNK):
            rest = text.buffer.partition("\n")[2]
        try:
            json.loads(first_line)
            is_jsonl = bool(rest.strip())
        except json.JSONDecodeError:
            is_jsonl = False
        if not is_jsonl:
            while text.more(JSON_CHUNK):
                pass
            try:
                value = json.loads(text.buffer)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path.name}, line {exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno}).",
                                JSON_HINT) from None
            if not isinstance(value, dict):
                raise DataError(f"{path.name}: the file holds a JSON {type(value).__name__}, not an array of objects.",
                                JSON_HINT)
            yield RawRow(1, 1, value=value)
            return
    yield from _read_jsonl(path)


def _csv_rows(path: Path, reader: Any) -> Iterator[RawRow]:
    header: list[str] | None = None
    row = 0
    start_line = 1
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            return
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
            if name in ("messages", "conversations", "tools", "chosen", "rejected") and cell.strip().startswith("["):
                try:
                    cell = json.loads(cell)
                except json.JSONDecodeError as exc:
                    problem = f"column '{name}' is not valid JSON ({exc.msg})"
                    break
            value[name] = cell
        yield RawRow(row, line, problem=problem) if problem else RawRow(row, line, value=value)


def _decoded_lines(path: Path, f: IO[bytes]) -> Iterator[str]:
    """The file's lines as text, naming the line of a byte that is not UTF-8."""
    for line_no, line in enumerate(f, start=1):
        try:
            yield line.decode("utf-8-sig" if line_no == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{path.name}, line {line_no}: not valid UTF-8 text (byte 0x{line[exc.start]:02x}).",
                            "Save the file as UTF-8 (most editors offer this under 'Save as' / 'Encoding').") from None


def _read_csv(path: Path) -> Iterator[RawRow]:
    # The csv module refuses cells over 128 KiB by default; long documents are normal here.
    csv.field_size_limit(2 ** 31 - 1)
    with open(path, "rb") as f:
        # csv.reader, not DictReader: DictReader skips blank lines without saying
        # so, and the line numbers of every later row would be off.
        # strict: a stray quote is an error at its line, not a cell that
        # silently swallows every row after it.
        yield from _csv_rows(path, csv.reader(_decoded_lines(path, f), strict=True))


def _read_arrow_rows(rows: Iterator[dict]) -> Iterator[RawRow]:
    for i, value in enumerate(rows, start=1):
        yield RawRow(i, None, value=value)


def _read_parquet(path: Path) -> Iterator[RawRow]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise DataError(f"{path.name}: not a readable Parquet file ({type(exc).__name__}).",
                        "Check that the file was written completely.") from None

    def rows() -> Iterator[dict]:
        for batch in parquet.iter_batches(batch_size=1024):
            yield from batch.to_pylist()

    yield from _read_arrow_rows(rows())


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
    yield from _read_arrow_rows(iter(loaded))  # Arrow files are memory-mapped: this streams


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
        yield from _read_parquet(path)
        return
    try:
        empty = _is_empty(path)
    except OSError as exc:
        raise DataError(f"Cannot read {path}: {exc.strerror}.") from None
    if empty:
        raise DataError(f"{path.name} is empty.", "Add at least one row of data.")
    reader = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv}[suffix]
    yield from reader(path)


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
