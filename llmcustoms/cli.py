"""The `llmcustoms` command line. Each command parses flags, calls one function
and renders the result; heavy libraries (torch, transformers, peft) are
imported inside commands so `llmcustoms --help` starts instantly.

Exit codes: 0 done; 2 user error; 1 unexpected bug; 130/143 interrupted.
"""

from __future__ import annotations

import os
import re
import time
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Any, Iterator, Optional

import typer

from llmcustoms import __version__
from llmcustoms.console import console, print_error
from llmcustoms.errors import LlmcustomsError

class Method(str, Enum):
    lora = "lora"
    qlora = "qlora"
    full = "full"


class Scheduler(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class Precision(str, Enum):
    no = "no"
    bf16 = "bf16"
    fp16 = "fp16"


app = typer.Typer(
    name="llmcustoms",
    help="Fine-tune a small open LLM on your own data with one command.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn an `LlmcustomsError` into one clear message and exit code 2."""
    try:
        yield
    except LlmcustomsError as exc:
        print_error(exc.message, exc.hint)
        raise typer.Exit(exc.exit_code) from None


def _quiet_libraries() -> None:
    """Keep the libraries' own progress bars and advice out of the user's terminal."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import logging
    import warnings

    # bitsandbytes announces on import that an optional Hub-hosted CPU kernel is
    # missing; it falls back to its own kernel, so the notice only confuses.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(torch|transformers|peft|bitsandbytes)\..*")


def _version_callback(value: bool) -> None:
    if value:
        console.print(f"llmcustoms {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True,
                                       help="Show the version and exit.")) -> None:
    """Fine-tune a small open LLM on your own data with one command."""


def default_run_name(model: str, preset: str) -> str:
    short = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model.rstrip("/")).name).strip("-").lower() or "model"
    return f"{short}-{Path(preset).stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def _overrides(values: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """Plan values the user set with a flag; None means not given."""
    return {name: (value.value if isinstance(value, Enum) else value, "flag")
            for name, value in values.items() if value is not None}


@app.command()
def train(
    data: str = typer.Argument(..., help="Training data: .jsonl, .json, .csv, .parquet or a saved datasets directory."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Hugging Face Hub id or local model directory. Default: the preset's choice."),
    preset: Optional[str] = typer.Option(None, "--preset", "-p", help="highspeed, quality (default), bestaccuracy, or a preset YAML file."),
    method: Optional[Method] = typer.Option(None, "--method", help="lora, qlora (4-bit base) or full fine-tuning."),
    output_dir: Path = typer.Option(Path("runs"), "--output-dir", "-o", help="Where run directories go."),
    run_name: Optional[str] = typer.Option(None, "--run-name", help="Name of this run's directory. Default: model-preset-time."),
    epochs: Optional[float] = typer.Option(None, "--epochs", min=0.01, help="Passes over the training data."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", min=1, help="Stop after this many optimizer steps (overrides --epochs)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", min=1, help="Micro-batch size: rows per forward pass."),
    grad_accum: Optional[int] = typer.Option(None, "--grad-accum", min=1, help="Micro-batches per optimizer step."),
    lr: Optional[float] = typer.Option(None, "--lr", min=0.0, help="Peak learning rate."),
    lr_scheduler: Optional[Scheduler] = typer.Option(None, "--lr-scheduler", help="Learning-rate decay after warmup."),
    warmup_ratio: Optional[float] = typer.Option(None, "--warmup-ratio", min=0.0, max=0.99, help="Share of steps spent warming up."),
    max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len", min=16, help="Longest sequence in tokens; longer rows are truncated."),
    lora_r: Optional[int] = typer.Option(None, "--lora-r", min=1, help="LoRA rank."),
    lora_alpha: Optional[int] = typer.Option(None, "--lora-alpha", min=1, help="LoRA alpha (scale = alpha / r)."),
    lora_dropout: Optional[float] = typer.Option(None, "--lora-dropout", min=0.0, max=0.99, help="Dropout on the LoRA path."),
    eval_split: Optional[float] = typer.Option(None, "--eval-split", min=0.0, max=0.9, help="Share of rows held out for evaluation."),
    eval_data: Optional[str] = typer.Option(None, "--eval-data", help="A separate evaluation file (replaces --eval-split)."),
    save_every: Optional[int] = typer.Option(None, "--save-every", min=1, help="Checkpoint every N optimizer steps."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed: same seed, same run."),
    early_stopping_patience: Optional[int] = typer.Option(None, "--early-stopping-patience", min=0,
                                                          help="Stop after N evaluations without a better eval loss (0: never)."),
    gradient_checkpointing: Optional[bool] = typer.Option(None, "--gradient-checkpointing/--no-gradient-checkpointing",
                                                          help="Recompute activations to save memory (slower)."),
    mixed_precision: Optional[Precision] = typer.Option(None, "--mixed-precision",
                                                        help="Autocast precision. Default: bf16 or fp16 on a GPU, none on CPU."),
    train_on_prompt: bool = typer.Option(False, "--train-on-prompt", help="Also compute the loss on prompts, not only on responses."),
    skip_bad_rows: bool = typer.Option(False, "--skip-bad-rows", help="Skip rows that fail validation instead of stopping."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Allow the model repository to run its own code."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing run directory of the same name."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display; for scripts."),
) -> None:
    """Fine-tune a model on DATA and save a LoRA adapter (or full model) into a run directory."""
    with user_errors():
        _quiet_libraries()
        from llmcustoms import console as ui
        from llmcustoms.finetuner import FineTuner
        from llmcustoms.hardware import detect
        from llmcustoms.preparation import TrainOptions, prepare_run
        from llmcustoms.rundir import RunDirectory

        overrides = _overrides({
            "method": method, "epochs": epochs, "max_steps": max_steps, "micro_batch_size": batch_size,
            "grad_accum": grad_accum, "lr": lr, "lr_scheduler": lr_scheduler, "warmup_ratio": warmup_ratio,
            "max_seq_len": max_seq_len, "lora_r": lora_r, "lora_alpha": lora_alpha, "lora_dropout": lora_dropout,
            "eval_split": eval_split, "save_every": save_every, "seed": seed,
            "early_stopping_patience": early_stopping_patience, "gradient_checkpointing": gradient_checkpointing,
            "mixed_precision": mixed_precision, "train_on_prompt": train_on_prompt or None,
            "trust_remote_code": trust_remote_code or None,
        })
        options = TrainOptions(data=data, model=model, preset=preset, eval_data=eval_data,
                               skip_bad_rows=skip_bad_rows, overrides=overrides)
        if run_name:  # fail before any slow work, not after it
            RunDirectory(output_dir / run_name).check_available(overwrite)
        prepared = prepare_run(options, detect())
        plan = prepared.plan
        run_dir = RunDirectory(output_dir / (run_name or default_run_name(plan.model, plan.preset)))

        if not quiet:
            ui.show_data_summary(data, prepared.dataset.format_description, len(prepared.dataset.examples),
                                 prepared.dataset.skipped, len(prepared.evaluation), prepared.eval_source)
            if prepared.used_fallback_template:
                console.print("The tokenizer has no chat template: using the llmcustoms fallback template (see README).")
            if prepared.truncated:
                console.print(f"{prepared.truncated} rows truncated to {plan.max_seq_len} tokens"
                              + (f", {prepared.dropped} dropped (no response left)" if prepared.dropped else "") + ".")
            ui.show_plan(plan)
        if not yes and not quiet and not ui.confirm("Start training?"):
            raise typer.Exit(0)
        run_dir.create(overwrite=overwrite)
        run_dir.write_plan(plan)
        reporter = ui.make_reporter(quiet)
        result = FineTuner(plan, prepared.tokenizer, prepared.train, prepared.evaluation, run_dir, reporter).run()
        if quiet:
            print(result.output_path)
        else:
            ui.show_summary(result)


def load_env_file(path: Path = Path(".env")) -> None:
    """Variables from ./.env (HF_TOKEN, HF_HOME, ...) for this process. The
    real environment wins over the file, so a one-off `VAR=x llmcustoms ...` works."""
    if path.is_file():
        from dotenv import load_dotenv

        load_dotenv(path, override=False)


def main() -> None:
    load_env_file()
    try:
        app()
    except KeyboardInterrupt:
        print_error("Interrupted.", None)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
