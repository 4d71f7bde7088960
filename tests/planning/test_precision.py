"""bf16 on a CPU: chosen where the CPU has native bf16 (AVX512-BF16 or AMX), fp32
elsewhere, the plan says why, and training in it follows fp32's losses."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from llmcustoms.planning import hardware
from llmcustoms.planning.duration import estimate_seconds
from llmcustoms.planning.hardware import Hardware, cpu_bf16
from llmcustoms.models.loading import weights_dtype
from test_finetuner import train
from test_planning import model, plan_for
from tiny_models import WIDE

FLAGS = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr avx2 avx512f avx512bw avx512vl"
CPUINFO = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {flags}\nbugs\t\t: sysret_ss_attrs\n\n"
BF16_CPU = replace(Hardware.cpu_only(ram_gib=16), cpu_bf16="AVX512-BF16")
FP32_CPU = Hardware.cpu_only(ram_gib=16)
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
THIS_CPU_HAS_BF16 = bool(cpu_bf16(Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""))


@pytest.mark.parametrize("extra, expected", [
    ("", ""), (" avx512_bf16 avx512_vnni", "AVX512-BF16"), (" avx512_bf16 amx_bf16 amx_tile", "AMX"),
    (" amx_tile", ""),  # AMX tiles without the bf16 instructions
])
def test_the_cpus_bf16_instructions_are_read_from_its_flags(extra, expected):
    assert cpu_bf16(CPUINFO.format(flags=FLAGS + extra)) == expected
    assert cpu_bf16("") == "" and cpu_bf16("flags: avx512_bf16x") == ""


def test_a_cpu_with_bf16_trains_in_bf16_and_says_why():
    plan = plan_for(BF16_CPU, SMOLLM2)
    assert plan.mixed_precision == "bf16" and plan.sources["mixed_precision"] == "planner"
    [reason] = [r for r in plan.reasons if r.startswith("precision")]
    assert reason.startswith("precision bf16 (CPU supports it: AVX512-BF16)") and "--mixed-precision no" in reason


def test_a_cpu_without_bf16_trains_in_fp32_and_says_why():
    plan = plan_for(FP32_CPU, SMOLLM2)
    assert plan.mixed_precision == "no"
    [reason] = [r for r in plan.reasons if r.startswith("precision")]
    assert reason.startswith("precision fp32: no GPU, and this CPU has no native bf16")


def test_mixed_precision_no_keeps_fp32_on_a_bf16_cpu_with_fp32_estimates():
    bf16, fp32 = plan_for(BF16_CPU, SMOLLM2), plan_for(BF16_CPU, SMOLLM2, {"mixed_precision": "no"})
    assert fp32.mixed_precision == "no" and fp32.sources["mixed_precision"] == "flag"
    # The frozen base is held in bf16 (half the bytes) and activations are 16-bit.
    assert bf16.memory["weights_bytes"] * 2 == fp32.memory["weights_bytes"]
    assert bf16.memory["activations_bytes"] < 0.6 * fp32.memory["activations_bytes"]
    # The time estimate follows the precision: fp32 on this CPU is estimated as on a CPU without bf16.
    assert fp32.estimated_seconds == pytest.approx(plan_for(FP32_CPU, SMOLLM2, {"mixed_precision": "no"}).estimated_seconds)
    assert bf16.estimated_seconds < fp32.estimated_seconds / 1.3


def test_bf16_asked_for_on_a_cpu_without_it_is_allowed_with_a_warning():
    plan = plan_for(FP32_CPU, SMOLLM2, {"mixed_precision": "bf16"})
    assert plan.mixed_precision == "bf16"
    assert any("emulated" in w and "--mixed-precision no" in w for w in plan.warnings)
    assert not any("emulated" in w for w in plan_for(BF16_CPU, SMOLLM2, {"mixed_precision": "bf16"}).warnings)


def test_measured_speeds_of_fp32_and_bf16_cpus_are_kept_apart():
    assert BF16_CPU.machine_key != FP32_CPU.machine_key
    assert BF16_CPU.as_used("no").machine_key == FP32_CPU.machine_key
    assert BF16_CPU.as_used("bf16") is BF16_CPU
    arch = model(SMOLLM2).arch
    assert estimate_seconds(arch, "lora", False, 1e6, BF16_CPU) < estimate_seconds(arch, "lora", False, 1e6, FP32_CPU)


def test_the_plan_command_names_the_precision_and_why(cli, tmp_path, tiny_models):
    # In a subprocess, so the machine is this one: the answer depends on its CPU's flags.
    result = cli("plan", str(Path(__file__).parent.parent / "fixtures" / "alpaca.jsonl"), "--model", str(tiny_models["llama"]),
                 cwd=tmp_path, env={"COLUMNS": WIDE})
    assert result.returncode == 0, result.stderr
    expected = "precision bf16 (CPU supports it" if THIS_CPU_HAS_BF16 else "precision fp32: no GPU, and this CPU"
    assert expected in result.stdout
    forced = cli("plan", str(Path(__file__).parent.parent / "fixtures" / "alpaca.jsonl"), "--model", str(tiny_models["llama"]),
                 "--mixed-precision", "no", cwd=tmp_path, env={"COLUMNS": WIDE})
    assert forced.returncode == 0 and "precision bf16" not in forced.stdout


def test_detect_reads_this_machines_flags(monkeypatch):
    monkeypatch.setattr(hardware, "_read_cpuinfo", lambda: CPUINFO.format(flags=FLAGS + " amx_bf16"))
    assert hardware.detect().cpu_bf16 == "AMX"
    monkeypatch.setattr(hardware, "_read_cpuinfo", lambda: "")
    assert hardware.detect().mixed_precision == "no" or hardware.detect().has_gpu


@pytest.mark.skipif(not THIS_CPU_HAS_BF16, reason="this CPU has no native bf16: only the planner's choice is checked")
def test_bf16_training_on_a_cpu_tracks_fp32(tmp_path, tiny_models):
    """Same rows, same seed: per-step losses within 2% (relative) of fp32's over 12 steps,
    the loss falls in both, and the trained weights stay fp32 while the frozen base is bf16."""
    settings = dict(max_steps=12, micro_batch_size=4, grad_accum=1, lr=5e-3)
    # In one process, as tune's trials and tests run: accelerate's one-precision state is switched each time.
    fp32_tuner, _, _, fp32 = train(tmp_path, tiny_models["llama"], name="fp32", mixed_precision="no", **settings)
    bf16_tuner, _, _, bf16 = train(tmp_path, tiny_models["llama"], name="bf16", mixed_precision="bf16", **settings)
    assert bf16_tuner.accelerator.mixed_precision == "bf16"
    again, _, _, _ = train(tmp_path, tiny_models["llama"], name="fp32-again", mixed_precision="no", max_steps=1)
    assert again.accelerator.mixed_precision == "no"
    assert bf16_tuner.plan.mixed_precision == "bf16" and fp32_tuner.plan.mixed_precision == "no"
    fp32_losses, bf16_losses = [r["loss"] for r in fp32.steps], [r["loss"] for r in bf16.steps]
    assert len(fp32_losses) == len(bf16_losses) == 12
    for a, b in zip(fp32_losses, bf16_losses):
        assert abs(a - b) <= 0.02 * a, (fp32_losses, bf16_losses)
    assert bf16_losses[-1] < 0.8 * bf16_losses[0] and fp32_losses[-1] < 0.8 * fp32_losses[0]
    model = bf16_tuner.accelerator.unwrap_model(bf16_tuner.model)
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    frozen = {p.dtype for n, p in model.named_parameters() if not p.requires_grad and "layers" in n}
    assert trained == {torch.float32} and frozen == {weights_dtype(bf16_tuner.plan)} == {torch.bfloat16}
    evals = [r["eval_loss"] for r in bf16.evals]
    assert evals and abs(evals[-1] - fp32.evals[-1]["eval_loss"]) <= 0.02 * fp32.evals[-1]["eval_loss"]
