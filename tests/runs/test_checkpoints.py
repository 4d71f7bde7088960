"""CheckpointManager and the recovery ladder, without training."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from llmcustoms.runs.checkpoints import CheckpointManager, load_optimizer_state, optimizer_state, rng_state, set_rng_state
from llmcustoms.recovery.faults import FaultInjector
from llmcustoms.errors import ConfigError
from llmcustoms.planning.plan import LoraSettings, Plan
from llmcustoms.recovery.recovery_system import MAX_NAN_RECOVERIES, TrainingFailed, TrainingRecoverySystem


def save(manager: CheckpointManager, step: int, value: float = 1.0):
    return manager.save(step, {"model.safetensors": {"w": torch.full((4, 4), value)},
                               "optimizer.safetensors": {"state.0.exp_avg": torch.zeros(4)},
                               "rng.safetensors": {"torch_cpu": torch.get_rng_state()}}, {"step": step, "last_eval": None})


def test_a_checkpoint_round_trips_and_verifies(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3)
    checkpoint = save(manager, 7, value=2.5)
    assert checkpoint.path.name == "step-000007"
    assert manager.verify(checkpoint.path) is None
    assert torch.equal(checkpoint.tensors("model.safetensors")["w"], torch.full((4, 4), 2.5))
    assert checkpoint.state()["step"] == 7
    manifest = json.loads((checkpoint.path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"}


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_manifest", "delete_file"])
def test_a_damaged_checkpoint_does_not_exist(tmp_path, damage):
    warnings = []
    manager = CheckpointManager(tmp_path, keep=5, warn=warnings.append)
    save(manager, 3)
    newest = save(manager, 6)
    target = newest.path / "model.safetensors"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "delete_manifest":
        (newest.path / "manifest.json").unlink()
    else:
        target.unlink()
    assert manager.latest().step == 3
    assert len(warnings) == 1 and "step-000006 is unusable" in warnings[0]


def test_a_half_written_checkpoint_is_invisible(tmp_path):
    manager = CheckpointManager(tmp_path, keep=5)
    save(manager, 3)
    # What a kill mid-save leaves: a temp directory without a manifest.
    partial = tmp_path / ".tmp-step-000006-12345"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\0" * 10)
    assert [c.step for c in manager.all()] == [3] and manager.latest().step == 3
    manager.prune(best_step=None)
    assert not partial.exists()


def test_prune_keeps_the_newest_and_the_best(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (3, 6, 9, 12, 15):
        save(manager, step)
    manager.prune(best_step=6)
    assert [c.step for c in manager.all()] == [15, 12, 6]


def test_resaving_a_step_replaces_it_whole(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3)
    save(manager, 3, value=1.0)
    again = save(manager, 3, value=9.0)
    assert manager.verify(again.path) is None
    assert float(again.tensors("model.safetensors")["w"][0, 0]) == 9.0
    assert [p.name for p in tmp_path.iterdir()] == ["step-000003"]


def test_rng_and_optimizer_state_round_trip_through_tensors_and_json(tmp_path):
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    tensors, state = rng_state()
    json.dumps(state)  # must be plain JSON
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    set_rng_state(tensors, state)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1] and np.random.rand() == expected[2]

    weight = torch.nn.Parameter(torch.randn(3, 3))
    optimizer = torch.optim.AdamW([weight], lr=0.1, betas=(0.8, 0.95))
    weight.grad = torch.ones(3, 3)
    optimizer.step()
    tensors, groups = optimizer_state(optimizer)
    json.dumps(groups)
    other = torch.optim.AdamW([weight], lr=0.5)
    load_optimizer_state(other, tensors, groups)
    assert other.param_groups[0]["betas"] == (0.8, 0.95) and other.param_groups[0]["lr"] == 0.1
    assert torch.equal(other.state[weight]["exp_avg"], optimizer.state[weight]["exp_avg"])


def plan(**changes) -> Plan:
    fields = dict(model="m", family="llama", model_type="llama", preset="quality", method="lora", micro_batch_size=8,
                  grad_accum=2, effective_batch_size=16, max_seq_len=512, gradient_checkpointing=False,
                  mixed_precision="bf16", lr=2e-4, lr_scheduler="cosine", warmup_steps=0, weight_decay=0.0,
                  max_grad_norm=1.0, epochs=1.0, steps_per_epoch=10, total_steps=10, eval_every=0,
                  early_stopping_patience=0, save_every=5, keep_checkpoints=3, seed=1, train_on_prompt=False,
                  trust_remote_code=False, train_rows=160, eval_rows=0, lora=LoraSettings(16, 32, 0.0, ("q_proj",)))
    return Plan(**{**fields, **changes})


def test_out_of_memory_escalates_batch_then_checkpointing_then_length_then_stops():
    system, current, actions = TrainingRecoverySystem(), plan(), []
    while True:
        try:
            current, recovery = system.after_oom(current, step=4)
        except TrainingFailed as failed:
            assert "even with micro-batch 1" in failed.report["reason"]
            assert any("qlora" in s for s in failed.report["suggestions"])
            break
        actions.append(recovery.action)
        # The effective batch never changes: micro-batches shrink, accumulation grows.
        assert current.micro_batch_size * current.grad_accum == 16
    assert actions == ["halved micro-batch"] * 3 + ["enabled gradient checkpointing"] + ["shortened sequences"] * 3
    assert current.max_seq_len == 64 and current.gradient_checkpointing and current.micro_batch_size == 1


def test_nan_lowers_the_learning_rate_a_few_times_then_stops():
    system, current = TrainingRecoverySystem(), plan()
    for attempt in range(MAX_NAN_RECOVERIES):
        current, recovery = system.after_nan(current, step=3)
        assert recovery.details["lr"][1] == pytest.approx(2e-4 * 0.5 ** (attempt + 1))
    with pytest.raises(TrainingFailed) as failed:
        system.after_nan(current, step=3)
    assert "--lr" in " ".join(failed.value.report["suggestions"])


def test_fault_injection_parses_fires_once_and_rejects_nonsense():
    faults = FaultInjector("oom@5, nan@7:rank=1", rank=0)
    assert not faults.due("oom", 4) and faults.due("oom", 5) and not faults.due("oom", 5)
    assert not faults.due("nan", 7)  # meant for rank 1
    assert FaultInjector("nan@7:rank=1", rank=1).due("nan", 7)
    with pytest.raises(torch.OutOfMemoryError):
        FaultInjector("oom@2").raise_oom_if_due(2)
    with pytest.raises(ConfigError):
        FaultInjector("explode@3")


def test_out_of_memory_with_several_processes_keeps_the_effective_batch():
    current, recovery = TrainingRecoverySystem().after_oom(
        plan(world_size=2, micro_batch_size=8, grad_accum=1, effective_batch_size=16), step=4)
    assert (current.micro_batch_size, current.grad_accum, current.effective_batch_size) == (4, 2, 16)
    assert recovery.details["grad_accum"] == [1, 2]


def test_faults_of_steps_before_a_restart_do_not_fire_again():
    restarted = FaultInjector("oom@5:rank=1, nan@7", rank=1, spent_through=5)
    assert not restarted.due("oom", 5) and restarted.due("nan", 7)


def test_a_restart_request_is_written_by_any_process_and_cleared_by_the_main_one(tmp_path):
    from llmcustoms.runs.run_directory import RunDirectory

    worker, main = RunDirectory(tmp_path, writable=False), RunDirectory(tmp_path)
    assert main.pending_restart() is None
    worker.request_restart("oom", 6, rank=1, launch=None)
    assert main.pending_restart() == {"kind": "oom", "step": 6, "rank": 1, "launch": None}  # not under relaunch
    worker.clear_restart()  # a read-only view leaves it for the main process
    assert main.pending_restart() is not None
    main.clear_restart()
    assert main.pending_restart() is None and not list(tmp_path.iterdir())
