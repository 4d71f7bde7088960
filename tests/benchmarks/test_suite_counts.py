"""benchmarks/suite_counts.py writes the README's test counts: every place that
states a number gets it, a measured run's numbers come from pytest's last line,
and a README reworded past the patterns is an error, not a silent skip.
(tests/test_docs.py checks the README's counts against a collection.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent.parent / "benchmarks" / "suite_counts.py"
spec = importlib.util.spec_from_file_location("suite_counts", SCRIPT)
suite_counts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite_counts)

README = """downloads, 1,180 tests in about 6 min on two CPU cores (the reference machine,
idle: 1,170 passed in 6 min 7 s; 8 of them need a CUDA GPU and
skip). `python -m pytest -q -m slow` runs the end-to-end tier: 97 tests
that train through the CLI (14 min 12 s on the same machine).

```bash
python -m pytest -q                  # the suite, one worker per core: 1,178 tests, about 6 min on two cores
python -m pytest -q -m slow          # the end-to-end tier: 96 tests, about 14 min
```
"""


def test_every_place_gets_the_collected_counts_and_the_measured_run():
    values = {"fast_tests": 1462, "slow_tests": 108,
              **suite_counts.measured("1455 passed, 7 skipped, 2 warnings in 452.61s (0:07:32)", "fast"),
              **suite_counts.measured("108 passed in 905.2s (0:15:05)", "slow")}
    text = suite_counts.rewrite(README, values)
    assert "downloads, 1,462 tests in about 8 min on two CPU cores" in text
    assert "idle: 1,455 passed in 7 min 33 s; 7 of them need a CUDA GPU" in text
    assert "end-to-end tier: 108 tests\nthat train" in text and "(15 min 5 s on the same machine)" in text
    assert "one worker per core: 1,462 tests, about 8 min on two cores" in text
    assert "the end-to-end tier: 108 tests, about 15 min" in text
    assert suite_counts.differences(text, {"fast_tests": 1462, "slow_tests": 108}) == []


def test_without_a_run_only_the_collected_counts_change_and_every_stale_place_is_named():
    text = suite_counts.rewrite(README, {"fast_tests": 1200, "slow_tests": 99})
    assert "idle: 1,170 passed in 6 min 7 s; 8 of them" in text and "(14 min 12 s on the same" in text
    assert text.count("1,200 tests") == 2 and text.count("99 tests") == 2
    stale = suite_counts.differences(README, {"fast_tests": 1180, "slow_tests": 97})
    assert stale == ["README.md says 1,178 fast tests, the suite has 1,180",
                     "README.md says 96 slow tests, the suite has 97"]


def test_a_failed_run_or_a_reworded_readme_is_refused():
    with pytest.raises(SystemExit, match="did not pass"):
        suite_counts.measured("3 failed, 1450 passed in 400.0s", "fast")
    with pytest.raises(SystemExit, match="not pytest's last line"):
        suite_counts.measured("all good", "fast")
    with pytest.raises(SystemExit, match="no longer says"):
        suite_counts.rewrite(README.replace("end-to-end tier", "slow tier"), {"slow_tests": 5})
