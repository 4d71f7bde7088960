"""Analytics over a finished (or stopped) run: `llmcustoms report RUN [--plot]`.

Reads only the run directory (plan.json, metrics.jsonl, status.json,
samples.jsonl) and answers the questions a user has after training: how much
better than the base model is it, and which weights were kept; is the loss
still falling, is the model overfitting, was the learning rate right, how
fast was it, what went wrong along the way, and what to change next time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from llmcustoms import measures
from llmcustoms.errors import ConfigError
from llmcustoms.rundir import RunDirectory
from llmcustoms.samples import side_by_side

# A loss that falls more than this share over the last quarter is "still falling".
STILL_FALLING = 0.03
# Eval loss this much above its best, after the best, is overfitting.
OVERFIT_RISE = 0.02


@dataclass
class Finding:
    topic: str
    verdict: str
    detail: str


@dataclass
class RunReport:
    name: str
    status: str
    steps: int
    total_steps: int
    findings: list[Finding] = field(default_factory=list)
    recommendations: list[str] = field(default_factory=list)
    samples: list[dict[str, str]] = field(default_factory=list)  # samples.side_by_side entries


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def analyse(run: RunDirectory) -> RunReport:
    plan = run.read_plan()
    status = run.read_status()
    rows = run.read_metrics()
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r and r["step"] > 0]  # step 0: the base model
    report = RunReport(name=run.path.name, status=status.get("status", "unknown"), steps=len(train),
                       total_steps=plan.total_steps, samples=side_by_side(run.read_samples()))
    _quality(report, status)
    if len(train) < 4:
        report.findings.append(Finding("convergence", "too short", f"only {len(train)} steps were logged"))
        report.recommendations.append("train for more steps before judging the run")
        return report
    losses = [r["loss"] for r in train]
    stopped_early = status.get("stop_cause") == "early stopping"
    _convergence(report, plan, losses, stopped_early)
    _overfitting(report, plan, losses, evals, stopped_early)
    _learning_rate(report, plan, train, losses)
    speed = median(r["tokens_per_s"] for r in train)
    report.findings.append(Finding("throughput", f"{speed:,.0f} tokens/s",
                                   f"median over {len(train)} steps, micro-batch {plan.micro_batch_size} x "
                                   f"{plan.grad_accum}, {plan.max_seq_len} tokens, {plan.method}"))
    recoveries = status.get("recoveries", [])
    if recoveries:
        listed = "; ".join(f"step {r['step']}: {r['kind']} -> {r['action']}" for r in recoveries)
        report.findings.append(Finding("recoveries", f"{len(recoveries)}", listed))
        if any(r["kind"] == "oom" for r in recoveries):
            report.recommendations.append(f"memory ran out during training: start with --batch-size "
                                          f"{plan.micro_batch_size} next time, so no step is lost to recovery")
        if any(r["kind"] == "nan" for r in recoveries):
            report.recommendations.append(f"the loss diverged: start with --lr {plan.lr:.1e} or lower")
    else:
        report.findings.append(Finding("recoveries", "none", "no out-of-memory or NaN event"))
    if status.get("status") in ("failed", "interrupted"):
        report.recommendations.insert(0, f"the run is {status['status']}: continue it with `llmcustoms resume {run.path}`")
    if not report.recommendations:
        report.recommendations.append("nothing to change: the run converged cleanly")
    return report


def _quality(report: RunReport, status: dict[str, Any]) -> None:
    """How much better than the base model, and which weights the run kept."""
    best, base = status.get("best_eval_loss"), status.get("base_eval_loss")
    if best is None:
        return
    change = measures.improvement(base, best)
    verdict = "unknown" if change is None else "better" if change > 0 else "not better"
    report.findings.append(Finding("quality", verdict, f"{measures.describe(base, best)}; best eval loss "
                                                       f"{best:.4f} at step {status.get('best_eval_step')}"))
    if status.get("kept"):
        report.findings.append(Finding("weights kept", f"step {status.get('kept_step')}", status["kept"]))
    if change is not None and change <= 0:
        report.recommendations.append("training did not lower perplexity below the base model's: check that the "
                                      "data teaches something the model cannot already do, or try --lr lower")


def _convergence(report: RunReport, plan: Any, losses: list[float], stopped_early: bool = False) -> None:
    quarter = max(2, len(losses) // 4)
    early, late = _mean(losses[-2 * quarter:-quarter]), _mean(losses[-quarter:])
    change = (early - late) / max(abs(early), 1e-9)
    overall = (losses[0] - late) / max(abs(losses[0]), 1e-9)
    if change > STILL_FALLING:
        report.findings.append(Finding("convergence", "still falling",
                                       f"train loss fell {change:.0%} over the last quarter ({early:.3f} -> {late:.3f})"))
        if stopped_early:  # eval loss rose while train loss fell: more of the same would overfit
            return
        report.recommendations.append(f"the loss was still falling at the end: try --epochs {plan.epochs * 2:g} "
                                      f"(or --max-steps {plan.total_steps * 2})")
    elif change < -STILL_FALLING:
        report.findings.append(Finding("convergence", "rising at the end",
                                       f"train loss rose {-change:.0%} over the last quarter ({early:.3f} -> {late:.3f})"))
        report.recommendations.append(f"the loss rose at the end: try a lower learning rate (--lr {plan.lr / 3:.1e})")
    else:
        report.findings.append(Finding("convergence", "converged",
                                       f"train loss flat over the last quarter ({late:.3f}); {overall:.0%} below the start"))


def _overfitting(report: RunReport, plan: Any, losses: list[float], evals: list[dict[str, Any]],
                 stopped_early: bool = False) -> None:
    if not evals:
        report.findings.append(Finding("overfitting", "unknown", "no evaluation rows (use --eval-split to measure it)"))
        return
    best = min(evals, key=lambda r: r["eval_loss"])
    last = evals[-1]
    gap = last["eval_loss"] - losses[-1]
    if last["step"] > best["step"] and last["eval_loss"] > best["eval_loss"] * (1 + OVERFIT_RISE):
        report.findings.append(Finding("overfitting", "yes",
                                       f"eval loss rose from {best['eval_loss']:.3f} at step {best['step']} to "
                                       f"{last['eval_loss']:.3f} at step {last['step']}; train/eval gap {gap:+.3f}"))
        epochs_at_best = plan.epochs * best["step"] / max(1, plan.total_steps)
        if stopped_early:
            report.recommendations.append(f"eval loss rose after step {best['step']} and early stopping ended the "
                                          f"run; the step-{best['step']} weights were kept. Next time --epochs "
                                          f"{max(1, round(epochs_at_best)):g} gets there sooner")
        else:
            report.recommendations.append(f"eval loss rose after step {best['step']}: try --epochs "
                                          f"{max(1, round(epochs_at_best)):g} or --early-stopping-patience 3")
    else:
        report.findings.append(Finding("overfitting", "no",
                                       f"eval loss {last['eval_loss']:.3f} at step {last['step']} (best "
                                       f"{best['eval_loss']:.3f} at step {best['step']}); train/eval gap {gap:+.3f}"))


def _learning_rate(report: RunReport, plan: Any, train: list[dict[str, Any]], losses: list[float]) -> None:
    tenth = max(2, len(losses) // 10)
    start, early = losses[0], _mean(losses[:tenth])
    spikes = sum(1 for a, b in zip(losses, losses[1:]) if b > 1.5 * a)
    clipped = sum(1 for r in train if plan.max_grad_norm and r["grad_norm"] > plan.max_grad_norm)
    total_drop = (start - _mean(losses[-tenth:])) / max(abs(start), 1e-9)
    if spikes or early > start * 1.1:
        verdict, detail = "too high", f"{spikes} loss spikes; the loss rose in the first {tenth} steps"
        report.recommendations.append(f"the learning rate looks too high: try --lr {plan.lr / 3:.1e}")
    elif total_drop < 0.02:
        verdict, detail = "too low", f"the loss fell only {total_drop:.1%} over the whole run"
        report.recommendations.append(f"the loss hardly moved: try --lr {plan.lr * 3:.1e} or more steps")
    else:
        verdict, detail = "effective", f"the loss fell {total_drop:.0%} with no spikes"
    if clipped > len(train) // 2:
        detail += f"; gradients were clipped on {clipped} of {len(train)} steps"
    report.findings.append(Finding("learning rate", verdict, f"peak {plan.lr:.1e} ({plan.lr_scheduler}); {detail}"))


def plot(run: RunDirectory) -> Path:
    """loss.png in the run directory: train and eval loss, and the learning rate."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib, which is not installed.",
                          'Install it with: pip install "llmcustoms[plot]"') from None
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    rows = run.read_metrics()
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    if not train:
        raise ConfigError(f"{run.path} has no training steps to plot yet.")
    figure, (loss_axis, lr_axis) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=[3, 1])
    loss_axis.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", linewidth=1)
    if evals:
        loss_axis.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    loss_axis.set_ylabel("loss")
    loss_axis.set_title(run.path.name)
    loss_axis.legend()
    loss_axis.grid(alpha=0.3)
    lr_axis.plot([r["step"] for r in train], [r["lr"] for r in train], color="tab:green")
    lr_axis.set_ylabel("learning rate")
    lr_axis.set_xlabel("optimizer step")
    lr_axis.grid(alpha=0.3)
    figure.tight_layout()
    path = run.path / "loss.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
