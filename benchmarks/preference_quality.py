"""Held-out reward accuracy of a short DPO run on a real model, before and after.

    python benchmarks/preference_quality.py --model ~/.cache/llmcustoms-dev/smollm2-135m-instruct [--json]

Builds a preference set from ../shared/data/code_alpaca_2k.json: for each
instruction the chosen reply is its own output, the rejected one the output of
another row (a reply to a different request: fluent, but wrong for this one).
Training and held-out pairs come from disjoint rows. Then it runs
`llmcustoms train` exactly as a user would (preference data is detected and
trained with DPO, with the preset's lr) and reads the held-out evaluations
from metrics.jsonl: before training every reward is 0 (the policy is the
reference), so accuracy is 0.5, chance; after it, the share of held-out pairs
whose chosen reply the trained model prefers more than the reference does.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "code_alpaca_2k.json"


# Rows longer than these (characters) are left out: a CPU run stays short.
MAX_PROMPT_CHARS, MAX_REPLY_CHARS = 300, 500


def preference_rows(source: Path, seed: int) -> list[dict]:
    """One pair per usable row: chosen = its output, rejected = another row's."""
    rows = [r for r in json.loads(source.read_text()) if r["output"].strip() and len(r["output"]) <= MAX_REPLY_CHARS
            and len(r["instruction"]) + len(r["input"]) <= MAX_PROMPT_CHARS]
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    pairs = []
    for k, i in enumerate(order):
        other = rows[order[(k + 1) % len(order)]]["output"]  # the next row in a shuffled cycle: never itself
        if other.strip() == rows[i]["output"].strip():
            continue
        prompt = rows[i]["instruction"] + (f"\n\n{rows[i]['input']}" if rows[i]["input"].strip() else "")
        pairs.append({"prompt": prompt, "chosen": rows[i]["output"], "rejected": other})
    return pairs


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(Path.home() / ".cache/llmcustoms-dev/smollm2-135m-instruct"))
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--train-pairs", type=int, default=240)
    parser.add_argument("--eval-pairs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `llmcustoms train` flags")
    parser.add_argument("--json", action="store_true", help="print one JSON line at the end")
    args = parser.parse_args()

    pairs = preference_rows(Path(args.data), args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        train = write(Path(tmp) / "prefs.jsonl", pairs[:args.train_pairs])
        held_out = write(Path(tmp) / "prefs-eval.jsonl", pairs[args.train_pairs:args.train_pairs + args.eval_pairs])
        command = [sys.executable, "-m", "llmcustoms", "train", str(train), "--model", args.model,
                   "--eval-data", str(held_out), "--max-steps", str(args.steps), "--eval-every", str(args.steps),
                   "--output-dir", str(Path(tmp) / "runs"), "--run-name", "dpo", "--yes", "--quiet", *args.extra]
        started = time.perf_counter()
        out = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        seconds = time.perf_counter() - started
        if out.returncode != 0:
            raise SystemExit(f"training failed ({out.returncode}):\n{out.stderr[-3000:]}")
        run = Path(tmp) / "runs" / "dpo"
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        plan = json.loads((run / "plan.json").read_text())
    evaluations = [r for r in rows if "eval_reward_accuracy" in r]
    before, after = evaluations[0], evaluations[-1]
    summary = {"model": Path(args.model).name, "train_pairs": args.train_pairs, "eval_pairs": args.eval_pairs,
               "steps": after["step"], "method": plan["method"], "lr": plan["lr"], "beta": plan["beta"],
               "effective_batch": plan["effective_batch_size"], "seconds": round(seconds),
               "before": {k: before[k] for k in before if k.startswith("eval_")},
               "after": {k: after[k] for k in after if k.startswith("eval_")}}
    if args.json:
        print(json.dumps(summary))
        return
    print(f"{summary['model']}: DPO ({plan['method']}, lr {plan['lr']:g}, beta {plan['beta']:g}), "
          f"{args.train_pairs} training pairs, {after['step']} steps of {plan['effective_batch_size']} pairs, "
          f"{seconds / 60:.1f} min")
    for name, row in (("before", before), ("after", after)):
        print(f"  {name:6} held-out reward accuracy {row['eval_reward_accuracy']:.3f}, margin "
              f"{row['eval_reward_margin']:+.3f}, DPO loss {row['eval_loss']:.4f}")


if __name__ == "__main__":
    main()
