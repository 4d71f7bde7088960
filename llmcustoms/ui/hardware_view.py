"""The `hardware` command's screen: the machine in a few lines, then what
fits it, a row per model family (`fitting.by_family`): its sizes, and per
method the largest of its models that fits with its largest micro-batch, or
what the smallest needs. All of it within 80x24. Computes nothing:
`planning/fitting.py` works it out."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from llmcustoms.planning.fitting import by_family, family_availability
from llmcustoms.ui.console import PRECISION_LABELS, console, escape, gib
from llmcustoms.ui.layout import Parts


def show_hardware(hardware: Any, fits: Any, where: dict[str, str]) -> None:
    """The machine, and `fitting.FitTable`: which models and methods fit it, and
    `where` each model would load from (`hub_access.availability`)."""
    console.print(machine_table(hardware))
    console.print(fits_table(fits, where))
    if "offline: no" in where.values():
        console.print("The Hugging Face Hub cannot be reached: only cached models (or --model PATH to a local "
                      "model directory) can be trained.")
    if hardware.torch_note:  # GPUs found that the installed torch cannot use: the table is the CPU's
        console.print(f"[yellow]warning:[/] {escape(hardware.torch_note)}")
    if not hardware.has_gpu:
        console.print("No GPU: training runs on the CPU, which fits in memory but takes hours for real models. "
                      "`llmcustoms plan DATA --vram 24` shows what a 24 GB GPU would run.")
    elif len(hardware.gpus) > 1:
        n = len(hardware.gpus)
        # Two lines at 80 columns: with the table, `hardware` stays within a screen.
        console.print(f"{n} GPUs: the table is for one of them. Train on all with `--num-processes {n}`; a "
                      f"model one card cannot hold trains sharded with `--distributed fsdp`.")


def machine_table(hardware: Any) -> Table:
    """The machine in a few lines, without rules or a title: `hardware` fits an 80x24 screen."""
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    for first, same in _alike_gpus(hardware.gpus):
        gpu = same[0]
        least, most = min(g.free_bytes for g in same), max(g.free_bytes for g in same)
        free = gib(least) if least == most else f"{gib(least)} to {gib(most)}"
        size = ([f"{gpu.name}: {gib(gpu.total_bytes)} ({free} free)"] if len(same) == 1 else
                [f"{len(same)} x {gpu.name}", f"{gib(gpu.total_bytes)} each", f"{free} free"])
        label = f"GPU {first}" if len(same) == 1 else f"GPUs {first}-{first + len(same) - 1}"
        table.add_row(label, Parts([*size, "compute capability {}.{}".format(*gpu.compute_capability),
                                    f"bf16 {'yes' if gpu.supports_bf16 else 'no'}"], sep=", "))
    if not hardware.gpus:
        table.add_row("GPU", "none" + (f" ({escape(hardware.driver_note)})" if hardware.driver_note else ""))
    bf16 = f", native bf16 ({hardware.cpu_bf16})" if hardware.cpu_bf16 else ""
    table.add_row("CPU cores", f"{hardware.cpu_cores}{bf16}")
    table.add_row("RAM", f"{gib(hardware.ram_bytes)} ({gib(hardware.ram_free_bytes)} available)")
    table.add_row("precision", PRECISION_LABELS.get(hardware.mixed_precision, hardware.mixed_precision))
    return table


def _alike_gpus(gpus: Any) -> list[tuple[int, list[Any]]]:
    """Runs of the same card (name, size, compute capability), with the index of the first:
    a machine of eight alike GPUs is one row, and `hardware` stays within a screen."""
    runs: list[tuple[int, list[Any]]] = []
    for i, gpu in enumerate(gpus):
        key = (gpu.name, gpu.total_bytes, gpu.compute_capability)
        if runs and (runs[-1][1][0].name, runs[-1][1][0].total_bytes, runs[-1][1][0].compute_capability) == key:
            runs[-1][1].append(gpu)
        else:
            runs.append((i, [gpu]))
    return runs


# Two lines at 80 columns, under the table.
FIT_LEGEND = ("Each cell: the family's largest model that fits, yes N (micro-batch up to N) or ckpt (with gradient "
              "checkpointing); or no NG (needs N GiB). `llmcustoms presets` lists every model.")


def fits_table(fits: Any, where: dict[str, str] | None = None) -> Group:
    """`fitting.FitTable` as a table, a row per family (`fitting.by_family`):
    its sizes, and per method the largest model that fits with its largest
    micro-batch, or what the smallest needs. No rules, and the title and
    legend are lines of their own (a table's would wrap at its width):
    `hardware` fits 80x24."""
    table = Table(box=None, pad_edge=False)
    for column in ("family", "sizes", *fits.methods, *(("here",) if where else ())):
        table.add_column(column, no_wrap=True)
    for family in by_family(fits):
        here = (escape(family_availability(family.hub_ids, where)),) if where else ()
        smallest, largest = _size(family.smallest_params), _size(family.largest_params)
        sizes = largest if smallest == largest else f"{smallest[:-1]}-{largest}"
        table.add_row(escape(family.family), sizes,
                      *(_fit_cell(*family.methods[m]) for m in fits.methods), *here)
    title = (f"What fits in {gib(fits.budget_bytes)} of {'GPU memory' if fits.on_gpu else 'RAM'} "
             f"({fits.seq_len}-token sequences)")
    return Group(Text(title, style="bold"), table, Text(FIT_LEGEND, style="dim"))


def _size(params: int) -> str:
    return f"{params / 1e9:.1f}B"


def _fit_cell(params: int, fit: Any) -> str:
    if fit.micro_batch:
        return f"{_size(params)} [green]yes[/] {fit.micro_batch}"
    if fit.needs_checkpointing:
        return f"{_size(params)} [yellow]ckpt[/]"  # fits with gradient checkpointing (the footnote says so)
    return f"[red]no[/] {fit.need_bytes / 1024 ** 3:.0f}G"
