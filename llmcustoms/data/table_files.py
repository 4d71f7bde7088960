"""The rows of a table: a CSV file, a Parquet file, or the Arrow rows of a
saved `datasets` directory, each streamed with its location (`data/data_files.py`
picks the reader). A CSV cell of JSON text (a messages column) is parsed
within the limits of `data/raw_rows.py`; a CSV line or cell longer than
`MAX_ROW_BYTES` is a `DataError`, since skipping it would leave the csv
module's quoting out of step. Nothing here shows a row's content. No torch.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import IO, Any, Iterator

from llmcustoms.data import raw_rows
from llmcustoms.data.raw_rows import TOO_LONG, BeyondLimits, RawRow, parse_json
from llmcustoms.errors import DataError

# Columns that hold JSON text in a CSV: a chat's turns, a row's tools, a pair's replies.
JSON_COLUMNS = ("messages", "conversations", "tools", "chosen", "rejected")


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
            # The csv module's own words, except for its limit on a cell, which is ours.
            said = TOO_LONG if "field limit" in str(exc) else f"not valid CSV ({exc})"
            raise DataError(f"{path.name}, line {start_line}: {said}.",
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
            if name in JSON_COLUMNS and cell.strip().startswith("["):
                try:
                    cell = parse_json(cell)
                except json.JSONDecodeError as exc:
                    problem = f"column '{name}' is not valid JSON ({exc.msg})"
                    break
                except BeyondLimits as exc:
                    problem = f"column '{name}': {exc}"
                    break
            value[name] = cell
        yield RawRow(row, line, problem=problem) if problem else RawRow(row, line, value=value)


def _decoded_lines(path: Path, f: IO[bytes]) -> Iterator[str]:
    """The file's lines as text, naming the line of a byte that is not UTF-8."""
    for line_no, line in raw_rows.lines(f):
        if line is None:
            raise DataError(f"{path.name}, line {line_no}: {TOO_LONG}.",
                            "Check that line: a missing line break or quote can make one line of the whole file.")
        try:
            yield line.decode("utf-8-sig" if line_no == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{path.name}, line {line_no}: not valid UTF-8 text (byte 0x{line[exc.start]:02x}).",
                            "Save the file as UTF-8 (most editors offer this under 'Save as' / 'Encoding').") from None


class _LoneCarriageReturns(io.RawIOBase):
    """A file whose lines end in a lone "\r" (as old Macs and some exports
    write), read with "\n" line ends: it has no "\n" to keep apart."""

    def __init__(self, raw: IO[bytes]):
        self.raw = raw

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.raw.read(len(buffer)).replace(b"\r", b"\n")
        buffer[:len(data)] = data
        return len(data)


def read_csv(path: Path) -> Iterator[RawRow]:
    # The csv module refuses cells over 128 KiB by default; long documents are normal here.
    csv.field_size_limit(raw_rows.MAX_ROW_BYTES)
    with open(path, "rb") as f:
        head = f.read(1 << 16)
        f.seek(0)
        lines: IO[bytes] = f
        if b"\r" in head and b"\n" not in head:  # every line ends in a lone "\r"
            lines = io.BufferedReader(_LoneCarriageReturns(f))
        # csv.reader, not DictReader: DictReader skips blank lines without saying
        # so, and the line numbers of every later row would be off.
        # strict: a stray quote is an error at its line, not a cell that
        # silently swallows every row after it.
        yield from _csv_rows(path, csv.reader(_decoded_lines(path, lines), strict=True))


def read_arrow_rows(path: Path, rows: Iterator[dict]) -> Iterator[RawRow]:
    """Rows from Arrow. Arrow decodes its strings as UTF-8, so they hold no
    surrogate; JSON text in them is checked where it is parsed."""
    i = 0
    while True:
        try:
            value = next(rows)
        except StopIteration:
            return
        except Exception as exc:  # pyarrow and datasets raise several types for a damaged file
            raise DataError(f"{path.name}: cannot read past row {i:,} ({type(exc).__name__}).",
                            "Check that the file was written completely, and that its text columns are UTF-8.") from None
        i += 1
        yield RawRow(i, None, value=value)


def read_parquet(path: Path) -> Iterator[RawRow]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise DataError(f"{path.name}: not a readable Parquet file ({type(exc).__name__}).",
                        "Check that the file was written completely.") from None

    json_fields = [(field.name, *path) for field in parquet.schema_arrow for path in _json_paths(field.type)]

    def rows() -> Iterator[dict]:
        for batch in parquet.iter_batches(batch_size=1024):
            for value in batch.to_pylist():
                yield _with_json_decoded(value, json_fields)

    yield from read_arrow_rows(path, rows())


def _json_paths(kind: Any) -> list[tuple[str, ...]]:
    """Where JSON-typed values lie inside an Arrow type, as paths of field names
    ("" for a list's items): `datasets` writes a column of mixed types, such as
    turns whose content is text in some rows and a list of parts in others
    (`on_mixed_types="use_json"`), as Arrow's JSON type, which reads back as
    the JSON text."""
    import pyarrow as pa

    if getattr(kind, "extension_name", None) == "arrow.json":
        return [()]
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return [("", *path) for path in _json_paths(kind.value_type)]
    if pa.types.is_struct(kind):
        return [(kind.field(i).name, *path) for i in range(kind.num_fields) for path in _json_paths(kind.field(i).type)]
    return []


def _with_json_decoded(value: Any, paths: list[tuple[str, ...]]) -> Any:
    """`value` with the JSON text at each of `paths` parsed (text that is not
    JSON stays as it is: the row's check names it)."""
    for path in paths:
        value = _decode_at(value, path)
    return value


def _decode_at(value: Any, path: tuple[str, ...]) -> Any:
    if not path:
        if isinstance(value, str):
            try:
                return parse_json(value)
            except (json.JSONDecodeError, BeyondLimits):
                return value
        return value
    head, rest = path[0], path[1:]
    if head == "" and isinstance(value, list):
        return [_decode_at(item, rest) for item in value]
    if isinstance(value, dict) and head in value:
        return {**value, head: _decode_at(value[head], rest)}
    return value
