"""Which part of the GPU kit to run next: the one whose tables are missing or oldest.

    python benchmarks/gpu/schedule.py [RESULTS_DIR]     prints the part's number, and why on stderr

A lent GPU has time for one or two parts (a call each), so every session that gets one runs
`run.sh OUT --next` and the tables fill in over sessions. The record is what was committed:
every `*kit.json` under benchmarks/results/ (a kit's own record, copied from OUT_DIR). A step
counts as measured on the day its record has a result (a step stopped at its cap keeps what
it measured); env and models, which every part runs, do not count. A part whose steps were
never all measured comes first, the one with the larger share of them unmeasured before the other; then
the part whose oldest measurement is oldest; ties go to the lower number.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import measurements  # noqa: E402  (beside this file)

RESULTS = HERE.parent / "results"
EVERY_PART = ("env", "models")


def last_measured(results: Path) -> dict[str, str]:
    """{step name: the latest day (YYYY-MM-DD ...) a committed record has its result}."""
    latest: dict[str, str] = {}
    for record in sorted(results.rglob("*kit.json")):
        try:
            kit = json.loads(record.read_text())
            day = kit["kit"]["started_at"]
            steps = kit["steps"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a kit's record: ignored
        if kit["kit"].get("dry_run"):
            continue
        for step in steps:
            if step.get("result") and step.get("status") != "skipped" and day > latest.get(step["name"], ""):
                latest[step["name"]] = day
    return latest


def next_part(latest: dict[str, str]) -> tuple[int, str]:
    """(part, why) for the record `latest`."""
    def standing(part: int) -> tuple:
        names = [s.name for s in measurements.STEPS if part in s.parts and s.name not in EVERY_PART]
        missing = [n for n in names if n not in latest]
        oldest = min((latest[n] for n in names if n in latest), default="")
        return (0 if missing else 1, -len(missing) / len(names), oldest, part), missing, oldest

    ranked = sorted(measurements.PARTS, key=lambda p: standing(p)[0])
    part = ranked[0]
    _, missing, oldest = standing(part)
    why = (f"never measured: {', '.join(missing)}" if missing else f"its oldest table is from {oldest}")
    return part, why


def main() -> None:
    results = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS
    part, why = next_part(last_measured(results))
    print(f"next part: {part} ({why})", file=sys.stderr)
    print(part)


if __name__ == "__main__":
    main()
