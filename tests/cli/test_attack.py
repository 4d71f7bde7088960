"""The attacks of issues 32 and 46 (benchmarks/attack.py), in their reduced form: one case or more
for the problems that lost data or leaked, against a real world of runs, exports and data. The full
attack (every problem of both) runs by hand: `python benchmarks/attack.py`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
BENCHMARKS = Path(__file__).parent.parent.parent / "benchmarks"


def test_the_reduced_attack_finds_nothing():
    out = subprocess.run([sys.executable, str(BENCHMARKS / "attack.py"), "--reduced", "--json"], capture_output=True,
                         text=True, timeout=1500)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    failed = [f"{r['name']}: {'; '.join(r['problems'])}\n{r['output_tail']}" for r in summary["results"] if not r["passed"]]
    assert not failed, "\n\n".join(failed)
    assert out.returncode == 0 and summary["cases"] >= 12
    # The two data-loss problems and the leaks are in the reduced form; of issue 46, the user's .env,
    # the Modelfile's SYSTEM, the storage password, markup in paths and the GGUF round trip.
    assert {1, 2, 12, "46.1", "46.2", "46.3", "46.6", "46.16"} <= set(summary["problems_covered"])
