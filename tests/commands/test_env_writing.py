"""`setup` changes only what it asks about in a user's .env: every other
variable reads back byte for byte (python-dotenv's quoting), comments and
order stay, a symlink is written through (issue 46, item 1)."""

from __future__ import annotations

import os
from pathlib import Path

from dotenv import dotenv_values

from llmcustoms.commands.env_writing import env_text, write_env

USERS = """# my settings
HF_TOKEN=hf_keepme
WANDB_NOTES='said "hello" there'
export WINDOWS=C:\\\\Users\\\\me   # a comment after it
LLMCUSTOMS_PRESET=quality
LLMCUSTOMS_SAVE_EVERY=25
MULTI="line one
line two"
"""


def test_the_answers_are_set_and_everything_else_reads_back_as_it_was(tmp_path):
    env = tmp_path / ".env"
    env.write_text(USERS)
    before = dotenv_values(env)
    answers = {"LLMCUSTOMS_PRESET": "bestaccuracy", "LLMCUSTOMS_DATA": 'my "best" data [1].json',
               "LLMCUSTOMS_OUTPUT_DIR": "C:\\runs\\it's"}
    write_env(env, answers)
    after = dotenv_values(env)
    assert after == {**before, **answers}
    text = env.read_text()
    assert text.startswith("# my settings\nHF_TOKEN=hf_keepme\nWANDB_NOTES='said \"hello\" there'\n")
    assert "# a comment after it" in text and text.index("LLMCUSTOMS_PRESET=bestaccuracy") < text.index("MULTI=")
    assert text.count("LLMCUSTOMS_PRESET") == 1


def test_a_symlinked_env_file_is_written_through_to_its_target(tmp_path):
    target = tmp_path / "shared" / "real.env"
    target.parent.mkdir()
    target.write_text("A=1\n")
    os.chmod(target, 0o640)
    link = tmp_path / ".env"
    link.symlink_to(target)
    write_env(link, {"LLMCUSTOMS_PRESET": "quality"})
    assert link.is_symlink() and link.resolve() == target
    assert dotenv_values(target) == {"A": "1", "LLMCUSTOMS_PRESET": "quality"}
    assert oct(target.stat().st_mode & 0o777) == "0o640"


def test_a_new_file_has_a_header_and_a_duplicate_keeps_one_line():
    assert env_text("", {"LLMCUSTOMS_PRESET": "quality"}).startswith("# Written by `llmcustoms setup`.")
    assert env_text("X=1\nX=2\n", {"X": "3"}) == "X=3\n"  # python-dotenv keeps the last: one line only
    assert env_text("A=1", {"B": "2"}) == "A=1\n\nB=2\n"


def test_an_env_file_that_is_a_pipe_a_folder_or_a_device_is_refused_before_any_question(tmp_path):
    """Reading a named pipe waited forever for a writer (issue 46, 17); a link to a regular file,
    or a path not there yet, is fine."""
    import pytest

    from llmcustoms.commands.env_writing import check_writable
    from llmcustoms.errors import ConfigError
    from llmcustoms.planning.settings import load_settings

    os.mkfifo(tmp_path / "pipe")
    for path, what in ((tmp_path / "pipe", r"a named pipe \(FIFO\)"), (tmp_path, "a folder"), (Path("/dev/null"), "a device")):
        with pytest.raises(ConfigError, match=f"is {what}, not a regular file"):
            check_writable(path)
    with pytest.raises(ConfigError, match="is not a regular file"):
        load_settings(tmp_path / "pipe")  # the other commands' --env-file: not "not found", and no wait
    (tmp_path / "real.env").write_text("A=1\n")
    os.symlink(tmp_path / "real.env", tmp_path / "link.env")
    check_writable(tmp_path / "link.env")
    check_writable(tmp_path / "new.env")
