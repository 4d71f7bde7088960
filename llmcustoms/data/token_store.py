"""Tokenized rows on disk, memory-mapped, so data larger than memory can train.

A store is a directory of flat arrays: every row's token ids one after the
other (`ids`, int32), whether each token is learned (`learned`, uint8), where
each row starts (`offsets`), its row number in the data file (`rows`) and the
index of its first learned label (`first_loss`). Training reads a micro-batch
at a time from them; the operating system pages in only what is read.

Stores are written once, under a key naming everything the ids depend on
(`token_cache.tokenization_cache_key`), into a temporary directory renamed
into place when complete, so a killed run never leaves half a store that
looks whole. `TokenRows` is a view: a selection of a store's rows (the
training split, say), optionally cut to a length.

meta.json, written last, holds a checksum of every other file: a store whose
files were changed since (by hand, a bad disk, another program) is not used
but rebuilt, so it can neither train on ids the data never gave nor stop a run
on ids outside the vocabulary. A temporary directory whose writer is gone (a
killed run) is removed by the next run that opens the cache
(`remove_abandoned`).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from array import array
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from llmcustoms.data.tokenization import IGNORE_INDEX, TokenizedExample

# v3: "\r\n" and a lone "\r" in a row's text are read as "\n", so a file with
# them tokenizes otherwise than before; so does one whose replies carry
# OpenAI's `weight: 0` (masked now) or reasoning parts.
# v4: every reply of a template that shows earlier turns otherwise (Qwen3,
# Phi-3.5) is learned, not only the last; a reply ends at its end-of-turn
# token (the newline ChatML writes after it is prompt).
STORE_FORMAT = "tokenized-v4"
# No row keeps more tokens than this (far beyond any max_seq_len a run uses);
# text is clipped to MAX_ROW_TOKENS * MAX_CHARS_PER_TOKEN characters before
# tokenizing, so one huge row costs little time and memory.
MAX_ROW_TOKENS = 65536
MAX_CHARS_PER_TOKEN = 8
MAX_ROW_CHARS = MAX_ROW_TOKENS * MAX_CHARS_PER_TOKEN
# Data with fewer rows is tokenized in one process; more spreads over the cores.
# With fewer cores, workers only add the cost of passing rows between processes:
# on 2 cores, 20 MB of chat rows took 11.9 s with 2 workers and 8.5 s without.
PARALLEL_MIN_ROWS = 20_000
# Text tokenized in one call, at most (about 4 MB: a few hundred MB of memory while it is tokenized).
CHUNK_CHARS = 4_000_000
PARALLEL_MIN_CORES = 4
MAX_WORKERS = 8
# Files of a store covered by meta.json's checksums.
STORE_FILES = ("ids.bin", "learned.bin", "offsets.npy", "rows.npy", "first_loss.npy")
# Who is writing a temporary store: its process and machine, so the next run can tell a killed writer's leftovers.
WRITER_FILE = "writer.json"
# A temporary store none of whose files changed for this long is abandoned even if
# its writer cannot be checked (another machine sharing the cache, or no writer.json).
ABANDONED_AFTER_S = 3600


@dataclass(frozen=True)
class Arrays:
    """The flat arrays of a store (memory-mapped, or in memory for small data)."""

    ids: np.ndarray
    learned: np.ndarray
    offsets: np.ndarray  # n + 1
    rows: np.ndarray
    first_loss: np.ndarray

    @classmethod
    def from_examples(cls, examples: Sequence[TokenizedExample]) -> "Arrays":
        ids = np.array([t for e in examples for t in e.input_ids], np.int32)
        learned = np.array([label != IGNORE_INDEX for e in examples for label in e.labels], np.uint8)
        offsets = np.cumsum([0] + [len(e.input_ids) for e in examples], dtype=np.int64)
        first = [_first_loss(np.array([label != IGNORE_INDEX for label in e.labels], np.uint8)) for e in examples]
        return cls(ids, learned, offsets, np.array([e.row for e in examples], np.int64), np.array(first, np.int32))


def _first_loss(learned: np.ndarray) -> int:
    """Index of the first label that counts (label i is predicted from i-1, so never 0)."""
    hits = np.flatnonzero(learned[1:])
    return int(hits[0]) + 1 if len(hits) else len(learned)


class TokenRows:
    """Some rows of a store, optionally cut to `max_len` tokens. Indexing gives
    a `TokenizedExample`; lengths and first learned positions are arrays."""

    def __init__(self, arrays: Arrays, index: np.ndarray | None = None, max_len: int | None = None):
        self.arrays = arrays
        self.index = np.arange(len(arrays.rows), dtype=np.int64) if index is None else np.asarray(index, np.int64)
        self.max_len = max_len

    @classmethod
    def from_examples(cls, examples: Sequence[TokenizedExample]) -> "TokenRows":
        return cls(Arrays.from_examples(examples))

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):  # a few rows as a list, as from a list of rows
            return [self[j] for j in range(*i.indices(len(self)))]
        k = self.index[i]
        start, end = int(self.arrays.offsets[k]), int(self.arrays.offsets[k + 1])
        if self.max_len is not None:
            end = min(end, start + self.max_len)
        ids = self.arrays.ids[start:end].astype(np.int64)
        labels = np.where(self.arrays.learned[start:end] != 0, ids, IGNORE_INDEX)
        return TokenizedExample(int(self.arrays.rows[k]), ids.tolist(), labels.tolist())

    def __iter__(self) -> Iterator[TokenizedExample]:
        return (self[i] for i in range(len(self)))

    @property
    def full_lengths(self) -> np.ndarray:
        """Tokens per row before any cut (at most MAX_ROW_TOKENS)."""
        return np.diff(self.arrays.offsets)[self.index]

    @property
    def lengths(self) -> np.ndarray:
        full = self.full_lengths
        return full if self.max_len is None else np.minimum(full, self.max_len)

    @property
    def first_loss(self) -> np.ndarray:
        return self.arrays.first_loss[self.index].astype(np.int64)

    @property
    def row_numbers(self) -> np.ndarray:
        return self.arrays.rows[self.index]

    def select(self, positions: Sequence[int] | np.ndarray) -> "TokenRows":
        return TokenRows(self.arrays, self.index[np.asarray(positions, np.int64)], self.max_len)

    def cut(self, max_len: int) -> "TokenRows":
        """The same rows shortened to `max_len` tokens; none is dropped."""
        limit = max_len if self.max_len is None else min(max_len, self.max_len)
        return TokenRows(self.arrays, self.index, limit)

    def truncated(self, max_len: int) -> tuple["TokenRows", int, int]:
        """(rows cut to max_len without those left with nothing to learn,
        rows truncated, rows dropped)."""
        # A row keeps a learned token only if its first one is inside both the
        # cut and the row (a row of prompt only has first_loss == its length).
        keep = self.first_loss < np.minimum(self.full_lengths, max_len)
        truncated = int((self.lengths > max_len).sum())
        return TokenRows(self.arrays, self.index[keep], max_len), truncated, int((~keep).sum())

    def examples(self, positions: Sequence[int]) -> list[TokenizedExample]:
        """The sequences these rows put through the model, in order."""
        return [self[i] for i in positions]

    def input_tokens(self, positions: Sequence[int]) -> int:
        return int(self.lengths[np.asarray(positions, np.int64)].sum())

    def trained_tokens(self, positions: Sequence[int]) -> int:
        """Labels that count towards the loss in these rows (after the cut)."""
        total = 0
        for i in positions:
            k = self.index[i]
            start = int(self.arrays.offsets[k])
            end = int(self.arrays.offsets[k + 1]) if self.max_len is None else min(int(self.arrays.offsets[k + 1]), start + self.max_len)
            total += int(self.arrays.learned[start + 1:end].sum())
        return total


class StoreWriter:
    """Appends tokenized rows to a new store; `finish` puts it in place."""

    def __init__(self, directory: Path):
        self.directory = directory
        directory.parent.mkdir(parents=True, exist_ok=True)
        # A name of its own: processes on several machines may share a cache (and a pid).
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".tmp", dir=directory.parent))
        (self.tmp / WRITER_FILE).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        self.ids_file = open(self.tmp / "ids.bin", "wb")
        self.learned_file = open(self.tmp / "learned.bin", "wb")
        # Hashed as written: the checksum costs no second read of the biggest files.
        self.ids_hash, self.learned_hash = hashlib.blake2b(), hashlib.blake2b()
        self.offsets, self.rows, self.first = array("q", [0]), array("q"), array("i")

    def add(self, row: int, ids: np.ndarray, learned: np.ndarray) -> None:
        for data, file, digest in ((ids.astype(np.int32).tobytes(), self.ids_file, self.ids_hash),
                                   (learned.astype(np.uint8).tobytes(), self.learned_file, self.learned_hash)):
            file.write(data)
            digest.update(data)
        self.offsets.append(self.offsets[-1] + len(ids))
        self.rows.append(row)
        self.first.append(_first_loss(learned))

    def finish(self, meta: dict) -> Path:
        for f in (self.ids_file, self.learned_file):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        np.save(self.tmp / "offsets.npy", np.frombuffer(self.offsets, np.int64))
        np.save(self.tmp / "rows.npy", np.frombuffer(self.rows, np.int64))
        np.save(self.tmp / "first_loss.npy", np.frombuffer(self.first, np.int32))
        checksums = {"ids.bin": self.ids_hash.hexdigest(), "learned.bin": self.learned_hash.hexdigest(),
                     **{name: _checksum(self.tmp / name) for name in STORE_FILES[2:]}}
        (self.tmp / WRITER_FILE).unlink()
        (self.tmp / "meta.json").write_text(json.dumps({"format": STORE_FORMAT, "tokens": self.offsets[-1], **meta,
                                                        "checksums": checksums}))
        try:
            os.rename(self.tmp, self.directory)
        except OSError:
            if not self.directory.is_dir():  # another process finished the same store first: keep theirs
                raise
            shutil.rmtree(self.tmp, ignore_errors=True)
        return self.directory

    def abandon(self) -> None:
        for f in (self.ids_file, self.learned_file):
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _mapped(path: Path, dtype: type, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def _saved(path: Path) -> np.ndarray:
    # open_memmap reads plain numeric .npy files only: never a pickle.
    return np.lib.format.open_memmap(path, mode="r")


def _checksum(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "blake2b").hexdigest()


def open_store(directory: Path, verify: bool = True) -> TokenRows | None:
    """The rows of a complete store, memory-mapped; None if missing, damaged,
    or (`verify`) not what was written: a file's checksum differs, or the store
    is from before checksums were kept."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
        if meta.get("format") != STORE_FORMAT:
            return None
        checksums = meta.get("checksums")
        if verify and (not isinstance(checksums, dict)
                       or any(_checksum(directory / name) != checksums.get(name) for name in STORE_FILES)):
            return None
        tokens = int(meta["tokens"])
        offsets = _saved(directory / "offsets.npy")
        if len(offsets) == 0 or int(offsets[-1]) != tokens:
            return None
        arrays = Arrays(ids=_mapped(directory / "ids.bin", np.int32, tokens),
                        learned=_mapped(directory / "learned.bin", np.uint8, tokens), offsets=np.asarray(offsets),
                        rows=_saved(directory / "rows.npy"), first_loss=_saved(directory / "first_loss.npy"))
    except (OSError, ValueError, KeyError):  # a damaged store is rebuilt
        return None
    if len(arrays.rows) + 1 != len(arrays.offsets) or len(arrays.first_loss) != len(arrays.rows):
        return None
    return TokenRows(arrays)


def tokenizing_workers(rows: int) -> int:
    """Processes to tokenize `rows` rows with: one for small data (starting
    workers costs seconds) or few cores, else one per core but one."""
    try:
        cores = len(os.sched_getaffinity(0))  # the cores this process may use, not the machine's
    except AttributeError:  # not on every platform
        cores = os.cpu_count() or 1
    if rows < PARALLEL_MIN_ROWS or cores < PARALLEL_MIN_CORES:
        return 1
    return min(cores - 1, MAX_WORKERS)  # one core stays with reading and writing


_worker_tokenizer: Any = None


def _start_worker(tokenizer: Any) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer
    # Ctrl-C reaches the whole process group: the main process stops the
    # workers; each printing its own traceback would bury the message.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _encode_chunk(chunk: list, tokenizer: Any = None) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Clip, tokenize and cut one chunk of examples (in a worker, or here).
    A preference pair gives two store rows, chosen then rejected."""
    chunk = [half.clipped(MAX_ROW_CHARS) for e in chunk for half in e.halves()]
    encoded = (tokenizer or _worker_tokenizer).encode_many(chunk)
    return [(e.row, ids[:MAX_ROW_TOKENS], learned[:MAX_ROW_TOKENS]) for e, (ids, learned) in zip(chunk, encoded)]


def _encoded_chunks(examples: Iterator, tokenizer: Any, chunk_rows: int, workers: int) -> Iterator[list]:
    """Encoded chunks in the data's order. With workers, reading and checking
    stay here while rendering and tokenizing run in other processes; a few
    chunks in flight per worker keep memory bounded."""
    chunks = _chunks(examples, chunk_rows)
    if workers <= 1:
        for chunk in chunks:
            yield _encode_chunk(chunk, tokenizer)
        return
    # spawn, not fork: the parent may hold threads (tokenizers, torch) a fork would copy mid-work.
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(tokenizer,))
    pending: deque = deque()
    try:
        for chunk in chunks:
            pending.append([None, chunk])  # kept before submitting, so a refused submit loses no chunk
            pending[-1][0] = pool.submit(_encode_chunk, chunk)
            if len(pending) >= 2 * workers:
                yield pending[0][0].result()
                pending.popleft()
        while pending:
            yield pending[0][0].result()
            pending.popleft()
    except BrokenProcessPool:
        # Workers could not start (a main module that cannot be imported
        # again, as in an interactive session) or one was killed: this
        # process does what is left, in order.
        for _, chunk in pending:
            yield _encode_chunk(chunk, tokenizer)
        for chunk in chunks:
            yield _encode_chunk(chunk, tokenizer)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _chunks(examples: Iterator, most_rows: int) -> Iterator[list]:
    """Examples in chunks of at most `most_rows` rows and about CHUNK_CHARS
    characters: tokenizing a chunk of long documents must not take gigabytes."""
    chunk, chars = [], 0
    for example in examples:
        chunk.append(example)
        chars += min(example.char_count(), MAX_ROW_CHARS)
        if len(chunk) >= most_rows or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def build_store(directory: Path, examples: Iterator, tokenizer, meta: dict,
                progress: Callable[[int], None] | None = None, chunk_rows: int = 256, workers: int = 1) -> TokenRows:
    """Tokenize `examples` into a new store at `directory` and open it. Text is
    clipped before tokenizing and ids cut after, to MAX_ROW_TOKENS."""
    writer = StoreWriter(directory)
    done = 0
    try:
        for encoded in _encoded_chunks(examples, tokenizer, chunk_rows, workers):
            for row, ids, learned in encoded:
                writer.add(row, ids, learned)
            done += len({row for row, _, _ in encoded})  # a pair's two halves are one row
            if progress is not None:
                progress(done)
        writer.finish(meta)
    except BaseException:
        writer.abandon()
        raise
    rows = open_store(directory, verify=False)  # the checksums were just taken of what was written
    if rows is None:
        raise OSError(f"the tokenized rows written to {directory} cannot be read back")
    return rows


def _writer_gone(tmp: Path, now: float) -> bool:
    """Whether nobody is writing the temporary store `tmp` any more: its writer
    on this machine has exited, or none of its files changed for ABANDONED_AFTER_S."""
    try:
        writer = json.loads((tmp / WRITER_FILE).read_text())
        if writer.get("host") == socket.gethostname():
            os.kill(int(writer["pid"]), 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # alive but not ours, or no readable writer.json
        pass
    try:
        changed = max([tmp.stat().st_mtime] + [f.stat().st_mtime for f in tmp.iterdir()])
    except OSError:  # removed meanwhile, or unreadable
        return False
    return now - changed > ABANDONED_AFTER_S


def remove_abandoned(parent: Path) -> int:
    """Remove the temporary stores under `parent` that no process is writing
    (left by a run killed while tokenizing); how many went. Never a complete store."""
    removed, now = 0, time.time()
    try:
        leftovers = [p for p in parent.glob(".*.tmp") if p.is_dir()]
    except OSError:
        return 0
    for tmp in leftovers:
        if _writer_gone(tmp, now):
            shutil.rmtree(tmp, ignore_errors=True)
            removed += not tmp.exists()
    return removed
