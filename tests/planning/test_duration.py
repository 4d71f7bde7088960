"""The plan's time is the command's: training, evaluations, the sample replies and
general questions before and after, loading and saving, each part named; and the
live ETA counts what follows the last step."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from llmcustoms.planning import duration
from llmcustoms.planning.duration import answering_seconds, seconds_after_last_step
from llmcustoms.planning.hardware import Hardware
from llmcustoms.planning.planner import Planner
from llmcustoms.planning.presets import find_model_spec, load_preset
from llmcustoms.ui.train_progress import TrainingProgress
from test_planning import CATALOG, FAMILIES, model, plan_for, stats

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
TWO_CORES = Hardware.cpu_only(ram_gib=16, cores=2)
PARTS = ["training", "evaluations", "base model's answers", "trained model's answers", "loading and saving"]


def test_the_plans_time_is_the_sum_of_its_named_parts_and_the_reason_names_each():
    plan = plan_for(TWO_CORES, SMOLLM2, {"max_steps": 20})
    parts = plan.duration_parts
    assert list(parts) == PARTS and all(seconds > 0 for seconds in parts.values())
    assert plan.estimated_seconds == pytest.approx(sum(parts.values()))
    [reason] = [r for r in plan.reasons if r.startswith("estimated duration")]
    assert all(f"{name} " in reason for name in PARTS), reason
    # The base model's answers and the trained model's: a first run on 2 idle cores waited 35-45 s for each.
    assert 15 < parts["base model's answers"] == parts["trained model's answers"] < 120
    # Starting, loading 540 MB of weights and 5 LoRA checkpoints: seconds, not minutes.
    assert duration.STARTUP_S < parts["loading and saving"] < 30


def test_a_cpu_step_costs_its_own_work_beside_its_flops(monkeypatch):
    # The README's first run (issue 47): 136 steps of a two-layer model whose FLOPs say 0.6 s took 7-9 s.
    measured = replace(TWO_CORES, speeds=((f"{SMOLLM2}|lora", 500.0),))  # a measured speed has the steps' work in it

    def training(machine, steps=20):
        return plan_for(machine, SMOLLM2, {"max_steps": steps, "replay": 0}).duration_parts["training"]

    few, more, with_speed = training(TWO_CORES), training(TWO_CORES, 40), training(measured)
    monkeypatch.setattr(duration, "CPU_STEP_S", 0.0)
    assert few == pytest.approx(training(TWO_CORES) + 20 * 0.05, abs=0.15)  # parts are rounded to 0.1 s
    assert more == pytest.approx(2 * few, abs=0.25)
    assert with_speed == training(measured)


def test_replay_adds_its_rows_to_the_training_time_and_the_base_models_replies_as_a_part():
    plain = plan_for(TWO_CORES, SMOLLM2, {"max_steps": 20, "replay": 0})
    replayed = plan_for(TWO_CORES, SMOLLM2, {"max_steps": 20, "replay": 0.25})
    assert replayed.replay == 0.25 and plain.replay == 0 and replayed.total_steps == plain.total_steps  # the same steps, each larger
    assert replayed.duration_parts["training"] > plain.duration_parts["training"]
    assert "replay's replies" not in plain.duration_parts and replayed.duration_parts["replay's replies"] > 0
    rows = 20 * duration.replayed_per_step(0.25, replayed.effective_batch_size)
    assert any(r.startswith(f"replay: {rows:,} rows of the base model's own replies") for r in replayed.reasons)
    assert duration.replayed_per_step(0.25, 16) == 4 and duration.replayed_per_step(0.01, 16) == 1


def test_replay_is_off_by_default_for_preference_pairs_and_several_processes(monkeypatch):
    from llmcustoms.planning import plan, step_choices
    from llmcustoms.planning.step_choices import choose_replay

    monkeypatch.setattr(step_choices, "DEFAULT_REPLAY", plan.DEFAULT_REPLAY)  # the default the tests turn off

    class Given:
        def __init__(self, values):
            self.values = values

        def given_value(self, name):
            return self.values.get(name)

        def get(self, name):
            return self.values[name]

    from llmcustoms.planning.objective_kinds import DPO, SFT

    assert choose_replay(Given({}), SFT, 1) == 0.25
    assert choose_replay(Given({}), DPO, 1) == 0.0 and choose_replay(Given({}), SFT, 2) == 0.0
    assert choose_replay(Given({"replay": 0.5}), SFT, 1) == 0.5 and choose_replay(Given({"replay": 0}), SFT, 1) == 0.0


def test_a_run_without_evaluation_rows_answers_nothing():
    plan = Planner(TWO_CORES, load_preset("quality"), catalog=CATALOG).plan(
        model(SMOLLM2), replace(stats(), eval_rows=0), {"max_steps": (20, "flag")})
    assert plan.eval_rows == 0
    assert plan.duration_parts["base model's answers"] == plan.duration_parts["trained model's answers"] == 0
    assert plan.duration_parts["evaluations"] == 0


def test_generating_is_tokens_over_the_rate_with_a_floor_per_decoding_step():
    arch = find_model_spec(SMOLLM2, FAMILIES)
    idle = answering_seconds(arch, "lora", False, TWO_CORES, 0, 60)
    # A CPU decoding step has a floor per layer: 3 x 48 sample tokens one at a time cost at least that.
    floor = arch.num_layers * duration.CPU_DECODE_SECONDS_PER_LAYER
    assert idle > duration.SAMPLE_PROMPTS * duration.SAMPLE_TOKENS * floor
    # A machine measured to train at half its nominal rate answers slower too.
    nominal = duration.CPU_FLOPS_PER_CORE * 2 / duration.flops_per_token(arch, "lora", False)
    slow = replace(TWO_CORES, speeds=((f"{SMOLLM2}|lora", nominal / 2),))
    assert answering_seconds(arch, "lora", False, slow, 0, 60) > 1.3 * idle
    # Longer prompts take longer to read.
    assert answering_seconds(arch, "lora", False, TWO_CORES, 0, 600) > idle
    # On an H200 a decoding step is launches, not FLOPs: about 34 s for TinyLlama's base answers.
    h200 = Hardware.with_gpu(140, name="NVIDIA H200", compute_capability=(9, 0))
    tinyllama = find_model_spec("TinyLlama/TinyLlama-1.1B-Chat-v1.0", FAMILIES)
    assert 20 < answering_seconds(tinyllama, "lora", False, h200, 0, 60) < 50


def test_what_planning_counts_is_what_the_run_generates():
    from llmcustoms.training import general_knowledge, samples

    assert (duration.SAMPLE_PROMPTS, duration.SAMPLE_TOKENS) == (samples.SAMPLE_PROMPTS, samples.MAX_NEW_TOKENS)
    questions = json.loads(general_knowledge.QUESTIONS_FILE.read_text())["questions"]
    assert (duration.GENERAL_QUESTIONS, duration.GENERAL_TOKENS, duration.GENERAL_GPU_BATCH) == (
        len(questions), general_knowledge.MAX_NEW_TOKENS, general_knowledge.GPU_BATCH_SIZE)


def test_the_time_after_the_last_step_is_its_evaluation_the_trained_answers_and_saving():
    plan = plan_for(TWO_CORES, SMOLLM2, {"max_steps": 20, "eval_every": 5})
    parts = plan.duration_parts
    after = seconds_after_last_step(plan)
    # 5 evaluations (the base model's and every 5 steps): the last is one of them.
    assert after == pytest.approx(parts["evaluations"] / 5 + parts["trained model's answers"] + 2 * duration.SAVE_S)
    assert seconds_after_last_step(replace(plan, duration_parts=None)) == 0  # a plan.json written before
    # A plan.json written when both rounds were one part: half of it is the trained model's.
    both = {k: v for k, v in parts.items() if "answers" not in k}
    both["sample replies and general questions"] = 2 * parts["trained model's answers"]
    assert seconds_after_last_step(replace(plan, duration_parts=both)) == pytest.approx(after)


def test_a_plan_whose_base_answers_are_kept_leaves_them_out_of_its_time_and_says_so():
    plan = plan_for(TWO_CORES, SMOLLM2, {"max_steps": 20, "eval_every": 5})
    kept = duration.with_base_answers_kept(plan)
    assert "base model's answers" not in kept.duration_parts
    assert kept.estimated_seconds == pytest.approx(plan.estimated_seconds - plan.duration_parts["base model's answers"],
                                                   abs=0.2)
    [reason] = [r for r in kept.reasons if r.startswith("estimated duration")]
    parts_named = reason.split(" (")[0]
    assert "base model's answers" not in parts_named and "trained model's answers" in parts_named
    assert "kept from an earlier run" in reason and "nominal speed" in reason  # the rest of the reason stays
    # The time after the last step is the same: the trained model still answers.
    assert seconds_after_last_step(kept) == pytest.approx(seconds_after_last_step(plan))
    assert duration.with_base_answers_kept(kept) == kept  # nothing left to remove


def test_the_live_eta_counts_the_time_after_the_last_step_and_counts_it_down():
    progress = TrainingProgress(total_steps=2, start_step=0, now=0.0, after=60.0)
    progress.step({"step": 1, "loss": 1.0, "lr": 1e-4, "tokens_per_s": 100.0, "seconds": 10.0}, now=10.0)
    assert progress.eta(10.0) == pytest.approx(10.0 + 60.0)  # a step left, then what follows it
    progress.step({"step": 2, "loss": 1.0, "lr": 1e-4, "tokens_per_s": 100.0, "seconds": 10.0}, now=20.0)
    assert progress.eta(20.0) == pytest.approx(60.0)  # not 0:00:00 while the last evaluation runs
    assert progress.eta(50.0) == pytest.approx(30.0)
    assert progress.eta(100.0) == 0.0
    _, timing = progress.lines(now=50.0)
    assert "eta 0:00:30" in timing
