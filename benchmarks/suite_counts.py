"""The README's test counts, written from the suite itself, never by hand.

  python benchmarks/suite_counts.py            # each tier's collected tests, written into README.md
  python benchmarks/suite_counts.py --check    # exit 1, saying which, where README.md says other counts
  python benchmarks/suite_counts.py \\
      --fast "1250 passed, 7 skipped in 367.12s (0:06:07)" \\
      --slow "97 passed in 852.30s (0:14:12)"  # and what a run of each tier measured

The counts are collected (`pytest --collect-only`, in one process): the fast
tier is what `python -m pytest -q` runs (the tests marked slow deselected), the
end-to-end tier what `python -m pytest -q -m slow` runs. What a run measured
(passed, skipped, minutes) only a run can say: give each tier's last line of
`pytest -q`, run on the reference machine (two cores, idle, a clean clone), as
the README says. Without them the measured numbers are left as they are.
tests/test_docs.py checks that the README's counts are the collected ones.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# Where README.md states each number: a pattern whose groups are the numbers, and
# what each group is. Every pattern must match (a reworded README fails loudly).
PLACES = [
    (r"([\d,]+) tests,? (?:in )?about (\d+) min on two", ("fast_tests", "fast_minutes")),
    (r"idle: ([\d,]+) passed in (\d+ min \d+ s); (\d+) of them need a CUDA GPU", ("fast_passed", "fast_time",
                                                                                  "fast_skipped")),
    (r"end-to-end tier: ([\d,]+) tests", ("slow_tests",)),
    (r"end-to-end tier: [\d,]+ tests, about (\d+) min", ("slow_minutes",)),
    (r"\((\d+ min \d+ s) on the same machine\)", ("slow_time",)),
]
COLLECTED = ("fast_tests", "slow_tests")


class _Tally:
    """Counts the collected tests of each tier (a pytest plugin)."""

    def __init__(self) -> None:
        self.fast = self.slow = 0

    def pytest_collection_modifyitems(self, items: list) -> None:
        self.slow = sum(1 for item in items if item.get_closest_marker("slow"))
        self.fast = len(items) - self.slow


def collected() -> dict[str, int]:
    """{fast_tests, slow_tests}: one collection of the whole suite, no test run."""
    import pytest

    tally, out = _Tally(), io.StringIO()
    here = os.getcwd()
    os.chdir(ROOT)  # pyproject.toml's settings and testpaths
    try:
        with contextlib.redirect_stdout(out):  # the list of every test's id
            code = pytest.main(["--collect-only", "-q", "-n", "0", "-m", "", "-p", "no:cacheprovider"], plugins=[tally])
    finally:
        os.chdir(here)
    if code != 0:
        raise SystemExit(f"collecting the tests failed (pytest exit {code}):\n{out.getvalue()[-3000:]}")
    return {"fast_tests": tally.fast, "slow_tests": tally.slow}


def measured(line: str, tier: str) -> dict[str, int | str]:
    """A tier's numbers from pytest -q's last line, "1250 passed, 7 skipped in 367.12s (0:06:07)"."""
    passed, seconds = re.search(r"(\d+) passed", line), re.search(r" in ([\d.]+)s", line)
    if not passed or not seconds:
        raise SystemExit(f"--{tier}: not pytest's last line (\"N passed, M skipped in S.SSs\"): {line!r}")
    if re.search(r"\d+ (failed|error)", line):
        raise SystemExit(f"--{tier}: the run did not pass ({line!r}); the README states a passing run")
    skipped = re.search(r"(\d+) skipped", line)
    total = round(float(seconds[1]))
    values: dict[str, int | str] = {f"{tier}_minutes": round(total / 60),
                                    f"{tier}_time": f"{total // 60} min {total % 60} s"}
    if tier == "fast":
        values.update(fast_passed=int(passed[1]), fast_skipped=int(skipped[1]) if skipped else 0)
    return values


def stated(text: str) -> dict[str, list[str]]:
    """Every number README.md states, by name: its value in each place that states it."""
    found: dict[str, list[str]] = {}
    for pattern, names in PLACES:
        matches = list(re.finditer(pattern, text))
        if not matches:
            raise SystemExit(f"README.md no longer says /{pattern}/: update PLACES in {Path(__file__).name}")
        for match in matches:
            for name, value in zip(names, match.groups()):
                found.setdefault(name, []).append(value)
    return found


def rewrite(text: str, values: dict[str, int | str]) -> str:
    """`text` with each number in `values` written in every place it is stated."""
    stated(text)  # every place still there
    for pattern, names in PLACES:
        def put(match: re.Match, names: tuple[str, ...] = names) -> str:
            whole, start = match.group(0), match.start(0)
            for index in reversed(range(len(names))):  # from the end: earlier offsets stay right
                if names[index] in values:
                    value = values[names[index]]
                    left, right = match.start(index + 1) - start, match.end(index + 1) - start
                    whole = whole[:left] + (f"{value:,}" if isinstance(value, int) else value) + whole[right:]
            return whole

        text = re.sub(pattern, put, text)
    return text


def differences(text: str, counts: dict[str, int]) -> list[str]:
    """Where README.md's collected counts differ from `counts`."""
    said = stated(text)
    return [f"README.md says {value} {name.replace('_', ' ')}, the suite has {counts[name]:,}"
            for name in COLLECTED for value in said[name] if value.replace(",", "") != str(counts[name])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether README.md's counts are the suite's")
    parser.add_argument("--fast", help="the fast tier's last line of `pytest -q`, from a run on the reference machine")
    parser.add_argument("--slow", help="the end-to-end tier's last line of `pytest -q -m slow`, from a run there")
    args = parser.parse_args(argv)
    counts, text = collected(), README.read_text(encoding="utf-8")
    if args.check:
        problems = differences(text, counts)
        print("\n".join(problems) or f"README.md's counts are the suite's: {counts}")
        return 1 if problems else 0
    values: dict[str, int | str] = dict(counts)
    for tier in ("fast", "slow"):
        if getattr(args, tier):
            values.update(measured(getattr(args, tier), tier))
    if "fast_passed" in values and values["fast_passed"] + values["fast_skipped"] != counts["fast_tests"]:
        print(f"note: the run passed and skipped {values['fast_passed'] + values['fast_skipped']:,} tests, "
              f"{counts['fast_tests']:,} are collected now", file=sys.stderr)
    README.write_text(rewrite(text, values), encoding="utf-8")
    print(f"README.md: {', '.join(f'{k} {v}' for k, v in values.items())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
