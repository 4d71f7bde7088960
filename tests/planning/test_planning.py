"""Planning is pure: plans for machines we do not have, from `Hardware` values."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from llmcustoms.planning.duration import CPU_TIME_LIMIT_S
from llmcustoms.errors import ConfigError
from llmcustoms.planning.hardware import GIB, Hardware
from llmcustoms.planning.memory import MemoryEstimator, parameter_counts
from llmcustoms.models.loading import choice_from_spec
from llmcustoms.planning.plan import DataStats, Plan
from llmcustoms.planning.planner import Planner
from llmcustoms.planning.presets import find_model_spec, load_families, load_preset

FAMILIES = load_families()
MACHINES = {
    "cpu-only": Hardware.cpu_only(ram_gib=16),
    "6GB": Hardware.with_gpu(6, name="RTX 2060", compute_capability=(7, 5)),
    "8GB": Hardware.with_gpu(8, name="RTX 3070"),
    "16GB": Hardware.with_gpu(16, name="RTX 4080"),
    "24GB": Hardware.with_gpu(24, name="RTX 4090", compute_capability=(8, 9)),
    "80GB": Hardware.with_gpu(80, name="A100 80GB", compute_capability=(8, 0)),
}
# One model per family, smallest first within the family is not the point:
# the family's flagship must get a sensible plan or a clear refusal.
FLAGSHIPS = {
    "tinyllama": "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    "phi": "microsoft/Phi-3.5-mini-instruct",
    "mistral": "mistralai/Mistral-7B-Instruct-v0.3",
    "qwen": "Qwen/Qwen2.5-7B-Instruct",
}


def stats(rows: int = 2000, length: int = 300) -> DataStats:
    # Skewed like real instruction data: most rows short, a tail of long ones.
    lengths = tuple(max(16, int(length * (0.3 + (i % 10) / 6))) for i in range(rows))
    return DataStats(lengths=lengths, first_loss_positions=tuple(n // 2 for n in lengths), eval_rows=rows // 20)


def model(hub_id: str):
    return choice_from_spec(find_model_spec(hub_id, FAMILIES), FAMILIES, "flag")


CATALOG = tuple(spec for family in FAMILIES.values() for spec in family.models)


def plan_for(machine: Hardware, hub_id: str, overrides: dict | None = None, preset: str = "quality") -> Plan:
    return Planner(machine, load_preset(preset), catalog=CATALOG).plan(
        model(hub_id), stats(), {k: (v, "flag") for k, v in (overrides or {}).items()})


@pytest.mark.parametrize("machine", list(MACHINES))
@pytest.mark.parametrize("family", list(FLAGSHIPS))
def test_every_machine_gets_a_sensible_plan_or_a_clear_refusal(machine, family):
    hardware = MACHINES[machine]
    try:
        plan = plan_for(hardware, FLAGSHIPS[family])
    except ConfigError as error:
        # A refusal must say how much is missing and what would work instead.
        assert "does not fit" in error.message and "GiB" in error.message
        assert error.hint.startswith("What would fit:")
        assert hardware.has_gpu and hardware.gpus[0].total_bytes <= 8 * GIB, (machine, family, error.message)
        return
    assert plan.micro_batch_size >= 1 and plan.grad_accum >= 1
    assert plan.memory["total_bytes"] <= plan.memory["budget_bytes"] * 0.9
    assert plan.effective_batch_size == plan.micro_batch_size * plan.grad_accum
    assert plan.mixed_precision == ("no" if machine == "cpu-only" else "bf16" if machine != "6GB" else "fp16")
    assert plan.method in ("lora", "qlora")
    assert plan.estimated_seconds and plan.estimated_seconds > 0
    assert set(plan.sources) >= {"model", "method", "micro_batch_size", "grad_accum", "max_seq_len", "lr"}
    assert any("estimated peak memory" in r for r in plan.reasons)


@pytest.mark.parametrize("hub_id", [spec.hub_id for family in FAMILIES.values() for spec in family.models])
@pytest.mark.parametrize("method", [None, "lora", "qlora"])
def test_more_memory_never_gives_a_smaller_micro_batch(hub_id, method):
    previous = 0
    for gib in (2, 4, 6, 8, 12, 16, 24, 32, 48, 80, 141):
        try:
            plan = plan_for(Hardware.with_gpu(gib), hub_id, {"method": method} if method else None)
        except ConfigError:
            assert previous == 0, f"{hub_id} fit at less memory but not at {gib} GiB"
            continue
        assert plan.micro_batch_size >= previous, (hub_id, gib)
        previous = plan.micro_batch_size


@pytest.mark.parametrize("length, rows", [(128, 16), (256, 8), (384, 4), (1024, 2), (4096, 1)])
def test_a_cpu_micro_batch_holds_at_most_2048_tokens_and_keeps_the_effective_batch(length, rows):
    """On a CPU more rows a forward pass ran no faster and padded more (code: micro-batch 16 88 tokens/s,
    4 247 tokens/s); the preset's effective batch is kept by accumulation. A GPU, or a given size, is not capped."""
    big_cpu = Hardware.cpu_only(ram_gib=256)
    plan = plan_for(big_cpu, "HuggingFaceTB/SmolLM2-135M-Instruct", {"max_seq_len": length})
    assert plan.effective_batch_size == 16  # the preset's, for this many rows
    assert (plan.micro_batch_size, plan.micro_batch_size * plan.grad_accum) == (rows, 16)
    if rows < 16:
        assert any("2,048 tokens a forward pass" in r for r in plan.reasons)
    given = plan_for(big_cpu, "HuggingFaceTB/SmolLM2-135M-Instruct",
                     {"max_seq_len": length, "micro_batch_size": 16})
    assert given.micro_batch_size == 16
    gpu = plan_for(MACHINES["80GB"], "HuggingFaceTB/SmolLM2-135M-Instruct", {"max_seq_len": length})
    assert gpu.micro_batch_size == 16


def test_mistral_7b_needs_qlora_on_8gb_and_lora_on_24gb():
    small = plan_for(MACHINES["8GB"], "mistralai/Mistral-7B-Instruct-v0.3")
    assert small.method == "qlora" and small.sources["method"] == "planner"
    assert any(r.startswith("method qlora: lora does not fit") for r in small.reasons)
    big = plan_for(MACHINES["80GB"], "mistralai/Mistral-7B-Instruct-v0.3")
    assert big.method == "lora"


def test_mistral_7b_is_refused_on_2gb_with_what_is_missing():
    with pytest.raises(ConfigError) as info:
        plan_for(Hardware.with_gpu(2), "mistralai/Mistral-7B-Instruct-v0.3")
    message, hint = info.value.message, info.value.hint
    assert "does not fit in 2.0 GiB" in message and "more than can be used" in message
    suggested = hint.split("--model ")[1].split()[0]
    assert suggested in {spec.hub_id for spec in CATALOG}
    # The suggestion really fits: planning it on the same card succeeds.
    length = int(hint.split("--max-seq-len ")[1].split(";")[0]) if "--max-seq-len" in hint else None
    fitting = plan_for(Hardware.with_gpu(2), suggested, {"max_seq_len": length} if length else None)
    assert fitting.method == "qlora"
    assert "a machine with at least" in hint and "GiB of GPU memory" in hint


def test_mistral_7b_v03_in_4_bit_is_about_4_1_gb():
    spec = find_model_spec("mistralai/Mistral-7B-Instruct-v0.3", FAMILIES)
    weights = MemoryEstimator(spec, on_gpu=True, budget_bytes=0).weights("qlora", "bf16")
    # First principles: 6.98e9 block weights x 4.127 bits + 2 x 32768 x 4096 bf16 embeddings/head.
    linear, other = parameter_counts(spec)
    assert linear == pytest.approx(6.98e9, rel=0.01)
    assert weights == int(linear * 4.127 / 8) + other * 2
    assert 4.0e9 < weights < 4.2e9


def test_full_fine_tuning_of_a_small_model_on_a_big_card():
    plan = plan_for(MACHINES["80GB"], "Qwen/Qwen2.5-0.5B-Instruct", {"method": "full"})
    assert plan.method == "full" and plan.lora is None
    # fp32 master weights + gradients + two AdamW moments: 16 bytes per parameter.
    memory = plan.memory
    params = sum(parameter_counts(find_model_spec("Qwen/Qwen2.5-0.5B-Instruct", FAMILIES)))
    assert memory["weights_bytes"] + memory["gradients_bytes"] + memory["optimizer_bytes"] == 16 * params


def test_a_small_model_on_a_big_gpu_is_timed_by_its_launches_not_its_flops():
    """On an H200 a LoRA step of Qwen2.5-0.5B's shape took 250-450 ms where its FLOPs said a few
    ms, and the plan said 0.4 s for 20 steps that took 10 (the GPU kit, 2026-11-27)."""
    from llmcustoms.planning.duration import GPU_SECONDS_PER_LAYER_PASS

    h200 = Hardware.with_gpu(140, name="NVIDIA H200", compute_capability=(9, 0))
    plan = plan_for(h200, "Qwen/Qwen2.5-0.5B-Instruct", {"max_steps": 20})
    layers = find_model_spec("Qwen/Qwen2.5-0.5B-Instruct", FAMILIES).num_layers
    launches = 20 * plan.grad_accum * layers * GPU_SECONDS_PER_LAYER_PASS
    steps = plan.duration_parts["training"] + plan.duration_parts["evaluations"]  # the rest is not steps
    assert launches <= steps < 3 * launches  # evaluations add a third of a pass a batch
    # A 7B on a small card runs long micro-batches: there the FLOPs are the slower, and they decide.
    big = plan_for(MACHINES["24GB"], "mistralai/Mistral-7B-Instruct-v0.3", {"max_steps": 20})
    big_launches = 20 * big.grad_accum * find_model_spec("mistralai/Mistral-7B-Instruct-v0.3",
                                                          FAMILIES).num_layers * GPU_SECONDS_PER_LAYER_PASS
    assert big.duration_parts["training"] > 2 * big_launches


def test_gradient_checkpointing_only_when_needed():
    roomy = plan_for(MACHINES["80GB"], "Qwen/Qwen2.5-0.5B-Instruct")
    assert not roomy.gradient_checkpointing
    tight = plan_for(MACHINES["8GB"], "Qwen/Qwen2.5-3B-Instruct")
    assert tight.gradient_checkpointing and any("gradient checkpointing on" in r for r in tight.reasons)
    forced_off = plan_for(MACHINES["8GB"], "Qwen/Qwen2.5-3B-Instruct", {"gradient_checkpointing": False})
    assert not forced_off.gradient_checkpointing and forced_off.sources["gradient_checkpointing"] == "flag"


def test_flags_win_and_are_recorded_as_flags():
    plan = plan_for(MACHINES["24GB"], "Qwen/Qwen2.5-1.5B-Instruct",
                    {"micro_batch_size": 2, "grad_accum": 3, "lr": 5e-5, "max_seq_len": 256, "method": "qlora"})
    assert (plan.micro_batch_size, plan.grad_accum, plan.effective_batch_size) == (2, 3, 6)
    assert plan.lr == 5e-5 and plan.max_seq_len == 256 and plan.method == "qlora"
    for name in ("micro_batch_size", "grad_accum", "lr", "max_seq_len", "method"):
        assert plan.sources[name] == "flag"


def test_the_preset_adjusts_for_dataset_size():
    small = Planner(MACHINES["24GB"], load_preset("quality")).plan(
        model("Qwen/Qwen2.5-0.5B-Instruct"), DataStats(lengths=(100,) * 200, first_loss_positions=(50,) * 200, eval_rows=20), {})
    assert small.epochs == 4 and small.sources["lr"] == "preset quality (small dataset)"


def test_sequence_length_follows_the_data_and_the_model():
    plan = plan_for(MACHINES["24GB"], "Qwen/Qwen2.5-0.5B-Instruct")
    p99 = stats().percentile(99)
    assert p99 <= plan.max_seq_len < p99 + 64 and plan.max_seq_len % 64 == 0
    with pytest.raises(ConfigError) as info:
        plan_for(MACHINES["24GB"], "TinyLlama/TinyLlama-1.1B-Chat-v1.0", {"max_seq_len": 4096})
    assert "longer than the model's context of 2048" in info.value.message


def test_a_cpu_plan_says_plainly_that_it_will_be_slow():
    plan = Planner(MACHINES["cpu-only"], load_preset("quality")).plan(
        model("Qwen/Qwen2.5-1.5B-Instruct"), stats(rows=20000), {})
    assert plan.estimated_seconds > 3600
    assert any("long, because there is no GPU" in r for r in plan.reasons)


def test_the_model_is_chosen_by_what_fits():
    preset = load_preset("bestaccuracy")
    candidates = [model(m) for m in preset.model_candidates(has_gpu=True)]
    assert [c.name for c in candidates] == list(preset.models)
    for gib, expected in ((80, "Qwen/Qwen3-8B"), (4, None)):
        chosen, reason = Planner(Hardware.with_gpu(gib), preset).choose_model(candidates, stats(), {})
        if expected:
            assert chosen.name == expected
        assert "fits" in reason


CPU = Hardware.cpu_only(ram_gib=16, cores=8)


def test_without_a_gpu_the_best_cpu_model_that_finishes_in_time_is_chosen():
    preset = load_preset("quality")
    cpu_models = [model(m) for m in preset.model_candidates(has_gpu=False)]
    assert [c.name for c in cpu_models] == ["HuggingFaceTB/SmolLM2-360M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    optimizer = Planner(CPU, preset)

    def minutes(choice, rows):
        return optimizer.plan(choice, stats(rows=rows), {}).estimated_seconds / 60

    # Few rows: the 360M model fits in the time limit, so the preset's first choice.
    assert minutes(cpu_models[0], 100) < CPU_TIME_LIMIT_S / 60
    chosen, reason = optimizer.choose_model(cpu_models, stats(rows=100), {})
    assert chosen.name == "HuggingFaceTB/SmolLM2-360M-Instruct"
    assert reason.startswith("model HuggingFaceTB/SmolLM2-360M-Instruct: no GPU found; the preset's first CPU model, "
                             "estimated about ") and reason.endswith("within 30 min")
    # More rows: the 360M would be over the limit and the 135M is not; the reason says so.
    assert minutes(cpu_models[1], 300) < CPU_TIME_LIMIT_S / 60 < minutes(cpu_models[0], 300)
    chosen, reason = optimizer.choose_model(cpu_models, stats(rows=300), {})
    assert chosen.name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    expected = (f"model HuggingFaceTB/SmolLM2-135M-Instruct: no GPU found; estimated about {round(minutes(cpu_models[1], 300))} "
                f"min (SmolLM2-360M-Instruct would take about {round(minutes(cpu_models[0], 300))} min, over 30 min)")
    assert reason == expected
    # Nothing finishes in time: the smallest, and the reason says none would.
    chosen, reason = optimizer.choose_model(cpu_models, stats(rows=2000), {})
    assert chosen.name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "the smallest CPU model" in reason and "none is expected to finish within 30 min" in reason
    assert "SmolLM2-360M-Instruct about" in reason


def test_a_preset_without_a_cpu_tier_falls_back_to_its_models_by_time():
    preset = replace(load_preset("highspeed"), cpu_models=())
    candidates = [model(m) for m in preset.model_candidates(has_gpu=False)]
    assert [c.name for c in candidates] == list(preset.models)
    optimizer = Planner(CPU, preset)
    in_time = [c.name for c in candidates if optimizer.plan(c, stats(rows=100), {}).estimated_seconds <= CPU_TIME_LIMIT_S]
    assert in_time and in_time[0] != candidates[0].name
    chosen, reason = optimizer.choose_model(candidates, stats(rows=100), {})
    assert chosen.name == in_time[0] and "no GPU found" in reason and "Qwen2.5-1.5B-Instruct would take" in reason
    chosen, reason = optimizer.choose_model(candidates, stats(rows=20_000), {})
    assert chosen.name == "Qwen/Qwen2.5-0.5B-Instruct" and "the smallest CPU model" in reason


def test_the_model_size_class_sets_values_after_the_dataset_bucket_and_says_so():
    data = DataStats(lengths=(100,) * 200, first_loss_positions=(50,) * 200, eval_rows=20)  # a small dataset
    tiny = Planner(CPU, load_preset("bestaccuracy")).plan(model("HuggingFaceTB/SmolLM2-135M-Instruct"), data, {})
    # The small-dataset bucket sets lr 5e-5; the tiny class's 3e-4 wins, and rank 16 replaces 64.
    assert tiny.lr == 3e-4 and tiny.lora.r == 16 and tiny.lora.alpha == 32 and tiny.epochs == 6
    assert tiny.sources["lr"] == tiny.sources["lora.r"] == "preset bestaccuracy (tiny model)"
    assert tiny.sources["epochs"] == "preset bestaccuracy (small dataset)"
    assert "lr 0.0003, lora_r 16, lora_alpha 32: preset bestaccuracy for a tiny model (135M parameters)" in tiny.reasons
    # A flag still wins, and the reason names only what the class set.
    flagged = Planner(CPU, load_preset("bestaccuracy")).plan(
        model("HuggingFaceTB/SmolLM2-135M-Instruct"), data, {"lr": (1e-4, "flag")})
    assert flagged.lr == 1e-4 and flagged.sources["lr"] == "flag"
    assert "lora_r 16, lora_alpha 32: preset bestaccuracy for a tiny model (135M parameters)" in flagged.reasons
    large = plan_for(MACHINES["80GB"], "Qwen/Qwen2.5-7B-Instruct")
    assert large.lr == 1e-4 and large.sources["lr"] == "preset quality (large model)"
    assert any(r.startswith("lr 0.0001: preset quality for a large model (7.6B parameters)") for r in large.reasons)


@pytest.mark.parametrize("name", ["highspeed", "quality", "bestaccuracy"])
def test_every_preset_stops_early_when_there_is_evaluation(name):
    plan = plan_for(MACHINES["24GB"], "Qwen/Qwen2.5-1.5B-Instruct", preset=name)
    assert plan.eval_rows > 0 and plan.eval_every > 0 and plan.early_stopping_patience >= 2
    assert plan.sources["early_stopping_patience"].startswith(f"preset {name}")


def test_plan_json_round_trips_and_has_the_contract_keys():
    plan = plan_for(MACHINES["24GB"], "Qwen/Qwen2.5-1.5B-Instruct")
    data = json.loads(plan.dumps())
    for key in ("model", "family", "preset", "method", "micro_batch_size", "grad_accum", "effective_batch_size",
                "max_seq_len", "gradient_checkpointing", "lr", "lora", "memory", "reasons", "sources"):
        assert key in data
    assert set(data["lora"]) >= {"r", "alpha", "dropout", "target_modules"}
    assert set(data["memory"]) >= {"weights_bytes", "trainable_bytes", "gradients_bytes", "optimizer_bytes",
                                   "activations_bytes", "overhead_bytes", "total_bytes", "budget_bytes"}
    assert Plan.from_json(data) == plan


def test_optimizer_state_by_variant():
    spec = find_model_spec("Qwen/Qwen2.5-0.5B-Instruct", FAMILIES)
    memory = MemoryEstimator(spec, on_gpu=True, budget_bytes=0)
    full = sum(parameter_counts(spec))
    for optimizer, per_param in (("adamw", 8), ("paged_adamw", 8), ("adamw_8bit", 2), ("paged_adamw_8bit", 2)):
        assert memory.estimate("full", 1, 256, "bf16", False, optimizer=optimizer).optimizer_bytes == per_param * full


def plan_with_processes(machine: Hardware, hub_id: str, world_size: int, overrides: dict | None = None) -> Plan:
    return Planner(machine, load_preset("quality"), catalog=CATALOG).plan(
        model(hub_id), stats(), {k: (v, "flag") for k, v in (overrides or {}).items()}, world_size=world_size)


def test_more_processes_keep_the_effective_batch_by_lowering_accumulation():
    one = plan_with_processes(MACHINES["24GB"], "TinyLlama/TinyLlama-1.1B-Chat-v1.0", 1, {"micro_batch_size": 2})
    four = plan_with_processes(MACHINES["24GB"], "TinyLlama/TinyLlama-1.1B-Chat-v1.0", 4, {"micro_batch_size": 2})
    assert (one.distributed, four.distributed) == ("none", "ddp")
    assert four.micro_batch_size == one.micro_batch_size == 2  # per process
    assert four.grad_accum == one.grad_accum // 4
    assert four.effective_batch_size == one.effective_batch_size == 2 * four.grad_accum * 4
    # Each GPU process has its own card: the per-process memory is one process's.
    assert four.memory == one.memory


def test_fsdp_shards_full_fine_tuning_so_a_7b_model_fits_on_80gb_cards():
    with pytest.raises(ConfigError, match="does not fit"):
        plan_with_processes(MACHINES["80GB"], "mistralai/Mistral-7B-Instruct-v0.3", 1,
                            {"method": "full", "optimizer": "adamw"})
    with pytest.raises(ConfigError, match="does not fit"):  # data-parallel: each card holds everything
        plan_with_processes(MACHINES["80GB"], "mistralai/Mistral-7B-Instruct-v0.3", 8,
                            {"method": "full", "optimizer": "adamw"})
    # On one card only 8-bit AdamW's quarter-size moments let it fit at all.
    single = plan_with_processes(MACHINES["80GB"], "mistralai/Mistral-7B-Instruct-v0.3", 1, {"method": "full"})
    assert single.optimizer == "adamw_8bit" and single.gradient_checkpointing
    with pytest.raises(ConfigError, match="FSDP's shards"):
        plan_with_processes(MACHINES["80GB"], "mistralai/Mistral-7B-Instruct-v0.3", 8,
                            {"distributed": "fsdp", "optimizer": "adamw_8bit"})
    plan = plan_with_processes(MACHINES["80GB"], "mistralai/Mistral-7B-Instruct-v0.3", 8, {"distributed": "fsdp"})
    assert (plan.method, plan.distributed, plan.world_size) == ("full", "fsdp", 8)
    assert any("method full: --distributed fsdp" in r for r in plan.reasons)
    params = sum(parameter_counts(find_model_spec("mistralai/Mistral-7B-Instruct-v0.3", FAMILIES)))
    memory = plan.memory
    # An eighth of fp32 weights, gradients and two AdamW moments on each card ...
    assert memory["weights_bytes"] + memory["gradients_bytes"] + memory["optimizer_bytes"] == pytest.approx(
        16 * params / 8, rel=1e-6)
    # ... plus what is whole for a while: the root unit and two blocks in bf16, and the
    # root unit's and a block's fp32 gradients.
    assert 0 < memory["gathered_bytes"] < 0.3 * 16 * params / 8
    assert memory["total_bytes"] <= memory["budget_bytes"]


def test_fsdp_refuses_lora_and_says_what_to_use():
    with pytest.raises(ConfigError) as info:
        plan_with_processes(MACHINES["24GB"], "TinyLlama/TinyLlama-1.1B-Chat-v1.0", 2,
                            {"distributed": "fsdp", "method": "lora"})
    assert "--method lora" in info.value.message
    assert "--method full" in info.value.hint and "--distributed ddp" in info.value.hint


def test_distributed_is_ignored_with_one_process():
    plan = plan_with_processes(MACHINES["24GB"], "TinyLlama/TinyLlama-1.1B-Chat-v1.0", 1, {"distributed": "fsdp"})
    assert plan.distributed == "none" and plan.method == "lora"
    assert any("--distributed fsdp ignored: one process" in r for r in plan.reasons)


def test_full_fine_tuning_that_does_not_fit_suggests_sharding_over_more_gpus():
    with pytest.raises(ConfigError) as info:  # with 32-bit moments (8-bit ones would fit: see above)
        plan_with_processes(MACHINES["80GB"], "mistralai/Mistral-7B-Instruct-v0.3", 1,
                            {"method": "full", "optimizer": "adamw"})
    suggested = int(info.value.hint.split("--num-processes ")[1].split()[0])
    assert "--distributed fsdp" in info.value.hint
    # The suggestion really fits.
    plan = plan_with_processes(MACHINES["80GB"], "mistralai/Mistral-7B-Instruct-v0.3", suggested, {"distributed": "fsdp"})
    assert plan.method == "full" and plan.memory["total_bytes"] <= plan.memory["budget_bytes"]
    with pytest.raises(ConfigError) as sharded:  # already sharded: more processes, not a 4-bit base
        plan_with_processes(Hardware.with_gpu(24), "mistralai/Mistral-7B-Instruct-v0.3", 2, {"distributed": "fsdp"})
    assert "--method qlora" not in sharded.value.hint
    assert int(sharded.value.hint.split("--num-processes ")[1].split()[0]) > 2


def test_resuming_a_sharded_run_over_fewer_processes_warns_when_it_will_not_fit():
    from llmcustoms.preparation.preparing import _less_sharding_warning

    plan = plan_with_processes(MACHINES["80GB"], "mistralai/Mistral-7B-Instruct-v0.3", 8, {"distributed": "fsdp"})
    assert _less_sharding_warning(plan, 8) is None and _less_sharding_warning(plan, 16) is None
    assert _less_sharding_warning(plan, 2) is None  # a quarter of 7B's fp32 training state fits 80 GB
    warning = _less_sharding_warning(plan, 1)
    assert warning.startswith("sharded over 8 processes") and "--num-processes 8" in warning
    small = plan_with_processes(MACHINES["80GB"], "TinyLlama/TinyLlama-1.1B-Chat-v1.0", 2, {"distributed": "fsdp"})
    assert _less_sharding_warning(small, 1) is None  # 1.1B in full fits one 80 GB card


def test_a_plan_written_before_fsdp_existed_reads_as_data_parallel():
    data = plan_with_processes(MACHINES["24GB"], "TinyLlama/TinyLlama-1.1B-Chat-v1.0", 2).to_json()
    del data["distributed"]
    assert Plan.from_json(data).distributed == "ddp"
    data["world_size"] = 1
    assert Plan.from_json(data).distributed == "none"


def test_every_problem_with_the_given_values_is_named_at_once():
    no_eval = DataStats(lengths=(300,) * 200, first_loss_positions=(150,) * 200, eval_rows=0)
    overrides = {"mixed_precision": "fp16", "max_seq_len": 4096, "lr": 2.0, "early_stopping_patience": 2}
    with pytest.raises(ConfigError) as info:
        Planner(MACHINES["cpu-only"], load_preset("quality")).plan(
            model("TinyLlama/TinyLlama-1.1B-Chat-v1.0"), no_eval, {k: (v, "flag") for k, v in overrides.items()})
    message, hint = info.value.message, info.value.hint
    assert message.startswith("Invalid value(s):\n  'lr' has an out-of-range value 2.0")
    for wording in ("fp16 mixed precision needs a GPU", "longer than the model's context of 2048",
                    "Early stopping needs evaluation rows"):
        assert wording in message
    assert "--mixed-precision no" in hint and "--max-seq-len 2048" in hint and "--eval-split" in hint
    with pytest.raises(ConfigError) as alone:  # a lone out-of-range value is listed as before
        plan_for(MACHINES["24GB"], "Qwen/Qwen2.5-0.5B-Instruct", {"lr": 2.0})
    assert alone.value.message.startswith("Invalid value(s):\n  'lr' has an out-of-range value 2.0")
    assert "\n  " not in alone.value.message.split("\n  ", 1)[1] and alone.value.hint is None


def test_a_length_that_keeps_no_response_is_refused_with_the_other_problems():
    late = DataStats(lengths=(400,) * 100, first_loss_positions=(300,) * 100, eval_rows=5)
    with pytest.raises(ConfigError) as info:
        Planner(MACHINES["24GB"], load_preset("quality")).plan(
            model("Qwen/Qwen2.5-0.5B-Instruct"), late, {"max_seq_len": (256, "flag")})
    assert info.value.message == "No row has a response token within max_seq_len 256."
    assert "Raise --max-seq-len" in info.value.hint


def test_warnings_are_typed_apart_from_reasons():
    plan = plan_for(MACHINES["8GB"], "TinyLlama/TinyLlama-1.1B-Chat-v1.0", {"micro_batch_size": 64})
    assert plan.micro_batch_size == 64
    assert len(plan.warnings) == 1 and plan.warnings[0].startswith("the estimated peak (")
    assert "out-of-memory is likely" in plan.warnings[0]
    assert not any(r.startswith("warning") or "estimated peak" in r for r in plan.reasons)
    assert Plan.from_json(json.loads(plan.dumps())) == plan
    assert not plan_for(MACHINES["8GB"], "TinyLlama/TinyLlama-1.1B-Chat-v1.0").warnings


def test_a_plan_json_with_warnings_among_its_reasons_reads_them_as_warnings():
    data = plan_for(MACHINES["24GB"], "TinyLlama/TinyLlama-1.1B-Chat-v1.0").to_json()
    del data["warnings"]  # written before warnings had a field of their own
    data["reasons"] = data["reasons"] + ["warning: sharded over 8 processes this run needs more", "resumed"]
    plan = Plan.from_json(data)
    assert plan.warnings == ("sharded over 8 processes this run needs more",)
    assert plan.reasons[-1] == "resumed" and not any(r.startswith("warning:") for r in plan.reasons)


def test_resuming_over_fewer_processes_adds_a_warning_not_a_reason():
    from llmcustoms.preparation.preparing import _less_sharding_warning

    plan = plan_with_processes(MACHINES["80GB"], "mistralai/Mistral-7B-Instruct-v0.3", 8, {"distributed": "fsdp"})
    warned = plan.with_warning(_less_sharding_warning(plan, 1))
    assert warned.warnings[len(plan.warnings):] == (_less_sharding_warning(plan, 1),)
    assert warned.reasons == plan.reasons


def test_the_schedule_fits_a_run_of_max_steps_8():
    from llmcustoms.planning.planner import MIN_SAVE_EVERY

    stats = DataStats(lengths=tuple([100] * 900), first_loss_positions=tuple([20] * 900), eval_rows=100)
    plan = Planner(Hardware.cpu_only(), load_preset("quality"), None, ()).plan(
        model("HuggingFaceTB/SmolLM2-135M-Instruct"), stats, {"max_steps": (8, "flag")})
    assert plan.total_steps == 8
    assert plan.eval_every == 2  # 4 evaluations, not only the final one
    assert plan.save_every == MIN_SAVE_EVERY  # not a checkpoint every step
    assert any("evaluate every 2 steps: 4 evaluations in this 8-step run" in r for r in plan.reasons)


def test_the_evaluation_reason_says_what_the_run_will_do_not_what_the_preset_asked():
    """A preset's 2 evaluations per epoch in a 3-step epoch is an evaluation every step: 3 per epoch."""
    stats = DataStats(lengths=tuple([100] * 48), first_loss_positions=tuple([20] * 48), eval_rows=5)
    plan = Planner(Hardware.cpu_only(), load_preset("quality"), None, ()).plan(
        model("HuggingFaceTB/SmolLM2-135M-Instruct"), stats,
        {"micro_batch_size": (4, "flag"), "grad_accum": (4, "flag"), "epochs": (3, "flag")})
    assert plan.steps_per_epoch == 3 and plan.eval_every == 1
    [reason] = [r for r in plan.reasons if r.startswith("evaluate every")]
    assert reason == "evaluate every 1 step: 3 evaluations per epoch of 3 steps"
