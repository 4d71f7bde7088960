"""`resume` as users ask for it: `--from` an earlier checkpoint, `--reset-optimizer`,
and `--epochs` to extend a run, a completed one too. End to end through the CLI
(slow), with the pieces they rest on checked on their own (fast)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import DATA_FILES, run_cli
from llmcustoms.runs.checkpoints import CheckpointManager, ResumeFrom, step_named
from llmcustoms.errors import ConfigError
from llmcustoms.training.optimization import lr_multiplier
from llmcustoms.planning.plan import Plan
from llmcustoms.training.position import Position
from llmcustoms.runs.training_time import seconds_between

STEPS = 8


def train_args(model: Path, output: Path, name: str, *extra: str) -> list[str]:
    # Early stopping off: every run trains the steps it is planned for.
    return ["train", str(DATA_FILES["alpaca"]), "--model", str(model), "--save-every", "2", "--batch-size", "4",
            "--grad-accum", "2", "--lr", "1e-2", "--lora-dropout", "0.1", "--early-stopping-patience", "0",
            "--output-dir", str(output), "--run-name", name, "--yes", "--quiet", *extra]


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def step_rows(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def checkpoint_steps(run: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in (run / "checkpoints").glob("step-*"))


def adapter(run: Path) -> dict:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def adam_steps(run: Path, step: int) -> set[float]:
    """The per-parameter `step` counts of AdamW in the checkpoint of `step`."""
    tensors = load_file(str(run / "checkpoints" / f"step-{step:06d}" / "optimizer.safetensors"))
    return {float(value) for name, value in tensors.items() if name.endswith(".step")}


@pytest.fixture(scope="module")
def uninterrupted(tiny_models, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("uninterrupted")
    result = run_cli(*train_args(tiny_models["llama"], root, "run", "--max-steps", str(STEPS)))
    assert result.returncode == 0, result.stderr
    return root / "run"


@pytest.mark.slow
def test_from_an_earlier_checkpoint_goes_on_as_the_uninterrupted_run(tmp_path, tiny_models, uninterrupted, cli):
    run = tmp_path / "run"
    stopped = cli(*train_args(tiny_models["llama"], tmp_path, "run", "--max-steps", str(STEPS)),
                  env={"LLMCUSTOMS_FAULT_INJECT": "sigint@7"})
    assert stopped.returncode == 130, stopped.stderr
    assert checkpoint_steps(run) == [4, 6, 7]

    unknown = cli("resume", str(run), "--from", "step-5", "--quiet")
    assert unknown.returncode == 2, unknown.stderr
    assert "no usable checkpoint of step 5" in unknown.stderr and "step-4, step-6, step-7" in unknown.stderr
    state = run / "checkpoints" / "step-000006" / "state.json"
    state.write_text(state.read_text().replace('"step": 6', '"step": 9'))  # fails its checksum: no checkpoint
    broken = cli("resume", str(run), "--from", "6", "--quiet")
    assert broken.returncode == 2 and "checksum" in broken.stderr and "step-4, step-7." in broken.stderr

    resumed = cli("resume", str(run), "--from", "step-000004")
    assert resumed.returncode == 0, resumed.stderr
    assert "removed the checkpoints after step 4 (step-6, step-7)" in resumed.stdout
    assert read_json(run / "status.json")["status"] == "completed"
    # Training is deterministic: from step 4 on, the same steps as the run that never stopped.
    assert max(float((adapter(run)[k] - w).abs().max()) for k, w in adapter(uninterrupted).items()) <= 1e-5
    assert [r["step"] for r in step_rows(run)] == list(range(1, STEPS + 1))  # steps 5-7 of before are gone
    assert checkpoint_steps(run) == [4, 6, 8]  # none from the abandoned future (step 7) is left


@pytest.mark.slow
def test_reset_optimizer_keeps_the_weights_and_starts_adam_afresh(tmp_path, tiny_models, uninterrupted, cli):
    run = tmp_path / "run"
    stopped = cli(*train_args(tiny_models["llama"], tmp_path, "run", "--max-steps", str(STEPS)),
                  env={"LLMCUSTOMS_FAULT_INJECT": "sigint@4"})
    assert stopped.returncode == 130, stopped.stderr
    # LLMCUSTOMS_EPOCHS is a setting for `train`: it never extends a run being resumed.
    resumed = cli("resume", str(run), "--reset-optimizer", env={"LLMCUSTOMS_EPOCHS": "5"})
    assert resumed.returncode == 0, resumed.stderr
    assert "optimizer state starts fresh" in resumed.stdout
    status = read_json(run / "status.json")
    assert (status["status"], status["step"], read_json(run / "plan.json")["total_steps"]) == ("completed", STEPS, STEPS)

    losses = {r["step"]: r["loss"] for r in step_rows(run)}
    reference = {r["step"]: r["loss"] for r in step_rows(uninterrupted)}
    # Step 5's loss is computed from the restored weights (and random state) before
    # any update: they are the checkpoint's, so it is the uninterrupted run's.
    assert losses[5] == pytest.approx(reference[5], rel=1e-6)
    assert abs(losses[6] - reference[6]) > 1e-6  # the fresh moments took step 5 elsewhere
    # Adam's per-parameter step count: steps 5 and 6 only, against 6 without the reset.
    assert adam_steps(run, 6) == {2.0} and adam_steps(uninterrupted, 6) == {6.0}


@pytest.mark.slow
def test_epochs_extends_a_completed_run(tmp_path, tiny_models, cli):
    run = tmp_path / "run"
    done = cli(*train_args(tiny_models["llama"], tmp_path, "run", "--epochs", "1", "--lr-scheduler", "cosine"))
    assert done.returncode == 0, done.stderr
    one_epoch = read_json(run / "plan.json")["total_steps"]

    extended = cli("resume", str(run), "--epochs", "2", "--quiet")
    assert extended.returncode == 0, extended.stderr
    plan = read_json(run / "plan.json")
    assert (plan["epochs"], plan["total_steps"]) == (2.0, 2 * one_epoch)
    assert "stretched" in plan["reasons"][-1]
    status = read_json(run / "status.json")
    assert (status["status"], status["step"]) == ("completed", 2 * one_epoch)
    rows = step_rows(run)
    assert [r["step"] for r in rows] == list(range(1, 2 * one_epoch + 1))
    # The schedule of two epochs from the restored step on: the cosine decay, which
    # had ended near zero, is about half way there, so the rate rises again.
    assert rows[one_epoch]["lr"] == pytest.approx(plan["lr"] * lr_multiplier(one_epoch, Plan.from_json(plan)))
    assert rows[one_epoch]["lr"] > 5 * rows[one_epoch - 1]["lr"]

    again = cli("resume", str(run), "--epochs", "2", "--quiet")
    assert again.returncode == 2 and "would not extend the run" in again.stderr


@pytest.mark.slow
def test_max_steps_shortens_an_interrupted_run_and_extends_a_completed_one(tmp_path, tiny_models, cli):
    run = tmp_path / "run"
    stopped = cli(*train_args(tiny_models["llama"], tmp_path, "run", "--max-steps", str(STEPS)),
                  env={"LLMCUSTOMS_FAULT_INJECT": "sigint@3"})
    assert stopped.returncode == 130, stopped.stderr
    assert read_json(run / "status.json")["step"] == 3

    refused = cli("resume", str(run), "--max-steps", "3", "--quiet")
    assert refused.returncode == 2, refused.stderr
    assert "already at step 3" in " ".join(refused.stderr.split())
    assert read_json(run / "plan.json")["total_steps"] == STEPS  # nothing changed

    shortened = cli("resume", str(run), "--max-steps", "5", "--quiet")
    assert shortened.returncode == 0, shortened.stderr
    plan, status = read_json(run / "plan.json"), read_json(run / "status.json")
    assert (plan["total_steps"], plan["sources"]["total_steps"]) == (5, "flag") and "--max-steps" in plan["reasons"][-1]
    assert (status["status"], status["step"], status["total_steps"]) == ("completed", 5, 5)
    assert [r["step"] for r in step_rows(run)] == [1, 2, 3, 4, 5]
    # The decay follows the new length: the learning rate of step 5 is the plan's for 5 steps.
    assert step_rows(run)[-1]["lr"] == pytest.approx(plan["lr"] * lr_multiplier(4, Plan.from_json(plan)))

    extended = cli("resume", str(run), "--max-steps", "7", "--quiet")  # completed: goes on
    assert extended.returncode == 0, extended.stderr
    status = read_json(run / "status.json")
    assert (status["step"], read_json(run / "plan.json")["total_steps"]) == (7, 7)
    # Three segments of training, each closed; never more than the time from the first start to the end.
    assert status["training_since"] is None
    assert 0 <= status["training_seconds"] <= seconds_between(status["started_at"], status["updated_at"])  # tiny segments may round to 0 s


# ---------------------------------------------------------- the pieces, fast

def test_a_checkpoint_is_named_as_users_name_it(tmp_path, clean_environment):
    from typer.testing import CliRunner

    from llmcustoms.cli import app

    assert step_named("step-40") == step_named("step-000040") == step_named("40") == 40
    result = CliRunner().invoke(app, ["resume", str(tmp_path), "--from", "best"])
    assert result.exit_code == 2 and "not a checkpoint's name" in result.output


def test_the_flags_reach_every_process_but_not_a_restart_nor_from_the_environment(clean_environment, monkeypatch):
    from llmcustoms.commands.train import Session

    monkeypatch.setenv("LLMCUSTOMS_EPOCHS", "5")
    session = Session.load({}, None, quiet=True).resuming("step-000004", True, 2.5)
    assert session.start == ResumeFrom(step=4, reset_optimizer=True, epochs=2.5)
    assert session.start_options() == ["--from", "4", "--reset-optimizer", "--epochs", "2.5"]
    assert session.resume_options() == ["--quiet"]  # what a restart after a failure is given
    assert Session.load({}, None).resuming(None, False, None).start == ResumeFrom()  # not LLMCUSTOMS_EPOCHS
    monkeypatch.setenv("LLMCUSTOMS_MAX_STEPS", "9")
    session = Session.load({}, None).resuming(None, False, None, max_steps=6)
    assert session.start == ResumeFrom(max_steps=6) and session.start_options() == ["--max-steps", "6"]
    assert Session.load({}, None).resuming(None, False, None).start == ResumeFrom()  # not LLMCUSTOMS_MAX_STEPS


def test_max_steps_sets_the_length_either_way_but_never_at_or_before_the_step_done():
    ten_steps = plan_of(max_steps=10)
    shorter = ResumeFrom(max_steps=6).planned(ten_steps, last_step=4)
    assert (shorter.total_steps, shorter.warmup_steps) == (6, ten_steps.warmup_steps)
    assert shorter.sources["total_steps"] == "flag" and "was 10" in shorter.reasons[-1]
    assert ResumeFrom(max_steps=13).planned(ten_steps, last_step=10).total_steps == 13  # a completed run, extended
    with pytest.raises(ConfigError, match="already at step 4"):
        ResumeFrom(max_steps=4).planned(ten_steps, last_step=4)
    with pytest.raises(ConfigError, match="already at step 2"):  # --from step-2: the run goes on from there
        ResumeFrom(step=2, max_steps=2).planned(ten_steps, last_step=8)
    assert ResumeFrom(step=2, max_steps=3).planned(ten_steps, last_step=8).total_steps == 3
    with pytest.raises(ConfigError, match="both"):
        ResumeFrom(epochs=3, max_steps=20).planned(ten_steps, last_step=4)
    assert ResumeFrom().planned(ten_steps, last_step=4) is ten_steps


def test_extending_counts_steps_as_planning_does_and_refuses_less():
    six_steps = plan_of(max_steps=6)  # 1.2 epochs
    longer = six_steps.extended_to(2.5)
    assert longer.total_steps == plan_of(epochs=2.5).total_steps == 13
    assert (longer.epochs, longer.warmup_steps) == (2.5, six_steps.warmup_steps)  # warmup is behind the run
    assert longer.sources["epochs"] == "flag" and "stretched" in longer.reasons[-1]
    with pytest.raises(ConfigError, match="would not extend"):
        six_steps.extended_to(1)
    with pytest.raises(ConfigError, match="would not extend"):
        plan_of(epochs=1.1).extended_to(1.15)  # more epochs, no more steps: both round up to 6


def test_going_on_from_a_step_removes_the_later_checkpoints_and_counts_patience_afresh(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", keep=5)
    for step in (2, 4, 6):
        manager.save(step, {}, {"step": step})
    position = Position(step=2, evals_since_best=3)
    said = ResumeFrom(step=2, reset_optimizer=True, epochs=3).went_on(position, manager, True, 30)
    assert [c.step for c in manager.all()] == [2]
    assert "removed the checkpoints after step 2 (step-4, step-6)" in said and "AdamW moments zero" in said
    assert position.evals_since_best == 0
    with pytest.raises(ConfigError, match="step-2"):
        manager.verified(4)


def plan_of(**overrides) -> Plan:
    """A plan for 40 rows at 8 rows a step: 5 steps an epoch."""
    from llmcustoms.planning.hardware import Hardware
    from llmcustoms.models.loading import choice_from_spec
    from llmcustoms.planning.plan import DataStats
    from llmcustoms.planning.planner import Planner
    from llmcustoms.planning.presets import find_model_spec, load_families, load_preset

    families = load_families()
    model = choice_from_spec(find_model_spec("TinyLlama/TinyLlama-1.1B-Chat-v1.0", families), families, "flag")
    stats = DataStats(lengths=(64,) * 40, first_loss_positions=(32,) * 40, eval_rows=4)
    given = {"micro_batch_size": 4, "grad_accum": 2, **overrides}
    return Planner(Hardware.cpu_only(ram_gib=16), load_preset("quality")).plan(
        model, stats, {name: (value, "flag") for name, value in given.items()})
