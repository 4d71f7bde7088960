"""Where a study is stored (`commands/tune_studies.open_storage`): a storage that cannot be
opened is a clear error naming it without its password, never a traceback."""

from __future__ import annotations

import pytest

from llmcustoms.commands.tune_studies import open_storage, redact_storage
from llmcustoms.errors import ConfigError


def test_a_journal_in_a_folder_that_does_not_exist_is_refused_naming_the_folder(tmp_path):
    with pytest.raises(ConfigError) as info:
        open_storage(f"journal:{tmp_path / 'nowhere' / 'study.log'}", tmp_path)
    assert "does not exist" in info.value.message and "nowhere" in info.value.message
    assert not (tmp_path / "nowhere").exists()  # nothing made behind the user's back


def test_a_journal_that_is_a_folder_is_refused(tmp_path):
    with pytest.raises(ConfigError) as info:
        open_storage(f"journal:{tmp_path}", tmp_path)
    assert "Is a directory" in info.value.message


def test_a_journal_in_an_existing_folder_opens(tmp_path):
    storage = open_storage(f"journal:{tmp_path / 'study.log'}", tmp_path)
    assert storage.get_all_studies() == [] and (tmp_path / "study.log").is_file()


@pytest.mark.parametrize("password", ["p@ss", "a:b@c", "%40x"])
def test_the_whole_user_part_of_a_storage_url_is_hidden(password):
    url = f"postgresql://tuner:{password}@db.example:5432/study"
    shown = redact_storage(f"could not connect to {url}", url)
    assert "postgresql://***@db.example:5432/study" in shown and password not in shown and "tuner" not in shown


@pytest.mark.parametrize("kind", ["journal", "server"])
def test_opening_a_storage_says_nothing_of_optuna_features_being_experimental(tmp_path, kind):
    """A database server's storage keeps Optuna's heartbeat, an "experimental" argument, and
    a journal was experimental before Optuna 4: its ExperimentalWarning is not shown (issue 46, 19c)."""
    import warnings

    url = f"journal:{tmp_path / 'study.log'}" if kind == "journal" else "postgresql://tuner@127.0.0.1:9/study"
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        try:
            open_storage(url, tmp_path)
        except ConfigError:
            pass  # no driver for postgresql:// here, or no server: the warning came before
    assert not [w for w in shown if type(w.message).__name__ == "ExperimentalWarning"], [str(w.message) for w in shown]
