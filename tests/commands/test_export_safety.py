"""Export never leaves half an export, nor breaks another: one export at a
time writes to a folder (a second is refused before it clears anything), a
disk that fills up after the space check is one message with the earlier
export as it was, and a GGUF tokenizer that cannot be written is refused
before the merge's minutes."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmcustoms.commands import export, export_gguf
from llmcustoms.commands.export_gguf import GgufOptions
from llmcustoms.errors import ConfigError
from llmcustoms.recovery import faults
from llmcustoms.runs import overwriting
from test_export import run_with_adapter  # noqa: F401  (a fixture: a run holding a LoRA adapter)

HOLD = ("import sys, time\nfrom pathlib import Path\nfrom llmcustoms.runs import run_lock\n"
        "with run_lock.exporting(Path(sys.argv[1])):\n    print('held', flush=True)\n    time.sleep(600)\n")


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def beside(output: Path) -> list[str]:
    return sorted(p.name for p in output.parent.iterdir() if p.name.startswith(f".{output.name}."))


def test_a_second_export_to_the_folder_is_refused_and_clears_nothing(run_with_adapter, tmp_path):  # noqa: F811
    output = tmp_path / "out"
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(output)], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        partial = tmp_path / ".out.partial-export"  # the first export's, half-written
        partial.mkdir()
        (partial / overwriting.EXPORT_MARKER).write_text("")
        with pytest.raises(ConfigError) as refused:
            export.export_run(run_with_adapter, output, merge=False)
        assert f"Another export is writing {output} (process {first.pid})" in refused.value.message
        assert "--output" in refused.value.hint
        assert partial.is_dir() and not output.exists()
    finally:
        first.kill()
        first.wait(timeout=30)


def test_the_export_lock_is_gone_once_the_export_is_in_place(run_with_adapter, tmp_path):  # noqa: F811
    output = tmp_path / "out"
    export.export_run(run_with_adapter, output, merge=False)
    assert (output / "adapter_model.safetensors").is_file() and beside(output) == []


def test_an_export_killed_before_its_marker_left_an_empty_folder_the_next_export_clears(run_with_adapter,  # noqa: F811
                                                                                          tmp_path):
    output = tmp_path / "out"
    (tmp_path / ".out.partial-export").mkdir()  # made, then killed before the marker was written
    export.export_run(run_with_adapter, output, merge=False)
    assert (output / "adapter_model.safetensors").is_file() and beside(output) == []
    (tmp_path / ".out.partial-export").mkdir()
    (tmp_path / ".out.partial-export" / "notes.txt").write_text("not ours")  # anything in it: never removed
    with pytest.raises(ConfigError, match="is in the way"):
        export.export_run(run_with_adapter, output, merge=False, overwrite=True)
    assert (tmp_path / ".out.partial-export" / "notes.txt").read_text() == "not ours"


def test_a_disk_full_writing_the_card_leaves_the_earlier_export_as_it_was(run_with_adapter, tmp_path,  # noqa: F811
                                                                         monkeypatch):
    output = tmp_path / "out"
    export.export_run(run_with_adapter, output, merge=False)
    before = files(output)
    monkeypatch.setenv(faults.ENV_VAR, "diskfull_export@1")
    monkeypatch.setitem(faults._export_files, "written", 0)
    with pytest.raises(ConfigError) as refused:
        export.export_run(run_with_adapter, output, merge=False, overwrite=True)
    message = refused.value.message
    assert message.startswith("The disk is full") and "stopped while writing README.md" in message
    assert f"the earlier export in {output} is as it was" in message and "Free some space" in refused.value.hint
    assert files(output) == before and beside(output) == []


def test_a_disk_full_while_copying_is_the_same_message(run_with_adapter, tmp_path, monkeypatch):  # noqa: F811
    def full(*args, **kwargs):  # as safetensors says it: no OSError, the system's words
        raise RuntimeError(f"I/O error: {os.strerror(errno.ENOSPC)} (os error {errno.ENOSPC})")

    monkeypatch.setattr(export.shutil, "copytree", full)
    output = tmp_path / "new"
    with pytest.raises(ConfigError, match="The disk is full .* stopped while writing its files"):
        export.export_run(run_with_adapter, output, merge=False)
    assert not output.exists() and beside(output) == []


def test_other_errors_keep_their_traceback(run_with_adapter, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(export.shutil, "copytree", lambda *a, **k: (_ for _ in ()).throw(KeyError("a bug")))
    with pytest.raises(KeyError):
        export.export_run(run_with_adapter, tmp_path / "new", merge=False)
    assert beside(tmp_path / "new") == []


def test_a_gguf_whose_eos_has_no_embedding_row_is_refused_before_the_merge(run_with_adapter, tmp_path,  # noqa: F811
                                                                          monkeypatch):
    from transformers import AutoTokenizer

    adapter = run_with_adapter / "adapter"
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    tokenizer.add_special_tokens({"eos_token": "<|my-end|>"})  # added, and the model never resized
    tokenizer.save_pretrained(adapter)
    monkeypatch.setattr(export_gguf, "load_merged", lambda *a, **k: pytest.fail("the merge started"))
    output = tmp_path / "gguf"
    with pytest.raises(ConfigError) as refused:
        export.export_run(run_with_adapter, output, merge=False, gguf=GgufOptions("f16"))
    assert "EOS token (id 512) is one without a row" in refused.value.message
    assert not output.exists() and beside(output) == []
