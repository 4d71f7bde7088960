"""Past one process: data-parallel training through accelerate's launcher, on CPU
with the gloo backend, as real subprocesses."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import DATA_FILES, start_cli

pytestmark = pytest.mark.slow


def args(model: Path, output: Path, name: str, micro: int, accum: int, steps: int = 6, method: str = "lora") -> list[str]:
    by_method = ["--lora-dropout", "0", "--lr", "1e-2"] if method == "lora" else ["--method", method, "--lr", "1e-3"]
    # fp32: these compare ways of splitting the same work, which bf16's rounding (the default on
    # CPUs that have it) would blur; bf16 against fp32 is test_precision's.
    return ["train", str(DATA_FILES["alpaca"]), "--model", str(model), "--max-steps", str(steps), "--save-every", "2",
            "--batch-size", str(micro), "--grad-accum", str(accum), *by_method, "--mixed-precision", "no",
            "--output-dir", str(output), "--run-name", name, "--yes", "--quiet"]


def adapter(run: Path) -> dict:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def max_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def one_process_run(model: Path, root: Path, micro: int, accum: int, method: str) -> Path:
    from conftest import run_cli

    result = run_cli(*args(model, root, "one", micro, accum, method=method))
    assert result.returncode == 0, result.stderr
    return root / "one"


@pytest.fixture(scope="module")
def single(tiny_models, tmp_path_factory):
    """One process, micro-batch 4 x accumulation 2: effective batch 8."""
    return one_process_run(tiny_models["llama"], tmp_path_factory.mktemp("single"), 4, 2, "lora")


def test_two_processes_match_one_with_the_same_effective_batch(tmp_path, tiny_models, single, cli):
    result = cli(*args(tiny_models["llama"], tmp_path, "two", 4, 1), "--num-processes", "2", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "two"
    plan = json.loads((run / "plan.json").read_text())
    assert (plan["world_size"], plan["micro_batch_size"], plan["grad_accum"], plan["effective_batch_size"]) == (2, 4, 1, 8)
    assert result.stdout.strip() == str(run / "adapter")  # one process speaks
    steps = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    assert steps == [1, 2, 3, 4, 5, 6]  # one writer
    assert max_difference(adapter(run), adapter(single)) <= 1e-4


def test_a_two_process_run_killed_after_a_checkpoint_resumes_with_one_process(tmp_path, tiny_models, single, cli):
    killed = cli(*args(tiny_models["llama"], tmp_path, "run", 4, 1), "--num-processes", "2",
                 env={"LLMCUSTOMS_FAULT_INJECT": "sigkill@4:rank=0"}, timeout=600)
    assert killed.returncode != 0
    run = tmp_path / "run"
    assert (run / "checkpoints" / "step-000004" / "manifest.json").exists()
    assert not (run / "adapter").exists()
    resumed = cli("resume", str(run), "--quiet", timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    plan = json.loads((run / "plan.json").read_text())
    assert (plan["world_size"], plan["grad_accum"], plan["effective_batch_size"]) == (1, 2, 8)
    assert any("resumed with 1 process(es) instead of 2" in r for r in plan["reasons"])
    assert json.loads((run / "status.json").read_text())["status"] == "completed"
    assert max_difference(adapter(run), adapter(single)) <= 1e-4


def test_out_of_memory_on_one_rank_is_recovered_by_both_without_a_hang(tmp_path, tiny_models, single, cli):
    started = time.time()
    result = cli(*args(tiny_models["llama"], tmp_path, "run", 4, 1), "--num-processes", "2",
                 env={"LLMCUSTOMS_FAULT_INJECT": "oom@5:rank=1"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.time() - started < 300
    run = tmp_path / "run"
    [recovery] = json.loads((run / "status.json").read_text())["recoveries"]
    assert recovery["kind"] == "oom" and recovery["step"] == 5
    plan = json.loads((run / "plan.json").read_text())
    assert (plan["micro_batch_size"], plan["effective_batch_size"]) == (2, 8)
    assert max_difference(adapter(run), adapter(single)) <= 1e-4


def test_sigterm_to_the_launcher_checkpoints_once_and_stops_every_process(tmp_path, tiny_models):
    run = tmp_path / "run"
    process = start_cli(*args(tiny_models["llama"], tmp_path, "run", 4, 1, 400), "--num-processes", "2",
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not (run / "checkpoints" / "step-000002").exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode != 0
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "interrupted", err[-3000:]
    assert (run / "checkpoints" / f"step-{status['step']:06d}" / "manifest.json").exists()
    leftover = subprocess.run(["pgrep", "-f", f"--run-name run .*{tmp_path}|{tmp_path}.*--run-name run"],
                              capture_output=True, text=True)
    assert leftover.stdout.strip() == ""  # no rank left behind


# --------------------------------------------------------------------- FSDP
# Full fine-tuning sharded over 2 processes (torch FSDP2 over gloo) against
# full fine-tuning in one process with the same effective batch.

def full_args(model: Path, output: Path, name: str, micro: int, accum: int) -> list[str]:
    return args(model, output, name, micro, accum, method="full")


def full_model(run: Path) -> dict:
    return load_file(str(run / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def single_full(tiny_models, tmp_path_factory):
    """One process, full fine-tuning, micro-batch 2 x accumulation 4: effective batch 8."""
    return one_process_run(tiny_models["llama"], tmp_path_factory.mktemp("single-full"), 2, 4, "full")


def test_fsdp_run_matches_one_process_and_checkpoints_whole_tensors(tmp_path, tiny_models, single_full, cli):
    arguments = [a for a in full_args(tiny_models["llama"], tmp_path, "fsdp", 2, 2) if a != "--quiet"]
    result = cli(*arguments, "--num-processes", "2", "--distributed", "fsdp", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sharded over 2 processes; each holds about 50%" in " ".join(result.stdout.split())
    run = tmp_path / "fsdp"
    plan = json.loads((run / "plan.json").read_text())
    assert (plan["distributed"], plan["world_size"], plan["effective_batch_size"]) == ("fsdp", 2, 8)
    assert max_difference(full_model(run), full_model(single_full)) <= 1e-4
    # The checkpoint holds the same whole tensors, under the same names, as one process writes.
    for name in ("model.safetensors", "optimizer.safetensors"):
        sharded = load_file(str(run / "checkpoints" / "step-000004" / name))
        whole = load_file(str(single_full / "checkpoints" / "step-000004" / name))
        assert {k: v.shape for k, v in sharded.items()} == {k: v.shape for k, v in whole.items()}
        assert max_difference(sharded, whole) <= 1e-4


def test_fsdp_out_of_memory_on_one_rank_restarts_every_process_and_completes(tmp_path, tiny_models, single_full, cli):
    started = time.time()
    result = cli(*full_args(tiny_models["llama"], tmp_path, "run", 2, 2), "--num-processes", "2",
                 "--distributed", "fsdp", env={"LLMCUSTOMS_FAULT_INJECT": "oom@5:rank=1"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.time() - started < 300
    assert "Process 1 ran out of memory at step 5" in result.stderr
    run = tmp_path / "run"
    assert not (run / "restart.json").exists()
    [recovery] = json.loads((run / "status.json").read_text())["recoveries"]
    assert (recovery["kind"], recovery["step"], recovery["details"]["micro_batch_size"]) == ("oom", 5, [2, 1])
    plan = json.loads((run / "plan.json").read_text())
    assert (plan["micro_batch_size"], plan["grad_accum"], plan["effective_batch_size"]) == (1, 4, 8)
    # Rolled back to step 4's checkpoint and redone with smaller micro-batches: the same update.
    steps = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert max_difference(full_model(run), full_model(single_full)) <= 1e-4


def test_fsdp_run_killed_after_a_checkpoint_resumes_unsharded_in_one_process(tmp_path, tiny_models, single_full, cli):
    killed = cli(*full_args(tiny_models["llama"], tmp_path, "run", 2, 2), "--num-processes", "2",
                 "--distributed", "fsdp", env={"LLMCUSTOMS_FAULT_INJECT": "sigkill@4:rank=0"}, timeout=600)
    assert killed.returncode != 0
    run = tmp_path / "run"
    assert (run / "checkpoints" / "step-000004" / "manifest.json").exists()
    resumed = cli("resume", str(run), "--quiet", timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    plan = json.loads((run / "plan.json").read_text())
    assert (plan["world_size"], plan["distributed"], plan["grad_accum"]) == (1, "none", 4)
    assert max_difference(full_model(run), full_model(single_full)) <= 1e-4


def test_fsdp_with_tied_embeddings_saves_the_same_model_as_one_process(tmp_path, tiny_models, cli):
    """Qwen2 ties its LM head to the embedding: sharded, gathered and saved, it
    must still be one tensor, as a single process saves it. Micro-batch 8 makes
    the 5 evaluation rows one batch: rank 1 has none of its own and must still
    join every gather (padding with a zero-weight batch), or rank 0 would hang."""
    one = cli(*full_args(tiny_models["qwen2"], tmp_path, "one", 8, 2), timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    sharded = cli(*full_args(tiny_models["qwen2"], tmp_path, "fsdp", 8, 1), "--num-processes", "2",
                  "--distributed", "fsdp", timeout=300)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    expected, got = full_model(tmp_path / "one"), full_model(tmp_path / "fsdp")
    assert sorted(got) == sorted(expected) and "lm_head.weight" not in got
    # Adam divides each update by the root of its second moment: for an embedding row of a token
    # seldom seen, whose gradient is near zero, the order of the sums moves the update by up to
    # about 1e-4 (1.3e-4 measured on a CPU with AVX512 and AMX); a model saved wrong is off by far more.
    assert max_difference(got, expected) <= 5e-4

    def evals(run: Path) -> list[float]:
        return [json.loads(l)["eval_loss"] for l in (run / "metrics.jsonl").read_text().splitlines() if "eval_loss" in l]

    assert evals(tmp_path / "fsdp") == pytest.approx(evals(tmp_path / "one"), abs=1e-4) and evals(tmp_path / "one")


def test_fsdp_signal_reaching_one_rank_stops_both_after_the_same_step_then_resumes_sharded(
        tmp_path, tiny_models, single_full, cli):
    """SIGTERM reaches rank 1 alone after step 3, after the ranks agreed on step 3.
    Checkpointing gathers from every rank, so both must stop after the same step:
    the next one, where they agree. Resumed with 2 processes, still sharded."""
    stopped = cli(*full_args(tiny_models["llama"], tmp_path, "run", 2, 2), "--num-processes", "2",
                  "--distributed", "fsdp", env={"LLMCUSTOMS_FAULT_INJECT": "sigterm@3:rank=1"}, timeout=300)
    assert stopped.returncode != 0
    run = tmp_path / "run"
    status = json.loads((run / "status.json").read_text())
    assert (status["status"], status["step"]) == ("interrupted", 4), stopped.stderr[-3000:]
    assert stopped.stderr.count("Stopped at step 4") == 1  # one message, from the main process
    resumed = cli("resume", str(run), "--num-processes", "2", "--quiet", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    plan = json.loads((run / "plan.json").read_text())
    assert (plan["world_size"], plan["distributed"]) == (2, "fsdp")
    assert max_difference(full_model(run), full_model(single_full)) <= 1e-4


def test_out_of_memory_during_evaluation_on_one_rank_is_agreed_without_a_hang(tmp_path, tiny_models, single, cli):
    evals = [json.loads(l)["step"] for l in (single / "metrics.jsonl").read_text().splitlines() if "eval_loss" in l]
    evals = [step for step in evals if step > 0]  # step 0: the base model
    result = cli(*args(tiny_models["llama"], tmp_path, "run", 4, 1), "--num-processes", "2",
                 env={"LLMCUSTOMS_FAULT_INJECT": f"eval_oom@{evals[0]}:rank=1"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    [recovery] = json.loads((run / "status.json").read_text())["recoveries"]
    assert (recovery["step"], recovery["during"]) == (evals[0], "evaluation")
    assert max_difference(adapter(run), adapter(single)) <= 1e-4
