"""A stop (SIGINT, SIGTERM) is honoured within about one micro-batch wherever
the loop spends long: evaluations, sample replies, DPO's reference pass. A
stop inside an evaluation keeps its finished step and `resume` evaluates again;
a second signal quits at once, saying so in status.json."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import DATA_FILES, start_cli
from test_best_weights import prepared_run
from test_recovery import until_asleep

STOP_STEP = 6  # an evaluation is due after it (every 2 steps), a checkpoint is not (every 4)


def adapter(run: Path) -> dict:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def status(run: Path) -> dict:
    return json.loads((run / "status.json").read_text())


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def evaluations(run: Path) -> list[tuple[int, float]]:
    return [(row["step"], row["eval_loss"]) for row in metrics(run) if "eval_loss" in row]


def steps(run: Path) -> list[int]:
    return [row["step"] for row in metrics(run) if "loss" in row]


def assert_same_run(run: Path, uninterrupted: Path) -> None:
    """The same adapter and the same rows of metrics.jsonl (none doubled, none missing)."""
    ours, theirs = adapter(run), adapter(uninterrupted)
    assert ours.keys() == theirs.keys()
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in ours) <= 1e-5
    assert steps(run) == steps(uninterrupted)
    assert [s for s, _ in evaluations(run)] == [s for s, _ in evaluations(uninterrupted)]
    assert [loss for _, loss in evaluations(run)] == pytest.approx([loss for _, loss in evaluations(uninterrupted)],
                                                                   abs=1e-6)


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def wait_for(condition, process, seconds: float = 180, ending: bool = False) -> None:
    """Until `condition()`, while `process` runs (`ending`: it may end meanwhile)."""
    deadline = time.time() + seconds
    while not condition() and time.time() < deadline and process.poll() is None:
        time.sleep(0.01)
    assert condition() and (ending or process.poll() is None), "the run ended, or never got there"


# ------------------------------------------------------------- in process

class SignalInEvaluation:
    """What `FineTuner` asks of a `FaultInjector`: here, SIGTERM to this process
    from inside the first forward pass of the evaluation after `step`."""

    def __init__(self, step: int):
        self.step, self.rank, self.sent = step, 0, False

    def due(self, kind: str, step: int) -> bool:
        return False

    def send_signal_if_due(self, step: int) -> None:
        pass

    def kill_saving(self, step: int | None, where: str) -> None:
        pass

    def in_forward(self, step: int, training: bool) -> None:
        if not training and step == self.step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


def train(tmp_path: Path, prepared, name: str, resume: bool = False, faults=None):
    from llmcustoms.training.finetuner import FineTuner
    from llmcustoms.reporting import SilentReporter
    from llmcustoms.runs.run_directory import RunDirectory

    run_dir = RunDirectory(tmp_path / name)
    if not resume:
        run_dir.create()
        run_dir.write_plan(prepared.plan)
    tuner = FineTuner(prepared.plan, prepared.tokenizer, prepared.train, prepared.evaluation, run_dir,
                      SilentReporter(), faults=faults)
    return tuner.run(resume=resume)


@pytest.fixture(scope="module")
def prepared(tiny_models):
    return prepared_run(tiny_models["llama"], eval_every=2, save_every=4, lora_dropout=0.1,
                        micro_batch_size=2, grad_accum=2)


@pytest.fixture(scope="module")
def uninterrupted(prepared, tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    train(root, prepared, "run")
    return root / "run"


@pytest.mark.slow
@pytest.mark.parametrize("stop_step", [STOP_STEP, 8])  # 8: the last step's evaluation
def test_a_stop_inside_an_evaluation_keeps_its_step_and_resume_evaluates_again(tmp_path, prepared, uninterrupted,
                                                                             stop_step):
    from llmcustoms.recovery.recovery_system import TrainingInterrupted

    from llmcustoms.training.batching import TrainingRows

    rows = TrainingRows([], prepared.evaluation, prepared.tokenizer.pad_token_id, 1)
    assert prepared.plan.total_steps == 8 and len(rows.evaluation_batches(prepared.plan.micro_batch_size)) > 2
    with pytest.raises(TrainingInterrupted) as stopped:
        train(tmp_path, prepared, "run", faults=SignalInEvaluation(stop_step))
    assert (stopped.value.signum, stopped.value.step) == (signal.SIGTERM, stop_step)
    run = tmp_path / "run"
    assert (status(run)["status"], status(run)["step"], status(run)["reason"]) == ("interrupted", stop_step,
                                                                                  "stopped by SIGTERM")
    assert (run / "checkpoints" / f"step-{stop_step:06d}" / "manifest.json").exists()  # saved by the stop
    assert stop_step not in [s for s, _ in evaluations(run)] and steps(run)[-1] == stop_step
    train(tmp_path, prepared, "run", resume=True)
    assert status(run)["status"] == "completed"
    assert_same_run(run, uninterrupted)


# ------------------------------------------------------------ the CLI

def cli_args(model: Path, output: Path, name: str) -> list[str]:
    return ["train", str(DATA_FILES["alpaca"]), "--model", str(model), "--max-steps", "8", "--save-every", "4",
            "--eval-every", "2", "--eval-split", "0.25", "--batch-size", "2", "--grad-accum", "2", "--lr", "1e-2",
            "--lora-dropout", "0.1", "--early-stopping-patience", "0", "--output-dir", str(output), "--run-name", name,
            "--yes", "--quiet"]


def start(args: list[str], fault: str):
    return start_cli(*args, env={"LLMCUSTOMS_FAULT_INJECT": fault}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     text=True)


@pytest.mark.slow
def test_sigterm_during_a_long_evaluation_exits_143_within_a_micro_batch_and_resume_matches(tmp_path, tiny_models,
                                                                                           cli):
    """Every micro-batch of the evaluation after step 6 takes SLOW_MICRO_BATCH_S
    longer (6 of them: half a minute in all). SIGTERM a second into it stops it
    after that micro-batch, with step 6 checkpointed (not due on its own)."""
    from llmcustoms.recovery.faults import SLOW_MICRO_BATCH_S

    reference = cli(*cli_args(tiny_models["llama"], tmp_path, "reference"))
    assert reference.returncode == 0, reference.stderr
    run = tmp_path / "run"
    process = start(cli_args(tiny_models["llama"], tmp_path, "run"), f"slow_eval@{STOP_STEP}")
    wait_for(lambda: f'"step": {STOP_STEP}, "epoch"' in _text(run / "metrics.jsonl"), process)
    until_asleep(process)  # inside the evaluation's first micro-batch
    process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    wait_for(lambda: '"interrupted"' in _text(run / "status.json"), process, seconds=60, ending=True)
    stopping = time.monotonic() - sent  # saved and said: what the process does next is leave
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143, err
    assert stopping < 2 * SLOW_MICRO_BATCH_S - 1, stopping  # the rest of one micro-batch, not the evaluation
    assert "Traceback" not in err and f"Stopped at step {STOP_STEP}" in " ".join(err.split())
    state = status(run)
    assert (state["status"], state["step"], state["reason"]) == ("interrupted", STOP_STEP, "stopped by SIGTERM")
    assert (run / "checkpoints" / f"step-{STOP_STEP:06d}" / "manifest.json").exists()
    assert STOP_STEP not in [s for s, _ in evaluations(run)]
    resumed = cli("resume", str(run), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert status(run)["status"] == "completed"
    assert_same_run(run, tmp_path / "reference")


@pytest.mark.slow
def test_a_second_sigint_quits_at_once_and_status_json_says_so(tmp_path, tiny_models):
    """Step 3 is slow (each micro-batch SLOW_MICRO_BATCH_S longer): Ctrl-C twice
    inside it quits at once, without the checkpoint a first Ctrl-C would save."""
    from llmcustoms.recovery.faults import SLOW_MICRO_BATCH_S

    run = tmp_path / "run"
    process = start(cli_args(tiny_models["llama"], tmp_path, "run"), "slow@3")
    wait_for(lambda: '"step": 2, "epoch"' in _text(run / "metrics.jsonl"), process)
    until_asleep(process)  # after step 2's evaluation, inside step 3's first micro-batch
    process.send_signal(signal.SIGINT)
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    sent = time.monotonic()
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert time.monotonic() - sent < SLOW_MICRO_BATCH_S - 1  # not even the rest of the micro-batch
    assert "quitting at once, without saving" in err
    state = status(run)
    assert (state["status"], state["step"]) == ("interrupted", 2)
    assert state["reason"] == "quit at once by a second SIGINT; no checkpoint saved"  # the first is due at step 4
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").glob("step-*"))


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_during_an_evaluation_stops_both_before_the_same_micro_batch(tmp_path,
                                                                                                    tiny_models):
    """Each process has 3 of the evaluation's 6 slow micro-batches; SIGTERM
    reaches process 1 alone, inside its first. They agree on it before the next
    one, write step 6's checkpoint together and leave: no process waits for ever."""
    import psutil

    from llmcustoms.recovery.faults import SLOW_MICRO_BATCH_S

    run = tmp_path / "run"
    process = start([*cli_args(tiny_models["llama"], tmp_path, "run"), "--num-processes", "2"],
                    f"slow_eval@{STOP_STEP}")
    wait_for(lambda: f'"step": {STOP_STEP}, "epoch"' in _text(run / "metrics.jsonl"), process, seconds=400)
    time.sleep(1.0)
    [second] = [p for p in psutil.Process(process.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
    second.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    wait_for(lambda: '"interrupted"' in _text(run / "status.json"), process, seconds=120, ending=True)
    assert time.monotonic() - sent < 2 * SLOW_MICRO_BATCH_S - 1  # not the 3 x 4 s of each share
    _, err = process.communicate(timeout=120)
    assert process.returncode != 0, err[-3000:]
    state = status(run)
    assert (state["status"], state["step"], state["reason"]) == ("interrupted", STOP_STEP, "stopped by SIGTERM")
    assert (run / "checkpoints" / f"step-{STOP_STEP:06d}" / "manifest.json").exists()
    assert err.count(f"Stopped at step {STOP_STEP}") == 1  # one message, from the main process


# ---------------------------------------------------- the signals themselves

QUITTER = """
import os, signal, sys, time
from llmcustoms.recovery.stop_signals import StopSignals

def quitting(signum):
    if sys.argv[1] == "hangs":
        time.sleep(60)
    if sys.argv[1] == "fails":
        raise OSError("the disk is gone")
    open(sys.argv[2], "w").write(signal.Signals(signum).name)

with StopSignals(lambda text: print(text, flush=True), True, quitting) as signals:
    os.kill(os.getpid(), signal.SIGTERM)
    while signals.received is None:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)
"""


@pytest.mark.parametrize("writer", ["writes", "hangs", "fails"])
def test_the_second_signal_tells_status_json_at_best_and_quits_regardless(tmp_path, writer):
    from llmcustoms.recovery.stop_signals import ACKNOWLEDGEMENT, QUIT_WRITE_S

    said = tmp_path / "said"
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", QUITTER, writer, str(said)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 130, result.stderr  # the second signal's number
    assert ACKNOWLEDGEMENT in result.stdout and "quitting at once, without saving" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < QUIT_WRITE_S + 8  # a hung writer is given up on
    assert _text(said) == ("SIGINT" if writer == "writes" else "")


def test_record_quit_says_since_which_step_nothing_was_saved(tmp_path):
    from llmcustoms.runs.checkpoints import CheckpointManager
    from llmcustoms.runs.run_directory import RunDirectory
    from llmcustoms.recovery.stop_signals import record_quit

    run_dir = RunDirectory(tmp_path / "run")
    run_dir.create()
    run_dir.write_status("running", step=7)
    checkpoints = CheckpointManager(run_dir.checkpoints_path, 3)
    record_quit(run_dir, signal.SIGTERM, 7, checkpoints)
    assert (status(run_dir.path)["status"], status(run_dir.path)["reason"]) == (
        "interrupted", "quit at once by a second SIGTERM; no checkpoint saved")
    for step in (3, 6):
        (run_dir.checkpoints_path / f"step-{step:06d}").mkdir(parents=True)
    record_quit(run_dir, signal.SIGINT, 7, checkpoints)
    assert (status(run_dir.path)["step"], status(run_dir.path)["reason"]) == (
        7, "quit at once by a second SIGINT; not saved after step 6")


# ------------------------------------------------ sample replies, reference

def test_sample_replies_stop_at_the_next_token_and_write_nothing(tmp_path, tiny_models, prepared):
    from transformers import AutoModelForCausalLM

    from llmcustoms.runs.run_directory import RunDirectory
    from llmcustoms.training.samples import SampleReplies, held_out_prompts

    run_dir = RunDirectory(tmp_path / "run")
    run_dir.create()
    warnings: list[str] = []
    replies = SampleReplies(held_out_prompts(prepared), prepared.tokenizer, prepared.plan, run_dir,
                            max_new_tokens=40, warn=warnings.append)
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"]).train()
    asked: list[int] = []
    assert replies.answer(model, 3, "eval", lambda: asked.append(1) or len(asked) > 2) == []
    assert len(asked) == 3 and warnings == [] and run_dir.read_samples() == []  # the third token's check stopped it
    assert model.training  # put back as it was
    assert len(replies.answer(model, 3, "eval")) == len(replies.prompts) > 0  # without a stop: every reply


def test_a_stop_during_the_reference_pass_ends_the_run_there(tmp_path, tiny_models):
    from transformers import AutoModelForCausalLM

    from llmcustoms.training.batching import TrainingRows
    from llmcustoms.losses.sft import select_logits
    from llmcustoms.training.processes import Processes
    from llmcustoms.recovery.recovery_system import TrainingInterrupted
    from llmcustoms.losses.dpo_reference import cached_reference, compute
    from llmcustoms.runs.run_directory import RunDirectory
    from llmcustoms.recovery.stop_signals import StopRequested, StopSignals
    from test_dpo import PAIRS, prepare

    prepared = prepare(PAIRS, tiny_models["llama"], method="full")
    data = TrainingRows(prepared.train, [], prepared.tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    select_logits(model)
    asked: list[int] = []
    with pytest.raises(StopRequested):
        compute(model, data.train, data.collate_examples, 2, torch.device("cpu"), nullcontext,
                stopped=lambda: asked.append(1) or len(asked) > 3)
    assert len(asked) == 4 and len(prepared.train) > 4  # three micro-batches of many

    run_dir = RunDirectory(tmp_path / "run")
    run_dir.create()
    run_dir.write_status("running", step=0)
    processes = Processes.start(prepared.plan, run_dir, StopSignals(lambda text: None))
    progress: list[str | None] = []

    def say(text: str | None) -> None:  # SIGTERM as the second micro-batch begins
        progress.append(text)
        if len(progress) == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingInterrupted) as stopped:
        cached_reference(model, data, run_dir, 2, processes, nullcontext, say)
    assert (stopped.value.signum, stopped.value.step) == (signal.SIGTERM, 0)
    assert len([text for text in progress if text]) == 2 and progress[-1] is None  # stopped before the third
    state = status(run_dir.path)
    assert (state["status"], state["reason"]) == ("interrupted", "stopped by SIGTERM while computing DPO's reference")
    assert not (run_dir.path / "reference").exists()
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers are put back


def test_after_a_hang_up_a_late_sighup_is_ignored_once_the_loop_has_ended():
    """The shell and the kernel each send SIGHUP when a terminal closes; the
    second may come after the loop stopped and its handlers were put back,
    and must not kill the process while it writes its ending."""
    from llmcustoms.recovery.stop_signals import StopSignals
    previous, interrupt = signal.getsignal(signal.SIGHUP), signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        stops = StopSignals(warn=lambda text: None)
        with stops:
            os.kill(os.getpid(), signal.SIGHUP)
            deadline = time.time() + 5
            while not stops.hung_up and time.time() < deadline:
                time.sleep(0.01)
        assert stops.received == signal.SIGHUP and stops.hung_up
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGHUP)  # the late one: this test process lives on
        time.sleep(0.05)
        with StopSignals(warn=lambda text: None):
            pass
        # The others are put back as they were: Python's own, or ignored in a job a shell started in the background.
        assert signal.getsignal(signal.SIGINT) == interrupt
    finally:
        signal.signal(signal.SIGHUP, previous)
