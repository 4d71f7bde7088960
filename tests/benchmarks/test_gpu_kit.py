"""The GPU kit (benchmarks/gpu/): its dry run on this CPU end to end, and the parts a GPU
session relies on without a chance to debug them there: the time caps, the terminal capture,
the slimmed wheel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from conftest import DATA_FILES

KIT = Path(__file__).parent.parent.parent / "benchmarks" / "gpu"
sys.path.insert(0, str(KIT))

import kit  # noqa: E402  (benchmarks/gpu/kit.py)
import measurements  # noqa: E402
import screen  # noqa: E402
import slim_wheel  # noqa: E402


def test_each_part_fits_the_budget_and_its_caps_scale_with_it():
    # Two calls of the budget, each with a start of about 45 s, must fit 15 minutes of device time
    # (three parts: a lent GPU runs the two whose tables are oldest, schedule.py says which).
    assert 2 * (kit.DEFAULT_BUDGET_S + 45) <= 15 * 60
    every = set()
    for part in measurements.PARTS:
        steps = measurements.chosen(None, part)
        caps = kit.caps(kit.DEFAULT_BUDGET_S, steps)
        assert sum(caps.values()) == pytest.approx(kit.DEFAULT_BUDGET_S)
        assert {"env", "models"} <= set(caps)  # the card named in each part's summary
        every |= set(caps)
        halved = kit.caps(kit.DEFAULT_BUDGET_S / 2, steps)
        assert all(halved[name] == pytest.approx(cap / 2) for name, cap in caps.items())
    assert every == {s.name for s in measurements.STEPS}  # no step left out of both parts


def test_steps_chosen_by_name_get_the_time_of_those_left_out():
    steps = measurements.chosen(["cuda_oom"])
    assert [s.name for s in steps] == ["env", "models", "cuda_oom"]
    caps = kit.caps(100, steps)
    assert sum(caps.values()) == pytest.approx(100)
    assert caps["cuda_oom"] > kit.caps(kit.DEFAULT_BUDGET_S)["cuda_oom"] * 100 / kit.DEFAULT_BUDGET_S


def test_a_step_past_its_cap_is_killed_with_its_children_and_the_kit_goes_on(tmp_path):
    k = kit.Kit(out=tmp_path, work=tmp_path / "work", dry_run=True, data=tmp_path, tokenizer=tmp_path, budget_s=60,
                started=time.time())
    pid_file = tmp_path / "child.pid"
    # A parent that starts a child of its own and both sleep: the benchmarks do that (a process per system).
    script = f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
             f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    started = time.time()
    ran = k.command("sleeper", [sys.executable, "-c", script], deadline=time.time() + 3)
    assert ran.timed_out and ran.returncode is None and time.time() - started < 15
    child = int(pid_file.read_text())
    time.sleep(0.5)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]

    def slow(kit_, deadline):
        ran = kit_.command("slow", [sys.executable, "-c", "import time; time.sleep(60)"], deadline)
        raise measurements.StepFailed("slow step", ran.timed_out)

    record = kit.run_step(k, measurements.Step("slow", 2, "sleeps", slow), cap=2)
    assert record["status"] == "timed out" and record["seconds"] < 10
    record = kit.run_step(k, measurements.Step("broken", 2, "raises", lambda *_: 1 / 0), cap=2)
    assert record["status"] == "failed" and "ZeroDivisionError" in record["error"]
    k.budget_s = 0  # spent: a step is not started at all
    assert kit.run_step(k, measurements.Step("late", 2, "never", slow), cap=2)["status"] == "skipped"


def test_the_terminal_shows_the_last_redraw_of_a_live_display():
    # What Rich writes for a two-line live display redrawn once, then a final line.
    raw = ("plan\r\n\x1b[?25lstep 0/2\r\n\x1b[2mloss -\x1b[0m\r\x1b[2K\x1b[1A\x1b[2K"
           "step 1/2\r\n\x1b[2mloss 1.5\x1b[0m\r\x1b[2K\x1b[1A\x1b[2Kstep 2/2\r\n\x1b[2mloss 1.2\x1b[0m\x1b[?25h\r\ndone\r\n")
    assert screen.render(raw).splitlines() == ["plan", "step 2/2", "loss 1.2", "done"]
    assert screen.render("x" * 85).splitlines() == ["x" * 80, "x" * 5]  # 80 columns wrap


def test_a_command_in_the_terminal_sees_a_tty_of_80_columns(tmp_path):
    transcript = tmp_path / "out.ansi"
    code, timed_out = screen.run_in_terminal(
        [sys.executable, "-c", "import os, shutil, sys; print(sys.stdout.isatty(), shutil.get_terminal_size().columns)"],
        dict(os.environ), tmp_path, time.time() + 30, transcript)
    assert (code, timed_out) == (0, False)
    assert screen.render(transcript.read_bytes().decode()).split() == ["True", "80"]


def test_a_slimmed_wheel_keeps_what_is_asked_and_a_true_record(tmp_path):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    files = {"pkg/__init__.py": "x = 1\n", "pkg/lib_cuda118.so": "a" * 1000, "pkg/lib_cuda130.so": "b",
             "pkg/lib_cpu.so": "c"}
    with zipfile.ZipFile(wheel, "w") as w:
        for name, text in files.items():
            w.writestr(name, text)
        w.writestr("pkg-1.0.dist-info/RECORD", "".join(f"{n},sha256=x,{len(t)}\n" for n, t in files.items()) +
                   "pkg-1.0.dist-info/RECORD,,\n")
    dropped = slim_wheel.slim(wheel, "pkg/lib_*", ["*cuda13*", "*_cpu.so"])
    assert dropped == ["pkg/lib_cuda118.so"]
    with zipfile.ZipFile(wheel) as w:
        assert sorted(w.namelist()) == sorted([n for n in files if n != "pkg/lib_cuda118.so"] + ["pkg-1.0.dist-info/RECORD"])
        record = w.read("pkg-1.0.dist-info/RECORD").decode()
    assert "lib_cuda118" not in record and "lib_cuda130.so" in record


def test_the_prepared_wheels_name_no_package_twice():
    wanted = [line.split("==")[0].lower().replace("_", "-") for line in (KIT / "wheels.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert len(wanted) == len(set(wanted)) and "bitsandbytes" in wanted and "transformers" in wanted
    assert all("==" in line for line in (KIT / "wheels.txt").read_text().splitlines()
               if line.strip() and not line.startswith("#"))


@pytest.mark.slow
def test_the_dry_run_runs_every_step_on_this_cpu(tmp_path):
    # 240 rows from the project's fixture (each row five times, told apart): enough for an eval split.
    rows = [json.loads(line) for line in DATA_FILES["alpaca"].read_text().splitlines()]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({**r, "instruction": f"{r['instruction']} ({k})"}) + "\n"
                            for k in range(5) for r in rows))
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(KIT / "run.sh"), "--dry-run", str(out), "--data", str(data), "--part", "1,2"],
                          capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "PYTHON": sys.executable, "KIT_STARTED": ""})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "budget 1200 s" in done.stdout and "cap" in done.stdout  # the plan is printed first
    report = json.loads((out / "kit.json").read_text())
    statuses = {s["name"]: s["status"] for s in report["steps"]}
    assert statuses == {s.name: "skipped" if s.cuda_only else "passed" for s in measurements.STEPS
                        if {1, 2} & set(s.parts)}
    steps = {s["name"]: s for s in report["steps"]}
    for name in statuses:
        assert json.loads((out / "steps" / f"{name}.json").read_text())["status"] == statuses[name]
    assert steps["test_cuda"]["result"]["skipped"] >= 6  # collected, and skipped without CUDA
    user = steps["user_run"]["result"]
    assert user["measured"]["status"] == "completed" and user["measured"]["peak_bytes"] > 0
    assert user["plan"]["estimated_peak_bytes"] > 0 and any("Training finished" in line for line in user["display"])
    lora = steps["throughput_lora"]["result"]
    assert lora["llmcustoms"]["tokens_per_s"] > 0 and set(lora["baselines"]) == {"trainer_grouped_bf16", "trl_padding_free"}
    assert steps["throughput_qlora"]["result"]["method"] == "qlora"
    assert [r["name"] for r in steps["memory"]["result"]["rows"]] == measurements.SIZES["dry"]["memory"]
    assert steps["precision"]["result"]["passed"] is True
    summary = (out / "summary.md").read_text()
    for heading in ("tests/training/test_cuda.py", "as a user runs them", "Throughput, LoRA", "Throughput, QLoRA",
                    "Memory estimate", "bf16 against fp32"):
        assert heading in summary
