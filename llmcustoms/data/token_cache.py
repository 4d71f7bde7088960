"""Where tokenized rows are cached, under which key, and whether a run could reuse
or keep them.

A store is keyed to everything its ids depend on (`tokenization_cache_key`),
the data file's bytes among them. Reused only when its checksums hold
(`token_store.open_store`); rebuilt, with a notice, when they do not. Kept only
when the data file is unchanged after tokenizing: a file edited meanwhile would
leave a store keyed to bytes it does not hold. A cache that cannot be written
(read-only, a file, a full disk) is said so; the run goes on from a temporary
copy.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from llmcustoms.data.data_files import fingerprint
from llmcustoms.data.dataset import Dataset
from llmcustoms.data.row_formats import is_preference
from llmcustoms.data.token_store import (
    MAX_ROW_TOKENS,
    STORE_FORMAT,
    TokenRows,
    build_store,
    open_store,
    remove_abandoned,
    tokenizing_workers,
)
from llmcustoms.errors import DataError
from llmcustoms.recovery import faults


def cache_dir(explicit: str | None = None) -> Path:
    """Where prepared data is cached: `--cache-dir` or LLMCUSTOMS_CACHE_DIR (from the
    settings), else the process environment's LLMCUSTOMS_CACHE_DIR, else $XDG_CACHE_HOME/llmcustoms."""
    explicit = explicit or os.environ.get("LLMCUSTOMS_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmcustoms"


def tokenization_cache_key(hf_tokenizer: Any, stop_ids: set[int], train_on_prompt: bool, data_key: str,
                           raw_prompts: bool = False) -> str:
    """Everything the token ids and labels depend on: the data, the whole
    tokenizer definition, its chat template and special tokens, the masking rules."""
    import hashlib

    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else repr(sorted(hf_tokenizer.get_vocab().items()))
    parts = [STORE_FORMAT, str(MAX_ROW_TOKENS), data_key, definition, str(hf_tokenizer.chat_template),
             str(hf_tokenizer.eos_token_id), str(hf_tokenizer.bos_token_id), str(sorted(stop_ids)),
             str(train_on_prompt), str(raw_prompts)]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


@dataclass(frozen=True)
class Stored:
    rows: TokenRows
    cached: bool  # taken from the cache
    kept: bool  # in the cache for the next run (False: built in a temporary directory)
    note: str = ""  # what the user should know about the cache: rebuilt, or not kept and why


def _not_kept(cache: Path, exc: OSError) -> str:
    why = exc.strerror or type(exc).__name__
    return (f"Tokenized rows not cached: {cache} cannot be written ({why}); they are not kept for the next run. "
            "Point --cache-dir (or LLMCUSTOMS_CACHE_DIR) at a writable directory to keep them.")


def _check_unchanged(dataset: Dataset, data_key: str, store: Path) -> None:
    """Refuse rows tokenized from a file that changed after its key was taken:
    the store would be keyed to bytes it does not hold, and the rows counted
    when the file was read are not the rows tokenized."""
    if fingerprint(dataset.path) == data_key:
        return
    shutil.rmtree(store, ignore_errors=True)
    raise DataError(f"{dataset.path.name} changed while it was being tokenized (its checksum differs from when it "
                    "was read); nothing of it was cached.",
                    "Run the command again once the file is no longer being written.")


def stored_rows(key: str, data_key: str, cache: str | None, dataset: Dataset, tokenizer: Any,
                report: Callable[[int], None]) -> Stored:
    """The file's usable rows tokenized: from the cache, or built now. A cache
    that cannot be written falls back to a temporary directory."""
    root = cache_dir(cache) / "tokenized"
    remove_abandoned(root)  # a run killed while tokenizing left its temporary store
    directory = root / key
    rows = open_store(directory)
    halves = 2 if is_preference(dataset.format) else 1  # a pair is stored as two rows
    if rows is not None and len(rows) == dataset.rows * halves:
        return Stored(rows, cached=True, kept=True)
    note = ""
    if directory.exists():  # damaged, changed since it was written, or not of these rows (the checking rules changed)
        note = (f"The cached tokenized rows of {dataset.path.name} did not match their checksum (changed or "
                "damaged, or from an older llmcustoms): tokenized again.")
    # It goes, or the new store could not take its place.
    shutil.rmtree(directory, ignore_errors=True)
    meta = {"data": dataset.path.name, "rows": dataset.rows}
    workers = tokenizing_workers(dataset.rows)

    def tick(done: int) -> None:
        report(done)
        faults.kill_tokenizing_if_due(done)

    faults.edit_data_if_due(dataset.path)
    try:
        rows = build_store(directory, dataset.examples(), tokenizer, meta, tick, workers=workers)
    except OSError as exc:
        not_kept = _not_kept(cache_dir(cache), exc)
    else:
        _check_unchanged(dataset, data_key, directory)
        return Stored(rows, cached=False, kept=True, note=note)
    fallback = Path(tempfile.mkdtemp(prefix="llmcustoms-tokens-"))
    atexit.register(shutil.rmtree, fallback, True)
    try:
        rows = build_store(fallback / key, dataset.examples(), tokenizer, meta, tick, workers=workers)
    except OSError as exc:
        raise DataError(f"Cannot store the tokenized rows of {dataset.path.name}: {exc.strerror or exc}.",
                        "Free some disk space, or point --cache-dir at a disk with room.") from None
    _check_unchanged(dataset, data_key, fallback / key)
    return Stored(rows, cached=False, kept=False, note=" ".join(filter(None, (note, not_kept))))
