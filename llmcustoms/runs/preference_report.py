"""What a preference (DPO) run's numbers say: its findings and advice in
`llmcustoms report`, from the rows of metrics.jsonl.

Perplexity means nothing for DPO's loss; what tells a DPO run is the reward
accuracy (the share of held-out pairs whose chosen reply the model now favours
more than the reference does: 0.5 is chance, and where every run starts), the
reward margin (how far apart it puts the two replies) and the chosen reward
itself (below 0: the model lost probability on the replies it should prefer,
a known way DPO goes wrong). No torch here.
"""

from __future__ import annotations

from typing import Any

# An accuracy under this on held-out pairs, after enough steps, is no better than chance.
STUCK_ACCURACY = 0.55
# The margin at the end below this share of its peak: it has collapsed.
MARGIN_COLLAPSE = 0.5
# Steps before the accuracy and the margin's course say anything.
MIN_STEPS = 10
# The chosen replies "lost probability" when their reward fell by more than this share of the margin.
CHOSEN_FALL = 0.25
# Held-out pairs below this, and the share ranked right says nothing yet, as the
# verdicts of `report` say nothing under 20 steps: a model no better than chance
# ranks all of n pairs right with probability 0.5**n (1 in 4 for 2 pairs, 1 in
# 1,024 for 10), and each pair moves the share by more than 0.1.
MIN_HELD_OUT_PAIRS = 10


def evaluations(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluation rows with DPO's metrics, in step order."""
    return sorted((r for r in rows if "eval_reward_accuracy" in r), key=lambda r: r["step"])


def evaluation_at(rows: list[dict[str, Any]], step: int | None) -> dict[str, Any]:
    """The DPO evaluation row of `step`; empty when there is none (or the run is not DPO)."""
    return next((r for r in reversed(evaluations(rows)) if r["step"] == step), {})


def too_few_pairs(pairs: int | None) -> str | None:
    """Why the ranking of `pairs` held-out pairs is withheld, or None (also when
    the count is unknown: an evaluation row written before it was kept)."""
    if pairs is None or pairs >= MIN_HELD_OUT_PAIRS:
        return None
    held, all_of = ("1 held-out pair is", "it comes") if pairs == 1 else (f"{pairs} held-out pairs are", f"all {pairs} come")
    return (f"withheld: {held} too few to judge the ranking (it needs {MIN_HELD_OUT_PAIRS}; by chance alone "
            f"{all_of} out right 1 time in {2 ** pairs:,})")


def held_out_line(row: dict[str, Any]) -> str:
    """'0.91 of held-out pairs ranked right (chance: 0.50), margin +1.234', or
    why it is withheld (`too_few_pairs`; the row's `eval_pairs`)."""
    withheld = too_few_pairs(row.get("eval_pairs"))
    if withheld:
        return withheld
    return (f"{row['eval_reward_accuracy']:.2f} of held-out pairs ranked right (chance: 0.50), "
            f"margin {row['eval_reward_margin']:+.3f}")


def preference_findings(plan: Any, rows: list[dict[str, Any]],
                        best_step: int | None) -> tuple[list[tuple[str, str, str]], list[tuple[str, str]]]:
    """The report's findings for a DPO run, as (topic, verdict, text), and its
    advice, as (what to change, why)."""
    findings: list[tuple[str, str, str]] = []
    advice: list[tuple[str, str]] = []
    evals = [r for r in evaluations(rows) if r["step"] > 0]
    steps = [r for r in rows if "reward_accuracy" in r]
    held_out = f"{plan.eval_rows} held-out pairs" if plan.eval_rows else "the held-out pairs"
    if not evals:
        findings.append(("preference", "not measured yet", f"no evaluation on {held_out} after training began"))
        return findings, advice
    best = next((r for r in evals if r["step"] == best_step), evals[-1])
    withheld = too_few_pairs(best.get("eval_pairs", plan.eval_rows or None))
    if withheld:  # and so is all the advice, drawn from the same pairs
        findings.append(("preference", "withheld", f"{withheld.removeprefix('withheld: ')}; DPO loss "
                                                   f"{best['eval_loss']:.4f} at step {best['step']} (0.6931 before "
                                                   "training)"))
        advice.append(("held-out pairs", f"hold out at least {MIN_HELD_OUT_PAIRS} pairs (--eval-split, or "
                                         "--eval-data FILE) so that the ranking can be judged"))
        return findings, advice
    verdict = "better" if best["eval_reward_accuracy"] > STUCK_ACCURACY else "not better"
    findings.append(("preference", verdict, f"{held_out_line(best)} at step {best['step']} on {held_out} "
                                            f"(DPO loss {best['eval_loss']:.4f}; 0.6931 before training)"))
    if len(steps) < MIN_STEPS:
        return findings, advice
    last = evals[-1]
    if last["eval_reward_accuracy"] <= STUCK_ACCURACY:
        advice.append(("preference", f"held-out reward accuracy is {last['eval_reward_accuracy']:.2f} after "
                                       f"{last['step']} steps, about chance: try --lr {plan.lr * 3:.1e}, more steps, or "
                                       "check that the chosen and rejected replies differ in what should be learned"))
    peak = max(evals, key=lambda r: r["eval_reward_margin"])
    if peak is not last and last["eval_reward_margin"] < MARGIN_COLLAPSE * peak["eval_reward_margin"]:
        advice.append(("fewer epochs", f"the held-out reward margin fell from {peak['eval_reward_margin']:+.3f} at "
                                         f"step {peak['step']} to {last['eval_reward_margin']:+.3f}: the model "
                                         "over-fits the training pairs; use fewer epochs or a lower --lr"))
    falling = last["eval_chosen_reward"] < -CHOSEN_FALL * abs(last["eval_reward_margin"])
    if falling and last["eval_reward_accuracy"] > STUCK_ACCURACY:
        advice.append(("beta", f"the chosen replies lost probability too (held-out chosen reward "
                                 f"{last['eval_chosen_reward']:+.3f}): the model favours them only by pushing the "
                                 f"rejected ones down faster. Raise --beta (now {plan.beta:g}) to keep it closer to "
                                 "the reference, or fine-tune on the chosen replies first and start DPO from that run"))
    return findings, advice
