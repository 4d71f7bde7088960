"""Analytics over a finished (or stopped) run: `llmcustoms report RUN [--plot]`.

Reads only the run directory (plan.json, metrics.jsonl, status.json,
samples.jsonl) and answers the questions a user has after training: how much
better than the base model is it, and which weights were kept; does it stop
(the stop rate of the sample replies, `runs/stop_rates.py`); has it
forgotten what it knew outside the data (`runs/forgetting.py`); is the loss
still falling, is the model overfitting, was the learning rate right, how
fast was it, what went wrong along the way, and what to change next time.

metrics.jsonl holds a row per optimizer step ("loss") and a row per
evaluation ("eval_loss"); the one at step 0 is the base model's, measured
before training. A run that held out rows evaluates every `eval_every` steps
and at its last step, so a run stopped early may have the base model's alone.
A verdict read from fewer steps than it needs is withheld, and the report
says so once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from llmcustoms.errors import ConfigError
from llmcustoms.runs import measures
from llmcustoms.runs.forgetting import forgetting_findings
from llmcustoms.runs.memory_use import memory_line
from llmcustoms.runs.preference_report import preference_findings
from llmcustoms.runs.read_only import check_writable
from llmcustoms.runs.run_directory import RunDirectory
from llmcustoms.runs.speeds import run_tokens_per_s
from llmcustoms.runs.stop_rates import stop_findings
from llmcustoms.training.samples import side_by_side

# A loss that falls more than this share over the last quarter is "still falling".
STILL_FALLING = 0.03
# Eval loss this much above its best, after the best, is overfitting.
OVERFIT_RISE = 0.02
# The fewest logged optimizer steps each verdict is drawn from. Per-step losses
# are single batches, as noisy as any trend a short run shows; a short run also
# spends a large share of its steps in warmup.
# Convergence compares the mean train loss of the last quarter with the quarter
# before it: at 5 steps a quarter the means begin to outweigh one batch's noise.
MIN_STEPS_CONVERGENCE = 20
# Learning rate reads spikes, the first steps against the first one and the
# whole run's fall; on 5 to 8 steps it said "too high" of warmup and batch noise.
MIN_STEPS_LEARNING_RATE = 20
# Eval loss rising after its best is overfitting once the model has had time to
# learn its training rows; over a handful of steps a rise is the step size
# shaking the weights, which the learning-rate verdict is for.
MIN_STEPS_OVERFITTING = 20
# Overfitting also needs a best evaluation and at least one after it, and one
# more so that a single evaluation that came out high is not a trend.
MIN_EVALUATIONS_OVERFITTING = 3
# The measured peak memory within this range of the plan's prediction: the
# estimate is right for this machine (the target the estimate is calibrated to).
MEMORY_RATIO_RANGE = (0.8, 1.25)
# A GPU busy less than this share of the time waits on something else.
LOW_GPU_UTILISATION = 50.0
GIB = 1024 ** 3


@dataclass
class Finding:
    topic: str
    verdict: str
    detail: str
    # The number that backs the verdict, short enough for `report`'s one line per
    # finding ("-90%"); the detail (`report --details`) has the rest.
    short: str = ""


@dataclass
class RunReport:
    name: str
    status: str
    steps: int
    total_steps: int
    findings: list[Finding] = field(default_factory=list)
    recommendations: list[str] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)  # samples.side_by_side entries
    sample_prompts: str = "held-out prompts"  # where the samples' prompts came from, for their title
    # What each recommendation changes ("lower lr"): two verdicts that ask for the
    # same change (the loss rose at the end, the rate looks too high) say it once.
    recommended: set[str] = field(default_factory=set, repr=False)

    def recommend(self, change: str, text: str, first: bool = False) -> None:
        if change in self.recommended or text in self.recommendations:
            return
        self.recommended.add(change)
        self.recommendations.insert(0 if first else len(self.recommendations), text)


@dataclass(frozen=True)
class _Evaluations:
    """The run's evaluation rows, as metrics.jsonl holds them."""

    base: float | None  # the base model's eval loss (step 0), when it was measured
    after: list[dict[str, Any]]  # every evaluation after training began, in step order

    @classmethod
    def of(cls, rows: list[dict[str, Any]]) -> "_Evaluations":
        evals = [r for r in rows if "eval_loss" in r]
        base = next((r["eval_loss"] for r in evals if r["step"] == 0), None)
        return cls(base, sorted((r for r in evals if r["step"] > 0), key=lambda r: r["step"]))

    @property
    def best(self) -> dict[str, Any] | None:
        finite = [r for r in self.after if math.isfinite(r["eval_loss"])]  # NaN is never the best
        return min(finite, key=lambda r: r["eval_loss"]) if finite else None


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def analyse(run: RunDirectory) -> RunReport:
    plan = run.read_plan()
    try:
        status = run.read_status()
    except ConfigError:  # not JSON: the report is drawn from the rest, and says so
        status, run.skipped["status.json"] = {}, -1
    rows = run.read_metrics()
    train = [r for r in rows if "loss" in r]
    evals = _Evaluations.of(rows)
    report = RunReport(name=run.path.name, status=status.get("status", "unknown"), steps=len(train),
                       total_steps=plan.total_steps, samples=side_by_side(run.read_samples()),
                       sample_prompts="prompts of rows it trained on" if plan.evaluates_training_rows else "held-out prompts")
    if plan.objective_kind.pairs:  # perplexity means nothing for a pair loss: its rewards tell
        findings, advice = preference_findings(plan, rows, status.get("best_eval_step"))
        report.findings += [Finding(*finding) for finding in findings]
        for change, text in advice:
            report.recommend(change, text)
    else:
        _quality(report, plan, status, evals)
    forgetting = forgetting_findings(status.get("general_knowledge"), plan, status.get("forgetting"))
    stopping = stop_findings(report.samples, status, plan.data_report, plan.epochs, forgot=bool(forgetting[1]))
    for findings, advice in (stopping, forgetting):
        report.findings += [Finding(*finding) for finding in findings]
        for change, text in advice:
            report.recommend(change, text)
    losses = [r["loss"] for r in train]
    stopped_early = status.get("stop_cause") == "early stopping"
    evaluates = bool(evals.after) or bool(plan.eval_rows and plan.eval_every)
    needs = {"convergence": MIN_STEPS_CONVERGENCE, "overfitting": MIN_STEPS_OVERFITTING,
             "learning rate": MIN_STEPS_LEARNING_RATE}
    # Without evaluations overfitting is unknown, however many steps; early
    # stopping is the run's own verdict on it, from its evaluations.
    withheld = {topic: n for topic, n in needs.items() if len(train) < n
                and not (topic == "overfitting" and (not evaluates or stopped_early))}
    if "convergence" not in withheld:
        _convergence(report, plan, losses, stopped_early)
    if "overfitting" not in withheld:
        _overfitting(report, plan, losses, evals, stopped_early)
    if "learning rate" not in withheld:
        _learning_rate(report, plan, train, losses)
    _withheld(report, len(train), withheld)
    _throughput(report, plan, train)
    _resources(report, plan, status)
    _recoveries(report, plan, status)
    _damaged(report, run.skipped)
    if status.get("status") in ("failed", "interrupted"):
        report.recommend("resume", f"the run is {status['status']}: continue it with `llmcustoms resume {run.path}`",
                         first=True)
    if not report.recommendations:
        report.recommend("none", f"nothing to change that {len(train)} steps can show" if withheld
                         else "nothing to change: the run converged cleanly")
    return report


def _quality(report: RunReport, plan: Any, status: dict[str, Any], evals: _Evaluations) -> None:
    """How much better than the base model, and which weights the run kept.

    status.json has the best evaluation once the run ends; a run stopped before
    then has its evaluations in metrics.jsonl only."""
    best, step = status.get("best_eval_loss"), status.get("best_eval_step")
    if best is None and evals.best is not None:
        best, step = evals.best["eval_loss"], evals.best["step"]
    base = status.get("base_eval_loss")
    base = evals.base if base is None else base
    held_out = _evaluation_rows(plan)
    if best is None:
        if base is not None:  # stopped before its first evaluation after training began
            report.findings.append(Finding("quality", "not measured yet",
                                           f"base model eval loss {base:.4f} on {held_out}; no evaluation after "
                                           f"training began (every {plan.eval_every} steps and at the end)"))
        return
    change = measures.improvement(base, best)
    verdict = "unknown" if change is None else "better" if change > 0 else "not better"
    report.findings.append(Finding("quality", verdict, f"{measures.describe(base, best)}; best eval loss "
                                                       f"{best:.4f} at step {step} on {held_out}",
                                   ("" if change is None else f"perplexity {-change:+.0%}")
                                   + ("; on training rows, not held out" if plan.evaluates_training_rows else "")))
    if status.get("kept"):
        report.findings.append(Finding("weights kept", f"step {status.get('kept_step')}", status["kept"]))
    if change is not None and change <= 0:
        report.recommend("quality", "training did not lower perplexity below the base model's: check that the "
                                    "data teaches something the model cannot already do, or try --lr lower")


def _evaluation_rows(plan: Any) -> str:
    """The rows the evaluations measured, in words: held out, or (`--eval-data` naming
    the training file) training rows, which no verdict may pass off as held out."""
    if plan.evaluates_training_rows:
        return (f"{plan.eval_rows} evaluation rows, {plan.eval_overlap_rows} of them training rows too, so not a "
                "held-out measure")
    return f"{plan.eval_rows} held-out rows" if plan.eval_rows else "the held-out rows"


def _withheld(report: RunReport, steps: int, withheld: dict[str, int]) -> None:
    """The verdicts too few steps cannot support, said once."""
    if not withheld:
        return
    topics = list(withheld)
    named = topics[0] if len(topics) == 1 else ", ".join(topics[:-1]) + f" and {topics[-1]}"
    if len(set(withheld.values())) == 1:
        need = f"{'it needs' if len(topics) == 1 else 'each needs'} at least {withheld[topics[0]]} steps"
    else:
        need = "they need at least " + ", ".join(f"{n} steps ({topic})" for topic, n in withheld.items())
    report.findings.append(Finding("verdicts", "withheld", f"too few steps ({steps}) to judge {named}; {need}",
                                   f"{named}: {steps} steps are too few"))  # which, on the compact screen too


def _convergence(report: RunReport, plan: Any, losses: list[float], stopped_early: bool = False) -> None:
    quarter = max(2, len(losses) // 4)
    early, late = _mean(losses[-2 * quarter:-quarter]), _mean(losses[-quarter:])
    change = (early - late) / max(abs(early), 1e-9)
    overall = (losses[0] - late) / max(abs(losses[0]), 1e-9)
    if change > STILL_FALLING:
        report.findings.append(Finding("convergence", "still falling",
                                       f"train loss fell {change:.0%} over the last quarter ({early:.3f} -> {late:.3f})",
                                       f"{-change:+.0%} in the last quarter"))
        if stopped_early:  # eval loss rose while train loss fell: more of the same would overfit
            return
        if "forgetting" in report.recommended:  # the two verdicts pull apart: say how to have both
            report.recommend("longer", "the loss was still falling at the end, but more epochs would also wear away "
                                       "more of what the base model knew (see the general questions): to learn more "
                                       "of your data, add rows of it rather than epochs")
            return
        report.recommend("longer", f"the loss was still falling at the end: try --epochs {plan.epochs * 2:g} "
                                   f"(or --max-steps {plan.total_steps * 2})")
    elif change < -STILL_FALLING:
        report.findings.append(Finding("convergence", "rising at the end",
                                       f"train loss rose {-change:.0%} over the last quarter ({early:.3f} -> {late:.3f})",
                                       f"{-change:+.0%} in the last quarter"))
        report.recommend("lower lr", f"the loss rose at the end: try a lower learning rate (--lr {plan.lr / 3:.1e})")
    else:
        report.findings.append(Finding("convergence", "converged",
                                       f"train loss flat over the last quarter ({late:.3f}); {overall:.0%} below the start"))


def _overfitting(report: RunReport, plan: Any, losses: list[float], evals: _Evaluations,
                 stopped_early: bool = False) -> None:
    if not evals.after and not (plan.eval_rows and plan.eval_every):
        why = ("no held-out evaluation rows (use --eval-split or --eval-data to measure it)" if not plan.eval_rows
               else f"the run did not evaluate its {plan.eval_rows} held-out rows (--eval-every N to measure it)")
        report.findings.append(Finding("overfitting", "unknown", why))
        return
    best = evals.best
    if best is None or (len(evals.after) < MIN_EVALUATIONS_OVERFITTING and not stopped_early):
        planned = math.ceil(plan.total_steps / plan.eval_every) if plan.eval_every else 0
        # A run stopped early would have had enough: only a plan with too few needs another --eval-every.
        hint = (f"the run evaluates every {plan.eval_every} steps" if planned >= MIN_EVALUATIONS_OVERFITTING
                else f"--eval-every {max(1, plan.total_steps // MIN_EVALUATIONS_OVERFITTING)}")
        report.findings.append(Finding("overfitting", "not judged",
                                       f"too few evaluations ({len(evals.after)}) to judge overfitting; it needs "
                                       f"{MIN_EVALUATIONS_OVERFITTING} after training began ({hint})"))
        return
    last = evals.after[-1]
    gap = last["eval_loss"] - losses[-1]
    if plan.evaluates_training_rows:  # a falling eval loss on trained rows says nothing of overfitting
        report.findings.append(Finding("overfitting", "unknown", f"the evaluations measured {_evaluation_rows(plan)} "
                                       f"(eval loss {last['eval_loss']:.3f} at step {last['step']}): hold out rows "
                                       "the run does not train on to judge it"))
        return
    if last["step"] > best["step"] and last["eval_loss"] > best["eval_loss"] * (1 + OVERFIT_RISE):
        report.findings.append(Finding("overfitting", "yes",
                                       f"eval loss rose from {best['eval_loss']:.3f} at step {best['step']} to "
                                       f"{last['eval_loss']:.3f} at step {last['step']}; train/eval gap {gap:+.3f}",
                                       f"after step {best['step']}"))
        epochs_at_best = plan.epochs * best["step"] / max(1, plan.total_steps)
        if stopped_early:
            report.recommend("fewer epochs", f"eval loss rose after step {best['step']} and early stopping ended "
                                             f"the run; the step-{best['step']} weights were kept. Next time "
                                             f"--epochs {max(1, round(epochs_at_best)):g} gets there sooner")
        else:
            report.recommend("fewer epochs", f"eval loss rose after step {best['step']}: try --epochs "
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
        report.recommend("lower lr", f"the learning rate looks too high: try --lr {plan.lr / 3:.1e}")
    elif total_drop < 0.02:
        verdict, detail = "too low", f"the loss fell only {total_drop:.1%} over the whole run"
        report.recommend("higher lr", f"the loss hardly moved: try --lr {plan.lr * 3:.1e} or more steps")
    else:
        verdict, detail = "effective", f"the loss fell {total_drop:.0%} with no spikes"
    if clipped > len(train) // 2:
        detail += f"; gradients were clipped on {clipped} of {len(train)} steps"
    report.findings.append(Finding("learning rate", verdict, f"peak {plan.lr:.1e} ({plan.lr_scheduler}); {detail}",
                                   f"peak {plan.lr:.1e}"))


def _throughput(report: RunReport, plan: Any, train: list[dict[str, Any]]) -> None:
    """The summary's tokens/s (`speeds.run_tokens_per_s`); the median step's
    for rows written before steps were timed."""
    if not train:
        return
    speed, how = run_tokens_per_s(train), "input tokens over the time in training steps"
    if speed is None:
        speed, how = median(r["tokens_per_s"] for r in train), "the median step's"
    report.findings.append(Finding("throughput", f"{speed:,.0f} tokens/s",
                                   f"{how}, {len(train)} steps, micro-batch {plan.micro_batch_size} x "
                                   f"{plan.grad_accum}, {plan.max_seq_len} tokens, {plan.method}"))


def _resources(report: RunReport, plan: Any, status: dict[str, Any]) -> None:
    """Measured peak memory against the plan's estimate, in the summary's words
    (`memory_use.memory_line`); how busy the GPU was."""
    memory = status.get("memory") or {}
    if not memory.get("peak_bytes"):
        return
    ratio = memory.get("ratio")
    detail = memory_line(memory)
    if memory.get("budget_bytes"):
        detail += f"; budget {memory['budget_bytes'] / GIB:.1f} GiB"
    low, high = MEMORY_RATIO_RANGE
    verdict = "as planned" if ratio is None or low <= ratio <= high else "above plan" if ratio > high else "below plan"
    report.findings.append(Finding("memory", verdict, detail, "" if ratio is None else f"{ratio:.2f}x the plan"))
    used = f"the run's peak was {ratio:.2f}x the plan's estimate for the largest batch it trained"
    if verdict == "above plan":
        report.recommend("memory", f"{used}: leave more headroom (--batch-size {max(1, plan.micro_batch_size // 2)}), "
                                   "and please report it with `llmcustoms hardware` and plan.json so the estimate "
                                   "can be corrected")
    elif verdict == "below plan":
        report.recommend("memory", f"{used}: a larger --batch-size than {plan.micro_batch_size} may fit")
    utilisation = memory.get("gpu_util")
    if utilisation is not None:
        busy = "under-used" if utilisation < LOW_GPU_UTILISATION else "busy"
        report.findings.append(Finding("gpu", busy, f"{utilisation:.0f}% utilisation on average"))
        if busy == "under-used":
            report.recommend("gpu", f"the GPU was busy only {utilisation:.0f}% of the time: try a larger --batch-size "
                                    f"than {plan.micro_batch_size}, or look at the data path (very short rows, "
                                    "a slow disk)")


def _recoveries(report: RunReport, plan: Any, status: dict[str, Any]) -> None:
    recoveries = status.get("recoveries", [])
    if not recoveries:
        report.findings.append(Finding("recoveries", "none", "no out-of-memory, NaN or loss spike event"))
        return
    listed = "; ".join(f"step {r['step']}: {r['kind']} -> {r['action']}" for r in recoveries)
    report.findings.append(Finding("recoveries", f"{len(recoveries)}", listed))
    if any(r["kind"] == "oom" for r in recoveries):
        report.recommend("batch size", f"memory ran out during training: start with --batch-size "
                                       f"{plan.micro_batch_size} next time, so no step is lost to recovery")
    if any(r["kind"] in ("nan", "divergence") for r in recoveries):
        report.recommend("lower lr", f"the loss diverged: start with --lr {plan.lr:.1e} or lower")


def _damaged(report: RunReport, skipped: dict[str, int]) -> None:
    """What of the run's files could not be read (`run_records`): the report is
    drawn from the rest."""
    said = [f"{name}: not JSON, not read" if count < 0 else
            f"{name}: {count} field{'s' * (count != 1)} of the wrong type left out" if name == "status.json" else
            f"{name}: {count} damaged line{'s' * (count != 1)} skipped" for name, count in skipped.items() if count]
    if said:
        report.findings.append(Finding("damaged records", "skipped", "; ".join(said)))


def plot(run: RunDirectory) -> Path:
    """loss.png in the run directory: train and eval loss, and the learning rate."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib, which is not installed.",
                          'Install it with: pip install "llmcustoms[plot]"') from None
    check_writable(run.path, "so --plot cannot save loss.png there", ("loss.png",))
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
