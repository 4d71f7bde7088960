"""Everything the user sees: tables, panels and error messages.

The trainer talks to the `Reporter` protocol (`reporting.py`) and never to
Rich directly; `ui/train_view.py` holds its Rich implementations (the live
training display). Rich appears here, in `ui/train_view.py`, in `ui/data_view.py`
(the data), in `ui/tune_view.py` (what `tune` and `lr-find` show), in
`ui/dialog.py` (what llmcustoms asks) and in `ui/layout.py` (what they share)
only, and none computes: what they show comes worked out (`fitting.fit_table`,
`run_directory.list_runs`).
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from rich import box
from rich.console import Console, Group, RenderableType
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from llmcustoms.planning.access_tokens import hide_tokens
from llmcustoms.planning.duration import CPU_TIME_LIMIT_S
from llmcustoms.planning.objective_kinds import objective_named
from llmcustoms.planning.presets import (
    MEDIUM_DATASET_ROWS,
    MEDIUM_MODEL_PARAMS,
    SMALL_DATASET_ROWS,
    SMALL_MODEL_PARAMS,
    TINY_MODEL_PARAMS,
)
from llmcustoms.runs import measures
from llmcustoms.runs.forgetting import general_line
from llmcustoms.runs.memory_use import memory_line
from llmcustoms.runs.preference_report import held_out_line
from llmcustoms.runs.stop_rates import stop_rate_line
from llmcustoms.ui.layout import Parts, WideOrNarrow

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


def print_warning(message: str) -> None:
    err_console.print(f"[yellow]warning:[/] {escape(hide_tokens(message))}")


def print_error(message: str, hint: str | None) -> None:
    """A token pasted as an argument (`--model hf_...`) is hidden wherever a message repeats it."""
    text = f"[bold red]Error:[/] {escape(hide_tokens(message))}"
    if hint:
        text += f"\n{escape(hide_tokens(hint))}"
    err_console.print(text)


def print_notice(message: str, hint: str | None) -> None:
    """Something the user asked for, such as a stop: said calmly, not as an error."""
    err_console.print(f"[bold]{escape(message)}[/]" + (f"\n{escape(hint)}" if hint else ""))


def escape(text: str) -> str:
    from rich.markup import escape as rich_escape

    return rich_escape(text)


MEMORY_PARTS = (("weights", "weights_bytes"), ("LoRA adapters", "trainable_bytes"), ("gradients", "gradients_bytes"),
                ("optimizer state", "optimizer_bytes"), ("activations", "activations_bytes"),
                ("logits", "logits_bytes"), ("gathered from other shards", "gathered_bytes"),
                ("overhead", "overhead_bytes"))


def memory_table(memory: dict[str, int], where: str) -> Table:
    total, budget = memory["total_bytes"], memory["budget_bytes"]
    table = Table(title=f"Estimated peak memory ({escape(where)})", show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(justify="right")
    table.add_column()
    for label, key in MEMORY_PARTS:
        if memory.get(key):
            table.add_row(label, gib(memory[key]), "")
    share = total / budget if budget else 0
    colour = "green" if share <= 0.9 else "red"
    width = 30
    filled = min(width, round(share * width))
    table.add_row("[bold]total", f"[bold]{gib(total)}",
                  f"[{colour}]{'#' * filled}[/]{'.' * (width - filled)} {share:.0%} of {gib(budget)}")
    return table


def gib(n: int) -> str:
    return f"{n / 1024 ** 3:.2f} GiB"


DISTRIBUTED_LABELS = {"ddp": "data-parallel (each holds the whole model)",
                      "fsdp": "FSDP (weights, gradients and optimizer state sharded)"}
# plan.json and --mixed-precision keep accelerate's "no"; what it means is fp32.
PRECISION_LABELS = {"no": "fp32"}
OPTIMIZER_LABELS = {"adamw": "AdamW", "adamw_8bit": "8-bit AdamW (bitsandbytes)",
                    "paged_adamw": "paged AdamW (bitsandbytes)", "paged_adamw_8bit": "paged 8-bit AdamW (bitsandbytes)"}


def plan_table(plan: Any) -> Table:
    table = Table(title="Training plan", show_header=True, header_style="bold")
    table.add_column("setting", no_wrap=True)
    table.add_column("value")
    table.add_column("source", style="dim", no_wrap=True)
    src = plan.sources
    rows = [
        ("model", plan.model, "model"),
        ("family", plan.family, None),
        ("method", plan.method, "method"),
        ("preset", plan.preset, "preset"),
        ("micro-batch x accumulation", f"{plan.micro_batch_size} x {plan.grad_accum} = {plan.effective_batch_size}", "micro_batch_size")
        if plan.world_size == 1 else
        ("micro-batch x accumulation x processes", f"{plan.micro_batch_size} per process x {plan.grad_accum} x "
                                                    f"{plan.world_size} = {plan.effective_batch_size}", "micro_batch_size"),
        ("max sequence length", str(plan.max_seq_len), "max_seq_len"),
        ("learning rate", f"{plan.lr:.2e} ({plan.lr_scheduler}, {plan.warmup_steps} warmup steps)", "lr"),
        ("steps", f"{plan.total_steps} ({plan.steps_per_epoch}/epoch)", "total_steps"),
        ("precision", PRECISION_LABELS.get(plan.mixed_precision, plan.mixed_precision), "mixed_precision"),
        ("gradient checkpointing", "on" if plan.gradient_checkpointing else "off", "gradient_checkpointing"),
        ("optimizer", OPTIMIZER_LABELS.get(plan.optimizer, plan.optimizer), "optimizer"),
        ("packing", "on (padding-free)" if plan.packing else "off", "packing"),
        ("torch.compile", "on" if plan.compile else "off", "compile"),
        ("evaluate every", f"{plan.eval_every} steps" if plan.eval_every else "never (no eval rows)", "eval_every"),
        ("checkpoint every", f"{plan.save_every} steps", "save_every"),
        ("seed", str(plan.seed), "seed"),
    ]
    if plan.world_size > 1:
        rows.insert(3, ("processes", f"{plan.world_size}, " + DISTRIBUTED_LABELS.get(plan.distributed, plan.distributed),
                        "distributed"))
    if plan.cpu_threads:  # CPU training: the threads chosen (busy machine, OMP_NUM_THREADS)
        rows.insert(rows.index(next(r for r in rows if r[0] == "precision")) + 1,
                    ("CPU threads", f"{plan.cpu_threads}" + (" per process" if plan.world_size > 1 else ""),
                     "cpu_threads"))
    if plan.lora is not None:
        rows.insert(3, ("LoRA", f"r={plan.lora.r} alpha={plan.lora.alpha} dropout={plan.lora.dropout}", "lora.r"))
        rows.insert(4, ("LoRA targets", " ".join(plan.lora.target_modules), None))
    if is_local_path(plan.model):  # its whole path under the table (`show_plan`): a column would cut it
        rows[0] = ("model", f"{Path(plan.model).name} (the folder below)", "model")
    for name, value, key in rows:
        table.add_row(name, escape(str(value)), _short_source(src.get(key, "")) if key else "")
    return table


def is_local_path(model: str) -> bool:
    """A model directory (or GGUF file) rather than a Hub id, as `train` reads --model."""
    from llmcustoms.models.loading import looks_like_path

    return looks_like_path(model)


def _short_source(source: str) -> str:
    """'preset quality (small dataset)' -> 'preset'; plan.json keeps the detail."""
    return source.split(" ")[0]


def show_plan(plan: Any, hardware: Any = None) -> None:
    console.print(plan_table(plan))
    if is_local_path(plan.model):
        print_path("Model folder", plan.model)
    if plan.memory:
        where = "RAM" if hardware is None or not hardware.has_gpu else f"GPU: {hardware.gpus[0].name}"
        console.print(memory_table(plan.memory, where + (", per process" if plan.world_size > 1 else "")))
    lines = [f"- {escape(r)}" for r in plan.reasons] + [f"- [yellow]warning:[/] {escape(w)}" for w in plan.warnings]
    if lines:
        console.print(Panel("\n".join(lines), title="Why", expand=False))


def show_summary(result: Any) -> None:
    table = Table(title="Training finished" if result.status == "completed" else f"Training {result.status}",
                  show_header=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")  # a path longer than the column folds, never cut short
    table.add_row("steps", f"{result.steps}")
    if result.final_loss is not None:
        table.add_row("final train loss", f"{result.final_loss:.4f}")
    if result.held_out:  # DPO: perplexity means nothing; how often the chosen reply wins does
        table.add_row("best eval loss", f"{result.best_eval_loss:.4f} (DPO loss; 0.6931 before training; step "
                                        f"{result.best_eval_step})")
        table.add_row("preference", escape(held_out_line(result.held_out)))
    elif result.base_eval_loss is not None:
        table.add_row("base model eval loss", f"{result.base_eval_loss:.4f} (perplexity "
                                              f"{measures.perplexity(result.base_eval_loss):.2f})")
    if result.best_eval_loss is not None and not result.held_out:
        on_training_rows = "; on rows it also trained on, not held out" if result.eval_on_training_rows else ""
        table.add_row("best eval loss", f"{result.best_eval_loss:.4f} (step {result.best_eval_step}{on_training_rows})")
        table.add_row("quality", escape(measures.describe(result.base_eval_loss, result.best_eval_loss)))
    if stops := stop_rate_line(result.samples):  # how many sample replies ended with the end-of-turn token
        table.add_row("replies that stop", escape(stops))  # the stop token's text may be "[/INST]"
    if general := general_line(result.general):  # the forgetting check: general questions answered right
        table.add_row("general questions", escape(general))
    table.add_row("time", _duration(result.seconds))  # the whole run's, resumes included, as `runs` says
    table.add_row("tokens/s", f"{result.tokens_per_s:,.0f} (input tokens over the time in training steps)")
    if result.memory.get("peak_bytes"):
        table.add_row("memory", memory_text(result.memory))
    if result.stop_reason:
        table.add_row("stopped", escape(result.stop_reason))
    if result.kept:
        table.add_row("weights kept", escape(result.kept))
    console.print(table)
    show_samples(result.samples, "prompts of rows it trained on" if result.eval_on_training_rows else "held-out prompts")
    print_path("Saved to", result.output_path)  # last: the screen ends with what the user copies next


def print_path(label: str, path: Any) -> None:
    """A path whole on a line of its own, under its label, so a triple-click or a
    drag copies it: in a table or a sentence Rich breaks it (or cuts it with "…").
    soft_wrap: Rich never breaks it; a path wider than the terminal is wrapped by
    the terminal, which joins it again when copied."""
    console.print(f"{escape(label)}:")
    console.print(Text(str(path)), soft_wrap=True)


def memory_text(memory: dict[str, Any]) -> str:
    """`memory_use.memory_line` (the plan as its table gives it), and how busy the GPU was."""
    text = escape(memory_line(memory))
    if memory.get("gpu_util") is not None:
        text += f"; GPU busy {memory['gpu_util']:.0f}%"
    return text


# A reply longer than this is cut in the summary (samples.jsonl has it whole).
SAMPLE_CHARS = 240


def show_samples(entries: list[dict[str, str]], prompts: str = "held-out prompts") -> None:
    """Sample replies side by side: the prompt, the data's reply, the base model's, the trained model's."""
    if not entries:
        return
    def cut(text: str) -> str:
        # Control characters a model wrote (\x0f, \x1b) would move the cursor or vanish: shown as one mark each.
        text = "".join(c if c.isprintable() else "\ufffd" for c in " ".join(text.split()))
        return escape(text if len(text) <= SAMPLE_CHARS else text[:SAMPLE_CHARS - 3] + "...")
    blocks = []
    for entry in entries:
        lines = [f"[bold]prompt[/]     {cut(entry['prompt'])}", f"[dim]data[/]       {cut(entry['reference'])}",
                 f"[yellow]base model[/] {cut(entry['base']) or '-'}"]
        if entry["trained"]:
            lines.append(f"[green]trained[/]    {cut(entry['trained'])}")
        blocks.append("\n".join(lines))
    console.print(Panel("\n\n".join(blocks), title=f"Sample replies ({prompts}, greedy)", expand=False))


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def confirm(question: str) -> bool:
    """Ask yes/no on an interactive terminal; say yes when there is no one to ask."""
    if not sys.stdin.isatty():
        return True
    from rich.prompt import Confirm

    return Confirm.ask(question, default=True, console=console)


def _by_model(values: list[Any], shown: Callable[[Any], str]) -> str:
    """One value, or where the model's size changes it, one for a tiny, small, medium and large model."""
    texts = [shown(value) for value in values]
    return texts[0] if len(set(texts)) == 1 else " ".join(texts)


def show_presets(presets: list[Any], families: dict[str, Any]) -> None:
    """Each preset's values as a plan takes them, by dataset and model size (`TrainingPreset.by_size`)."""
    table = Table(title="Presets (llmcustoms train DATA --preset NAME)", box=box.SIMPLE_HEAD, pad_edge=False,
                  show_edge=False)
    for column in ("preset", "data rows", "epochs", "batch", "lr", "LoRA r"):
        table.add_column(column, no_wrap=True)
    rows = {"small": f"< {SMALL_DATASET_ROWS:,}", "medium": f"< {MEDIUM_DATASET_ROWS:,}",
            "large": f"{MEDIUM_DATASET_ROWS:,}+"}
    for p in presets:
        for index, (bucket, values) in enumerate(p.by_size(("epochs", "effective_batch_size", "lr", "lora_r")).items()):
            table.add_row(Text(p.name if index == 0 else "", style="bold"), rows[bucket],
                          _by_model(values["epochs"], "{:g}".format), _by_model(values["effective_batch_size"], str),
                          _by_model(values["lr"], lambda lr: f"{lr:.0e}".replace("e-0", "e-")),
                          _by_model(values["lora_r"], str), end_section=index == 2)
    console.print(table)
    console.print(f"\nFour values: for a tiny model (< {TINY_MODEL_PARAMS / 1e6:.0f}M parameters), a small "
                  f"(< {SMALL_MODEL_PARAMS / 1e9:.0f}B), a medium (< {MEDIUM_MODEL_PARAMS / 1e9:.0f}B) and a large "
                  "one. `plan` says which apply; `--preset FILE.yaml` takes your own preset of the same shape.\n")
    for p in presets:
        console.print(f"[bold]{escape(p.name)}[/]: {escape(p.description)} Rows up to {p.max_seq_len} tokens. "
                      "Uses the first model that fits a GPU: "
                      + escape(", ".join(m.split("/")[-1] for m in p.models))
                      + ("; without a GPU, the first expected to finish in "
                         f"{CPU_TIME_LIMIT_S // 60:.0f} minutes: " + escape(", ".join(m.split("/")[-1] for m in p.cpu_models))
                         if p.cpu_models else "") + "\n")
    table = Table(title="Model families")
    table.add_column("family", no_wrap=True)
    table.add_column("models")
    table.add_column("LoRA targets")
    for family in families.values():
        models = "\n".join(f"{m.hub_id.split('/')[-1]} ({m.params / 1e9:.1f}B)" for m in family.models)
        targets = "\n".join(f"{mt}: {' '.join(t)}" for mt, t in family.lora_target_modules.items())
        table.add_row(Text(family.name, style="bold"), escape(models), escape(targets))
    console.print(table)


def show_failure(report: dict[str, Any], run_path: Any) -> None:
    text = f"[bold red]Training stopped:[/] {escape(report['reason'])}\n"
    text += "\n".join(f"- {escape(s)}" for s in report["suggestions"])
    text += "\nstatus.json in the run directory holds this report."
    err_console.print(Panel(text, expand=False))
    err_console.print("Run directory:")  # whole on its own line, as `print_path` gives it: a panel breaks it
    err_console.print(Text(str(run_path)), soft_wrap=True)


def show_runs(output_dir: Any, runs: list[Any]) -> None:
    """`run_directory.list_runs(output_dir)` as a table."""
    if not runs:
        console.print(f"No runs under {escape(str(output_dir))}. Start one with `llmcustoms train DATA`.")
        return
    console.print(runs_table(output_dir, runs))


RUN_COLOURS = {"completed": "green", "running": "cyan", "interrupted": "yellow", "stopped": "yellow", "failed": "red"}


def runs_table(output_dir: Any, runs: list[Any]) -> WideOrNarrow:
    """`run_directory.RunSummary` rows: a table, a run to a line, where the
    terminal holds it; else each run's name on a line of its own and its values
    under it, two spaces apart. A name is never folded: it is what `resume`,
    `report` and `export` take, so it must read whole."""
    table = Table(title=f"Runs in {escape(str(output_dir))}", box=box.SIMPLE_HEAD, pad_edge=False)
    # "eval ppl" heads the column when every run reports a perplexity; beside a pair objective's
    # loss ("dpo loss 0.690") the column is "evaluation" and each cell says what it is.
    all_perplexity = all(objective_named(run.objective).token_loss for run in runs)
    for column in ("run", "model (method)", "status", "steps", "eval ppl" if all_perplexity else "evaluation",
                   "time memory"):
        table.add_column(column, no_wrap=True)
    listing: list[RenderableType] = [Text(f"Runs in {output_dir}")]
    for run in runs:
        model, steps, result, seconds, memory = _run_values(run)
        perplexity = bool(result) and objective_named(run.objective).token_loss
        status = Text(run.status, style=RUN_COLOURS.get(run.status, "white"))
        table.add_row(Text(run.name), Text(model), status, Text(steps),
                      Text(result if all_perplexity or not perplexity else f"ppl {result}"),
                      Text(" ".join(filter(None, (seconds, memory)))))
        # Without headers each value says what it is; a pair objective's result already does.
        result = f"eval ppl {result}" if perplexity else result
        listing += [Text(run.name, style="bold"),
                    Parts([model, status, f"step {steps}", result, seconds and f"trained {seconds}",
                           memory and f"memory {memory}"], indent=2)]
    return WideOrNarrow(table, Group(*listing))


def _run_values(run: Any) -> tuple[str, str, str, str, str]:
    """A run's model (method), steps, best evaluation, training time, and measured
    peak memory with its ratio to the plan's ("1.2G 0.93x"); "" for what it lacks."""
    from pathlib import Path

    steps = f"{run.step}/{'?' if run.total_steps is None else run.total_steps}"
    steps += "" if run.kept_step is None else f" (kept {run.kept_step})"
    change = measures.improvement(run.base_eval_loss, run.best_eval_loss)
    if run.best_eval_loss is None:
        result = ""
    elif not objective_named(run.objective).token_loss:  # perplexity means nothing for DPO's loss
        result = f"{objective_named(run.objective).loss_label} {run.best_eval_loss:.3f}"
    else:
        result = f"{measures.perplexity(run.best_eval_loss):.4g}" + ("" if change is None else f" ({-change:+.0%})")
    memory = "" if not run.peak_bytes else f"{run.peak_bytes / 1024 ** 3:.1f}G"
    memory += "" if not memory or run.memory_ratio is None else f" {run.memory_ratio:.2f}x"
    return (f"{Path(run.model).name} ({run.method})", steps, result,
            "" if run.seconds is None else _duration(run.seconds), memory)


def show_report(report: Any, details: bool = False) -> None:
    """A screen (80x24) for a normal run: a line per verdict, topic and verdict
    with its number, then what to change. `details`: each verdict's reasons
    under it, and the sample replies; a column beside the verdict was 24
    characters wide at 80 columns, and the report 45 lines long."""
    console.print(Text.assemble(("Report: ", "bold"), (report.name, "bold"),
                                f" ({report.status}, {report.steps}/{report.total_steps} steps)"))
    if details:
        for finding in report.findings:
            console.print(Text.assemble((finding.topic, "bold"), "  ", finding.verdict))
            console.print(Padding(Text(finding.detail), (0, 0, 0, 2), expand=False))
        show_samples(report.samples, report.sample_prompts)
    else:
        table = Table(box=None, show_header=False, pad_edge=False)
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        for finding in report.findings:
            table.add_row(Text(finding.topic), Text(finding.verdict + (f" ({finding.short})" if finding.short else "")))
        console.print(table)
    advice = Table.grid(padding=(0, 1))  # "- " before each, its text wrapped under itself
    advice.add_column(no_wrap=True)
    advice.add_column()
    for recommendation in report.recommendations:
        advice.add_row("-", Text(recommendation))
    console.print(Text("Recommendations", style="bold"), advice)
    if not details:
        console.print("Each verdict's reasons and the sample replies: the same command with --details.",
                      style="dim")


@contextmanager
def waiting(what: str) -> Iterator[Callable[[str], None]]:
    """A wait the user can see, on stderr (stdout is for results, such as
    `generate`'s reply): on a terminal a spinner with what is happening and the
    time so far; elsewhere (a pipe, a log) a line as it starts. Either way a line
    with the time it took at the end. Yields `say(text)`: the stage it is at,
    shown by the spinner in place of `what`."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    started = time.monotonic()
    if err_console.is_terminal:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console,
                      transient=True) as progress:
            task = progress.add_task(escape(what))
            yield lambda text: progress.update(task, description=escape(text))
    else:
        err_console.print(f"{escape(what)}...", soft_wrap=True)
        yield lambda text: None  # a line per stage would only clutter a log
    seconds = time.monotonic() - started
    err_console.print(f"{escape(what)}: done in " + (f"{seconds:.1f}s" if seconds < 60 else _duration(seconds)),
                      soft_wrap=True)
