"""What is shown about the data: what reading found, how far preparing it is,
and what it costs. A UI module: Rich appears here, nothing is computed."""

from __future__ import annotations

import time
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from llmcustoms.preparation.prepared_run import PreparedRun
from llmcustoms.ui.console import console, escape

# A preparation quicker than this shows no progress display at all.
QUIET_SECONDS = 1.0
STAGES = {"read": "Reading the data", "tokenize": "Tokenizing", "gguf": "Reading the GGUF file"}
UNITS = {"gguf": "tensors"}  # what a stage counts; rows for the others


class PreparationProgress:
    """A transient progress display for `prepare_run(progress=...)`: a GGUF
    file's tensors read (`--model FILE.gguf`, once), rows read so far with their
    rate, then a bar of rows tokenized; each with its rate and ETA."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.progress: Progress | None = None
        self.tasks: dict[str, Any] = {}

    def __enter__(self) -> "PreparationProgress":
        self.started = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def __call__(self, stage: str, done: int, total: int | None) -> None:
        if self.progress is None:
            if time.monotonic() - self.started < QUIET_SECONDS:
                return
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                                     TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=True)
            self.progress.start()
        if stage not in self.tasks:
            self.tasks[stage] = (self.progress.add_task(STAGES.get(stage, stage), total=total, rate=""), time.monotonic())
        task, began = self.tasks[stage]
        elapsed = time.monotonic() - began
        rate = (f"{done / elapsed:,.0f}" if elapsed > 0.5 else "-") + f" {UNITS.get(stage, 'rows')}/s"
        self.progress.update(task, completed=done, total=total, rate=rate)


def show_prepared(prepared: PreparedRun, data_path: str) -> None:
    """What was found in the data, before the plan."""
    dataset = prepared.dataset
    line = (f"Data: [bold]{escape(data_path)}[/] - detected format [bold]{escape(dataset.format_description)}[/], "
            f"{dataset.rows:,} row{'s' if dataset.rows != 1 else ''}")
    console.print(line)
    if dataset.skipped:
        why = "--skip-bad-rows" if dataset.policy == "skip" else "a small share; --strict stops at the first"
        rows = "1 bad row" if dataset.skipped == 1 else f"{dataset.skipped:,} bad rows"
        console.print(f"[yellow]{rows} skipped[/] ({why}):")
        for reason in dataset.bad.lines():
            console.print(f"  {escape(reason)}")
    if dataset.unlearned:
        rows = "1 row" if dataset.unlearned == 1 else f"{dataset.unlearned:,} rows"
        console.print(f"{rows} marked undesirable (label: false) left out: those replies are never learned.")
    plan = prepared.plan
    if plan.eval_rows and plan.eval_overlap_rows:  # `splits.rows_also_trained`: not held out, whatever the flag said
        which = "all of them" if plan.eval_overlap_rows == plan.eval_rows else f"{plan.eval_overlap_rows:,} of them"
        console.print(f"[yellow]Evaluation: {plan.eval_rows:,} row{'s' if plan.eval_rows != 1 else ''} "
                      f"({escape(prepared.eval_source)}), {which} training rows too[/]: not held out")
    elif plan.eval_rows:
        console.print(f"Evaluation: {plan.eval_rows:,} row{'s' if plan.eval_rows != 1 else ''} held out ({escape(prepared.eval_source)})")
    else:  # never a silent "no evaluation": why there is none (`splits.split_rows`)
        console.print(f"[yellow]Evaluation: none[/] ({escape(prepared.eval_source)})")
    if prepared.templated_prompts:
        console.print("prompt/completion rows go through the model's chat template as a user turn and an assistant "
                      "turn (--raw-prompts joins them as they are).")
    if prepared.used_fallback_template:
        console.print("The tokenizer has no chat template: using the llmcustoms fallback template (docs/data-formats.md).")
    _show_facts(prepared.plan.data_report)
    if prepared.tokenizer is not None:
        console.print(_preparation_time(prepared))


def _show_facts(facts: dict[str, Any]) -> None:
    lengths = facts.get("train_token_lengths")
    if lengths:
        estimated = "" if facts.get("length_source") == "tokenizer" else " (estimated from characters)"
        console.print(f"Tokens per training row{estimated}: median {lengths['p50']:,}, 90% under {lengths['p90']:,}, "
                      f"99% under {lengths['p99']:,}, longest {lengths['max']:,}")
    for line in facts.get("advice", ()):
        console.print(f"[yellow]Data:[/] {escape(line)}")


def _preparation_time(prepared: PreparedRun) -> str:
    read = f"Data read in {prepared.read_seconds:.1f} s"
    notes = "".join(f"[yellow]Cache:[/] {escape(note)}\n" for note in prepared.cache_notes)
    if prepared.cached:
        return f"{notes}{read}; tokenized rows from the cache."
    rows = prepared.dataset.rows
    rate = f" ({rows / prepared.tokenize_seconds:,.0f} rows/s)" if prepared.tokenize_seconds > 0 else ""
    kept = "cached for the next run" if prepared.kept else "not cached"
    return f"{notes}{read}, tokenized in {prepared.tokenize_seconds:.1f} s{rate}; {kept}."
