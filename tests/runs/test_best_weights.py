"""The weights a run keeps: the best evaluation's, even between checkpoints and
across a resume; the base model measured first; perplexity and sample replies
recorded where a user looks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import FIXTURES

from llmcustoms.commands.model_card import model_card
from llmcustoms.commands.report import analyse
from llmcustoms.data.prompt_draws import pick_prompts, prompt_of
from llmcustoms.losses.sft import select_logits, token_cross_entropy
from llmcustoms.planning.hardware import Hardware
from llmcustoms.planning.train_options import TrainOptions
from llmcustoms.preparation.preparing import prepare_run
from llmcustoms.recovery.recovery_system import TrainingInterrupted
from llmcustoms.reporting import SilentReporter
from llmcustoms.runs.best_weights import BestWeightFiles
from llmcustoms.runs.run_directory import RunDirectory
from llmcustoms.training.batching import TrainingRows
from llmcustoms.training.finetuner import FineTuner
from llmcustoms.training.samples import SampleReplies, held_out_prompts, side_by_side

STEPS, SAVE_EVERY = 8, 4


def climb_after_three(step: int, plan) -> float:
    """Learn for three steps, then climb the loss (a negative learning rate):
    eval loss is best at step 3, between the checkpoints of steps 4 and 8."""
    return 1.0 if step < 3 else -3.0


def prepared_run(model_dir: Path, **overrides):
    settings = {"max_steps": STEPS, "lora_dropout": 0.0, "lr": 1e-2, "warmup_ratio": 0.0, "eval_every": 1,
                "save_every": SAVE_EVERY, "early_stopping_patience": 0, "eval_split": 0.2, **overrides}
    options = TrainOptions(data=str(FIXTURES / "alpaca.jsonl"), model=str(model_dir),
                           overrides={k: (v, "flag") for k, v in settings.items()})
    return prepare_run(options, Hardware.cpu_only())


def run(tmp_path: Path, prepared, name: str, resume: bool = False, faults=None, samples: bool = True):
    run_dir = RunDirectory(tmp_path / name)
    if not resume:
        run_dir.create()
        run_dir.write_plan(prepared.plan)
    replies = SampleReplies(held_out_prompts(prepared), prepared.tokenizer, prepared.plan, run_dir,
                            max_new_tokens=4) if samples else None
    tuner = FineTuner(prepared.plan, prepared.tokenizer, prepared.train, prepared.evaluation, run_dir,
                      SilentReporter(), faults=faults, schedule=climb_after_three, samples=replies)
    return tuner, tuner.run(resume=resume), run_dir


def eval_loss_of(model, prepared) -> float:
    """The eval loss of `model` over the run's evaluation rows, computed afresh."""
    rows = TrainingRows([], prepared.evaluation, prepared.tokenizer.pad_token_id, 1)
    batches = rows.evaluation_batches(4)
    total = torch.tensor(sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches))
    model.eval()
    if not hasattr(model.get_output_embeddings(), "logit_selection"):
        select_logits(model)
    with torch.no_grad():
        return float(sum(token_cross_entropy(model, b, total)[0] for b in batches))


def reloaded(model_dir: Path, adapter: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter)


def evals(run_dir: RunDirectory) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in run_dir.read_metrics() if "eval_loss" in r}


@pytest.mark.slow
def test_the_saved_adapter_is_the_best_evaluation_even_between_checkpoints(tmp_path, tiny_models):
    prepared = prepared_run(tiny_models["llama"])
    _, result, run_dir = run(tmp_path, prepared, "run")
    losses = evals(run_dir)
    best_step = min((s for s in losses if s > 0), key=losses.get)
    assert best_step % SAVE_EVERY != 0 and best_step < STEPS  # the best fell between checkpoints
    assert losses[STEPS] > losses[best_step] + 1e-3  # and the last step is worse
    assert not (run_dir.checkpoints_path / f"step-{best_step:06d}").exists()

    status = run_dir.read_status()
    assert (status["kept_step"], status["best_eval_step"], result.best_eval_step) == (best_step,) * 3
    assert status["last_output"] == "adapter-last" and result.last_output == "adapter-last"
    assert f"step {best_step}" in status["kept"] and "adapter-last/" in status["kept"]
    # adapter/ reproduces the best evaluation's loss; adapter-last/ the last one's.
    kept = eval_loss_of(reloaded(tiny_models["llama"], run_dir.path / "adapter"), prepared)
    last = eval_loss_of(reloaded(tiny_models["llama"], run_dir.path / "adapter-last"), prepared)
    assert kept == pytest.approx(losses[best_step], abs=1e-5)
    assert last == pytest.approx(losses[STEPS], abs=1e-5)

    # The base model was measured before the first step, and perplexity is exp(eval loss).
    rows = [r for r in run_dir.read_metrics() if "eval_loss" in r]
    assert rows[0]["step"] == 0 and status["base_eval_loss"] == pytest.approx(rows[0]["eval_loss"])
    assert all(r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"])) for r in rows)
    model = reloaded(tiny_models["llama"], run_dir.path / "adapter")
    with model.disable_adapter():
        assert eval_loss_of(model, prepared) == pytest.approx(status["base_eval_loss"], abs=1e-5)
    assert status["base_eval_loss"] > losses[best_step]

    # Sample replies: base before the first step, trained at the end, same prompts.
    samples = run_dir.read_samples()
    assert {r["label"] for r in samples} >= {"base", "trained"}
    base_rows = [r for r in samples if r["label"] == "base"]
    trained_rows = [r for r in samples if r["label"] == "trained"]
    assert [r["row"] for r in base_rows] == [r["row"] for r in trained_rows] and base_rows
    assert all(r["step"] == 0 for r in base_rows) and all(r["step"] == STEPS for r in trained_rows)
    assert len(result.samples) == len(base_rows) and all(e["prompt"] for e in result.samples)

    # report and the model card say the same; the card never shows the user's prompts.
    report = analyse(run_dir)
    quality = {f.topic: f for f in report.findings}
    assert quality["weights kept"].verdict == f"step {best_step}"
    assert "perplexity" in quality["quality"].detail and report.samples
    card = model_card(run_dir, prepared.plan, merged=False)
    assert "perplexity" in card and f"step {best_step}" in card
    assert not any(entry["prompt"] in card for entry in report.samples)


@pytest.mark.slow
def test_a_resumed_run_keeps_the_same_best_weights(tmp_path, tiny_models, monkeypatch):
    from llmcustoms.recovery.faults import FaultInjector

    prepared = prepared_run(tiny_models["llama"])
    _, reference, reference_dir = run(tmp_path, prepared, "reference", samples=False)
    # Stopped after step 6 (with a checkpoint of it): the best, step 3, is only a kept file.
    monkeypatch.setenv("LLMCUSTOMS_FAULT_INJECT", "sigterm@6")
    with pytest.raises(TrainingInterrupted):
        run(tmp_path, prepared, "run", faults=FaultInjector.from_env(), samples=False)
    monkeypatch.delenv("LLMCUSTOMS_FAULT_INJECT")
    run_dir = RunDirectory(tmp_path / "run")
    assert BestWeightFiles(run_dir.best_path).steps() == [reference.best_eval_step]
    _, resumed, _ = run(tmp_path, prepared, "run", resume=True, samples=False)
    assert resumed.best_eval_step == reference.best_eval_step
    for name in ("adapter", "adapter-last"):
        expected = load_file(str(reference_dir.path / name / "adapter_model.safetensors"))
        actual = load_file(str(run_dir.path / name / "adapter_model.safetensors"))
        assert max(float((expected[k] - actual[k]).abs().max()) for k in expected) <= 1e-6
    assert run_dir.read_status()["kept_step"] == reference.best_eval_step


@pytest.mark.slow
def test_full_fine_tuning_keeps_the_best_evaluation_as_a_checkpoint(tmp_path, tiny_models):
    from transformers import AutoModelForCausalLM

    prepared = prepared_run(tiny_models["llama"], method="full", lr=1e-3)
    _, result, run_dir = run(tmp_path, prepared, "run", samples=False)
    best = result.best_eval_step
    assert best % SAVE_EVERY != 0
    assert (run_dir.checkpoints_path / f"step-{best:06d}").is_dir()  # kept through pruning
    model = AutoModelForCausalLM.from_pretrained(run_dir.path / "model", dtype=torch.float32)
    assert eval_loss_of(model, prepared) == pytest.approx(evals(run_dir)[best], abs=1e-5)
    assert (run_dir.path / "model-last" / "config.json").is_file()


def test_best_weight_files_follow_rollbacks_and_keep_what_checkpoints_name(tmp_path):
    files = BestWeightFiles(tmp_path / "best")
    for step in (3, 5, 9):
        files.keep(step, {"w": torch.full((2,), float(step))}, eval_loss=1.0 / step)
    assert files.steps() == [3, 5, 9]
    files.forget_after(5)  # went back to a checkpoint of step 5
    assert files.steps() == [3, 5]
    files.prune({5})
    assert files.steps() == [5] and float(files.load(5)["w"][0]) == 5.0
    assert files.load(3) is None
    assert not list((tmp_path / "best").glob(".*tmp"))  # nothing half-written left


def test_sample_prompts_come_from_held_out_rows_seeded_and_skip_rows_without_a_prompt():
    from llmcustoms.data.dataset import Example

    chat = Example(1, messages=(("system", "be brief"), ("user", "Who are you?"), ("assistant", "I am X."),
                                ("user", "Bye"), ("assistant", "Bye!")))
    raw = Example(2, prompt="2+2=", completion="4")
    text = Example(3, completion="just text")
    first = prompt_of(chat)
    assert first.text == "Who are you?" and first.reference == "I am X." and len(first.messages) == 2
    assert prompt_of(raw).text == "2+2=" and prompt_of(text) is None
    many = [Example(i, prompt=f"q{i}", completion=f"a{i}") for i in range(20)]
    picked = pick_prompts(many, 3, seed=7)
    assert picked == pick_prompts(many, 3, seed=7) and picked != pick_prompts(many, 3, seed=8)
    assert [p.row for p in picked] == sorted(p.row for p in picked) and len(picked) == 3
    entries = side_by_side([{"step": 0, "label": "base", "row": 2, "prompt": "2+2=", "reply": "5", "reference": "4"},
                            {"step": 4, "label": "eval", "row": 2, "prompt": "2+2=", "reply": "4.", "reference": "4"},
                            {"step": 8, "label": "trained", "row": 2, "prompt": "2+2=", "reply": "4", "reference": "4"}])
    assert entries == [{"prompt": "2+2=", "reference": "4", "base": "5", "trained": "4"}]


def test_a_run_without_evaluation_keeps_the_last_weights_and_says_so(tmp_path, tiny_models):
    prepared = prepared_run(tiny_models["llama"], eval_split=0.0, max_steps=2)
    _, result, run_dir = run(tmp_path, prepared, "run")
    status = run_dir.read_status()
    assert status["kept_step"] == 2 and "no evaluation" in status["kept"] and status["base_eval_loss"] is None
    assert not (run_dir.path / "adapter-last").exists()
    assert not run_dir.read_samples() and not [r for r in run_dir.read_metrics() if "eval_loss" in r]
    assert json.loads((run_dir.path / "adapter" / "adapter_config.json").read_text())


def test_summary_report_and_runs_show_perplexity_samples_and_the_kept_step(tmp_path, tiny_models):
    from typer.testing import CliRunner

    from llmcustoms.cli import app

    def invoke(*args: str) -> str:
        result = CliRunner().invoke(app, list(args), catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return " ".join(result.output.replace("│", " ").split())  # Rich's table wrapping undone

    trained = invoke("train", str(FIXTURES / "sharegpt.json"), "--model", str(tiny_models["llama"]), "--max-steps",
                     "3", "--eval-every", "1", "--eval-split", "0.3", "--yes", "--output-dir", str(tmp_path),
                     "--run-name", "r")
    status = json.loads((tmp_path / "r" / "status.json").read_text())
    assert "base model eval loss" in trained and "perplexity" in trained and "than the base model" in trained
    assert "Sample replies" in trained and "weights kept" in trained
    prompt = side_by_side(RunDirectory(tmp_path / "r").read_samples())[0]["prompt"]
    assert " ".join(prompt.split())[:20] in trained  # the user's own held-out prompt, in their terminal
    reported = invoke("report", str(tmp_path / "r"), "--details")
    assert "quality" in reported and "perplexity" in reported and f"step {status['kept_step']}" in reported
    assert "Sample replies" in reported
    listed = invoke("runs", "--output-dir", str(tmp_path))
    assert "eval ppl" in listed and f"{math.exp(status['best_eval_loss']):.4g}" in listed


def test_report_never_asks_for_more_patience_or_epochs_after_early_stopping(tmp_path, tiny_models):
    from dataclasses import replace

    run_dir = RunDirectory(tmp_path / "r")
    run_dir.create()
    # Held out: the fixture's rows repeat, so its split's evaluation rows are copies of training rows.
    plan = replace(prepared_run(tiny_models["llama"]).plan, total_steps=20, epochs=3, eval_overlap_rows=0)
    run_dir.write_plan(plan)
    for step in range(1, 21):  # train loss still falling, eval loss rising since step 8
        run_dir.append_metrics({"step": step, "loss": 3.0 - 0.1 * step, "lr": 1e-4, "grad_norm": 1.0,
                                "tokens_per_s": 100.0})
        if step % 4 == 0:
            run_dir.append_metrics({"step": step, "eval_loss": 2.0 + abs(step - 8) * 0.1, "eval_ppl": 1.0})
    run_dir.write_status("completed", step=20, best_eval_loss=2.0, best_eval_step=8, base_eval_loss=2.5,
                         stop_cause="early stopping", kept_step=8, kept="the best evaluation's")
    report = analyse(run_dir)
    text = " ".join(report.recommendations)
    assert "eval loss rose after step 8" in text  # the finding is there...
    assert "patience" not in text and "--epochs 6" not in text and "--max-steps 40" not in text  # ...not more of it
    assert "were kept" in text


def test_a_non_finite_eval_loss_is_never_the_best():
    from llmcustoms.training.position import Position

    position = Position(step=1)
    assert position.early_stop(float("nan"), patience=2) is None and position.best_step is None
    position.step = 2
    position.early_stop(1.5, patience=2)
    position.step = 3
    position.early_stop(float("inf"), patience=2)
    assert (position.best_step, position.best_eval, position.evals_since_best) == (2, 1.5, 1)


def test_a_question_the_data_repeats_is_drawn_once():
    from llmcustoms.data.row_formats import Example, Message

    def ask(row: int, question: str) -> Example:
        return Example(row=row, messages=(Message("user", question), Message("assistant", "Hello!")))

    rows = [ask(1, "What is up?"), ask(2, "Who are you?"), ask(3, "What is up?"), ask(4, "What is up?")]
    picked = pick_prompts(rows, 3, seed=0)
    assert sorted(p.text for p in picked) == ["What is up?", "Who are you?"]
    assert [p.row for p in picked] == [1, 2]  # the first row that asks it
