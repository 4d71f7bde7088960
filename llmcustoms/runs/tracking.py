"""Experiment tracking: the same metrics as metrics.jsonl, through TensorBoard's
or Weights & Biases' own writers (`--report-to`, `LLMCUSTOMS_REPORT_TO`).

Both libraries are optional extras; asking for one that is not installed is a
clear error before any work starts, not a crash halfway through training.
"""

from __future__ import annotations

import os
import re
import uuid
from typing import Any

from llmcustoms.errors import ConfigError

TRACKERS = ("none", "tensorboard", "wandb")
EXTRA_PACKAGE = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_tracker(name: str) -> str:
    """`name` if it can be used here; a ConfigError saying what to install if not."""
    if name not in TRACKERS:
        raise ConfigError(f"Unknown --report-to '{name}'.", f"Use one of {', '.join(TRACKERS)}.")
    if name == "none":
        return name
    import importlib.util

    if importlib.util.find_spec(EXTRA_PACKAGE[name]) is None:
        raise ConfigError(f"--report-to {name} needs the '{EXTRA_PACKAGE[name]}' package, which is not installed.",
                          f'Install it with: pip install "llmcustoms[{name}]"  (or run without --report-to).')
    return name


class _TensorBoard:
    def __init__(self, run_dir: Any, plan: Any):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir.path / "tensorboard"))
        self.writer.add_text("plan", "```\n" + plan.dumps() + "\n```")

    def log(self, row: dict[str, Any]) -> None:
        step = row["step"]
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(("eval/" + key[5:]) if key.startswith("eval_") else f"train/{key}", value, step)

    def close(self) -> None:
        self.writer.close()


def _wandb_run_id(run_dir: Any) -> str:
    """One W&B run per llmcustoms run, the same after `resume`. Run names repeat
    across output directories (and after --overwrite); W&B ids must not, or two
    runs would log into one."""
    id_file = run_dir.path / "wandb" / "llmcustoms-run-id"
    if id_file.exists():
        return id_file.read_text().strip()
    run_id = re.sub(r"[^A-Za-z0-9_-]", "-", run_dir.path.name)[:48] + "-" + uuid.uuid4().hex[:8]
    id_file.parent.mkdir(parents=True, exist_ok=True)
    id_file.write_text(run_id)
    return run_id


class _WandB:
    def __init__(self, run_dir: Any, plan: Any):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "llmcustoms"), name=run_dir.path.name,
                              id=_wandb_run_id(run_dir), resume="allow", dir=str(run_dir.path), config=plan.to_json())
        # A recovery rolls back and logs the same steps again, and W&B drops rows
        # whose `step` is not past the last one: plot against our own step instead.
        self.run.define_metric("train/step")
        self.run.define_metric("train/*", step_metric="train/step")
        self.run.define_metric("eval/*", step_metric="train/step")

    def log(self, row: dict[str, Any]) -> None:
        values = {(("eval/" + k[5:]) if k.startswith("eval_") else f"train/{k}"): v
                  for k, v in row.items() if k != "step"}
        self.run.log({**values, "train/step": row["step"]})

    def close(self) -> None:
        self.run.finish()


class TrackingReporter:
    """A Reporter that also sends step and eval rows to a tracker."""

    def __init__(self, inner: Any, writer: Any):
        self.inner = inner
        self.writer = writer

    @classmethod
    def wrap(cls, inner: Any, tracker: str, run_dir: Any, plan: Any) -> Any:
        if tracker == "none":
            return inner
        writer = _TensorBoard(run_dir, plan) if tracker == "tensorboard" else _WandB(run_dir, plan)
        return cls(inner, writer)

    def message(self, text: str, warning: bool = False) -> None:
        self.inner.message(text, warning)

    def activity(self, text: str | None) -> None:
        self.inner.activity(text)

    def count(self, what: str, done: int, total: int) -> None:
        self.inner.count(what, done, total)

    def training_started(self, total_steps: int, start_step: int = 0, memory: dict[str, Any] | None = None) -> None:
        self.inner.training_started(total_steps, start_step, memory)

    def step(self, row: dict[str, Any]) -> None:
        self.inner.step(row)
        self.writer.log(row)

    def evaluated(self, row: dict[str, Any]) -> None:
        self.inner.evaluated(row)
        self.writer.log(row)

    def training_finished(self) -> None:
        self.inner.training_finished()
        self.writer.close()
