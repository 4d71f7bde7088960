"""Issue 21's CPU-testable parts: padding-free packing gives the same loss and
gradients as padded rows, and trains the same weights; the planner chooses 8-bit
AdamW where it lets more fit and says why; a run with 8-bit AdamW resumes exactly;
--compile trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import DATA_FILES
from llmcustoms.training.batching import collate
from llmcustoms.planning.hardware import Hardware
from llmcustoms.losses.sft import select_logits, token_cross_entropy
from llmcustoms.models.packing import pack, packed_micro_batches, use_varlen_attention
from llmcustoms.planning.planner import Planner
from llmcustoms.planning.presets import load_preset
from llmcustoms.data.tokenization import IGNORE_INDEX
from test_losses import FAMILIES, rows


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_give_the_loss_and_gradients_of_padded_rows(tiny_models, family):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_models[family], dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    select_logits(model.get_base_model())
    examples = rows(base.config.vocab_size)
    padded = collate(examples, pad_token_id=0)
    normaliser = torch.tensor(float((padded["labels"][:, 1:] != IGNORE_INDEX).sum()))
    trained = [p for p in model.parameters() if p.requires_grad]
    expected, _ = token_cross_entropy(model, padded, normaliser)
    expected_grads = torch.autograd.grad(expected, trained)

    use_varlen_attention(model.get_base_model())
    packed = pack(examples)
    assert packed["input_ids"].shape == (1, sum(len(e.input_ids) for e in examples))  # no padding at all
    assert packed["position_ids"][0, :23].tolist() == list(range(23)) and packed["position_ids"][0, 23] == 0
    assert int((packed["labels"][:, 1:] != IGNORE_INDEX).sum()) == int(normaliser)  # the same tokens learned
    loss, _ = token_cross_entropy(model, packed, normaliser)
    grads = torch.autograd.grad(loss, trained)

    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
    for got, want in zip(grads, expected_grads):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)


def test_packed_rows_do_not_see_each_other(tiny_models):
    """A row's logits do not depend on the row packed before it."""
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    use_varlen_attention(model)
    examples = rows(model.config.vocab_size)
    alone = model(**{k: v for k, v in pack(examples[1:2]).items() if k != "labels"}).logits
    after = model(**{k: v for k, v in pack(examples[:2]).items() if k != "labels"}).logits
    assert torch.allclose(after[0, 23:], alone[0], atol=1e-5)


def test_packed_micro_batches_fill_a_token_budget():
    lengths = [500, 300, 200, 120, 100, 80, 60, 40]
    batches = packed_micro_batches(list(range(8)), lengths, token_budget=512, cap=512)
    assert sorted(i for b in batches for i in b) == list(range(8))  # every row once
    assert all(sum(lengths[i] for i in b) <= 512 for b in batches)
    assert len(batches) == 3  # 1400 tokens in three passes of at most 512, not eight rows one by one
    assert packed_micro_batches([0], [900], token_budget=512, cap=512) == [[0]]  # cut to 512: fits alone


def train_args(model: Path, output: Path, name: str, *extra: str) -> list[str]:
    return ["train", str(DATA_FILES["alpaca"]), "--model", str(model), "--max-steps", "6", "--save-every", "3",
            "--batch-size", "2", "--grad-accum", "2", "--lr", "1e-2", "--lora-dropout", "0", "--mixed-precision", "no",
            "--output-dir", str(output), "--run-name", name, "--yes", "--quiet", *extra]


def adapter(run: Path) -> dict:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_a_packed_run_trains_the_weights_of_a_padded_run(tmp_path, tiny_models, cli):
    for name, flag in (("padded", "--no-packing"), ("packed", "--packing")):
        result = cli(*train_args(tiny_models["llama"], tmp_path, name, flag))
        assert result.returncode == 0, result.stderr
    recovered = cli(*train_args(tiny_models["llama"], tmp_path, "recovered", "--packing"),
                    env={"LLMCUSTOMS_FAULT_INJECT": "oom@2"})
    assert recovered.returncode == 0, recovered.stderr
    assert json.loads((tmp_path / "recovered" / "plan.json").read_text())["micro_batch_size"] == 1  # budget halved
    assert max_difference(adapter(tmp_path / "recovered"), adapter(tmp_path / "packed")) <= 2e-4
    assert json.loads((tmp_path / "packed" / "plan.json").read_text())["packing"] is True
    losses = {name: [r["loss"] for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
                     if "loss" in r] for name in ("padded", "packed")}
    assert len(losses["packed"]) == 6
    assert losses["packed"] == pytest.approx(losses["padded"], rel=1e-5)
    # Packed, a step's rows share fewer forward passes: the sums run in another order,
    # and AdamW's normalised updates carry that float noise (a few 1e-5 after 6 steps at lr 1e-2).
    assert max_difference(adapter(tmp_path / "packed"), adapter(tmp_path / "padded")) <= 2e-4


@pytest.mark.slow
def test_a_run_with_8bit_adamw_interrupted_then_resumed_equals_the_uninterrupted_one(tmp_path, tiny_models, cli):
    # Rank 64: bitsandbytes keeps moments of matrices under 4,096 entries in 32 bits.
    args = lambda name: train_args(tiny_models["llama"], tmp_path, name, "--optimizer", "adamw_8bit",  # noqa: E731
                                   "--lora-r", "64")
    whole = cli(*args("whole"))
    assert whole.returncode == 0, whole.stderr
    stopped = cli(*args("split"), env={"LLMCUSTOMS_FAULT_INJECT": "sigint@4"})
    assert stopped.returncode == 130
    saved = load_file(str(tmp_path / "split" / "checkpoints" / "step-000003" / "optimizer.safetensors"))
    assert any(v.dtype == torch.uint8 for v in saved.values())  # 8-bit moments, in safetensors
    resumed = cli("resume", str(tmp_path / "split"), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert max_difference(adapter(tmp_path / "split"), adapter(tmp_path / "whole")) == 0.0


@pytest.mark.slow
def test_compile_trains_the_weights_of_an_uncompiled_run(tmp_path, tiny_models, cli):
    for name, flag in (("eager", "--no-compile"), ("compiled", "--compile")):
        result = cli(*train_args(tiny_models["llama"], tmp_path, name, flag), timeout=600)
        assert result.returncode == 0, result.stderr
    assert max_difference(adapter(tmp_path / "compiled"), adapter(tmp_path / "eager")) <= 1e-4


# ------------------------------------------------------------------ planning

def plan_on(hardware: Hardware, method: str = "full", hub_id: str = "Qwen/Qwen2.5-1.5B-Instruct", **overrides):
    from test_planning import model, stats

    given = {"method": (method, "flag"), **{k: (v, "flag") for k, v in overrides.items()}}
    return Planner(hardware, load_preset("quality")).plan(model(hub_id), stats(), given)


def test_the_planner_picks_8bit_adamw_where_it_lets_a_larger_micro_batch_fit_and_says_why():
    gpu = Hardware.with_gpu(48, name="L40S")  # full fine-tuning of 1.5B parameters
    plan = plan_on(gpu)
    assert plan.optimizer == "adamw_8bit" and plan.sources["optimizer"] == "planner"
    reason = next(r for r in plan.reasons if r.startswith("optimizer adamw_8bit"))
    assert "instead of AdamW's 8" in reason and "--optimizer adamw" in reason
    assert "full micro-batch 16 fits (with AdamW: full micro-batch 16 with gradient checkpointing" in reason
    fixed = plan_on(gpu, optimizer="adamw")
    assert plan.memory["optimizer_bytes"] * 4 == fixed.memory["optimizer_bytes"]
    assert fixed.optimizer == "adamw" and fixed.sources["optimizer"] == "flag"
    assert (fixed.micro_batch_size, not fixed.gradient_checkpointing) < (plan.micro_batch_size,
                                                                          not plan.gradient_checkpointing)


def test_8bit_adamw_lets_a_model_fit_that_adamw_cannot_train():
    from llmcustoms.errors import ConfigError

    plan = plan_on(Hardware.with_gpu(24, name="RTX 4090"))  # full fine-tuning of 1.5B parameters
    assert plan.optimizer == "adamw_8bit"
    assert any("(with AdamW nothing fits)" in r for r in plan.reasons)
    with pytest.raises(ConfigError):
        plan_on(Hardware.with_gpu(24, name="RTX 4090"), optimizer="adamw")


def test_the_planner_keeps_adamw_where_8bit_gains_nothing():
    roomy = plan_on(Hardware.with_gpu(80, name="H100"), method="lora")
    assert roomy.optimizer == "adamw"
    assert not any(r.startswith("optimizer") for r in roomy.reasons)
    assert plan_on(Hardware.cpu_only(), method="lora").optimizer == "adamw"  # CPUs: time, not memory, is short


def test_packing_is_planned_on_a_gpu_with_varlen_attention_and_said():
    from dataclasses import replace

    gpu = replace(Hardware.with_gpu(80, name="H100"), varlen_attention="torch")
    plan = plan_on(gpu, method="lora")
    assert plan.packing and any(r.startswith("packing on") and "varlen" in r for r in plan.reasons)
    assert not plan_on(replace(gpu, varlen_attention=""), method="lora").packing  # nothing to run it
    assert not plan_on(Hardware.cpu_only(), method="lora").packing
    assert not plan_on(gpu, method="lora", packing=False).packing
    assert plan_on(gpu, method="lora", compile=True).compile and not plan.compile


def test_packing_is_not_planned_where_its_kernels_or_the_model_code_may_not_take_it():
    from dataclasses import replace

    turing = replace(Hardware.with_gpu(16, name="T4", compute_capability=(7, 5)), varlen_attention="torch")
    assert not plan_on(turing, method="lora").packing  # FlashAttention needs Ampere
    ampere = replace(Hardware.with_gpu(24, name="A10"), varlen_attention="torch")
    assert plan_on(ampere, method="lora").packing
    assert not plan_on(ampere, method="lora", trust_remote_code=True).packing
    assert plan_on(ampere, method="lora", trust_remote_code=True, packing=True).packing  # asked for: as given


def test_a_sliding_window_is_kept_in_packed_rows(tiny_models):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_models["mistral"], dtype=torch.float32)
    model.config.sliding_window = 5  # shorter than the rows: the window matters
    select_logits(model)
    examples = rows(model.config.vocab_size)
    padded = collate(examples, pad_token_id=0)
    normaliser = torch.tensor(float((padded["labels"][:, 1:] != IGNORE_INDEX).sum()))
    windowed, _ = token_cross_entropy(model, padded, normaliser)
    model.config.sliding_window = None
    unwindowed, _ = token_cross_entropy(model, padded, normaliser)
    assert abs(windowed.item() - unwindowed.item()) > 1e-4
    model.config.sliding_window = 5
    use_varlen_attention(model)
    packed, _ = token_cross_entropy(model, pack(examples), normaliser)
    assert packed.item() == pytest.approx(windowed.item(), rel=1e-5)
    evaluated, _ = token_cross_entropy(model, padded, normaliser)  # unpacked, on the switched model
    assert evaluated.item() == pytest.approx(windowed.item(), rel=1e-5)


def test_models_that_change_their_logits_after_the_head_keep_them():
    """Gemma 2 softcaps its logits in its forward: the loss must see capped logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                           final_logit_softcapping=2.0, initializer_range=0.5))
    select_logits(model)
    batch = collate(rows(300), pad_token_id=0)
    normaliser = torch.tensor(float((batch["labels"][:, 1:] != IGNORE_INDEX).sum()))
    loss, _ = token_cross_entropy(model, batch, normaliser)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                                 ignore_index=IGNORE_INDEX, reduction="sum") / normaliser
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_a_chunk_without_trained_tokens_gives_zero_and_a_gradient():
    from llmcustoms.losses.sft import head_cross_entropy

    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.zeros((0, 8), requires_grad=True)
    loss = head_cross_entropy(hidden, head, torch.zeros(0, dtype=torch.long))
    loss.backward()
    assert loss.item() == 0.0 and head.weight.grad is not None


def test_dpo_estimates_every_logit_of_its_pairs():
    from llmcustoms.planning.memory import MemoryEstimator
    from test_planning import model

    memory = MemoryEstimator(model("Qwen/Qwen2.5-0.5B-Instruct").arch, on_gpu=True, budget_bytes=80 * 2 ** 30)
    one, eight = (memory.estimate("lora", micro, 1024, "bf16", False, trained_fraction=0.5,
                                  sequences_per_row=2).logits_bytes for micro in (1, 8))
    assert eight == pytest.approx(8 * one, rel=1e-3)  # not chunked: DPO takes log-probabilities of every position
