"""The run directory: the files a run leaves for users, `resume` and `report`.

    <output-dir>/<run-name>/
      plan.json         the plan in force (rewritten when recovery changes it)
      metrics.jsonl     one JSON object per optimizer step, plus eval rows (step 0: the base model)
      samples.jsonl     replies to a few held-out prompts: base model, evaluations, trained model
      status.json       running | completed | failed | interrupted, last step, reason, which weights were kept
      train.log         what the display showed, as timestamped plain text (runs/run_log.py)
      failure.json      a failed run's report for a bug report, no secrets or data rows (runs/failure_report.py)
      checkpoints/      step-NNNNNN/ directories
      best/             the best evaluation's trainable weights so far (adapters)
      adapter/          the PEFT adapter of the best evaluation, and the tokenizer (model/ for --method full)
      adapter-last/     the last step's adapter, when it is not the best one (model-last/)

JSON files are replaced atomically (write a temp file, then rename), so a
reader never sees half a file even if the process dies mid-write.

A full disk never stops the run here: status.json, metrics.jsonl and
samples.jsonl are written as far as there is room (status.json, as a last
resort, over its old content in the room it already has; a row is appended
whole or not at all) and stderr says, once a file, what could not be. The
training loop notices the full disk where it matters, at a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcustoms.errors import ConfigError
from llmcustoms.planning.plan import Plan
from llmcustoms.planning.plan_values import PlanDamaged, plan_problem
from llmcustoms.runs import overwriting, run_lock
from llmcustoms.runs import run_records as runrecords
from llmcustoms.runs import training_time as trainingtime
from llmcustoms.runs.disk_writes import DISK_FULL, append_lines, overwrite, replace_file, say_unwritten

STATUSES = ("running", "completed", "failed", "interrupted")
# What status.json keeps when a full disk leaves room for no more: how the run stands and why.
ESSENTIAL_STATUS = ("status", "step", "total_steps", "reason", "suggestions", "recoveries", "pid", "started_at",
                    "updated_at", "training_seconds", "training_since")
# Room under a file system's 255-byte name limit for the names made from it (".tmp" files, suffixes).
MAX_RUN_NAME_BYTES = 200


def default_run_name(model: str, preset: str) -> str:
    """MODEL-PRESET-TIME, for a run not named with --run-name. A long model folder
    or preset file name is cut short, well within MAX_RUN_NAME_BYTES, so the run
    is never refused for a name the user did not give."""
    model_part = _name_part(Path(model.rstrip("/")).name, 64) or "model"
    return f"{model_part}-{_name_part(Path(preset).stem, 32) or 'preset'}-{time.strftime('%Y%m%d-%H%M%S')}"


def _name_part(text: str, limit: int) -> str:
    """`text` as a plain lower-case name of at most `limit` characters; one cut
    short keeps its start and a hash of the whole, so two cut alike still differ."""
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-").lower()
    if len(text) <= limit:
        return text
    return text[:limit - 9].rstrip("-.") + "-" + hashlib.sha256(text.encode()).hexdigest()[:8]


def write_json_atomic(path: Path, data: Any) -> None:
    """Replace `path` with `data` as JSON, atomically; a write that fails removes its temp file."""
    replace_file(path, json.dumps(data, indent=2))


def _read_jsonl(path: Path, whole: Any) -> tuple[list[dict[str, Any]], int]:
    """The lines that are `whole` rows (`run_records`), and how many were not:
    a line cut short by a kill, or damaged; the rest are read."""
    if not path.exists():
        return [], 0
    return runrecords.read_lines(path.read_text(encoding="utf-8", errors="replace"), whole)


class RunDirectory:
    def __init__(self, path: Path, writable: bool = True):
        """`writable=False`: reads work, writes are skipped. Every process of a
        distributed run reads the run directory; only the main one writes it."""
        self.path = Path(path)
        self.writable = writable
        # What the last reads skipped, by file name: damaged lines, status.json's unreadable fields.
        self.skipped: dict[str, int] = {}

    @property
    def plan_path(self) -> Path:
        return self.path / "plan.json"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def status_path(self) -> Path:
        return self.path / "status.json"

    @property
    def checkpoints_path(self) -> Path:
        return self.path / "checkpoints"

    @property
    def samples_path(self) -> Path:
        return self.path / "samples.jsonl"

    @property
    def best_path(self) -> Path:
        return self.path / "best"

    @property
    def log_path(self) -> Path:
        return self.path / "train.log"

    @property
    def failure_path(self) -> Path:
        return self.path / "failure.json"

    def output_path(self, method: str) -> Path:
        """Where the weights the run keeps go: the best evaluation's, or the last step's without evaluation."""
        return self.path / ("model" if method == "full" else "adapter")

    def last_output_path(self, method: str) -> Path:
        """Where the last step's weights go when they are not the ones kept."""
        return self.path / ("model-last" if method == "full" else "adapter-last")

    @classmethod
    def inside(cls, output_dir: Path, run_name: str, flag: str = "--run-name") -> "RunDirectory":
        """The run directory `output_dir/run_name`; a name that would point anywhere
        else (".", "..", a path) is refused, since --overwrite deletes the target.
        `flag`: the option the name came from, for the message (`tune`'s --study-name)."""
        if run_name in ("", ".", "..") or any(sep in run_name for sep in ("/", "\\")) or Path(run_name).is_absolute():
            raise ConfigError(f"{flag} '{run_name}' is not a plain name.",
                              "Use a name without slashes, such as my-run; --output-dir says where it goes.")
        # A file name has at most 255 bytes on most file systems; control characters
        # (a newline) would break every listing and log line that names the run.
        if len(run_name.encode("utf-8", "replace")) > MAX_RUN_NAME_BYTES or not run_name.isprintable():
            shown = run_name[:40].encode("unicode_escape").decode("ascii") + ("..." if len(run_name) > 40 else "")
            raise ConfigError(f"{flag} '{shown}' is too long or holds control characters.",
                              f"Use at most {MAX_RUN_NAME_BYTES} printable characters, such as my-run.")
        return cls(Path(output_dir) / run_name)

    @classmethod
    def existing(cls, path: Path) -> "RunDirectory":
        """A run made by `train`, for `report`, `generate`, `chat` and `export`."""
        if not (Path(path) / "plan.json").is_file():
            raise ConfigError(f"{path} is not an llmcustoms run directory (no plan.json).",
                              "`llmcustoms runs` lists the runs under ./runs.")
        return cls(Path(path))

    def check_no_file_in_the_way(self) -> None:
        found = run_lock.file_in_the_way(self.path)
        if found is not None:
            where = "it cannot be the run directory" if found == self.path else \
                f"the run directory {self.path} cannot be made under it"
            raise ConfigError(f"{found} is a file, not a folder, so {where}.", "Choose another --output-dir or --run-name.")

    def check_available(self, overwrite: bool = False, keep: dict[str, Path] | None = None) -> None:
        """Refuse a path where a file is in the way, a folder that holds a run
        (unless told to overwrite it), and anything --overwrite must never remove
        (`overwriting`): a folder llmcustoms did not make, a link, the current
        directory, a folder holding a path the command was given (`keep`)."""
        self.check_no_file_in_the_way()
        why = overwriting.refusal(self.path, keep or {})
        if why is not None:
            raise ConfigError(f"{self.path} {why}, so it cannot be the run directory; --overwrite never removes it.",
                              "Choose another --run-name or --output-dir; nothing was removed.")
        if not (self.path.exists() and any(self.path.iterdir())):
            return
        if not overwriting.is_run_directory(self.path):
            raise ConfigError(f"{self.path} already exists and is not an llmcustoms run (it has no plan.json or "
                              "status.json), so it cannot be the run directory; --overwrite never removes it.",
                              "Choose another --run-name or --output-dir; nothing was removed.")
        if not overwrite:
            raise ConfigError(f"The run directory {self.path} already exists.",
                              "Continue it with `llmcustoms resume`, pick another --run-name, or pass --overwrite to start over.")

    def create(self, overwrite: bool = False, keep: dict[str, Path] | None = None) -> None:
        self.check_available(overwrite, keep)
        try:
            if self.path.exists():
                shutil.rmtree(self.path)
            self.path.mkdir(parents=True)
        except OSError as exc:
            raise ConfigError(f"Cannot create the run directory {self.path}: {exc.strerror}.",
                              "Check the permissions of --output-dir, or choose another.") from None

    def write_plan(self, plan: Plan) -> None:
        if not self.writable:
            return
        write_json_atomic(self.plan_path, plan.to_json())

    def read_plan(self) -> Plan:
        """The run's plan; a plan.json that cannot be read, is not JSON or holds a
        field that is missing, of the wrong type or out of range (edited by hand,
        cut short) is refused, naming the field (`plan_values`)."""
        try:
            return Plan.from_json(json.loads(self.plan_path.read_bytes().decode("utf-8")))
        except OSError as exc:
            problem = f"it cannot be read ({exc.strerror or exc})"
        except PlanDamaged as exc:
            problem = str(exc)
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            problem = "it is not valid JSON (cut short, or edited by hand)"
        raise ConfigError(f"The plan.json of the run {self.path} is damaged: {problem}.",
                          "Put back what `llmcustoms train` wrote there (from a copy of the run, or by hand), or "
                          "train the run again; nothing was changed.")

    def append_metrics(self, row: dict[str, Any]) -> None:
        self._append(self.metrics_path, [row])

    def append_samples(self, rows: list[dict[str, Any]]) -> None:
        self._append(self.samples_path, rows)

    def truncate_logs(self, step: int) -> None:
        """Forget rows after `step` (metrics and samples): after a rollback or
        resume they are trained again, and the file keeps one row per optimizer step."""
        if not self.writable:
            return
        for path in (self.metrics_path, self.samples_path):
            if path.exists():
                whole = runrecords.metrics_row if path == self.metrics_path else runrecords.samples_row
                rows = [r for r in _read_jsonl(path, whole)[0] if r["step"] <= step]
                text = "".join(json.dumps(r) + "\n" for r in rows)
                try:
                    replace_file(path, text)
                except OSError as exc:
                    if exc.errno not in DISK_FULL:
                        raise
                    if not overwrite(path, text):  # fewer rows than it holds: they fit in the room it has
                        say_unwritten(path, exc, f"it still holds rows after step {step}")

    def _append(self, path: Path, rows: list[dict[str, Any]]) -> None:
        """Append rows, a line each; on a full disk those that fit, and stderr says so."""
        if not self.writable or not rows:
            return
        try:
            append_lines(path, [json.dumps(row) + "\n" for row in rows])
        except OSError as exc:
            if exc.errno not in DISK_FULL:
                raise
            say_unwritten(path, exc, "rows are missing from it while the disk is full")

    def add_recovery(self, recovery: dict[str, Any]) -> None:
        if not self.writable:
            return
        status = self.read_status()
        self._save_status({**status, "recoveries": status.get("recoveries", []) + [recovery]})

    def _save_status(self, status: dict[str, Any]) -> None:
        """status.json as far as the disk allows. On a full disk it is written
        over its old content (compact, and if need be without what only
        `report` shows) in the room that already has; else stderr says it is out of date."""
        try:
            write_json_atomic(self.status_path, status)
        except OSError as exc:
            if exc.errno not in DISK_FULL:
                raise
            essential = {key: status[key] for key in ESSENTIAL_STATUS if key in status}
            if not any(overwrite(self.status_path, json.dumps(data, separators=(",", ":")))
                       for data in (status, essential)):
                say_unwritten(self.status_path, exc, f"it may not say the run is `{status.get('status')}`")

    @property
    def restart_path(self) -> Path:
        return self.path / "restart.json"

    def request_restart(self, kind: str, step: int, rank: int, launch: str | None) -> None:
        """Ask for every process to restart from the last checkpoint and recover
        from `kind` first. The one file any process may write, whether or not it
        is the main one: under FSDP a failing process cannot reach the others (they
        wait inside a collective), so it leaves this note, exits, and the launcher
        starts them all again (see launching.relaunch).

        `launch` is `launching.launch_token()`, which the note names so a launcher
        acts only on its own processes' requests. The caller passes it, since
        launching imports this module."""
        tmp = self.restart_path.with_name(f".restart.json.{rank}.tmp")
        tmp.write_text(json.dumps({"kind": kind, "step": step, "rank": rank, "launch": launch}))
        os.replace(tmp, self.restart_path)

    def pending_restart(self) -> dict[str, Any] | None:
        """The restart a failed process asked for, if any."""
        try:
            return json.loads(self.restart_path.read_text())
        except (OSError, ValueError):
            return None

    def clear_restart(self) -> None:
        if self.writable:
            self.restart_path.unlink(missing_ok=True)

    def read_metrics(self) -> list[dict[str, Any]]:
        return self._read_rows(self.metrics_path, runrecords.metrics_row)

    def read_samples(self) -> list[dict[str, Any]]:
        return self._read_rows(self.samples_path, runrecords.samples_row)

    def _read_rows(self, path: Path, whole: Any) -> list[dict[str, Any]]:
        rows, self.skipped[path.name] = _read_jsonl(path, whole)
        return rows

    def read_status(self) -> dict[str, Any]:
        if not self.status_path.exists():
            return {}
        try:
            status = json.loads(self.status_path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{self.status_path} is damaged ({type(exc).__name__}).",
                              "Delete status.json; `llmcustoms resume` works from the checkpoints alone.") from None
        readable, left_out = runrecords.readable_status(status)  # a field of the wrong type is left out
        self.skipped[self.status_path.name] = len(left_out)
        return readable

    def running_pid(self) -> int | None:
        """The pid of another process training this run (holding its lock), if
        there is one. Not status.json's: a process killed with kill -9 leaves it
        saying `running`, and its pid may be another program's by now."""
        return run_lock.holder(self.path)

    def write_status(self, status: str, *, training: bool = True, **fields: Any) -> dict[str, Any]:
        """Say how the run stands, keeping its training time (`training_time`).
        `training=False`: `running`, but its training has not begun (the model loads)."""
        assert status in STATUSES, status
        current = self.read_status()
        if not self.writable:
            return current
        current.update(fields)
        now = time.strftime(runrecords.TIME_FORMAT)
        trainingtime.count_segment(current, status, now, begins=training)  # before the pid is this process's
        current["status"] = status
        current["pid"] = os.getpid()
        current["updated_at"] = now
        current.setdefault("started_at", current["updated_at"])
        current.setdefault("recoveries", [])
        self._save_status(current)
        return current


def find_unfinished_run(output_dir: Path) -> RunDirectory:
    """The most recently updated run under `output_dir` that has not completed."""
    candidates = []
    for path in Path(output_dir).glob("*/plan.json"):
        run = RunDirectory(path.parent)
        try:
            status = run.read_status()
        except ConfigError:
            status = {}
        if status.get("status") != "completed" and run.running_pid() is None:
            updated = run.status_path.stat().st_mtime if run.status_path.exists() else path.stat().st_mtime
            candidates.append((updated, run))
    if not candidates:
        raise ConfigError(f"No unfinished run under {output_dir}.",
                          "Pass the run directory (`llmcustoms resume runs/NAME`), or --output-dir where your runs are.")
    return max(candidates, key=lambda pair: pair[0])[1]


@dataclass(frozen=True)
class RunSummary:
    """One line of `llmcustoms runs`."""

    name: str
    model: str
    method: str
    status: str  # status.json's, or "stopped": it says running, but no process owns the run
    step: int
    total_steps: int | None
    best_eval_loss: float | None
    base_eval_loss: float | None  # the model before training, for the change
    kept_step: int | None  # whose weights adapter/ holds, when the run kept another than its last
    started_at: str | None
    seconds: float | None  # training time (`training_time`): its segments summed, up to now while it trains
    objective: str = "sft"  # "dpo": its eval loss is DPO's, not a perplexity
    peak_bytes: int | None = None  # measured peak memory (`resource_use`), and against the plan's prediction
    memory_ratio: float | None = None


def list_runs(output_dir: Path) -> list[RunSummary]:
    """Every run under `output_dir`, by name. One whose plan.json or status.json
    is damaged is listed as `damaged` (it was left out: the run seemed gone)."""
    runs = []
    for plan_path in sorted(Path(output_dir).glob("*/plan.json")):
        run = RunDirectory(plan_path.parent)
        plan = _listed_plan(plan_path)
        try:
            status = run.read_status()
        except ConfigError:  # not JSON: the run is listed with what plan.json says
            status = {"status": "damaged"}
        if plan is None:  # what status.json says of its steps and losses is still shown
            plan, status = {"model": "?", "method": "?"}, {**status, "status": "damaged"}
        memory, current = status.get("memory") or {}, _current_status(run, status)
        runs.append(RunSummary(run.path.name, str(plan.get("model", "")), plan.get("method", ""),
                               current, status.get("step", 0), plan.get("total_steps"),
                               status.get("best_eval_loss"), status.get("base_eval_loss"),
                               status.get("kept_step") if status.get("last_output") else None, status.get("started_at"),
                               trainingtime.training_seconds(status, running=current == "running"),
                               plan.get("objective", "sft"), memory.get("peak_bytes"), memory.get("ratio")))
    return runs


def _listed_plan(path: Path) -> dict[str, Any] | None:
    """plan.json's fields as far as they are there and right (a listing reads
    plans of every version, and hand-written ones), or None if damaged."""
    try:
        plan = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return plan if plan_problem(Plan, plan, complete=False) is None else None


def _current_status(run: RunDirectory, status: dict[str, Any]) -> str:
    """status.json's word, except `stopped` for a run it says is running that no
    process owns (killed, or its terminal closed, before it could say so)."""
    said = status.get("status", "unknown")
    return "stopped" if said == "running" and run.running_pid() is None else said
