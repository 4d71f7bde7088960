"""SIGKILL at random moments, resume each time: the run ends as if never killed.

    python benchmarks/kill_anywhere.py [--kills 50] [--per-run 5] [--model DIR] [--steps 30] [--json]

One uninterrupted run is the reference. Then runs of the same plan
(`--save-every 1 --keep 2`, LoRA dropout on, so the random state must be
restored too) are each killed up to `--per-run` times with SIGKILL and
resumed after every kill, then resumed to the end, until `--kills` kills
have been made; each run's adapter is compared with the reference's (largest
difference of any weight, at most 1e-5), and its metrics.jsonl must hold one
row per step, as the reference's does.

Where a kill lands is chosen three ways in turn, so the dangerous moments are
not left to chance: from outside, at a random moment of one of the next few
steps; from inside, with `LLMCUSTOMS_FAULT_INJECT=kill_saving@N` (N a few steps
ahead), which SIGKILLs the process at a random point of step N's checkpoint
write or of the pruning after it (a tiny model writes a checkpoint in
milliseconds: a kill from outside would rarely land there); and with
`kill_pruning@N`, in the middle of the pruning after step N's checkpoint. Each kill is
recorded with what the checkpoints directory held after it: a `.tmp-` (a
checkpoint half written), a `.deleting-` (a pruning cut short), or neither.

Without --model a tiny random Llama is built locally (tests/tiny_models.py):
the contract is about files and signals, not model size, and a tiny model
fits many kills into minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import forked_cli  # benchmarks/forked_cli.py

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "fixtures" / "alpaca.jsonl"
WAYS = ("from outside", "inside a save", "inside a pruning")
FAULTS = {"inside a save": "kill_saving", "inside a pruning": "kill_pruning"}
TOLERANCE = 1e-5


def train_args(model: Path, output: Path, name: str, steps: int) -> list[str]:
    return ["train", str(DATA), "--model", str(model), "--max-steps", str(steps), "--save-every", "1",
            "--keep", "2", "--batch-size", "2", "--grad-accum", "2", "--lr", "1e-2", "--lora-dropout", "0.1",
            "--eval-every", "5", "--output-dir", str(output), "--run-name", name, "--yes", "--quiet"]


def start(args: list[str], fault: str | None = None):
    """The command, forked (forked_cli.py): each kill then costs the run's own work, not 6-8 s of
    imports. Kills land once training is under way, so where they land does not change."""
    return forked_cli.popen(args, environment(fault), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def environment(fault: str | None = None) -> dict[str, str]:
    env = {**os.environ, "COLUMNS": "120", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("LLMCUSTOMS_FAULT_INJECT", None)
    return {**env, "LLMCUSTOMS_FAULT_INJECT": fault} if fault else env


def in_progress(checkpoints: Path) -> list[str]:
    """The checkpoint directories that are neither whole nor absent: being written or being deleted."""
    try:
        return sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("."))
    except OSError:
        return []


def landed(names: list[str]) -> str:
    if any(n.startswith(".tmp-") for n in names):
        return "checkpoint write"
    if any(n.startswith((".deleting-", ".old-")) for n in names):
        return "pruning"
    return "between writes"


def last_status(run: Path) -> str | None:
    try:
        return json.loads((run / "status.json").read_text()).get("status")
    except (OSError, ValueError):
        return None


def started_training(run: Path, since: float) -> bool:
    metrics = run / "metrics.jsonl"
    return metrics.exists() and metrics.stat().st_mtime > since


def logged_step(run: Path) -> int:
    """The last training step metrics.jsonl has a row for (0 before the first)."""
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [0]
    for line in lines[-20:]:
        try:
            row = json.loads(line)
        except ValueError:  # blank, or the line being written as we read
            continue
        steps += [row.get("step", 0)] if "loss" in row else []
    return max(steps)


def kill_from_outside(process, run: Path, since: float, steps: int, pace: float, rng: random.Random) -> None:
    """SIGKILL at a random moment of one of the next few steps. The step is drawn, not the delay
    alone: on a fast machine a fixed window after the first row can outlast the whole run."""
    deadline = time.monotonic() + 300
    while process.poll() is None and not started_training(run, since) and time.monotonic() < deadline:
        time.sleep(0.005)
    now = logged_step(run)
    target = rng.randint(now, max(now, min(now + 3, steps - 2)))  # a few ahead, one left after the wait
    while process.poll() is None and logged_step(run) < target and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, pace))
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)


def kill_once(args: list[str], run: Path, way: str, steps: int, pace: float, rng: random.Random) -> str | None:
    """Start the command, have it killed the chosen way; where it landed, or None if it finished first.
    `pace` is the uninterrupted run's seconds per step."""
    since = time.time()
    fault = f"{FAULTS[way]}@{min(steps, logged_step(run) + rng.randint(1, 4))}" if way in FAULTS else None
    process = start(args, fault)
    if fault is None:
        kill_from_outside(process, run, since, steps, pace, rng)
    _, err = process.communicate(timeout=600)
    if process.returncode == 0:
        return None
    if process.returncode != -signal.SIGKILL:
        raise SystemExit(f"the command failed before it could be killed ({process.returncode}):\n{err[-2000:]}")
    return landed(in_progress(run / "checkpoints"))


def finish(run: Path) -> None:
    resuming = start(["resume", str(run), "--quiet"])
    _, err = resuming.communicate(timeout=600)
    if resuming.returncode != 0:
        raise SystemExit(f"resume failed ({resuming.returncode}):\n{err[-3000:]}")


def adapter_difference(run: Path, reference: Path) -> float:
    from safetensors.torch import load_file

    a = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(reference / "adapter" / "adapter_model.safetensors"))
    if a.keys() != b.keys():
        return float("inf")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def steps_written(run: Path) -> list[int]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if "loss" in r]


def killed_run(model: Path, root: Path, index: int, kills: int, steps: int, pace: float,
               rng: random.Random) -> dict:
    name = f"run-{index:02d}"
    run = root / name
    where: list[str] = []
    first = train_args(model, root, name, steps)
    while len(where) < kills and last_status(run) != "completed":  # a kill may land just after the end
        args = first if not (run / "plan.json").exists() else ["resume", str(run), "--quiet"]
        spot = kill_once(args, run, WAYS[len(where) % len(WAYS)], steps, pace, rng)
        if spot is None:
            break  # finished before the kill: the run is shorter than the kills asked for
        where.append(spot)
    if json.loads((run / "status.json").read_text()).get("status") != "completed":
        finish(run)
    return {"run": name, "kills": where, "status": json.loads((run / "status.json").read_text())["status"],
            "steps": steps_written(run)}


def build_tiny_model(root: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import build_model

    return build_model("llama", root / "tiny-llama")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--per-run", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kill-anywhere-") as tmp:
        root = Path(tmp)
        model = args.model or build_tiny_model(root)
        forked_cli.start_server(environment())
        reference = start(train_args(model, root, "reference", args.steps))
        _, err = reference.communicate(timeout=600)
        if reference.returncode != 0:
            raise SystemExit(f"the reference run failed:\n{err[-3000:]}")
        expected_steps = steps_written(root / "reference")
        status = json.loads((root / "reference" / "status.json").read_text())
        pace = float(status.get("training_seconds") or args.steps * 0.1) / args.steps
        runs: list[dict] = []
        while sum(len(r["kills"]) for r in runs) < args.kills:
            kills = min(args.per_run, args.kills - sum(len(r["kills"]) for r in runs))
            result = killed_run(model, root, len(runs), kills, args.steps, pace, rng)
            if not result["kills"]:
                raise SystemExit("a run finished before its first kill: give it more --steps")
            result["max_difference"] = adapter_difference(root / result["run"], root / "reference")
            result["same_adapter"] = result["max_difference"] <= TOLERANCE
            result["one_row_per_step"] = result["steps"] == expected_steps
            runs.append(result)
            if not args.json:
                print(f"{result['run']}: {len(result['kills'])} kills ({', '.join(result['kills'])}); "
                      f"max difference {result['max_difference']:.2e}; rows per step ok: {result['one_row_per_step']}",
                      flush=True)
    kills = [spot for r in runs for spot in r["kills"]]
    summary = {
        "kills": len(kills),
        "landed": {spot: kills.count(spot) for spot in ("checkpoint write", "pruning", "between writes")},
        "runs": len(runs),
        "runs_identical": sum(r["same_adapter"] and r["one_row_per_step"] for r in runs),
        "all_identical": all(r["same_adapter"] and r["one_row_per_step"] for r in runs),
        "max_difference": max(r["max_difference"] for r in runs),
        "seconds": round(time.monotonic() - started, 1),
        "results": runs,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{summary['kills']} kills over {summary['runs']} runs, landed: {summary['landed']}; "
              f"{summary['runs_identical']}/{summary['runs']} runs identical to the uninterrupted one "
              f"(largest difference {summary['max_difference']:.2e}); {summary['seconds']} s")
    sys.exit(0 if summary["all_identical"] else 1)


if __name__ == "__main__":
    main()
