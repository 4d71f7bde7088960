"""GPU memory by simulation (benchmarks/cuda_simulation.py): a training step on fake
tensors allocates exactly what the same step allocates on real ones."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parent.parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import cuda_simulation  # noqa: E402
from memory_accuracy import Config, predict, small_arch  # noqa: E402

TINY_LLAMA = small_arch("tiny-llama", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512)
TINY_QWEN = small_arch("tiny-qwen", model_type="qwen2", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=160,
                       vocab=1024, tied=True)


# Today's families at two layers: heads wider than hidden / heads, q/k norms, Gemma's extra norms.
TINY_QWEN3 = replace(small_arch("tiny-qwen3", model_type="qwen3", hidden=64, layers=2, heads=4, kv_heads=2,
                                intermediate=128, vocab=512, tied=True), head_dim=32)
TINY_GEMMA3 = replace(small_arch("tiny-gemma3", model_type="gemma3_text", hidden=64, layers=2, heads=2, kv_heads=1,
                                 intermediate=128, vocab=1024, tied=True), head_dim=48)


@pytest.mark.parametrize("config", [
    Config("lora", TINY_LLAMA, "lora", 4, 64),
    Config("lora-qwen3", TINY_QWEN3, "lora", 4, 64),
    Config("lora-gemma3", TINY_GEMMA3, "lora", 4, 64),
    Config("lora-tied-checkpointed", TINY_QWEN, "lora", 2, 96, gradient_checkpointing=True),
    Config("qlora", TINY_LLAMA, "qlora", 4, 64),
    Config("full", TINY_LLAMA, "full", 2, 64),
], ids=lambda c: c.name)
def test_the_fake_step_tracks_what_the_real_step_allocates(config):
    fake = cuda_simulation.simulate(config, fake=True)
    real = cuda_simulation.simulate(config, fake=False)
    assert fake["fake"] and not real["fake"]
    assert abs(fake["simulated_bytes"] - real["simulated_bytes"]) <= 0.01 * real["simulated_bytes"]
    assert fake["breakdown"] == pytest.approx(real["breakdown"], rel=0.01)
    assert fake["peak_at"] == real["peak_at"]
    assert fake["simulated_bytes"] > fake["breakdown"]["parameters"] + fake["breakdown"]["optimizer_state"]
    if config.method == "qlora":  # PEFT keeps embeddings and head in fp32 there, the estimate in bf16
        return
    # The weights as loaded: 16-bit frozen base and fp32 adapters, or fp32 for full fine-tuning;
    # tied embeddings counted once (the fake weights stay tied).
    estimate = predict(config, "cuda", "bf16")
    assert fake["breakdown"]["parameters"] == pytest.approx(estimate["weights_bytes"] + estimate["trainable_bytes"],
                                                            rel=0.02)


@pytest.mark.slow
def test_memory_accuracy_simulates_a_gpu_configuration():
    out = subprocess.run([sys.executable, str(BENCHMARKS / "memory_accuracy.py"), "--simulate-cuda", "--only",
                          "small-llama-lora-b4-s256", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    [row] = summary["results"]
    assert row["name"] == "small-llama-lora-b4-s256" and row["ratio"] > 0
    assert row["ratio"] == row["simulated_bytes"] / row["predicted"]["total_bytes"]
    assert row["attention_kernels"] and row["peak_at"].startswith("step 2")  # the step with AdamW's state
    predicted = row["predicted"]
    assert row["breakdown"]["optimizer_state"] == pytest.approx(predicted["optimizer_bytes"], rel=0.02)
