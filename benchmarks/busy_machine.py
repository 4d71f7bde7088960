"""A CPU busy with other work: the plan's estimate, the live ETA and the threads
against the time a run really takes, on an idle machine and beside a CPU hog.

    python benchmarks/busy_machine.py [--model DIR] [--data FILE] [--max-steps 8] [--runs idle,busy]
                                      [--hog N] [--warmup 60] [--omp N] [--dry-run] [--json]

Each run is `llmcustoms train` through the CLI, as a user runs it (a
subprocess, COLUMNS wide, OMP_NUM_THREADS unset unless --omp gives it), on the
real model (--model, by default SmolLM2-135M-Instruct built by
../shared/tools/make_real_model.py into ~/.cache/llmcustoms-dev/) for
--max-steps steps of ../shared/data/sharegpt_identity.json. `busy` runs it
beside --hog processes spinning on a core each (`while True: pass`; one per
physical core by default), started --warmup seconds before, so the 1-minute
load average the plan reads has risen (to about 63% of the hog after 60 s).
An idle run after a busy one first waits for the load to settle (at most 3 min).
--runs idle,busy,idle shows the busy run's speed does not become the machine's.

Every run shares one fresh cache directory, so the first plan is the nominal
estimate and the later ones use the speeds the earlier runs measured
(`runs/speeds.py`). For each run the table gives: the load the plan saw and
the threads it chose (and those the steps ran with: metrics.jsonl's
`cpu_threads`); the plan's estimate (plan.json's `estimated_seconds`:
training and evaluations); the ETA after 2 steps, as the live display shows
it (`ui/train_progress.py` fed each row when it appeared) plus the time
elapsed; and the actual time, from "training started" in train.log to the
last row of metrics.jsonl (both watched as they are written), which is what
the estimate covers. Ratios above 1 overestimate.

--dry-run plans instead of training (`llmcustoms plan --json`, hog included):
a quick check of the set-up on any model. With --json the last line is
{"runs": [{...}, ...], "cpus": ..., ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

REAL_MODEL = Path.home() / ".cache" / "llmcustoms-dev" / "smollm2-135m-instruct"
DATA = ROOT.parent / "shared" / "data" / "sharegpt_identity.json"
HOG = "while True: pass"
POLL_S = 0.05
SETTLE_S = 180


def environment(cache: Path, omp: int | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(COLUMNS="1000", LLMCUSTOMS_CACHE_DIR=str(cache), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return {**env, "OMP_NUM_THREADS": str(omp)} if omp else env


def start_hog(processes: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(processes)]


def stop_hog(hog: list[subprocess.Popen]) -> None:
    for process in hog:
        process.kill()
    for process in hog:
        process.wait()


def settle(cores: int, seconds: float = SETTLE_S) -> None:
    """Wait for the load a hog left to fall below half a core (or give up after `seconds`)."""
    until = time.monotonic() + seconds
    while os.getloadavg()[0] >= 0.5 and time.monotonic() < until:
        time.sleep(2)


def planned(args: argparse.Namespace, env: dict[str, str]) -> dict:
    """`llmcustoms plan --json`: what --dry-run reports."""
    out = subprocess.run([sys.executable, "-m", "llmcustoms", "plan", str(args.data), "--model", str(args.model),
                          "--max-steps", str(args.max_steps), "--json"], capture_output=True, text=True, env=env,
                         timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"plan failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def watch(process: subprocess.Popen, run: Path) -> tuple[float | None, list[tuple[float, dict]]]:
    """When training started (train.log) and each metrics row with when it appeared, until the run ends."""
    started, rows, seen = None, [], 0
    while True:
        ended = process.poll() is not None
        now = time.monotonic()
        log = run / "train.log"
        if started is None and log.exists() and "training started" in log.read_text(errors="replace"):
            started = now
        metrics = run / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        complete = lines if ended else lines[:-1]  # the last line may be half written
        rows += [(now, json.loads(line)) for line in complete[seen:]]
        seen = len(complete)
        if ended:
            return started, rows
        time.sleep(POLL_S)


def eta_after(rows: list[tuple[float, dict]], started: float, total: int, after: int = 2) -> float | None:
    """The display's ETA once step `after` is shown, plus the time elapsed: the total it foresees."""
    from llmcustoms.ui.train_progress import TrainingProgress

    progress = TrainingProgress(total, 0, started)
    for at, row in rows:
        if "loss" in row:
            progress.step(row, at)
            if row["step"] == after:
                eta = progress.eta(at)
                return None if eta is None else at - started + eta
        elif "eval_loss" in row:
            progress.evaluated(row, at)
    return None


def trained(args: argparse.Namespace, env: dict[str, str], out: Path, name: str) -> dict:
    run = out / name
    with open(out / f"{name}.out", "w") as output:
        process = subprocess.Popen([sys.executable, "-m", "llmcustoms", "train", str(args.data), "--model",
                                    str(args.model), "--max-steps", str(args.max_steps), "--yes", "--output-dir",
                                    str(out), "--run-name", name], stdout=output, stderr=subprocess.STDOUT, env=env)
        started, rows = watch(process, run)
    if process.returncode != 0 or started is None:
        raise SystemExit(f"{name}: train failed ({process.returncode}):\n{(out / f'{name}.out').read_text()[-3000:]}")
    plan = json.loads((run / "plan.json").read_text())
    steps = [row for _, row in rows if "loss" in row]
    actual = rows[-1][0] - started
    eta = eta_after(rows, started, plan["total_steps"])
    return {**summary(plan), "threads_used": sorted({r.get("cpu_threads") for r in steps} - {None}),
            "others_measured": round(sorted(r["cpu_others"] for r in steps if "cpu_others" in r)[len(steps) // 2], 2)
            if any("cpu_others" in r for r in steps) else None,
            "eta_after_2_s": None if eta is None else round(eta, 1), "actual_s": round(actual, 1),
            "estimate_ratio": round(plan["estimated_seconds"] / actual, 2) if actual > 0 else None,
            "eta_ratio": round(eta / actual, 2) if eta and actual > 0 else None}


def summary(plan: dict) -> dict:
    reasons = plan.get("reasons", [])
    return {"threads": plan.get("cpu_threads"), "estimate_s": round(plan["estimated_seconds"], 3),
            "threads_reason": next((r for r in reasons if r.startswith("threads")), ""),
            "duration_reason": next((r for r in reasons if r.startswith("estimated duration")), "")}


def one_run(args: argparse.Namespace, kind: str, env: dict[str, str], out: Path, index: int) -> dict:
    hog = start_hog(args.hog) if kind == "busy" else []
    try:
        if hog:
            time.sleep(args.warmup)
        load = round(os.getloadavg()[0], 2)
        result = summary(planned(args, env)) if args.dry_run else trained(args, env, out, f"{index}-{kind}")
    finally:
        stop_hog(hog)
    return {"run": kind, "hog": len(hog), "load_at_start": load, **result}


def table(results: list[dict], dry_run: bool) -> str:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f} s" if value >= 10 else f"{value:.2g} s"

    if dry_run:
        lines = ["| run | load | threads | estimate |", "|---|---|---|---|"]
        return "\n".join(lines + [f"| {r['run']} | {r['load_at_start']} | {r['threads']} | {seconds(r['estimate_s'])} |"
                                  for r in results])
    lines = ["| run | load at start | threads (plan / steps) | estimate | ETA after 2 steps | actual | "
             "estimate / actual | ETA / actual |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        used = ",".join(str(t) for t in r["threads_used"]) or "-"
        lines.append(f"| {r['run']} | {r['load_at_start']} | {r['threads']} / {used} | {seconds(r['estimate_s'])} | "
                     f"{seconds(r['eta_after_2_s'])} | {seconds(r['actual_s'])} | {r['estimate_ratio']} | "
                     f"{r['eta_ratio'] if r['eta_ratio'] is not None else '-'} |")
    return "\n".join(lines)


def main() -> None:
    import psutil

    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REAL_MODEL)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--runs", default="idle,busy", help="idle and busy runs, in order (comma-separated)")
    parser.add_argument("--hog", type=int, default=cores, help="busy-looping processes beside a busy run")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds the hog runs before the busy run")
    parser.add_argument("--omp", type=int, default=None, help="OMP_NUM_THREADS for every run (unset by default)")
    parser.add_argument("--dry-run", action="store_true", help="plan instead of training")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    kinds = [k.strip() for k in args.runs.split(",") if k.strip()]
    if not kinds or set(kinds) - {"idle", "busy"}:
        parser.error("--runs takes idle and busy, e.g. idle,busy,idle")
    if not args.model.exists():
        parser.error(f"no model at {args.model} (build it with ../shared/tools/make_real_model.py, or pass --model)")
    results = []
    with tempfile.TemporaryDirectory(prefix="busy-machine-") as tmp:
        out, env = Path(tmp), environment(Path(tmp) / "cache", args.omp)
        for index, kind in enumerate(kinds):
            if kind == "idle" and index and kinds[index - 1] == "busy" and not args.dry_run:
                settle(cores)
            results.append(one_run(args, kind, env, out, index))
            if not args.json:
                print(f"{kind}: {json.dumps(results[-1])}", flush=True)
    header = (f"{Path(args.model).name}, {args.max_steps} steps of {args.data.name}; {cores} cores, "
              f"hog of {args.hog} beside busy runs after {args.warmup:.0f} s")
    if args.json:
        print(json.dumps({"model": str(args.model), "cpus": cores, "max_steps": args.max_steps, "runs": results}))
    else:
        print(f"\n{header}\n\n{table(results, args.dry_run)}")


if __name__ == "__main__":
    main()
