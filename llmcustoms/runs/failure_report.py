"""failure.json: what a failed run leaves to attach to a bug report.

A run that fails (`TrainingFailed`, or an unexpected exception out of the
`FineTuner`) writes `<run dir>/failure.json` from the main process:

    failure       out_of_memory | nan | divergence | disk_full | data | cuda | bug
    reason        why the run stopped (status.json says the same)
    step, suggestions
    error         the underlying exception: its type and message (capped)
    traceback     the underlying exception's traceback, with its causes
    versions      python, torch, cuda, transformers, peft, accelerate, bitsandbytes, llmcustoms
    hardware      what `hardware.detect()` finds
    plan          the plan in force when it failed
    last_metrics  the last rows of metrics.jsonl

Users attach it to bug reports, so it holds no secrets and no data rows:
every string in it goes through `redact` (tokens and keys, found by the
environment's secret-looking variables and by their shapes), and an
exception's message is capped, since a message may quote what it choked on.
Tracebacks hold file names, line numbers and code lines, never local values.

Writing it never raises: the failure it describes is what the user must see,
so a report that cannot be written (a full disk) is said in one sentence.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import sys
import time
import traceback
from typing import Any

from llmcustoms.data.chat_turns import RowProblem
from llmcustoms.errors import DataError
from llmcustoms.runs.disk_writes import disk_full_code
from llmcustoms.runs.run_directory import write_json_atomic

# TrainingFailed.report's kinds that say what failed on their own.
KNOWN_KINDS = {"oom": "out_of_memory", "nan": "nan", "divergence": "divergence", "disk_full": "disk_full"}
# What CUDA, its libraries and the driver put in their errors' messages.
CUDA_MARKERS = ("cuda error", "cudnn", "cublas", "nccl", "device-side assert", "driver")
CUDA_ERROR_TYPES = ("AcceleratorError",)  # torch's type for CUDA errors since 2.8
PACKAGES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "llmcustoms")
LAST_METRICS = 5
# An exception's message past this is cut: long ones quote inputs (a row, a tensor).
MESSAGE_CHARS = 1000
TRACEBACK_CHARS = 60_000  # the end is kept: the frames nearest the error
REDACTED = "[redacted]"
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|CREDENTIAL|AUTH", re.IGNORECASE)
SECRET_MIN_CHARS = 6  # shorter values (flags such as "1") would blank out ordinary text
# Hugging Face tokens, and OpenAI-style keys, wherever they come from.
SECRET_SHAPES = re.compile(r"(?<![A-Za-z0-9])(?:hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,})")


def secret_values() -> list[str]:
    """The values of environment variables whose names look secret, longest first
    (so a secret that holds a shorter one is replaced whole)."""
    values = {value for name, value in os.environ.items()
              if SECRET_NAME.search(name) and len(value) >= SECRET_MIN_CHARS}
    return sorted(values, key=len, reverse=True)


def redact(value: Any, secrets: list[str] | None = None) -> Any:
    """`value` with every string in it (dict keys too, at any depth) cleared of
    secrets. What JSON cannot hold becomes its text, redacted as well."""
    secrets = secret_values() if secrets is None else secrets
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
        return SECRET_SHAPES.sub(REDACTED, value)
    if isinstance(value, dict):
        return {redact(str(k), secrets): redact(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, secrets) for v in value]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return redact(str(value), secrets)


def cap(text: str, limit: int = MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit:,} more characters)"


def describe(error: BaseException) -> str:
    """`Type: message`, the message capped."""
    try:
        message = str(error)
    except Exception:  # a broken __str__ must not hide the failure
        message = "(the message could not be read)"
    return f"{type(error).__name__}: {cap(message)}" if message else type(error).__name__


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and what it came from, outermost first, as Python prints them."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and not any(current is seen for seen in chain):
        chain.append(current)
        current = current.__cause__ if current.__cause__ is not None else (
            None if current.__suppress_context__ else current.__context__)
    return chain


def format_traceback(error: BaseException) -> str:
    """Python's traceback of `error` and its causes, with each message capped."""
    chain = _chain(error)
    text = ""
    for inner, outer in zip(reversed(chain), list(reversed(chain))[1:] + [None]):
        text += "Traceback (most recent call last):\n" + "".join(traceback.format_tb(inner.__traceback__))
        text += describe(inner) + "\n"
        if outer is not None:
            text += ("\nThe above exception was the direct cause of the following exception:\n\n"
                     if outer.__cause__ is inner else
                     "\nDuring handling of the above exception, another exception occurred:\n\n")
    return text if len(text) <= TRACEBACK_CHARS else "...\n" + text[-TRACEBACK_CHARS:]


def classify(error: BaseException | None, kind: str = "error") -> str:
    """The failure's class: from the report's kind when it says, else from the exception and its causes."""
    if kind in KNOWN_KINDS:
        return KNOWN_KINDS[kind]
    chain = _chain(error) if error is not None else []
    torch = sys.modules.get("torch")  # not loaded: no exception can be torch's
    out_of_memory = (torch.OutOfMemoryError,) if torch is not None else ()
    if any(isinstance(e, out_of_memory) for e in chain):
        return "out_of_memory"
    if any(disk_full_code(e) is not None for e in chain):
        return "disk_full"
    if any(isinstance(e, (DataError, RowProblem)) for e in chain):
        return "data"
    if any(type(e).__name__ in CUDA_ERROR_TYPES or any(m in describe(e).lower() for m in CUDA_MARKERS)
           for e in chain):
        return "cuda"
    return "bug"


def versions() -> dict[str, str | None]:
    """What a bug report needs to reproduce the run; a package not installed is None."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    try:
        import torch

        found["cuda"] = torch.version.cuda
    except Exception:  # a broken torch install is worth a report of its own
        found["cuda"] = None
    return found


def _hardware() -> dict[str, Any]:
    from llmcustoms.planning.hardware import detect

    try:
        return detect().to_json()
    except Exception as exc:  # a failing detection must not hide the failure
        return {"detection_failed": describe(exc)}


def _last_metrics(run_dir: Any) -> list[dict[str, Any]]:
    try:
        return run_dir.read_metrics()[-LAST_METRICS:]
    except OSError:
        return []


def failure_report(run_dir: Any, plan: Any, error: BaseException, report: dict[str, Any]) -> dict[str, Any]:
    """failure.json's content, redacted. `error`: the underlying exception (a
    TrainingFailed's __cause__ when it has one); `report`: TrainingFailed.report's
    keys (kind, step, reason, suggestions)."""
    return redact({
        "failure": classify(error, report.get("kind", "error")),
        "reason": cap(str(report.get("reason", "")), 2 * MESSAGE_CHARS),
        "step": report.get("step"),
        "suggestions": list(report.get("suggestions", [])),
        "error": describe(error),
        "traceback": format_traceback(error),
        "versions": versions(),
        "hardware": _hardware(),
        "plan": plan.to_json() if plan is not None else None,
        "last_metrics": _last_metrics(run_dir),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })


def save_failure_report(run_dir: Any, plan: Any, error: BaseException, report: dict[str, Any]) -> str | None:
    """Write failure.json; the sentence that says where it is (or that it could
    not be written). None on a process that writes nothing (not the main one)."""
    if not run_dir.writable:
        return None
    path = run_dir.failure_path
    try:
        write_json_atomic(path, failure_report(run_dir, plan, error, report))
    except Exception as exc:  # a full disk, say: the failure itself still has to be shown
        return f"The failure report could not be written to {path} ({describe(exc)})."
    return f"The failure report is {path} (no tokens, no data rows): attach it to a bug report."
