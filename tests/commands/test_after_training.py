"""Life after training: runs, report, generate, chat, export, experiment tracking."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import DATA_FILES
from llmcustoms.cli import app
from llmcustoms.commands.report import analyse
from llmcustoms.runs.run_directory import RunDirectory
from tiny_models import WIDE

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def trained(tiny_models, tmp_path_factory):
    """One short run of the tiny Llama, with TensorBoard tracking."""
    root = tmp_path_factory.mktemp("after")
    result = invoke("train", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["llama"]), "--max-steps", "12",
                    "--lr", "1e-2", "--yes", "--quiet", "--output-dir", str(root), "--run-name", "done",
                    "--report-to", "tensorboard")
    assert result.exit_code == 0, result.output
    return root / "done"


def test_runs_lists_the_run_as_completed(trained):
    result = runner.invoke(app, ["runs", "--output-dir", str(trained.parent)], env={"COLUMNS": WIDE})
    assert result.exit_code == 0
    row = next(line for line in result.output.splitlines() if "done" in line)
    assert "completed" in row and "12/12" in row and "tiny-llama" in row and "lora" in row


def test_report_analyses_the_run_and_plots_it(trained):
    result = invoke("report", str(trained), "--plot")
    assert result.exit_code == 0, result.output
    for topic in ("convergence", "overfitting", "learning rate", "throughput", "recoveries", "Recommendations"):
        assert topic in result.output
    png = (trained / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_report_spots_overfitting_and_recommends_fewer_epochs(tmp_path, trained):
    run = RunDirectory(tmp_path / "overfit")
    run.path.mkdir()
    plan = json.loads((trained / "plan.json").read_text())
    plan.update(total_steps=40, epochs=4.0, eval_overlap_rows=0)  # held out (the fixture's rows repeat)
    (run.path / "plan.json").write_text(json.dumps(plan))
    run.write_status("completed", step=40)
    for step in range(1, 41):
        run.append_metrics({"step": step, "loss": 3.0 - step * 0.05, "lr": 1e-4, "grad_norm": 0.5, "tokens_per_s": 1000})
        if step % 10 == 0:
            run.append_metrics({"step": step, "eval_loss": {10: 2.5, 20: 2.2, 30: 2.4, 40: 2.7}[step]})
    report = analyse(run)
    verdicts = {f.topic: f.verdict for f in report.findings}
    assert verdicts["overfitting"] == "yes"
    assert any("eval loss rose after step 20" in r and "--early-stopping-patience 3" in r for r in report.recommendations)


def test_generate_prints_text_greedy_by_default(trained):
    def reply(*extra: str) -> str:
        result = invoke("generate", str(trained), "--prompt", "What do bees make?", "--max-new-tokens", "8", *extra)
        assert result.exit_code == 0, result.output
        return result.stdout  # the reply alone: what is loaded, and how long it took, goes to stderr

    greedy = reply("--temperature", "0")
    assert greedy.strip()
    # What the model learned, the same every time: no sampling unless asked for.
    assert reply("--seed", "1") == reply("--seed", "2") == greedy


def test_chat_streams_replies_and_ends_on_exit(trained):
    result = runner.invoke(app, ["chat", str(trained), "--max-new-tokens", "6", "--temperature", "0"],
                           input="What do bees make?\n/exit\n", catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert result.output.count("you>") == 2 and "model>" in result.output
    ended = runner.invoke(app, ["chat", str(trained)], input="", catch_exceptions=False)  # Ctrl-D at once
    assert ended.exit_code == 0


def test_export_copies_the_adapter_with_a_model_card(trained, tmp_path):
    result = invoke("export", str(trained), "--output", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "README.md"):
        assert (tmp_path / "out" / name).is_file(), name
    card = (tmp_path / "out" / "README.md").read_text()
    assert "base_model:" not in card and "a local model, `tiny-llama`" in card and "AutoPeftModelForCausalLM.from_pretrained" in card
    again = invoke("export", str(trained), "--output", str(tmp_path / "out"))
    assert again.exit_code == 2 and "already exists" in " ".join(again.output.split())


def test_export_merge_gives_a_standalone_model_with_the_same_logits(trained, tiny_models, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = invoke("export", str(trained), "--output", str(tmp_path / "merged"), "--merge")
    assert result.exit_code == 0, result.output
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    base = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, trained / "adapter").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert tokenizer.chat_template  # the template the run used travels with the model
    ids = tokenizer("What is the capital of France?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, with_adapter(ids).logits, atol=1e-5)


def test_tensorboard_receives_the_same_metrics(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(trained / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/loss")]
    rows = [json.loads(l) for l in (trained / "metrics.jsonl").read_text().splitlines()]
    expected = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    assert [s for s, _ in logged] == [s for s, _ in expected]
    assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6)
    assert events.Scalars("eval/loss")


def test_a_missing_tracking_extra_is_a_clear_message(tmp_path, tiny_models, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    result = invoke("train", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["llama"]), "--report-to", "wandb",
                    "--yes", "--output-dir", str(tmp_path))
    assert result.exit_code == 2
    assert 'pip install "llmcustoms[wandb]"' in " ".join(result.output.split())
    assert not any(tmp_path.iterdir())  # refused before any work


def wandb_history(run: Path) -> list[dict]:
    """The history rows of W&B's offline run files under `run`: W&B's own record
    log (LevelDB's log format: 32 KiB blocks of CRC, length, type, payload), each
    record a protobuf of W&B's schema."""
    import struct

    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(run.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, payload = path.read_bytes(), 7, b""  # after the ':W&B' header
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            payload, pos = payload + data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind in (1, 4):  # a whole record, or the last piece of one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(payload)
                payload = b""
                if record.WhichOneof("record_type") == "history":
                    rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                 for item in record.history.item})
    return rows


def test_wandb_receives_the_same_metrics_across_a_rollback_and_a_resume(tmp_path, tiny_models, monkeypatch):
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "cfg"),
                        "WANDB_CACHE_DIR": str(tmp_path / "cache"), "WANDB_DATA_DIR": str(tmp_path / "data")}.items():
        monkeypatch.setenv(name, value)
    common = ("--model", str(tiny_models["llama"]), "--lr", "1e-2", "--save-every", "2", "--yes", "--quiet",
              "--output-dir", str(tmp_path), "--run-name", "wb", "--report-to", "wandb")
    monkeypatch.setenv("LLMCUSTOMS_FAULT_INJECT", "oom@4,sigint@5")  # steps 3 and 4 again after a rollback to 2
    stopped = invoke("train", str(DATA_FILES["alpaca"]), "--max-steps", "6", *common)
    assert stopped.exit_code == 130, stopped.output
    monkeypatch.delenv("LLMCUSTOMS_FAULT_INJECT")
    resumed = invoke("resume", str(tmp_path / "wb"), "--quiet", "--report-to", "wandb")
    assert resumed.exit_code == 0, resumed.output
    run = tmp_path / "wb"
    assert len(list(run.glob("wandb/offline-run-*"))) == 2  # train and resume ...
    assert len({p.name.rsplit("-", 1)[0].split("-", 3)[-1] for p in run.glob("wandb/offline-run-*")}) == 1  # ... one id
    logged = [(row["train/step"], row["train/loss"]) for row in wandb_history(run) if "train/loss" in row]
    assert [step for step, _ in logged] == [1, 2, 3, 3, 4, 5, 6]  # none dropped, the rolled-back step included
    last_logged = dict(logged)
    expected = {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if "loss" in r}
    assert sorted(last_logged) == sorted(expected) == list(range(1, 7))
    assert [last_logged[s] for s in sorted(expected)] == pytest.approx([expected[s] for s in sorted(expected)], rel=1e-6)
