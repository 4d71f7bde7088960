"""The attack on llmcustoms as a hostile or unlucky user would make it (issue 32), repeatable.

    python benchmarks/attack.py [--reduced] [--only NAME ...] [--json] [--keep-work]

Builds one world in a scratch folder (a tiny random model and its tokenizer, a data folder,
two finished runs side by side), then runs each case in a fresh copy of it: a command of the
real CLI, in a process of its own, with the exit code it must end with, a phrase its output
must hold, phrases it must never show (a traceback, a password, a data row), and the files that
must come out of it unchanged (compared byte for byte, symlinks by target). A case passes when
all of that holds. `--reduced` runs the cases marked for CI (tests/cli/test_attack.py), the rest
run by hand; each case names the problem of issue 32 it guards. The cases are in attack_cases.py.
Exit code: 0 when every case passed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "tests")]

import attack_cases  # noqa: E402  (benchmarks/attack_cases.py)
from attack_cases import Case, World, run_llmcustoms  # noqa: E402
from attack_cases_fourth import FOURTH_CASES  # noqa: E402  (issue 46's cases; they import attack_cases, not back)

# Never in any output: Python's own report of a bug, and the secrets the cases plant.
ALWAYS_FORBIDDEN = ("Traceback (most recent call last)",) + attack_cases.SECRETS


def build_world(root: Path) -> Path:
    """The template every case copies: model/, data/rows.jsonl, runs/done and runs/sibling (finished
    runs) and exports/first (runs/done exported)."""
    from tiny_models import FIXTURES, build_model  # tests/tiny_models.py: a two-layer Llama, no download

    build_model("llama", root / "model")
    (root / "data").mkdir()
    shutil.copy(FIXTURES / "alpaca.jsonl", root / "data" / "rows.jsonl")
    steps = [["train", "data/rows.jsonl", "--model", "model", "--max-steps", "2", "--eval-split", "0",
              "--output-dir", "runs", "--run-name", name, "--yes", "--quiet"] for name in ("done", "sibling")]
    steps.append(["export", "runs/done", "--output", "exports/first"])  # an earlier export, for --overwrite to replace
    for argv in steps:
        ran = run_llmcustoms(root, argv, timeout=600)
        if ran.returncode != 0:
            raise SystemExit(f"building the attack's world failed ({' '.join(argv[:2])}, exit {ran.returncode}):\n"
                             f"{(ran.stdout + ran.stderr)[-3000:]}")
    shutil.rmtree(root / ".cache", ignore_errors=True)  # each case tokenizes afresh: some attack the cache
    return root


def snapshot(paths: list[Path]) -> dict[str, str]:
    """Every file under `paths`, by content (symlinks by where they point): what must not change."""
    seen: dict[str, str] = {}
    for top in paths:
        if top.is_symlink():
            seen[str(top)] = "link->" + os.readlink(top)
            continue
        if not top.exists():
            seen[str(top)] = "absent"
            continue
        for path in sorted([top, *top.rglob("*")] if top.is_dir() else [top]):
            if path.is_symlink():
                seen[str(path)] = "link->" + os.readlink(path)
            elif path.is_file():
                seen[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
            elif path.is_dir():
                seen[str(path)] = "dir"
    return seen


def run_case(case: Case, template: Path, scratch: Path) -> dict:
    world_dir = scratch / case.name
    shutil.copytree(template, world_dir, symlinks=True)
    world = World(world_dir)
    argv = case.prepare(world)
    kept = [world_dir / p for p in case.keep]
    before = snapshot(kept)
    started = time.perf_counter()
    try:
        ran = run_llmcustoms(world_dir, argv, env=case.env, timeout=case.timeout, stdin=case.stdin)
        code, output = ran.returncode, ran.stdout + ran.stderr
    except subprocess.TimeoutExpired as expired:
        code, output = None, f"timed out after {case.timeout} s: {expired}"
    after = snapshot(kept)
    for process in world.background:
        process.kill()
        process.wait()
    if case.undo is not None:
        case.undo(world)
    problems = []
    if code not in case.exits:
        problems.append(f"exit {code}, expected {' or '.join(map(str, case.exits))}")
    flat = " ".join(output.split())  # Rich wraps long messages at the terminal's width
    if case.says and case.says.lower() not in flat.lower():
        problems.append(f"the output does not say {case.says!r}")
    problems += [f"the output shows {word!r}" for word in ALWAYS_FORBIDDEN + case.never_says
                 if word in output or word in flat]
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    if changed:
        problems.append(f"{len(changed)} kept paths changed or lost, e.g. {os.path.relpath(changed[0], world_dir)}")
    if case.check is not None and not problems:
        problems += case.check(world)
    return {"name": case.name, "problem": case.problem, "passed": not problems, "problems": problems,
            "exit": code, "seconds": round(time.perf_counter() - started, 1),
            "output_tail": output[-1500:] if problems else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reduced", action="store_true", help="only the cases CI runs")
    parser.add_argument("--only", action="append", help="run the cases of this name (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON line at the end")
    parser.add_argument("--keep-work", action="store_true", help="leave the scratch folder for a look")
    args = parser.parse_args()
    cases = [c for c in attack_cases.CASES + FOURTH_CASES if (not args.reduced or c.reduced) and (not args.only or c.name in args.only)]
    if not cases:
        parser.error("no case matches")
    scratch = Path(tempfile.mkdtemp(prefix="llmcustoms-attack-"))
    attack_cases.start_commands(scratch)
    try:
        template = build_world(scratch / "template")
        results = []
        for case in cases:
            result = run_case(case, template, scratch / "cases")
            results.append(result)
            if not args.json:
                mark = "ok  " if result["passed"] else "FAIL"
                print(f"{mark} #{case.problem!s:<5} {case.name:52} {result['seconds']:5.1f} s"
                      + ("" if result["passed"] else f"  {'; '.join(result['problems'])}"), flush=True)
    finally:
        attack_cases.stop_commands()
        if not args.keep_work:
            shutil.rmtree(scratch, ignore_errors=True)
    failed = [r for r in results if not r["passed"]]
    summary = {"cases": len(results), "passed": len(results) - len(failed), "failed": len(failed),
               "problems_covered": sorted({r["problem"] for r in results}, key=str), "results": results}
    print(json.dumps(summary) if args.json else f"{summary['passed']} passed, {summary['failed']} failed")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
