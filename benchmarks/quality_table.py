"""The results of `quality.py`: stored per (dataset, configuration, seed), shown
per (dataset, configuration) as mean and spread over the seeds measured.

The results file holds {dataset: {configuration: {seed: measures}}}, the seed
as a string (JSON keys are strings). Files written before seeds existed hold
{dataset: {configuration: measures}}: each such entry is read as seed 0, which
is what it was (every system at its own fixed seed). Other top-level values
(a "note", a "command") are kept as they are.

Spread: the sample standard deviation over 3 seeds or more, the range (max -
min) over 2, none over 1. A configuration is "ahead of" or "behind" the best
peer recipe on test loss only when the difference of the two means is larger
than the larger of the two spreads; closer than that it is "within spread",
and with one seed on either side nothing is said: one run cannot tell a
configuration from its seed.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

PEER_RECIPES = ("unsloth", "trl")  # the recipes a configuration is judged against


def is_entry(value) -> bool:
    """Whether `value` is one run's measures (not a {seed: measures} map)."""
    return isinstance(value, dict) and "test_loss" in value


def normalize(results: dict) -> dict:
    """`results` with every configuration as {seed: measures}; an old file's entries become seed "0"."""
    out = {}
    for dataset, configs in results.items():
        if not isinstance(configs, dict):
            out[dataset] = configs
            continue
        out[dataset] = {config: {"0": value} if is_entry(value) else value for config, value in configs.items()}
    return out


def runs(results: dict, dataset: str, config: str) -> dict[int, dict]:
    """{seed: measures} of one configuration, in seed order."""
    by_seed = results.get(dataset, {}).get(config) or {}
    if is_entry(by_seed):  # a results dict not normalized
        by_seed = {"0": by_seed}
    return {int(seed): by_seed[seed] for seed in sorted(by_seed, key=int)}


def record(results: dict, dataset: str, config: str, seed: int, measures: dict) -> None:
    results.setdefault(dataset, {}).setdefault(config, {})[str(seed)] = measures


def equal_time_steps(results: dict, dataset: str) -> int:
    """Steps for `equal-time` to take the wall time of the fastest peer recipe on
    `dataset`: what is left of that time after `quality`'s fixed costs (loading,
    the base model's replies, the checks: its wall time less its training time),
    at `quality`'s seconds per step. Each side is its fastest measured run, the
    one least slowed by whatever else the machine ran (seed 0's runs were measured
    beside up to three other benchmarks, later seeds beside one). Once seed 0 of
    `equal-time` has run, every later seed takes its steps."""
    sized = runs(results, dataset, "equal-time").get(0)
    if sized is not None:
        return sized["planned_steps"]
    peers = [m["wall_seconds"] for r in PEER_RECIPES for m in runs(results, dataset, r).values()]
    qualities = list(runs(results, dataset, "quality").values())
    if not peers or not qualities:
        raise SystemExit(f"equal-time is sized from {dataset}'s `quality` and a peer recipe's runs: "
                         f"run {dataset}:quality:0 and {dataset}:unsloth:0 first")
    quality = min(qualities, key=lambda m: m["wall_seconds"])
    per_step = quality["step_seconds"] / max(quality["steps"], 1)
    fixed = quality["wall_seconds"] - quality["step_seconds"]
    return max(1, int((min(peers) - fixed) / per_step))


@dataclass(frozen=True)
class Summary:
    n: int
    mean: float
    spread: float | None  # None with one value
    low: float
    high: float


def summarize(values: list[float]) -> Summary | None:
    if not values:
        return None
    n, low, high = len(values), min(values), max(values)
    spread = None if n == 1 else high - low if n == 2 else statistics.stdev(values)
    return Summary(n, statistics.fmean(values), spread, low, high)


def versus(mine: Summary, peer: Summary) -> str:
    """Where a configuration's test loss stands against a peer's (lower is better)."""
    if mine.spread is None or peer.spread is None:
        return "one seed: not judged"
    margin = max(mine.spread, peer.spread)
    if peer.mean - mine.mean > margin:
        return "ahead"
    if mine.mean - peer.mean > margin:
        return "behind"
    return "within spread"


def task_success(measures: dict) -> float | None:
    """The behaviour score, 0..1; older identity entries call it identity_accuracy. None: the data has none."""
    return measures.get("task_success", measures.get("identity_accuracy"))


def seconds(measures: dict) -> float:
    """The command's wall time where it was measured (loading and checks included), else status.json's."""
    return measures.get("wall_seconds", measures.get("seconds", 0.0))


def measure(results: dict, dataset: str, config: str, of) -> Summary | None:
    """Mean and spread of `of(measures)` over the seeds measured (runs where it is None left out)."""
    values = [of(m) for m in runs(results, dataset, config).values()]
    return summarize([v for v in values if v is not None])


def best_peer(results: dict, dataset: str) -> tuple[str, Summary] | None:
    """The peer recipe with the lowest mean test loss on `dataset`."""
    measured = [(name, measure(results, dataset, name, lambda m: m["test_loss"])) for name in PEER_RECIPES]
    measured = [(name, s) for name, s in measured if s is not None]
    return min(measured, key=lambda pair: pair[1].mean) if measured else None


def shown(summary: Summary | None, digits: int, scale: float = 1.0) -> str:
    """"mean" (n=1), "mean (low-high)" (n=2), "mean ± sd" (n>=3)."""
    if summary is None:
        return ""
    number = lambda value: f"{value * scale:.{digits}f}"  # noqa: E731
    if summary.spread is None:
        return number(summary.mean)
    if summary.n == 2:
        return f"{number(summary.mean)} ({number(summary.low)}-{number(summary.high)})"
    return f"{number(summary.mean)} ± {number(summary.spread)}"


def span(values: list) -> str:
    """One value, or "low-high" where the seeds differ (steps, kept step, load)."""
    values = [v for v in values if v is not None and v != ""]
    if not values:
        return ""
    try:
        low, high = min(values), max(values)
    except TypeError:  # a hand-written "1.5-5.4" among numbers
        return "/".join(dict.fromkeys(map(str, values)))
    return f"{low}" if low == high else f"{low}-{high}"


HEADER = ["| data | configuration | n | steps (kept) | time (min) | load | test loss | vs base | task success (%) "
          "| general | vs best peer (test loss) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
NOTE = ("n: seeds measured. Each value: the mean over the seeds, then ± the sample standard deviation (n >= 3) "
        "or (min-max) (n = 2). vs base: perplexity of the mean test loss against the base model's. "
        "task success: identity, the share of held-out identity questions answered with the taught name; "
        "sentiment, the share of held-out words labelled right; code has none (test loss only). "
        "vs best peer: ahead/behind only where the means differ by more than the larger spread.")


def row(results: dict, dataset: str, config: str, peer: tuple[str, Summary] | None) -> str | None:
    """One configuration's line of the table, or None if it has no runs."""
    measured = list(runs(results, dataset, config).values())
    if not measured:
        return None
    loss = measure(results, dataset, config, lambda m: m["test_loss"])
    base = measure(results, dataset, "base", lambda m: m["test_loss"])
    trained = config != "base"
    change = f"{1 - math.exp(loss.mean) / math.exp(base.mean):.1%} lower" if trained and base else ""
    steps = f"{span([m.get('steps') for m in measured])} ({span([m.get('kept_step') for m in measured])})"
    when = shown(measure(results, dataset, config, lambda m: seconds(m) / 60), 1) if trained else ""
    success = shown(measure(results, dataset, config, task_success), 0, 100)
    general = measure(results, dataset, config, lambda m: m.get("general"))
    asked = span([m.get("general_asked") for m in measured])
    right = f"{shown(general, 1 if general and general.n > 1 else 0)} of {asked}" if general else ""
    judged = ""
    if trained and peer is not None and config != peer[0]:
        judged = f"{versus(loss, peer[1])} ({peer[0]})"
    elif peer is not None and config == peer[0]:
        judged = "best peer"
    return (f"| {dataset} | {config} | {loss.n} | {steps if trained else ''} | {when} "
            f"| {span([m.get('load') for m in measured])} | {shown(loss, 4)} | {change} | {success} | {right} "
            f"| {judged} |")


def table(results: dict, datasets, configs) -> str:
    """Every (dataset, configuration) measured, in the given orders, and what the columns mean."""
    lines = list(HEADER)
    for dataset in datasets:
        peer = best_peer(results, dataset)
        lines += [line for config in configs if (line := row(results, dataset, config, peer)) is not None]
    return "\n".join(lines + ["", NOTE])
