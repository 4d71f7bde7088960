"""What a GPU user gets: the plan `llmcustoms plan` makes for each model family and
preset on 8, 16, 24, 48 and 80 GB NVIDIA cards, from the planner itself.

    python benchmarks/gpu_plans.py                  # print the tables (markdown)
    python benchmarks/gpu_plans.py --check FILE     # exit 1 with a diff if FILE's copy is stale
    python benchmarks/gpu_plans.py --write FILE     # replace FILE's copy
    python benchmarks/gpu_plans.py --preset quality --write docs/benchmarks.md   # one preset (the docs' table)

FILE's copy lies between `<!-- gpu-plans:start -->` and `<!-- gpu-plans:end -->`;
without both markers --check and --write exit 2 and change nothing.
Planning is pure (no torch, no download: the presets hold each model's
architecture), so this runs in seconds on any machine, and a planner change
that moves a plan makes `--check` fail instead of leaving the table wrong.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from llmcustoms.planning.duration import GPU_MFU, GPU_SECONDS_PER_LAYER_PASS, QLORA_SLOWDOWN, human_duration  # noqa: E402
from llmcustoms.errors import ConfigError  # noqa: E402
from llmcustoms.planning.hardware import GIB, Gpu, Hardware  # noqa: E402
from llmcustoms.models.loading import choice_from_spec  # noqa: E402
from llmcustoms.planning.plan import DataStats, ModelChoice, Plan  # noqa: E402
from llmcustoms.planning.planner import Planner  # noqa: E402
from llmcustoms.planning.presets import Family, TrainingPreset, find_model_spec, load_families, load_preset  # noqa: E402
from llmcustoms.data.splits import eval_fraction, split_eval  # noqa: E402

MIB = 1024 ** 2
START, END = "<!-- gpu-plans:start -->", "<!-- gpu-plans:end -->"
PRESETS = ("quality", "highspeed", "bestaccuracy")


@dataclass(frozen=True)
class Card:
    size: str  # what the card is sold as
    name: str  # as NVML reports it: `peak_tflops` (the time estimate) matches on it
    total_mib: int  # NVML's total
    reserved_mib: int  # what NVML already counts as used before training starts
    capability: tuple[int, int]
    cores: int
    ram_gib: int


# Cards the duration table (`hardware.PEAK_TFLOPS`) knows, so each time is the card's
# own estimate rather than the unknown-card default. A GeForce card usually drives the
# desktop too (display server, compositor: about 0.75 GiB); a headless card loses about
# 0.5 GiB to what the driver reserves. Both are what `detect()` would read as free.
CARDS = (
    Card("8 GB", "NVIDIA GeForce RTX 3070", 8192, 768, (8, 6), 8, 32),
    Card("16 GB", "NVIDIA GeForce RTX 4080", 16376, 768, (8, 9), 8, 32),
    Card("24 GB", "NVIDIA GeForce RTX 4090", 24564, 768, (8, 9), 16, 64),
    Card("48 GB", "NVIDIA RTX A6000", 49140, 512, (8, 6), 16, 64),
    Card("80 GB", "NVIDIA H100 80GB HBM3", 81559, 512, (9, 0), 16, 64),
)

# The data: 1,000 rows of a typical chat SFT set. Token lengths are log-normal with
# median 250 and p90 600 (so p99 is about 1,200: some rows get truncated), and the
# prompt is 40% of each row, the response the rest.
ROWS, MEDIAN_TOKENS, P90_TOKENS, PROMPT_SHARE = 1000, 250, 600, 0.4
SEED = 42  # the split's default seed: the same rows are held out as `plan` would hold out


def hardware(card: Card) -> Hardware:
    """One such card in a typical host, as `detect()` reads it on a current torch (>= 2.11:
    its own varlen attention, so the planner packs rows)."""
    gpu = Gpu(card.name, card.total_mib * MIB, (card.total_mib - card.reserved_mib) * MIB, card.capability)
    return Hardware(gpus=(gpu,), cpu_cores=card.cores, ram_bytes=card.ram_gib * GIB,
                    ram_free_bytes=int(card.ram_gib * GIB * 0.8), varlen_attention="torch")


def row_lengths() -> list[int]:
    """Deterministic quantiles of the log-normal, not random draws: the table must not move."""
    sigma = math.log(P90_TOKENS / MEDIAN_TOKENS) / statistics.NormalDist().inv_cdf(0.9)
    normal = statistics.NormalDist(math.log(MEDIAN_TOKENS), sigma)
    lengths = [round(math.exp(normal.inv_cdf((i + 0.5) / ROWS))) for i in range(ROWS)]
    # Interleave short and long rows, as a real file has them (the split then takes a fair sample).
    return [lengths[(i * 7919) % ROWS] for i in range(ROWS)]


def data_stats(preset: TrainingPreset) -> DataStats:
    """The planner's view of the data: the training rows after the preset's evaluation split."""
    fraction, _ = eval_fraction(preset, ROWS, {})
    train, evaluation = split_eval(ROWS, fraction, SEED)
    lengths = row_lengths()
    kept = tuple(lengths[i] for i in train)
    return DataStats(lengths=kept, first_loss_positions=tuple(int(n * PROMPT_SHARE) for n in kept),
                     eval_rows=len(evaluation), format="messages")


def candidates(preset: TrainingPreset, family: Family, families: dict[str, Family]) -> list[ModelChoice]:
    """The family's models, best first, as the preset would rank them: the ones the preset
    lists, in its order (quality stops at Qwen 3B on purpose), then the rest, largest first."""
    listed = [hub_id for hub_id in preset.models if any(s.hub_id == hub_id for s in family.models)]
    others = sorted((s for s in family.models if s.hub_id not in listed),
                    key=lambda s: (-s.params, -family.models.index(s)))  # equal sizes: the newer (later) first
    specs = [find_model_spec(hub_id, families) for hub_id in listed] + others
    return [choice_from_spec(spec, families, "planner") for spec in specs]


@dataclass(frozen=True)
class Row:
    card: Card
    family: str
    preset: str
    plan: Plan | None  # None: nothing fits, `refusal` says why
    epoch_seconds: float = 0.0
    refusal: str = ""


def plan_row(card: Card, family: Family, preset: TrainingPreset, families: dict[str, Family]) -> Row:
    """What `llmcustoms plan --preset P` makes on this card when the model is this family's."""
    catalog = tuple(spec for f in families.values() for spec in f.models)
    optimizer = Planner(hardware(card), preset, catalog=catalog)
    stats = data_stats(preset)
    try:
        model, _ = optimizer.choose_model(candidates(preset, family, families), stats, {})
        plan = optimizer.plan(model, stats, {}, preset_source=f"preset {preset.name}")
        # One epoch's time from the planner's own estimate: the same plan with --epochs 1
        # (the epochs change neither the method nor the batch, only how many passes).
        epoch = optimizer.plan(model, stats, {"epochs": (1, "flag")}).estimated_seconds
    except ConfigError as error:
        return Row(card, family.name, preset.name, None, refusal=error.message)
    return Row(card, family.name, preset.name, plan, epoch or 0.0)


@functools.cache  # pure: the same rows every call (the tests call `main` several times)
def plan_rows() -> tuple[Row, ...]:
    families = load_families()
    presets = [load_preset(name) for name in PRESETS]
    return tuple(plan_row(card, family, preset, families)
                 for preset in presets for card in CARDS for family in families.values())


# ------------------------------------------------------------- rendering

HEADER = ("| Card | Family | Model | Method | Micro-batch × accum | Optimizer | Packing | Memory (GiB) | 1 epoch |\n"
          "|---|---|---|---|---|---|---|---|---|")


def render_row(row: Row) -> str:
    if row.plan is None:
        return f"| {row.card.size} | {row.family} | — | does not fit: {row.refusal} | — | — | — | — | — |"
    plan = row.plan
    batch = f"{plan.micro_batch_size} × {plan.grad_accum}" + (", ckpt" if plan.gradient_checkpointing else "")
    memory = f"{plan.memory['total_bytes'] / GIB:.1f} of {plan.memory['budget_bytes'] / GIB:.1f}"
    epoch = human_duration(row.epoch_seconds).removeprefix("about ")
    return (f"| {row.card.size} | {row.family} | {plan.model.split('/')[-1]} | {plan.method} | {batch} "
            f"| {plan.optimizer} | {'yes' if plan.packing else 'no'} | {memory} | {epoch} |")


def preset_heading(name: str, rows: list[Row]) -> str:
    """The values every row of a preset shares, said once above its table."""
    plans = [row.plan for row in rows if row.plan]
    shared = [("max_seq_len", lambda p: p.max_seq_len), ("effective batch", lambda p: p.effective_batch_size),
              ("epochs", lambda p: f"{p.epochs:g}"), ("training rows kept", lambda p: p.train_rows),
              ("evaluation rows", lambda p: p.eval_rows)]
    # A value that differs between rows (a model's shorter context) shows all its values.
    said = [f"{label} {'/'.join(map(str, sorted({value(p) for p in plans})))}" for label, value in shared]
    return f"#### Preset `{name}`: " + ", ".join(said)


def intro() -> str:
    cards = ", ".join(f"{card.size} = {card.name.removeprefix('NVIDIA ')} "
                      f"({(card.total_mib - card.reserved_mib) / 1024:.1f} GiB free)" for card in CARDS)
    return "\n".join([
        f"- Data: {ROWS:,} rows of chat SFT (token lengths log-normal, median {MEDIAN_TOKENS}, p90 {P90_TOKENS}; "
        f"the prompt {PROMPT_SHARE:.0%} of a row), split and planned as `llmcustoms plan` would.",
        f"- Cards: {cards}; one card, a typical host, torch >= 2.11 (its varlen attention: rows are packed).",
        "- Model: the preset's first model of the family that fits (the family's models the preset lists, "
        "in its order, then the family's others, largest first).",
        "- Memory (GiB): the planner's estimated peak, of the card's free memory (it plans within 90% of it). "
        "ckpt: gradient checkpointing.",
        "- 1 epoch: the planner's rough estimate of one pass with its evaluations, before any speed is measured "
        f"here: the model's FLOPs per token at {GPU_MFU:.0%} of the card's nominal bf16 tensor-core peak "
        f"({QLORA_SLOWDOWN:g}x for QLoRA), or {GPU_SECONDS_PER_LAYER_PASS * 1000:g} ms per layer per micro-batch "
        "when that is longer (a small model's step is bound by kernel launches: measured on an H200); with "
        "what the command does besides (loading, the sample replies and general questions, saving), as "
        "the plan's estimated duration counts it.",
    ])


def render(rows: tuple[Row, ...], presets: tuple[str, ...] = PRESETS) -> str:
    parts = [intro()]
    for name in presets:
        ours = [row for row in rows if row.preset == name]
        parts += [preset_heading(name, ours), "\n".join([HEADER] + [render_row(row) for row in ours])]
    return "\n\n".join(parts) + "\n"


# ------------------------------------------------------- the copy in a file


class NoBlock(Exception):
    """The file has no start and end marker to put the tables between."""


def block(text: str) -> tuple[int, int]:
    """Where the generated copy lies in `text`: the offsets just inside the markers."""
    start = text.find(START)
    end = text.find(END, start + len(START)) if start >= 0 else -1
    if end < 0:
        raise NoBlock(f"no block between {START} and {END}")
    return start + len(START), end


def with_block(text: str, generated: str) -> str:
    start, end = block(text)
    return text[:start] + "\n" + generated + text[end:]


def check(path: Path, generated: str) -> int:
    """0 when `path`'s copy is what the planner makes now, else 1 with the diff."""
    text = path.read_text(encoding="utf-8")
    start, end = block(text)
    current, wanted = text[start:end], "\n" + generated
    if current == wanted:
        return 0
    sys.stdout.writelines(difflib.unified_diff(current.splitlines(keepends=True), wanted.splitlines(keepends=True),
                                               f"{path} (as written)", f"{path} (as planned now)"))
    print(f"\n{path}: the GPU plans are stale; rerun `python benchmarks/gpu_plans.py --write {path}`.",
          file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print, check or write the table of plans for 8-80 GB GPUs.")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", type=Path, metavar="FILE", help="exit 1 with a diff if FILE's copy is stale")
    group.add_argument("--write", type=Path, metavar="FILE", help="replace FILE's copy between the markers")
    parser.add_argument("--preset", action="append", choices=PRESETS,
                        help="only this preset's table (repeatable; default: all three)")
    args = parser.parse_args(argv)
    generated = render(plan_rows(), tuple(args.preset or PRESETS))
    path = args.check or args.write
    try:
        if args.check:
            return check(path, generated)
        if args.write:
            path.write_text(with_block(path.read_text(encoding="utf-8"), generated), encoding="utf-8")
            return 0
    except NoBlock as problem:
        print(f"{path}: {problem}; add both markers where the tables belong.", file=sys.stderr)
        return 2
    sys.stdout.write(generated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
