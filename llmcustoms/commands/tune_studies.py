"""A tuning study's name and storage: what `tune.run_study` runs trials in.

- The name is a plain name, checked as a run name is: the study's directory,
  `tune-NAME`, stays inside --output-dir.
- A storage URL is shown, logged and put in messages only without its password
  (`shown_storage`, `redact_storage`).
- A study's identity (what its trials must share to compare) is in
  `commands/tune_identity.py`.
- A trial whose process died (kill -9, a lost machine) stays `running` in the
  storage: `fail_stale_trials` marks it failed when the next `tune` starts,
  if no process holds its directory's lock; a database server's storage also
  keeps Optuna's heartbeat, for processes on other machines.
- Each trial is sampled with a sampler seeded by the study's seed plus the
  trial's number (`TrialSeededSampler`): numbers are unique in a study, even
  between processes sharing it, so a continued study and two `tune` at once
  draw new points, and the same study draws the same points again.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import unquote, urlsplit

from llmcustoms.commands.tune_space import rungs
from llmcustoms.errors import ConfigError
from llmcustoms.runs import run_lock
from llmcustoms.runs.run_directory import RunDirectory

# A trial's process says it is alive this often in an RDB storage; one silent
# for STALE_AFTER_S is failed by the next trial that starts (Optuna's heartbeat).
HEARTBEAT_S = 60
STALE_AFTER_S = 300
# Several processes share one SQLite study: a write waits this long for another's.
SQLITE_BUSY_S = 60
# SQLite's words for a full disk (SQLITE_FULL), as sqlite3 and SQLAlchemy repeat them.
SQLITE_FULL = "database or disk is full"
# A URL's whole user part, up to the last "@" of its host part: a password may hold "@" itself.
USER_IN_URL = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://)[^/\s]*@")
PASSWORD_IN_QUERY = re.compile(r"(?i)(?P<head>password=)[^&\s]*")
HIDDEN = "***"


# A trial no process has claimed yet is not judged stale before this age: it may be just starting.
UNCLAIMED_GRACE_S = 120


def study_dir(output_dir: Path, name: str) -> Path:
    """`output_dir/tune-NAME`; a name that is no plain name is refused, like a run name."""
    RunDirectory.inside(output_dir, name, flag="--study-name")
    return Path(output_dir) / f"tune-{name}"


def default_name(data: str, model: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{Path(data).stem}-{Path(model.rstrip('/')).name}").lower()


@dataclass
class TuneSettings:
    trials: int
    steps: int
    study_name: str
    study_dir: Path
    storage: str | None = None
    sampler: str = "tpe"
    timeout: float | None = None
    seed: int = 42
    lr_centre: float | None = None  # the lr range's centre, from `lr-find`'s saved suggestion
    confirm: bool = True  # train the best and the preset at full length before writing the preset (`tune_confirm`)
    note: str = ""  # why the study is not the one of the name asked for (`tune_identity.choose_study`)
    # --forgetting-limit as the user gave it (None: not given): then no trial forgetting more is
    # picked, instead of none forgetting more than the preset's own trial (`tune_pareto.pick`).
    forgetting_limit: float | None = None

    @property
    def where(self) -> str:
        """Where the study is stored, as shown: the URL without its password."""
        return shown_storage(self.storage, self.study_dir)

    @property
    def rungs(self) -> tuple[int, ...]:
        """The steps at which successive halving judges a trial (`tune_space.rungs`)."""
        return rungs(self.steps)


def shown_storage(url: str | None, study_path: Path) -> str:
    """Where the study is stored, as shown: the URL without its password."""
    return str(study_path / "study.db") if url is None else redact_storage(url, url)


def redact_storage(text: str, url: str | None) -> str:
    """`text` with the storage URL's user part (name and password, whatever
    they hold) and a password in its query hidden."""
    text = PASSWORD_IN_QUERY.sub(lambda m: m["head"] + HIDDEN, USER_IN_URL.sub(lambda m: m["head"] + HIDDEN + "@", text))
    try:
        password = urlsplit(url or "").password
    except ValueError:
        password = None
    for secret in filter(None, {password, unquote(password or "")}):
        text = text.replace(secret, HIDDEN)  # wherever a driver repeated it
    return text


@contextmanager
def _experimental_quiet() -> Iterator[None]:
    """Without Optuna's ExperimentalWarning: the heartbeat (and, before Optuna 4.x, the
    journal) are features chosen here on purpose, and its warning is nothing the user can act on."""
    import warnings

    from optuna.exceptions import ExperimentalWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        yield


def open_storage(url: str | None, path: Path, full_disk: Any = None) -> Any:
    """An Optuna storage: the SQLite file in the study directory by default, any
    RDB URL, or `journal:PATH` for a journal file several processes can share.
    Errors name the URL without its password."""
    if url is not None and url.startswith("journal:"):
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        journal = Path(url[len("journal:"):])
        if not journal.parent.is_dir():  # Optuna would create the file, not the folders above it
            raise ConfigError(f"Cannot open the study storage {url}: the folder {journal.parent} does not exist.",
                              "Create it first, or name a journal file in a folder that exists.")
        try:
            with _experimental_quiet():
                return JournalStorage(JournalFileBackend(str(journal)))
        except OSError as exc:
            raise ConfigError(f"Cannot open the study storage {url}: {exc.strerror or exc}.",
                              "Name a journal file you can write (journal:FILE), or leave --storage out.") from None
    from optuna.storages import RDBStorage
    from sqlalchemy.exc import SQLAlchemyError

    target = url or f"sqlite:///{(path / 'study.db').resolve()}"
    sqlite = target.startswith("sqlite")
    # SQLite is local: the trials' locks show which are alive (`fail_stale_trials`),
    # without a heartbeat thread writing to it.
    beats = {} if sqlite else {"heartbeat_interval": HEARTBEAT_S, "grace_period": STALE_AFTER_S}
    try:
        with _one_creator(target), _experimental_quiet():
            storage = RDBStorage(target, engine_kwargs={"connect_args": {"timeout": SQLITE_BUSY_S}} if sqlite else None,
                                 **beats)
    except ImportError:
        raise ConfigError(f"Cannot open the study storage {shown_storage(url, path)}: its database driver is not installed.",
                          "Install it (psycopg2-binary for postgresql://, pymysql for mysql://), or use "
                          "sqlite:///FILE or journal:FILE.") from None
    except (ValueError, RuntimeError, SQLAlchemyError) as exc:
        raise ConfigError(f"Cannot open the study storage {shown_storage(url, path)}: {redact_storage(str(exc), url)}",
                          "Check that the database is reachable and the URL right (sqlite:///study.db, "
                          "postgresql://USER@HOST/DB, journal:FILE).") from None
    if sqlite and full_disk is not None:
        full_disk.attach(storage.engine)
    return storage


@contextmanager
def _one_creator(target: str) -> Iterator[None]:
    """Two `tune` processes opening a new SQLite study at once would both create its
    tables, and one fails on Optuna's schema version row: they take turns (a flock
    beside the file). A server database or a path that cannot be locked goes on as is."""
    if not target.startswith("sqlite:///") or target == "sqlite:///:memory:":
        yield
        return
    with _turns(target[len("sqlite:///"):]):
        yield


@contextmanager
def taking_turns(url: str | None, path: Path, waiting: Callable[[], None] = lambda: None) -> Iterator[None]:
    """The `tune` processes of one study on this machine, one at a time: what
    reads the study and then writes on what it read (whether the preset's trial
    is queued) is one step. The same flock as `_one_creator`, beside the SQLite
    or journal file; a server database goes on as is (two processes starting a
    study at the same moment may then both queue the preset's point).
    `waiting()` is called when another process has the turn."""
    if url is None:
        file = str((path / "study.db").resolve())
    elif url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        file = url[len("sqlite:///"):]
    elif url.startswith("journal:"):
        file = url[len("journal:"):]
    else:
        yield
        return
    with _turns(file, waiting):
        yield


@contextmanager
def _turns(file: str, waiting: Callable[[], None] = lambda: None) -> Iterator[None]:
    try:
        fd = os.open(f"{file}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waiting()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def storage_full(error: BaseException | None) -> bool:
    """Whether `error`, or one it came from, says the study's storage found its disk full."""
    from llmcustoms.runs.disk_writes import disk_full_code

    seen: list[BaseException] = []
    while error is not None and not any(error is e for e in seen):
        seen.append(error)
        if SQLITE_FULL in str(error) or disk_full_code(error) is not None:
            return True
        error = error.__cause__ or error.__context__
    return False


class FullDisk:
    """`LLMCUSTOMS_FAULT_INJECT=diskfull@N` in `tune`: from the Nth optimizer step
    of this command's trials (counted across them) on, every write to the
    study's SQLite storage fails as SQLite fails on a full disk."""

    def __init__(self, from_step: int | None):
        self.from_step = from_step
        self.steps = 0  # set by the trials as they go

    def attach(self, engine: Any) -> None:
        from sqlalchemy import event

        event.listen(engine, "before_cursor_execute", self._execute)

    def _execute(self, conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        import sqlite3

        full = self.from_step is not None and self.steps >= self.from_step
        if full and not statement.lstrip().upper().startswith(("SELECT", "PRAGMA")):
            raise sqlite3.OperationalError(SQLITE_FULL)  # what SQLite raises, wrapped by SQLAlchemy as it would be


def claim(trial: Any) -> None:
    """Say which process runs `trial`, first thing: another `tune` of the study
    judges by it whether the trial's process is gone (`fail_stale_trials`)."""
    trial.set_user_attr("owner", {"host": socket.gethostname(), "pid": os.getpid()})


def _owner_gone(trial: Any) -> bool | None:
    """Whether the process that claimed `trial` on this machine has ended; None
    when the trial names no owner here (another machine, or not claimed yet)."""
    owner = trial.user_attrs.get("owner")
    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return None
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def fail_stale_trials(storage: Any, study: Any, path: Path) -> int:
    """Mark failed the trials left `running` by a process that died here: the
    process that claimed the trial is gone (kill -9 included). A trial claimed by
    a live process is running, even between its lock's release and its result
    being stored. One not claimed (from an older llmcustoms) is judged by its
    lock, once it is old enough not to be one another process is just starting;
    a trial of another machine is left to Optuna's heartbeat."""
    from datetime import datetime, timedelta

    from optuna.trial import TrialState

    study_id = storage.get_study_id_from_name(study.study_name)
    failed = 0
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        gone = _owner_gone(trial)
        if gone is None:
            trial_dir = path / f"trial-{trial.number:04d}"
            started = trial.datetime_start
            recent = started is None or datetime.now() - started < timedelta(seconds=UNCLAIMED_GRACE_S)
            gone = not recent and (trial_dir.is_dir() or run_lock.lock_path(trial_dir).exists()) \
                and run_lock.holder(trial_dir) is None
        if not gone:
            continue
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
        storage.set_trial_user_attr(trial_id, "reason", "its process ended without finishing it (killed?)")
        storage.set_trial_user_attr(trial_id, "killed", True)  # not the values' fault: the preset's is tried again
        storage.set_trial_state_values(trial_id, TrialState.FAIL)
        failed += 1
    return failed


class TrialSeededSampler:
    """An Optuna sampler (duck-typed, so optuna loads only when a study runs) that
    samples each trial with `make(seed + trial number)`: see the module's docstring."""

    def __init__(self, make: Callable[[int], Any], seed: int):
        self.make = make
        self.seed = seed
        self._samplers: dict[int, Any] = {}

    def _of(self, trial: Any) -> Any:
        if trial.number not in self._samplers:
            self._samplers[trial.number] = self.make(self.seed + trial.number)
        return self._samplers[trial.number]

    def infer_relative_search_space(self, study: Any, trial: Any) -> dict[str, Any]:
        return self._of(trial).infer_relative_search_space(study, trial)

    def sample_relative(self, study: Any, trial: Any, search_space: dict[str, Any]) -> dict[str, Any]:
        return self._of(trial).sample_relative(study, trial, search_space)

    def sample_independent(self, study: Any, trial: Any, param_name: str, param_distribution: Any) -> Any:
        return self._of(trial).sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: Any, trial: Any) -> None:
        self._of(trial).before_trial(study, trial)

    def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
        self._samplers.pop(trial.number, self.make(self.seed + trial.number)).after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        pass  # the seeds come from the trial numbers


def stored_choices(storage: Any, name: str) -> dict[str, tuple[Any, ...]]:
    """The choices of each categorical parameter in the study of that name, as
    its trials recorded them; empty for a new study. Optuna refuses other choices
    for a parameter within one study, so a continued study keeps these."""
    from optuna.distributions import CategoricalDistribution

    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError:
        return {}
    found: dict[str, tuple[Any, ...]] = {}
    for trial in storage.get_all_trials(study_id, deepcopy=False):
        for param, distribution in trial.distributions.items():
            if isinstance(distribution, CategoricalDistribution):
                found[param] = tuple(distribution.choices)
    return found


def duplicate_of(study: Any, trial: Any, params: dict[str, Any]) -> int | None:
    """An earlier trial (tried, or running in another process) with exactly these
    values: a grid point two processes drew at the same moment. Only earlier
    numbers count, so of two such trials the first goes on."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED,
                                                      TrialState.FAIL))
    if any(t.number == trial.number and "fixed_params" in t.system_attrs for t in trials):
        return None  # enqueued with these values on purpose
    return next((t.number for t in trials if t.number < trial.number and t.params == params), None)
