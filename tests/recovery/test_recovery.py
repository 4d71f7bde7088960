"""Never lose a run: kills, interrupts, out-of-memory, NaN and corrupt files,
end to end through the CLI as real subprocesses."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import DATA_FILES, start_cli
from tiny_models import WIDE

pytestmark = pytest.mark.slow

STEPS = 12


def until_asleep(process, seconds: float = 120) -> None:
    """Until the process's main thread sleeps: inside a micro-batch that `slow@N` or `slow_eval@N`
    slows (its time.sleep), however long the evaluation and checkpoint before it took on a
    loaded machine. Linux's /proc/PID/wchan says so; where there is none, a second."""
    wchan = Path(f"/proc/{process.pid}/wchan")
    if not wchan.exists():
        time.sleep(1.0)
        return
    deadline = time.time() + seconds
    while time.time() < deadline and process.poll() is None:
        try:
            if wchan.read_text().strip() == "hrtimer_nanosleep":
                return
        except OSError:  # the process just ended: the caller's assertions say so
            return
        time.sleep(0.01)


def train_args(model: Path, output: Path, name: str, dropout: float, steps: int = STEPS) -> list[str]:
    # fp32: a run recovered with a halved micro-batch is compared with one that was not, a split
    # of the same work that bf16's rounding (the default on CPUs that have it) would blur.
    return ["train", str(DATA_FILES["alpaca"]), "--model", str(model), "--max-steps", str(steps), "--save-every", "3",
            "--batch-size", "4", "--grad-accum", "2", "--lr", "1e-2", "--lora-dropout", str(dropout),
            "--mixed-precision", "no",
            "--output-dir", str(output), "--run-name", name, "--yes", "--quiet"]


def adapter(run: Path) -> dict:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def status(run: Path) -> dict:
    return json.loads((run / "status.json").read_text())


@pytest.fixture(scope="module")
def baselines(tiny_models, tmp_path_factory):
    """Uninterrupted runs to compare against: with dropout (exercises RNG restore) and without."""
    from conftest import run_cli

    root = tmp_path_factory.mktemp("baselines")
    for name, dropout in (("dropout", 0.1), ("plain", 0.0)):
        result = run_cli(*train_args(tiny_models["llama"], root, name, dropout))
        assert result.returncode == 0, result.stderr
    return {"dropout": adapter(root / "dropout"), "plain": adapter(root / "plain"), "root": root}


def test_kill_9_after_a_checkpoint_then_resume_matches_the_uninterrupted_run(tmp_path, tiny_models, baselines, cli):
    # A real SIGKILL from outside, as soon as the first checkpoint exists.
    long_steps = 300
    env = {**os.environ, "COLUMNS": WIDE}
    process = start_cli(*train_args(tiny_models["llama"], tmp_path, "run", 0.1, long_steps), env=env,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = tmp_path / "run" / "checkpoints" / "step-000003"
    deadline = time.time() + 120
    while not first.exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    assert status(tmp_path / "run")["status"] == "running"  # died without a word
    resumed = cli("resume", "--output-dir", str(tmp_path), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert status(tmp_path / "run")["status"] == "completed"
    reference = cli(*train_args(tiny_models["llama"], tmp_path, "reference", 0.1, long_steps))
    assert reference.returncode == 0
    assert max_difference(adapter(tmp_path / "run"), adapter(tmp_path / "reference")) <= 1e-5
    steps = [r["step"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    # One row per step, none doubled by the replay; early stopping (on in the
    # preset) ends the resumed run where it ends the uninterrupted one.
    assert steps == list(range(1, status(tmp_path / "reference")["step"] + 1))


def test_sigint_exits_130_interrupted_and_resume_matches(tmp_path, tiny_models, baselines, cli):
    run = tmp_path / "run"
    env = {**os.environ, "COLUMNS": WIDE}
    process = start_cli(*train_args(tiny_models["llama"], tmp_path, "run", 0.1, 300), env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while '"loss"' not in _text(run / "metrics.jsonl") and time.time() < deadline and process.poll() is None:
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    state = status(run)
    assert state["status"] == "interrupted" and "SIGINT" in state["reason"]
    assert "llmcustoms resume" in err and "Traceback" not in err
    # The checkpoint is of the step that was running when Ctrl-C came.
    assert (run / "checkpoints" / f"step-{state['step']:06d}" / "manifest.json").exists()
    resumed = cli("resume", str(run), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    cli(*train_args(tiny_models["llama"], tmp_path, "reference", 0.1, 300))
    assert max_difference(adapter(run), adapter(tmp_path / "reference")) <= 1e-5


def test_sigint_in_a_long_step_stops_at_the_next_micro_batch_and_resumes_exactly(tmp_path, tiny_models, baselines,
                                                                                  cli):
    """Step 4 is slowed (each of its 2 micro-batches takes SLOW_MICRO_BATCH_S
    more): Ctrl-C one second into it stops after its first micro-batch, not
    after the step; the unfinished step is dropped (its random draws too: dropout
    is on) and step 3, not saved on schedule, is checkpointed then."""
    from llmcustoms.recovery.faults import SLOW_MICRO_BATCH_S

    run = tmp_path / "run"
    env = {**os.environ, "COLUMNS": WIDE, "LLMCUSTOMS_FAULT_INJECT": "slow@4"}
    process = start_cli(*train_args(tiny_models["llama"], tmp_path, "run", 0.1), "--save-every", "5", env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None and '"step": 3, "epoch"' not in _text(run / "metrics.jsonl"):
        time.sleep(0.01)
    until_asleep(process)  # after step 3's evaluation and checkpoint, inside step 4's first micro-batch
    process.send_signal(signal.SIGINT)
    sent = time.monotonic()
    _, err = process.communicate(timeout=60)
    stopping = time.monotonic() - sent
    assert process.returncode == 130, err
    # The rest of one micro-batch, then a checkpoint; the whole step would take 2 x SLOW_MICRO_BATCH_S.
    assert stopping < 2 * SLOW_MICRO_BATCH_S - 1, stopping
    said = " ".join(err.split())
    assert "stopping: the last finished step is saved" in said and "Error" not in err and "Traceback" not in err
    assert "Stopped at step 3" in said
    assert f"resume{run}" in "".join(err.split())  # a long path wraps
    state = status(run)
    assert (state["status"], state["step"]) == ("interrupted", 3)
    assert (run / "checkpoints" / "step-000003" / "manifest.json").exists()
    resumed = cli("resume", str(run), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert max_difference(adapter(run), baselines["dropout"]) <= 1e-5


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_sigterm_exits_143(tmp_path, tiny_models, cli):
    result = cli(*train_args(tiny_models["llama"], tmp_path, "run", 0.0), env={"LLMCUSTOMS_FAULT_INJECT": "sigterm@4"})
    assert result.returncode == 143
    assert status(tmp_path / "run")["status"] == "interrupted"
    assert (tmp_path / "run" / "checkpoints" / "step-000004").is_dir()


def test_injected_oom_halves_the_micro_batch_and_matches_the_unrecovered_run(tmp_path, tiny_models, baselines, cli):
    result = cli(*train_args(tiny_models["llama"], tmp_path, "run", 0.0), env={"LLMCUSTOMS_FAULT_INJECT": "oom@5"})
    assert result.returncode == 0, result.stderr
    run = tmp_path / "run"
    plan = json.loads((run / "plan.json").read_text())
    assert (plan["micro_batch_size"], plan["grad_accum"], plan["effective_batch_size"]) == (2, 4, 8)
    assert plan["sources"]["micro_batch_size"] == "planner"
    assert any("out of memory at step 5" in r for r in plan["reasons"])
    [recovery] = status(run)["recoveries"]
    assert recovery["kind"] == "oom" and recovery["step"] == 5 and recovery["action"] == "halved micro-batch"
    assert "out of memory" in result.stderr  # shown to the user as it happened
    assert max_difference(adapter(run), baselines["plain"]) <= 1e-4


def test_injected_nan_recovers_with_a_lower_learning_rate(tmp_path, tiny_models, cli):
    result = cli(*train_args(tiny_models["llama"], tmp_path, "run", 0.0), env={"LLMCUSTOMS_FAULT_INJECT": "nan@5"})
    assert result.returncode == 0, result.stderr
    run = tmp_path / "run"
    [recovery] = status(run)["recoveries"]
    assert recovery["kind"] == "nan" and recovery["details"]["lr"] == [0.01, 0.005]
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == STEPS and all(l == l and abs(l) < float("inf") for l in losses)
    assert json.loads((run / "plan.json").read_text())["lr"] == 0.005


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, tiny_models, baselines, cli):
    run = tmp_path / "run"
    killed = cli(*train_args(tiny_models["llama"], tmp_path, "run", 0.1), env={"LLMCUSTOMS_FAULT_INJECT": "sigkill@10"})
    assert killed.returncode == -signal.SIGKILL
    newest = run / "checkpoints" / "step-000009" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:1000])
    resumed = cli("resume", str(run), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert "step-000009 is unusable" in " ".join(resumed.stderr.split())
    assert max_difference(adapter(run), baselines["dropout"]) <= 1e-5


def test_resume_with_nothing_to_resume_says_so(tmp_path, cli):
    result = cli("resume", "--output-dir", str(tmp_path))
    assert result.returncode == 2
    assert "No unfinished run" in result.stderr and "Traceback" not in result.stderr


def test_no_module_unpickles_anything():
    """Checkpoints are safetensors and JSON only: no pickle, no torch.load."""
    forbidden_modules = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
    package = Path(__file__).parent.parent.parent / "llmcustoms"
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not {a.name.split(".")[0] for a in node.names} & forbidden_modules, path
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] not in forbidden_modules, path
            elif isinstance(node, ast.Attribute) and node.attr in ("load", "loads"):
                owner = ast.unparse(node.value)
                assert owner not in ("torch", "pickle", "np", "numpy"), f"{path}: {owner}.{node.attr}"
            elif isinstance(node, ast.keyword) and node.arg in ("allow_pickle", "weights_only"):
                assert False, f"{path}: {node.arg}="


def test_resume_after_recovery_shortened_the_sequences_matches(tmp_path, tiny_models, cli):
    # Rows long enough that halving max_seq_len changes them; at micro-batch 1 with
    # checkpointing already on, an OOM shortens the sequences.
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"instruction": ("Tell me about bees and honey. " * 8) + str(i),
                                        "output": "Bees make honey from nectar."}) + "\n" for i in range(16)))
    args = ["train", str(data), "--model", str(tiny_models["llama"]), "--eval-split", "0", "--max-seq-len", "128",
            "--batch-size", "1", "--grad-accum", "2", "--gradient-checkpointing", "--max-steps", "6", "--save-every", "1",
            "--lora-dropout", "0", "--output-dir", str(tmp_path), "--yes", "--quiet"]
    whole = cli(*args, "--run-name", "whole", env={"LLMCUSTOMS_FAULT_INJECT": "oom@2"})
    assert whole.returncode == 0, whole.stderr
    assert json.loads((tmp_path / "whole" / "plan.json").read_text())["max_seq_len"] == 64
    stopped = cli(*args, "--run-name", "split", env={"LLMCUSTOMS_FAULT_INJECT": "oom@2,sigint@3"})
    assert stopped.returncode == 130
    resumed = cli("resume", str(tmp_path / "split"), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert max_difference(adapter(tmp_path / "split"), adapter(tmp_path / "whole")) <= 1e-5


def test_resume_refuses_data_that_changed_but_kept_its_row_count(tmp_path, tiny_models, cli):
    data = tmp_path / "mine.jsonl"
    data.write_text(DATA_FILES["alpaca"].read_text())
    stopped = cli("train", str(data), "--model", str(tiny_models["llama"]), "--max-steps", "6", "--output-dir",
                  str(tmp_path), "--run-name", "chg", "--yes", "--quiet", env={"LLMCUSTOMS_FAULT_INJECT": "sigint@2"})
    assert stopped.returncode == 130
    data.write_text(data.read_text().replace("Paris", "Lyon"))
    resumed = cli("resume", str(tmp_path / "chg"))
    assert resumed.returncode == 2 and "has changed since the run started" in " ".join(resumed.stderr.split())


def test_out_of_memory_during_evaluation_retries_it_with_smaller_batches(tmp_path, tiny_models, baselines, cli):
    def rows(run: Path) -> list[dict]:
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    expected = [r for r in rows(baselines["root"] / "plain") if "eval_loss" in r]
    first = next(r["step"] for r in expected if r["step"] > 0)  # the first after training (step 0: the base model)
    result = cli(*train_args(tiny_models["llama"], tmp_path, "run", 0.0),
                 env={"LLMCUSTOMS_FAULT_INJECT": f"eval_oom@{first}"})
    assert result.returncode == 0, result.stderr
    run = tmp_path / "run"
    [recovery] = status(run)["recoveries"]
    assert (recovery["kind"], recovery["step"], recovery["during"]) == ("oom", first, "evaluation")
    assert "evaluation after step" in result.stderr
    # Nothing rolled back: the same steps, the same evaluations, the same adapter.
    got = [r for r in rows(run) if "eval_loss" in r]
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    assert [r["eval_loss"] for r in got] == pytest.approx([r["eval_loss"] for r in expected], abs=1e-5)
    assert [r["step"] for r in rows(run) if "loss" in r] == list(range(1, STEPS + 1))
    assert max_difference(adapter(run), baselines["plain"]) <= 1e-4
