"""failure.json: what a failed run leaves for a bug report. Its classification
and redaction are tested here directly; an injected bug (`bug@2`) is run end to
end through the CLI, with a token in the environment and in the model's path."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from conftest import DATA_FILES
from llmcustoms.runs import failure_report as failurereport
from llmcustoms.data.chat_turns import RowProblem
from llmcustoms.errors import ConfigError, DataError
from llmcustoms.runs.failure_report import (MESSAGE_CHARS, REDACTED, classify, format_traceback, redact,
                                      save_failure_report)
from llmcustoms.runs.run_directory import RunDirectory
from test_checkpoints import plan

# Fake, but shaped as the real ones are.
HF_TOKEN = "hf_" + "Zq3xK9LmP2vR7tY1wE5uI8oA4sD6fG0hJk"
OPENAI_KEY = "sk-" + "proj-AbCdEfGhIjKlMnOpQrStUv"


def raised(error: BaseException, cause: BaseException | None = None) -> BaseException:
    """`error` with a traceback (raised from `cause`, when given)."""
    try:
        raise error from cause
    except BaseException as caught:
        return caught


# --------------------------------------------------------------- redaction

def test_secret_looking_variables_are_redacted_anywhere_in_the_report(monkeypatch):
    monkeypatch.setenv("MY_SERVICE_PASSWORD", "correct-horse")
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    monkeypatch.setenv("SOME_AUTH", "short")  # under 6 characters: ordinary words would vanish
    monkeypatch.setenv("MY_MODEL_NAME", "tinyllama-chat")  # not a secret's name
    report = {"reason": "login as correct-horse failed with tinyllama-chat",
              "plan": {"data": "/runs/0123456789abcdef/x", "0123456789abcdef": [("tuple", "correct-horse")]},
              "step": 3, "ratio": 0.5, "ok": True, "none": None, "path": SimpleNamespace(x=1)}
    clean = redact(report)
    text = json.dumps(clean)
    assert "correct-horse" not in text and "0123456789abcdef" not in text
    assert clean["reason"] == f"login as {REDACTED} failed with tinyllama-chat"
    assert clean["plan"] == {"data": f"/runs/{REDACTED}/x", REDACTED: [["tuple", REDACTED]]}
    assert (clean["step"], clean["ratio"], clean["ok"], clean["none"]) == (3, 0.5, True, None)
    assert redact("short and sweet") == "short and sweet"


def test_tokens_are_redacted_by_their_shape_without_the_environment(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    text = f"Authorization: Bearer {HF_TOKEN}; openai={OPENAI_KEY}; model hf_internal-testing"
    assert redact(text) == f"Authorization: Bearer {REDACTED}; openai={REDACTED}; model hf_internal-testing"
    # Words that merely contain the prefixes stay.
    assert redact("task-scheduler-for-the-big-disk-cleanup") == "task-scheduler-for-the-big-disk-cleanup"


def test_an_exceptions_message_is_capped_in_the_traceback():
    error = raised(ValueError("row text " + "x" * 50_000))
    text = format_traceback(error)
    assert "ValueError: row text" in text and "more characters" in text
    assert len(text) < MESSAGE_CHARS + 2_000


def test_the_traceback_holds_the_causes_as_python_prints_them():
    error = raised(RuntimeError("outer"), raised(KeyError("inner")))
    text = format_traceback(error)
    assert text.index("KeyError: 'inner'") < text.index("direct cause") < text.index("RuntimeError: outer")
    assert "test_failurereport.py" in text  # the frames, with their files


# ---------------------------------------------------------- classification

@pytest.mark.parametrize("kind, expected", [("oom", "out_of_memory"), ("nan", "nan"), ("divergence", "divergence")])
def test_a_reports_own_kind_is_its_class(kind, expected):
    assert classify(None, kind) == expected


@pytest.mark.parametrize("error, expected", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "out_of_memory"),
    (DataError("data.jsonl: no usable rows"), "data"),
    (RuntimeError("CUDA error: device-side assert triggered"), "cuda"),
    (RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"), "cuda"),
    (RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx"), "cuda"),
    (RuntimeError("NCCL communicator was aborted"), "cuda"),
    (RuntimeError("The NVIDIA driver on your system is too old"), "cuda"),
    (KeyError("lora_A"), "bug"),
    (RuntimeError("injected bug (LLMCUSTOMS_FAULT_INJECT=bug@2)"), "bug"),
])
def test_an_unexpected_error_is_classified_by_its_type_and_message(error, expected):
    assert classify(error) == expected


def test_a_data_problem_or_a_cuda_error_is_found_among_the_causes():
    assert classify(raised(RuntimeError("tokenizing failed"), RowProblem("field 'output' is empty"))) == "data"

    class AcceleratorError(RuntimeError):
        pass

    assert classify(raised(ValueError("step failed"), AcceleratorError("an illegal memory access"))) == "cuda"


# ------------------------------------------------------------------ writing

def failed_report() -> dict:
    return {"kind": "error", "step": 2, "reason": "unexpected error at step 2: RuntimeError: boom",
            "suggestions": ["resume with `llmcustoms resume`"]}


def test_the_report_holds_what_a_bug_report_needs(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    run = RunDirectory(tmp_path / "run")
    run.create()
    for step in range(1, 8):
        run.append_metrics({"step": step, "loss": 2.0 / step, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 50.0})
    said = save_failure_report(run, plan(model=f"/models/{HF_TOKEN}/tiny"), raised(RuntimeError("boom")),
                               failed_report())
    assert said is not None and str(run.failure_path) in said
    text = run.failure_path.read_text()
    assert HF_TOKEN not in text
    report = json.loads(text)
    assert report["failure"] == "bug" and report["step"] == 2 and report["error"] == "RuntimeError: boom"
    assert report["plan"]["model"] == f"/models/{REDACTED}/tiny" and report["plan"]["micro_batch_size"] == 8
    assert [row["step"] for row in report["last_metrics"]] == [3, 4, 5, 6, 7]
    assert report["versions"]["torch"] == torch.__version__ and report["versions"]["cuda"] == torch.version.cuda
    assert set(report["versions"]) >= {"python", "transformers", "peft", "accelerate", "bitsandbytes", "llmcustoms"}
    assert report["hardware"]["cpu_cores"] >= 1
    assert report["suggestions"] == ["resume with `llmcustoms resume`"]


def test_a_failing_hardware_detection_or_a_full_disk_never_hides_the_failure(tmp_path, monkeypatch):
    def broken_detect():
        raise OSError("NVML exploded")

    monkeypatch.setattr("llmcustoms.planning.hardware.detect", broken_detect)
    run = RunDirectory(tmp_path / "run")
    run.create()
    save_failure_report(run, plan(), raised(RuntimeError("boom")), failed_report())
    assert json.loads(run.failure_path.read_text())["hardware"] == {"detection_failed": "OSError: NVML exploded"}

    def disk_full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(failurereport, "write_json_atomic", disk_full)
    said = save_failure_report(RunDirectory(tmp_path / "full"), plan(), raised(RuntimeError("boom")), failed_report())
    assert said is not None and "could not be written" in said and "No space left on device" in said


def test_only_the_main_process_writes_it(tmp_path):
    run = RunDirectory(tmp_path, writable=False)
    assert save_failure_report(run, plan(), raised(RuntimeError("boom")), failed_report()) is None
    assert not run.failure_path.exists()


def test_a_bug_escaping_the_loop_marks_the_run_failed_and_a_user_error_does_not(tmp_path):
    from llmcustoms.runs.run_log import RunLog
    from llmcustoms.commands.train import _record_escaped

    run = RunDirectory(tmp_path / "run")
    run.create()
    run.write_status("running", step=0)
    tuner = SimpleNamespace(plan=plan(), position=SimpleNamespace(step=0))
    log = RunLog(run.log_path)
    _record_escaped(ConfigError("the model cannot be loaded", "check --model"), tuner, run, log)
    assert run.read_status()["status"] == "running" and not run.failure_path.exists()
    _record_escaped(raised(AttributeError("'NoneType' object has no attribute 'config'")), tuner, run, log)
    status = run.read_status()
    assert status["status"] == "failed" and "AttributeError" in status["reason"]
    report = json.loads(run.failure_path.read_text())
    assert report["failure"] == "bug" and "AttributeError" in report["traceback"]
    log_text = run.log_path.read_text()
    assert "stopped: the model cannot be loaded" in log_text and str(run.failure_path) in log_text


# ------------------------------------------------------------- end to end

@pytest.mark.slow
def test_an_injected_bug_writes_failure_json_without_the_token(tmp_path, tiny_models, cli):
    # The model's directory is named after the token too, as a token pasted into a
    # path would be: the plan in failure.json and the log's first line hold it.
    model = tmp_path / HF_TOKEN / "llama"
    shutil.copytree(tiny_models["llama"], model)
    result = cli("train", str(DATA_FILES["alpaca"]), "--model", str(model), "--max-steps", "4", "--batch-size", "4",
                 "--grad-accum", "1", "--output-dir", str(tmp_path / "runs"), "--run-name", "run", "--yes", "--quiet",
                 env={"LLMCUSTOMS_FAULT_INJECT": "bug@2", "HF_TOKEN": HF_TOKEN})
    assert result.returncode == 1, result.stderr
    run = tmp_path / "runs" / "run"
    output = result.stdout + result.stderr
    assert str(run / "failure.json") in output
    text = (run / "failure.json").read_text()
    report = json.loads(text)
    assert report["failure"] == "bug" and report["step"] == 2
    assert "injected bug" in report["traceback"] and "llmcustoms/recovery/faults.py" in report["traceback"]
    assert report["error"] == "RuntimeError: injected bug (LLMCUSTOMS_FAULT_INJECT=bug@2)"
    assert report["versions"]["torch"] == torch.__version__ and report["versions"]["llmcustoms"]
    assert report["plan"]["total_steps"] == 4 and report["plan"]["model"].endswith(f"{REDACTED}/llama")
    assert [r["step"] for r in report["last_metrics"] if "loss" in r] == [1]
    assert report["suggestions"]
    log = (run / "train.log").read_text()
    assert "failed: unexpected error at step 2" in log and str(run / "failure.json") in log
    for where in (text, log, output):
        assert HF_TOKEN not in where
    assert json.loads((run / "status.json").read_text())["status"] == "failed"
