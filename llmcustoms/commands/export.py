"""Take a trained model elsewhere: `llmcustoms export RUN --output DIR [--merge | --format gguf]`.

Without --merge: the PEFT adapter, tokenizer and chat template, and a model
card. With --merge: the base is reloaded in its own saved dtype (or --dtype;
never the 4-bit weights QLoRA trained on, since merging into those loses
quality), the adapter is merged in, and a standalone model is written that
`AutoModelForCausalLM.from_pretrained(DIR)` loads with no peft at all; the
message names the dtype it was written in. Either way nothing is written when
the disk of DIR cannot take it: exit 2 with the sizes (`training/preflight.py`). A merge
loads the base as this command's flags allow (`loading.Allowed`): a copy loads
nothing, so it needs no flag.

The export is written into a hidden folder beside DIR and renamed into place
when whole: a crash or a kill mid-export leaves the old DIR as it was (once a
kill left only config.json, and --overwrite had deleted the old export). DIR
must be new, empty, or (with --overwrite) an export this command wrote, which
it recognises by the marker it writes first (`overwriting`): --overwrite once
deleted whatever DIR was, the run itself or the folder of every run. One
export writes to a DIR at a time (`run_lock.exporting`): a second is refused
at once, where it used to clear the first's partial folder as a killed
export's leftover. A disk that fills up all the same (the space check counts
the weights, not the card or the Modelfile) ends in one message, exit 2: the
partial folder removed, an earlier export in DIR untouched.

A merge is checked (`merging.load_merged`: the merged model's greedy replies
against the adapter's, the chat template carried over unchanged), and so is a
GGUF (`export_gguf`). A failed GGUF check ends with exit 1 and keeps the files
for inspection.
"""

from __future__ import annotations

import os
import shutil
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcustoms.commands.export_gguf import GgufOptions, check_gguf_options, check_vocabulary, write_gguf_export, write_small_file
from llmcustoms.commands.merging import load_merged
from llmcustoms.commands.model_card import has_chat_template, model_card
from llmcustoms.errors import ConfigError
from llmcustoms.models.generation import Say, Waiting
from llmcustoms.models.loading import Allowed, adapter_weights, check_weight_files
from llmcustoms.planning.disk_space import TOKENIZER_BYTES, size
from llmcustoms.recovery import faults
from llmcustoms.runs import overwriting, run_lock
from llmcustoms.runs.disk_writes import disk_full_code
from llmcustoms.runs.file_modes import make_readable
from llmcustoms.runs.run_directory import RunDirectory
from llmcustoms.runs.run_weights import model_name, trained_output
from llmcustoms.training.preflight import bytes_under, check_export_space, free_space, mount_point

DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Exported:
    """What `export_run` wrote, for the lines the command prints."""

    path: Path
    what: str  # "the adapter", "the model", or "a merged model (float32 weights)"
    checks: tuple[str, ...] = ()  # what the checks of the export found, a line each
    failed: str | None = None  # why a check failed: the files are kept, the command exits 1


def _no_display(what: str) -> Any:
    return nullcontext(lambda text: None)


def export_run(path: Path, output: Path, merge: bool, dtype: str = "auto", overwrite: bool = False,
               waiting: Waiting = _no_display, allowed: Allowed = Allowed(), gguf: GgufOptions | None = None) -> Exported:
    """Write the export of the run at `path`; `waiting` shows the merge (a
    minute or more for real models) as it goes. Everything that can be refused
    is refused before a byte of it is written."""
    run = RunDirectory.existing(path)
    plan, trained = trained_output(run)
    if (merge or gguf) and dtype not in DTYPES:  # before anything is deleted
        raise ConfigError(f"Unknown --dtype {dtype}.", f"Use one of {', '.join(DTYPES)}.")
    if gguf is not None:
        if merge:
            raise ConfigError("--merge and --format gguf cannot be used together.",
                              "A GGUF export always merges the adapter in: drop --merge.")
        check_gguf_options(gguf)
    if (merge or gguf) and plan.method != "full":  # what the merge would refuse to load, refused before anything is deleted
        allowed.check(plan)
        check_weight_files(plan.model, allowed.pickle_weights)
        adapter_weights(trained)
    if gguf is not None:
        check_vocabulary(plan, trained, allowed)  # before the merge's minutes
    given = {"the run being exported": run.path, "the run's trained weights": trained, "the training data": plan.data,
             "the base model": plan.model}
    if trained.resolve() in output.absolute().resolve().parents:  # it would be copied into itself
        raise ConfigError(f"--output {output} is inside the run's trained weights ({trained}).",
                          "Choose a --output folder outside the run directory.")
    with run_lock.exporting(output):  # another export to `output` would clear this one's partial folder
        _clear_leftovers(output)
        _check_output(output, overwrite, {what: Path(given_path) for what, given_path in given.items() if given_path})
        partial = _start_partial(output)
        faults.hold_export_if_due()
        try:
            what, checks, failed = _write(run, plan, trained, partial, merge, dtype, waiting, allowed, gguf)
            write_small_file(partial / "README.md", model_card(run, plan, merged=(merge or gguf is not None)
                                                               and plan.method != "full", gguf=gguf is not None,
                                                               chat_template=has_chat_template(partial)))
            _put_in_place(partial, output)
        except BaseException as error:  # a refusal (no room), an error, Ctrl-C: nothing half-written stays
            shutil.rmtree(partial, ignore_errors=True)
            full = _disk_full(error, output, partial)
            if full is not None:
                raise full from None
            raise
    return Exported(output, what, checks, failed)


def _write(run: RunDirectory, plan: Any, trained: Path, partial: Path, merge: bool, dtype: str, waiting: Waiting,
           allowed: Allowed, gguf: GgufOptions | None) -> tuple[str, tuple[str, ...], str | None]:
    """The export's weights and tokenizer, into `partial`: what was written, what its checks found, why one failed."""
    if gguf is not None:
        checks, failed = write_gguf_export(run, plan, trained, partial, dtype, gguf, waiting, allowed)
        return f"a GGUF model ({gguf.quant}) and an Ollama Modelfile", checks, failed
    if not merge or plan.method == "full":
        check_export_space(partial, bytes_under(trained), f"a copy of {trained}")
        shutil.copytree(trained, partial, dirs_exist_ok=True)
        make_readable(partial)  # runs trained before the weights were written readable
        return ("the model" if plan.method == "full" else "the adapter"), (), None
    with waiting(f"Merging the adapter into {model_name(plan.model)}") as say:
        written_dtype, checks = _merge(plan, run.path, trained, partial, dtype, say, allowed)
    return f"a merged model ({written_dtype} weights)", checks, None


def _disk_full(error: BaseException, output: Path, partial: Path) -> ConfigError | None:
    """A full disk (or quota) met while the export was written, as one message;
    None for any other error. The partial folder is gone already, and an earlier
    export in `output` was never touched: it is replaced only once the new one is whole."""
    code = disk_full_code(error)
    if code is None:
        return None
    names = [Path(os.fsdecode(e.filename)) for e in _chain(error) if isinstance(e, OSError) and e.filename]
    inside = [name.name for name in names if name.absolute().parent == partial.absolute()]
    earlier = f"; the earlier export in {output} is as it was" if output.exists() else ""
    return ConfigError(f"The disk is full ({os.strerror(code)}): the export to {output} stopped while writing "
                       f"{inside[0] if inside else 'its files'}, and what it had written was removed{earlier}.",
                       f"Free some space on {mount_point(output)} ({size(free_space(output))} free now), "
                       "then run the export again.")


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and the errors it came from."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and not any(current is seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def gguf_options(format: str, quant: str, verify: bool) -> GgufOptions | None:
    """The GGUF options of `--format gguf`, None for `--format hf`."""
    if format not in ("hf", "gguf"):
        raise ConfigError(f"Unknown --format {format}.", "Use hf (the default) or gguf.")
    return GgufOptions(quant, verify) if format == "gguf" else None


def _check_output(output: Path, overwrite: bool, keep: dict[str, Path]) -> None:
    """Refuse an --output that is not a new folder, an empty one, or (with
    --overwrite) an earlier export; `keep`: what it must never be or hold."""
    why = overwriting.refusal(output, keep)
    if why is None and output.is_dir() and os.path.ismount(output):
        why = "is a mount point, which cannot be replaced by the folder the export is written into"
    if why is not None:
        raise ConfigError(f"--output {output} {why}; export never writes there, even with --overwrite.",
                          "Choose a --output folder that does not exist yet; nothing was removed.")
    if output.exists() and any(output.iterdir()):
        if not overwrite:
            raise ConfigError(f"{output} already exists and is not empty.",
                              "Choose another --output, or pass --overwrite to replace an earlier export.")
        if not overwriting.is_export(output):
            raise ConfigError(f"{output} is not an export llmcustoms wrote (it has no {overwriting.EXPORT_MARKER}), "
                              "so --overwrite does not replace it.",
                              "Choose another --output, or move or delete that folder yourself; nothing was removed.")


def _aside(output: Path, what: str) -> Path:
    """Where an export is written before it is whole ("partial"), or where the
    one it replaces waits while it is put in place ("old"): hidden, beside it."""
    return output.parent / f".{output.name}.{what}-export"


def _clear_leftovers(output: Path) -> None:
    """What a killed export left beside `output`: its partial folder is removed,
    and an export it had moved aside but not yet replaced is put back."""
    old = _aside(output, "old")
    for leftover in (old, _aside(output, "partial")):
        if not (leftover.exists() or leftover.is_symlink()):
            continue
        if leftover.is_dir() and not leftover.is_symlink() and not any(leftover.iterdir()):
            leftover.rmdir()  # killed between making its folder and writing the marker: empty, nothing to lose
            continue
        if leftover.is_symlink() or not leftover.is_dir() or not overwriting.is_export(leftover):
            raise ConfigError(f"{leftover} is in the way of the export to {output}.",
                              "Move or delete it, or choose another --output.")
        if leftover == old and not output.exists():
            os.rename(old, output)
        else:
            shutil.rmtree(leftover)


def _start_partial(output: Path) -> Path:
    """An empty folder beside `output`, holding only the marker (first, so a
    kill leaves a folder the next export knows), to write the export into."""
    partial = _aside(output, "partial")
    try:
        partial.mkdir(parents=True)
        (partial / overwriting.EXPORT_MARKER).write_text(
            "Written by `llmcustoms export`. `llmcustoms export --overwrite` replaces only a folder holding this file.\n")
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise ConfigError(f"Cannot write the export beside {output}: {exc.strerror}.",
                          "Check that you can write to that folder, or choose another --output.") from None
    return partial


def _put_in_place(partial: Path, output: Path) -> None:
    """Rename the whole export to `output`. An earlier one is renamed aside
    first and removed after: but for the instant between the two renames (which
    the next export repairs) `output` is always a whole export."""
    if not output.exists() or not any(output.iterdir()):
        os.replace(partial, output)  # a new name, or over an empty folder
        return
    old = _aside(output, "old")
    os.rename(output, old)
    os.rename(partial, output)
    shutil.rmtree(old, ignore_errors=True)


def _merge(plan: Any, run_path: Path, adapter: Path, output: Path, dtype: str, say: Say,
           allowed: Allowed) -> tuple[str, tuple[str, ...]]:
    """Write the merged model; the dtype its weights were written in
    ("float32") and what its checks found. `say` hears each stage."""
    from transformers import AutoTokenizer

    merged = load_merged(plan, run_path, adapter, dtype, say, allowed)
    # Before a byte is written: the weights as they will be saved (a tied head once), and the tokenizer.
    weights = sum(p.numel() * p.element_size() for p in merged.model.parameters())
    check_export_space(output, weights + TOKENIZER_BYTES, "the merged model", merged.dtype)
    say("Writing the merged model")
    merged.model.save_pretrained(output, safe_serialization=True)
    merged.tokenizer.save_pretrained(output)
    make_readable(Path(output))
    template = AutoTokenizer.from_pretrained(str(output)).chat_template
    carried = "carried over unchanged" if template == merged.tokenizer.chat_template else "CHANGED in the export"
    count = len(merged.prompts)
    return merged.dtype, (f"merged model's greedy replies equal the adapter's for {merged.replies_equal}/{count} "
                          "check prompts", f"chat template {carried}")
