"""The GPU kit: every GPU claim of docs/benchmarks.md measured in one call, inside a time budget.

    bash benchmarks/gpu/run.sh OUT_DIR --next | --part 1|2|3 [--budget SECONDS] [--only STEP ...]  (on a GPU)
    bash benchmarks/gpu/run.sh --dry-run OUT_DIR [--part 1,2 | --part 3]                    (here, tiny shapes)

run.sh installs the carried wheels and calls this. The steps come in three parts, one device
call each (--part 1 by default; run.sh --next picks the part whose tables are missing or oldest,
schedule.py). It prints its plan first: each step, its time cap and the budget they add up to
(380 s a part by default: a lent GPU has 15 minutes in all, start-up included, and two calls
with their start-ups must fit). Each step runs in processes
of its own, is killed at its cap, and writes OUT_DIR/steps/STEP.json and OUT_DIR/logs/STEP.log;
OUT_DIR/kit.json (every step) and OUT_DIR/summary.md (the tables) are rewritten after each
step, so a kit stopped from outside still leaves what it measured. A step that fails is
recorded with its error and the next one runs. The steps themselves are in measurements.py,
the tables in tables.py.

The dry run is the same script on a CPU with two-layer models (every part unless --part says):
it skips only what needs CUDA (the out-of-memory step), so the script is known to work before a GPU sees it. Exit code: 0
when every step that ran passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

import measurements  # noqa: E402  (benchmarks/gpu/, beside this file)
import tables  # noqa: E402

# Each part's caps in measurements.STEPS add up to this; --budget scales them.
DEFAULT_BUDGET_S = 380
# A CPU runs the dry run's tiny steps slower than a GPU runs the real ones.
DRY_RUN_BUDGET_S = 1200
# Below this a step is not started: it could not load a model, let alone measure.
SHORTEST_USEFUL_S = 8


@dataclass
class Ran:
    """One finished (or killed) command."""
    returncode: int | None
    seconds: float
    timed_out: bool
    log: Path

    def output(self, tail: int = 4000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text[-tail:]


@dataclass
class Kit:
    out: Path
    work: Path
    dry_run: bool
    data: Path
    tokenizer: Path
    budget_s: float
    started: float
    python: str = sys.executable
    models: dict[str, str] = field(default_factory=dict)
    model_keys: list[str] = field(default_factory=list)  # what the models step builds: the chosen steps' needs
    unsloth_site: str = ""  # where run.sh installed Unsloth's own packages (part 3); "" when absent

    def remaining(self) -> float:
        return self.budget_s - (time.time() - self.started)

    def env(self, **extra: str) -> dict[str, str]:
        base = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
                "COLUMNS": "80", "LLMCUSTOMS_CACHE_DIR": str(self.work / "cache"),
                # hooks/sitecustomize.py: a process killed at its cap first writes its stacks here
                "KIT_STACKS": str(self.out / "logs" / "stacks"),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE / "hooks"), os.environ.get("PYTHONPATH")]))}
        if self.dry_run:
            base["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is the CPU path, also on a machine with a GPU
        return {**base, **extra}

    def command(self, name: str, argv: list[str], deadline: float, env: dict[str, str] | None = None) -> Ran:
        """Runs `argv` from the repository root, output to logs/NAME.log, killed (its whole
        process group: the benchmarks start children of their own) at `deadline`."""
        log = self.out / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        started = time.time()
        with log.open("ab") as sink:
            sink.write(f"$ {' '.join(argv)}\n".encode())
            sink.flush()
            process = subprocess.Popen(argv, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=env or self.env(), start_new_session=True)
            try:
                code = process.wait(timeout=max(1.0, deadline - time.time()))
                return Ran(code, time.time() - started, False, log)
            except subprocess.TimeoutExpired:
                stop_group(process)
                return Ran(None, time.time() - started, True, log)


def stop_group(process: subprocess.Popen) -> None:
    """SIGUSR1 (each Python process writes its stacks: hooks/sitecustomize.py), then SIGTERM to
    the process group, then SIGKILL: a training run checkpoints on SIGTERM, and the kit waits 5 s at most."""
    for sig, grace in ((signal.SIGUSR1, 1.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def caps(budget_s: float, chosen: list[measurements.Step] | None = None) -> dict[str, float]:
    """Each chosen step's cap at this budget: the table's, scaled so that the chosen steps' caps
    add up to the budget (with --only, the steps left out give their time to those that run)."""
    for part in measurements.PARTS:
        total = sum(step.cap_s for step in measurements.STEPS if part in step.parts)
        assert total <= DEFAULT_BUDGET_S, f"part {part}'s caps add up to {total} s, over the {DEFAULT_BUDGET_S} s budget"
    steps = chosen or measurements.STEPS
    share = sum(step.cap_s for step in steps)
    return {step.name: step.cap_s * budget_s / share for step in steps}


def print_plan(kit: Kit, chosen: list[measurements.Step], step_caps: dict[str, float]) -> None:
    mode = "dry run on this CPU, tiny shapes" if kit.dry_run else "GPU"
    print(f"llmcustoms GPU kit ({mode}): budget {kit.budget_s:.0f} s, steps capped as below; out: {kit.out}")
    for step in chosen:
        skipped = " (skipped in the dry run: needs CUDA)" if kit.dry_run and step.cuda_only else ""
        print(f"  {step.name:18} cap {step_caps[step.name]:5.0f} s  {step.what}{skipped}")
    print(f"  {'total':18} cap {sum(step_caps[s.name] for s in chosen):5.0f} s", flush=True)


def run_step(kit: Kit, step: measurements.Step, cap: float) -> dict:
    """One step: its result, or what stopped it. Never raises: the next step runs."""
    record = {"name": step.name, "what": step.what, "cap_s": round(cap, 1)}
    if kit.dry_run and step.cuda_only:
        return {**record, "status": "skipped", "reason": "needs CUDA (dry run)", "seconds": 0.0}
    budget_left = kit.remaining()
    if budget_left < SHORTEST_USEFUL_S:
        return {**record, "status": "skipped", "reason": f"budget spent ({budget_left:.0f} s left)", "seconds": 0.0}
    deadline = time.time() + min(cap, budget_left)
    started = time.time()
    try:
        outcome = step.run(kit, deadline)
    except measurements.StepFailed as failed:
        outcome = {"status": "timed out" if failed.timed_out else "failed", "error": failed.message, **failed.partial}
    except Exception as error:  # a bug in the kit's own step: recorded, the kit goes on
        outcome = {"status": "failed", "error": f"{type(error).__name__}: {error}"}
    return {**record, **outcome, "seconds": round(time.time() - started, 1)}


def environment(kit: Kit) -> dict:
    return {"dry_run": kit.dry_run, "host": platform.node(), "python": platform.python_version(),
            "budget_s": kit.budget_s, "data": str(kit.data), "started_at": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def save(kit: Kit, results: list[dict]) -> None:
    (kit.out / "steps").mkdir(parents=True, exist_ok=True)
    for result in results:
        (kit.out / "steps" / f"{result['name']}.json").write_text(json.dumps(result, indent=1))
    elapsed = time.time() - kit.started
    kit_json = {"kit": environment(kit), "elapsed_s": round(elapsed, 1), "steps": results}
    (kit.out / "kit.json").write_text(json.dumps(kit_json, indent=1))
    (kit.out / "summary.md").write_text(tables.summary(kit_json))


def default_inputs(dry_run: bool) -> tuple[Path, Path]:
    """The data and tokenizer prepare.sh puts in .gpukit/; in a dry run without them, the
    shared data (or the project's fixture) and a tokenizer trained on it."""
    kit_dir = ROOT / ".gpukit"
    data = kit_dir / "data" / "code_alpaca_2k.json"
    if not data.exists() and dry_run:
        shared = ROOT.parent / "shared" / "data" / "code_alpaca_2k.json"
        data = shared if shared.exists() else ROOT / "tests" / "fixtures" / "alpaca.jsonl"
    tokenizer = kit_dir / "tokenizer"
    return data, tokenizer if (tokenizer / "tokenizer.json").exists() else Path()


def parts(text: str) -> list[int]:
    """--part's value: "3" or "1,2"."""
    chosen = [int(p) for p in text.split(",") if p.strip().isdigit()]
    if not chosen or any(p not in measurements.PARTS for p in chosen):
        raise argparse.ArgumentTypeError(f"parts are {', '.join(map(str, measurements.PARTS))}, or several as 1,2")
    return chosen


def unsloth_site(dry_run: bool) -> str:
    """Unsloth's site: run.sh's (UNSLOTH_SITE) on the GPU; in a dry run, also the CPU site that
    prepare.sh installs for its import check, when it is there (Unsloth then runs its CPU backend)."""
    given = os.environ.get("UNSLOTH_SITE", "")
    if given or not dry_run:
        return given
    local = Path.home() / ".cache" / "llmcustoms-dev" / "unsloth-site-cpu"
    return str(local) if (local / "unsloth").is_dir() else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="where the step files, logs, kit.json and summary.md go")
    parser.add_argument("--budget", type=float, help=f"seconds for the whole kit (default {DEFAULT_BUDGET_S}; "
                        f"{DRY_RUN_BUDGET_S} in a dry run)")
    parser.add_argument("--dry-run", action="store_true", help="on this CPU with tiny shapes, skipping CUDA-only steps")
    parser.add_argument("--part", type=parts, help="which device call this is: 1, 2 or 3, or several as 1,2 "
                        "(default 1; the dry run runs every part)")
    parser.add_argument("--only", action="append", choices=[s.name for s in measurements.STEPS],
                        help="run these steps (repeatable); the models step runs whenever a chosen step needs it")
    parser.add_argument("--data", type=Path, help="chat or instruction rows (default: .gpukit/data/code_alpaca_2k.json)")
    parser.add_argument("--work", type=Path, help="models and runs (default: OUT_DIR/work)")
    args = parser.parse_args()
    started = float(os.environ.get("KIT_STARTED") or time.time())  # run.sh's start: the wheels' install counts
    data, tokenizer = default_inputs(args.dry_run)
    out = args.out.resolve()
    work = (args.work or out / "work").resolve()
    kit = Kit(out=out, work=work, dry_run=args.dry_run, data=(args.data or data).resolve(),
              tokenizer=tokenizer if tokenizer != Path() else work / "tokenizer",
              budget_s=args.budget or (DRY_RUN_BUDGET_S if args.dry_run else DEFAULT_BUDGET_S), started=started)
    if not kit.data.exists():
        parser.error(f"no data at {kit.data}: run benchmarks/gpu/prepare.sh first, or give --data")
    work.mkdir(parents=True, exist_ok=True)
    chosen = [s for part in (args.part or ([None] if args.dry_run else [1])) for s in measurements.chosen(args.only, part)]
    chosen = list({s.name: s for s in chosen}.values())  # env and models once, though several parts name them
    kit.model_keys = measurements.models_for(chosen)
    kit.unsloth_site = unsloth_site(args.dry_run)
    step_caps = caps(kit.budget_s, chosen)
    print_plan(kit, chosen, step_caps)
    results: list[dict] = []
    for step in chosen:
        result = run_step(kit, step, step_caps[step.name])
        results.append(result)
        save(kit, results)
        print(f"[{time.time() - kit.started:5.0f} s] {tables.status_line(result)}", flush=True)
    print(tables.summary({"kit": environment(kit), "elapsed_s": round(time.time() - kit.started, 1), "steps": results}))
    ran = [r for r in results if r["status"] != "skipped"]
    raise SystemExit(0 if ran and all(r["status"] == "passed" for r in ran) else 1)


if __name__ == "__main__":
    main()
