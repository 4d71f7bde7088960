"""The training loop on tiny local models: it learns, it is repeatable, its
accumulation is exact, and what it saves reloads to the same model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from llmcustoms.losses.sft import TokenCrossEntropy
from llmcustoms.training.batching import collate
from llmcustoms.reporting import SilentReporter
from llmcustoms.training.finetuner import FineTuner
from llmcustoms.planning.hardware import Hardware
from llmcustoms.training.optimization import lr_multiplier
from llmcustoms.planning.plan import Plan
from llmcustoms.training.position import Position, StopCause
from llmcustoms.planning.train_options import TrainOptions
from llmcustoms.preparation.preparing import prepare_run
from llmcustoms.runs.run_directory import RunDirectory
from tiny_models import FIXTURES


def train(tmp_path: Path, model_dir: Path, data: str = "alpaca.jsonl", name: str = "run", tuner_args: dict | None = None,
          **overrides):
    """Prepare and run a training exactly as `llmcustoms train` does, in-process
    (`tuner_args`: more keyword arguments for FineTuner)."""
    settings = {"max_steps": 4, "lora_dropout": 0.0, "lr": 1e-2, "warmup_ratio": 0.0, **overrides}
    options = TrainOptions(data=str(FIXTURES / data), model=str(model_dir),
                           overrides={k: (v, "flag") for k, v in settings.items()})
    prepared = prepare_run(options, Hardware.cpu_only())
    run_dir = RunDirectory(tmp_path / name)
    run_dir.create()
    run_dir.write_plan(prepared.plan)
    reporter = SilentReporter()
    tuner = FineTuner(prepared.plan, prepared.tokenizer, prepared.train, prepared.evaluation, run_dir, reporter,
                      **(tuner_args or {}))
    result = tuner.run()
    return tuner, result, run_dir, reporter


def adapter_tensors(run_dir: RunDirectory) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir.path / "adapter" / "adapter_model.safetensors"))


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_loss_falls_on_a_repetitive_dataset(tmp_path, tiny_models):
    _, result, run_dir, reporter = train(tmp_path, tiny_models["llama"], max_steps=30, micro_batch_size=8, grad_accum=1)
    losses = [row["loss"] for row in reporter.steps]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    evals = [row["eval_loss"] for row in reporter.evals]
    assert evals[-1] < evals[0]
    assert result.status == "completed" and result.steps == 30


def test_splitting_a_step_into_micro_batches_gives_the_same_update(tmp_path, tiny_models):
    # 8 rows per step as 1x8, 2x4 and 8x1: the loss is normalised per token over
    # the whole step, so losses agree to float precision and the adapters to
    # within what Adam makes of float noise (~3e-5 here). Averaging per
    # micro-batch instead, the usual by-hand bug, moves them by ~4e-2.
    runs = []
    for micro, accum in [(8, 1), (2, 4), (1, 8)]:
        _, _, run_dir, reporter = train(tmp_path, tiny_models["qwen2"], name=f"m{micro}", max_steps=3,
                                        micro_batch_size=micro, grad_accum=accum)
        runs.append((adapter_tensors(run_dir), [row["loss"] for row in reporter.steps]))
    (first, first_losses), *others = runs
    for adapter, losses in others:
        assert losses == pytest.approx(first_losses, abs=1e-5)
        assert max_difference(first, adapter) < 1e-4


def test_same_seed_same_adapter_other_seed_other_adapter(tmp_path, tiny_models):
    a = adapter_tensors(train(tmp_path, tiny_models["mistral"], name="a", seed=7)[2])
    b = adapter_tensors(train(tmp_path, tiny_models["mistral"], name="b", seed=7)[2])
    c = adapter_tensors(train(tmp_path, tiny_models["mistral"], name="c", seed=8)[2])
    assert max_difference(a, b) == 0.0
    assert max_difference(a, c) > 1e-4


@pytest.mark.parametrize("family,method", [("llama", "lora"), ("qwen2", "lora"), ("phi3", "lora"), ("phi", "qlora")])
def test_saved_adapter_reproduces_the_trained_models_logits(tmp_path, tiny_models, family, method):
    from peft import PeftModel
    from transformers import BitsAndBytesConfig

    tuner, _, run_dir, _ = train(tmp_path, tiny_models[family], method=method)
    batch = collate(tuner.data.train[:3], tuner.tokenizer.pad_token_id)
    trained = tuner.accelerator.unwrap_model(tuner.model).eval()
    with torch.no_grad():
        expected = trained(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits

    kwargs = {"dtype": torch.float32}
    if method == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_use_double_quant=True,
                                                           bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_models[family], **kwargs)
    reloaded = PeftModel.from_pretrained(base, run_dir.path / "adapter").eval()
    if method == "qlora":
        # In eval mode bitsandbytes switches this CPU to a bf16 inference kernel
        # (~1e-3 off); compare like with like by keeping the fp32 training kernel.
        import bitsandbytes as bnb

        for module in reloaded.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                module.support_avx512bf16_for_cpu = False
    with torch.no_grad():
        actual = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    mask = batch["attention_mask"].bool()
    assert torch.allclose(actual[mask], expected[mask], atol=1e-4)
    # And the adapter really changed the model: the base alone gives other logits.
    with torch.no_grad(), reloaded.disable_adapter():
        untouched = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert not torch.allclose(untouched[mask], expected[mask], atol=1e-3)


def test_qlora_really_trains_a_4bit_base_on_cpu(tmp_path, tiny_models):
    import bitsandbytes as bnb

    tuner, result, _, reporter = train(tmp_path, tiny_models["llama"], method="qlora", max_steps=12,
                                       micro_batch_size=8, grad_accum=1)
    quantized = [m for m in tuner.accelerator.unwrap_model(tuner.model).modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 2 * 7  # every targeted linear layer of both blocks is 4-bit
    losses = [row["loss"] for row in reporter.steps]
    assert losses[-1] < losses[0]


def test_full_fine_tuning_saves_a_loadable_model(tmp_path, tiny_models):
    tuner, _, run_dir, _ = train(tmp_path, tiny_models["llama"], method="full", lr=1e-3)
    saved = AutoModelForCausalLM.from_pretrained(run_dir.path / "model", dtype=torch.float32).eval()
    original = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()
    batch = collate(tuner.data.train[:2], tuner.tokenizer.pad_token_id)
    with torch.no_grad():
        expected = tuner.accelerator.unwrap_model(tuner.model).eval()(input_ids=batch["input_ids"]).logits
        assert torch.allclose(saved(input_ids=batch["input_ids"]).logits, expected, atol=1e-5)
        assert not torch.allclose(original(input_ids=batch["input_ids"]).logits, expected, atol=1e-3)


def test_run_directory_follows_the_contract(tmp_path, tiny_models):
    _, _, run_dir, reporter = train(tmp_path, tiny_models["llama"], max_steps=6, micro_batch_size=4, grad_accum=2,
                                    save_every=5)
    rows = run_dir.read_metrics()
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 7))
    for r in steps:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "seconds"} <= r.keys()
        assert r["tokens_per_s"] > 0 and r["grad_norm"] >= 0 and r["seconds"] > 0
    # Every wait is named for the display, and each ends (None: back to training steps).
    said = reporter.activities
    assert said[0] == "loading the model" and said[-1] is None
    assert "evaluating 1/2" in said and "saving checkpoint 5" in said and "saving the trained weights" in said
    # An evaluation measures forgetting after its own rows (48 general rows in 12 micro-batches), then ends.
    assert said[said.index("evaluating 1/2") + 1] == "measuring forgetting 0/12"
    for waiting in ("measuring forgetting 11/12", "saving checkpoint 5"):
        assert said[said.index(waiting) + 1] is None
    assert any("eval_loss" in r for r in rows)
    status = json.loads(run_dir.status_path.read_text())
    assert status["status"] == "completed" and status["step"] == 6
    plan = Plan.from_json(json.loads(run_dir.plan_path.read_text()))
    assert plan.total_steps == 6 and plan.micro_batch_size == 4 and plan.grad_accum == 2
    adapter = run_dir.path / "adapter"
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (adapter / name).is_file(), name
    from llmcustoms.runs.file_modes import usual_mode

    written = [*adapter.iterdir(), *(run_dir.path / "checkpoints" / "step-000005").iterdir(),
               *(run_dir.path / "best").iterdir()]
    assert {path.stat().st_mode & 0o777 for path in written if path.is_file()} == {usual_mode()}


def test_early_stopping_ends_the_run_when_eval_loss_stops_improving(tmp_path, tiny_models):
    # A learning rate this high makes eval loss rise after the first evaluation.
    _, result, run_dir, reporter = train(tmp_path, tiny_models["llama"], max_steps=40, lr=0.5,
                                         lr_scheduler="constant", micro_batch_size=4, grad_accum=1,
                                         eval_every=1, early_stopping_patience=2)
    evals = [row["eval_loss"] for row in reporter.evals]
    assert result.steps < 40
    assert result.stop.cause is StopCause.EARLY_STOPPING and result.stop.step == result.steps
    assert result.stop_reason and "early stopping" in result.stop_reason
    best = min(range(len(evals)), key=evals.__getitem__)
    assert len(evals) - 1 - best == 2  # stopped exactly `patience` evaluations after the best
    assert json.loads(run_dir.status_path.read_text())["status"] == "completed"


def test_learning_rate_schedule_warms_up_then_decays():
    plan = Plan.from_json({**_plan_fields(), "warmup_steps": 4, "total_steps": 20, "lr_scheduler": "cosine"})
    factors = [lr_multiplier(s, plan) for s in range(20)]
    assert factors[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert factors[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))
    linear = Plan.from_json({**_plan_fields(), "warmup_steps": 0, "total_steps": 10, "lr_scheduler": "linear"})
    assert [lr_multiplier(s, linear) for s in (0, 5)] == pytest.approx([1.0, 0.5])


def _plan_fields() -> dict:
    return dict(model="m", family="llama", model_type="llama", preset="quality", method="lora", micro_batch_size=1,
                grad_accum=1, effective_batch_size=1, max_seq_len=64, gradient_checkpointing=False,
                mixed_precision="no", lr=1e-3, lr_scheduler="cosine", warmup_steps=0, weight_decay=0.0,
                max_grad_norm=1.0, epochs=1.0, steps_per_epoch=10, total_steps=10, eval_every=0,
                early_stopping_patience=0, save_every=5, keep_checkpoints=3, seed=1, train_on_prompt=False,
                trust_remote_code=False, train_rows=10, eval_rows=0, lora=None)


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_gradient_checkpointing_saves_memory_without_changing_the_result(tmp_path, tiny_models, method):
    plain = train(tmp_path, tiny_models["llama"], name="plain", method=method)
    checkpointed = train(tmp_path, tiny_models["llama"], name="ckpt", method=method, gradient_checkpointing=True)
    model = checkpointed[0].accelerator.unwrap_model(checkpointed[0].model)
    assert model.base_model.model.is_gradient_checkpointing
    assert [r["loss"] for r in checkpointed[3].steps] == pytest.approx([r["loss"] for r in plain[3].steps], abs=1e-6)
    assert max_difference(adapter_tensors(plain[2]), adapter_tensors(checkpointed[2])) < 1e-5


def test_gradients_are_all_reduced_in_buckets_of_one_dtype_up_to_the_limit():
    from llmcustoms.training.processes import buckets as bucketed

    tensors = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(5, dtype=torch.bfloat16), torch.zeros(3)]
    buckets = bucketed(tensors, limit=80)  # bytes: 40 + 40 fit, 120 is alone, a dtype change starts a bucket
    assert [[t.numel() for t in b] for b in buckets] == [[10, 10], [30], [5], [3]]
    assert sum(len(b) for b in buckets) == len(tensors)


def test_a_caller_stopping_the_run_is_a_typed_reason_not_a_message(tmp_path, tiny_models):
    _, result, run_dir, _ = train(tmp_path, tiny_models["llama"], max_steps=8, eval_every=2,
                                  tuner_args={"on_evaluate": lambda step, loss: step >= 4})
    assert result.steps == 4 and result.stop.cause is StopCause.CALLER and result.stop.step == 4
    assert json.loads(run_dir.status_path.read_text())["reason"] == result.stop_reason == result.stop.text


class Counted(TokenCrossEntropy):
    """SFT's loss, noting the rows of every micro-batch it is given."""

    def __init__(self, seen: list[int]):
        self.seen = seen

    def __call__(self, model, batch, normaliser):
        self.seen.append(batch["input_ids"].shape[0])
        return super().__call__(model, batch, normaliser)


def test_the_loss_and_the_schedule_are_arguments(tmp_path, tiny_models):
    calls = []
    counted = Counted(calls)

    tuner, _, run_dir, reporter = train(tmp_path, tiny_models["llama"], max_steps=2, micro_batch_size=4, grad_accum=2,
                                        eval_every=0, tuner_args={"loss": counted, "schedule": lambda step, plan: 0.5})
    assert len(calls) == 2 * 2  # every micro-batch of both steps
    assert [row["lr"] for row in reporter.steps] == pytest.approx([0.5e-2, 0.5e-2])


def test_which_rows_make_up_a_step_is_an_argument(tmp_path, tiny_models):
    """A caller (preference tuning, say) decides each step's rows; the loop trains on exactly those."""
    seen = []

    def fixed_steps(lengths, step_rows, seed, epoch):
        return [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]

    counted = Counted(seen)
    tuner, result, _, reporter = train(tmp_path, tiny_models["llama"], max_steps=5, micro_batch_size=4, grad_accum=2,
                                       eval_every=0, tuner_args={"steps": fixed_steps, "loss": counted})
    assert result.steps == 5 and seen == [4] * 5  # one micro-batch of 4 rows per step, not the planned 8 rows
    assert tuner.position.epoch == 1 and tuner.position.index == 2  # 3 steps an epoch: the 5th is the 2nd of epoch 1
    expected_tokens = sum(len(tuner.data.train[i].input_ids) for step in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                                                           [0, 1, 2, 3], [4, 5, 6, 7]) for i in step)
    assert tuner.position.tokens == expected_tokens


def test_the_loop_position_is_one_record_read_from_flat_checkpoint_state():
    # state.json keeps the position's fields as flat keys, beside the scheduler's and others.
    state = {"step": 6, "epoch": 1, "index": 2, "tokens": 900, "final_loss": 1.5, "best_eval": 1.7, "best_step": 4,
             "last_eval": 1.8, "evals_since_best": 1, "scheduler": {}, "micro_batch_size": 4}
    position = Position.from_state(state)
    assert (position.step, position.epoch, position.index, position.best_step) == (6, 1, 2, 4)
    assert position.early_stop(1.9, patience=2).cause is StopCause.EARLY_STOPPING


def test_cpu_threads_follow_the_physical_cores_unless_the_user_chose_a_number(monkeypatch):
    """One thread per physical core by default, or the plan's fewer (a busy machine, `planning/cpu_share.py`),
    never more than this machine has; OMP_NUM_THREADS, when set, is the user's choice and is kept."""
    from types import SimpleNamespace

    import psutil

    from llmcustoms.training.processes import Processes

    before = torch.get_num_threads()
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 3)
    try:
        torch.set_num_threads(1)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        Processes.use_physical_cores(SimpleNamespace(world=1))
        assert torch.get_num_threads() == 1
        Processes.use_physical_cores(SimpleNamespace(world=1), 2)
        assert torch.get_num_threads() == 1
        monkeypatch.delenv("OMP_NUM_THREADS")
        Processes.use_physical_cores(SimpleNamespace(world=1))
        assert torch.get_num_threads() == 3
        Processes.use_physical_cores(SimpleNamespace(world=1), 2)  # the plan's, on a busy machine
        assert torch.get_num_threads() == 2
        Processes.use_physical_cores(SimpleNamespace(world=1), 8)  # a plan made for a larger machine
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
