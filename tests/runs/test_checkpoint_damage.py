"""Checkpoints that are damaged, of another shape, or half-deleted: each is
called unusable, with the reason, and the run goes on from the one before,
never with a traceback and never restoring the wrong tensors. Deleting one
never leaves a half-deleted step-N behind, whenever it is interrupted."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmcustoms.runs import checkpoints as checkpoints_module
from llmcustoms.runs.checkpoints import MANIFEST, STATE_FILE, TENSOR_FILES, CheckpointManager, ResumeFrom
from llmcustoms.errors import ConfigError
from llmcustoms.recovery.faults import FaultInjector
from llmcustoms.training.finetuner import FineTuner
from llmcustoms.planning.hardware import Hardware
from llmcustoms.planning.train_options import TrainOptions
from llmcustoms.preparation.preparing import prepare_run
from llmcustoms.recovery.recovery_system import TrainingInterrupted
from llmcustoms.reporting import SilentReporter
from llmcustoms.runs.run_directory import RunDirectory
from test_checkpoints import save
from tiny_models import FIXTURES

# ------------------------------------------------------------------ helpers


def rehash(path: Path) -> None:
    """A manifest consistent with the files as they are now: what a buggy writer,
    or a hand edit followed by a re-hash, leaves."""
    files = {name: {"size": (path / name).stat().st_size,
                    "sha256": hashlib.sha256((path / name).read_bytes()).hexdigest()}
             for name in TENSOR_FILES + (STATE_FILE,)}
    (path / MANIFEST).write_text(json.dumps({"step": int(path.name.removeprefix("step-")), "files": files}))


def edit_manifest(path: Path, change) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps(change(manifest)))


def edit_state(path: Path, change) -> None:
    state = json.loads((path / STATE_FILE).read_text())
    (path / STATE_FILE).write_text(json.dumps(change(state)))
    rehash(path)


def split_safetensors(file: Path) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def write_safetensors(file: Path, header: dict | bytes, data: bytes) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes(len(text).to_bytes(8, "little") + text + data)


def edit_header(path: Path, change) -> None:
    header, data = split_safetensors(path / "model.safetensors")
    change(header["w"])
    write_safetensors(path / "model.safetensors", header, data)
    rehash(path)


def noise(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def set_key(mapping: dict, key: str, value) -> dict:
    mapping[key] = value
    return mapping


def randomise_everything(path: Path) -> None:
    for index, name in enumerate(TENSOR_FILES + (STATE_FILE, MANIFEST)):
        (path / name).write_bytes(noise(3000, index))


def garble_header(path: Path) -> None:
    header, data = split_safetensors(path / "model.safetensors")
    write_safetensors(path / "model.safetensors", b"{" + b"\xff" * len(json.dumps(header)), data)
    rehash(path)


def random_tensors_consistent_manifest(path: Path) -> None:
    (path / "model.safetensors").write_bytes(noise(500))
    rehash(path)


def random_state_consistent_manifest(path: Path) -> None:
    (path / STATE_FILE).write_bytes(noise(500, seed=5))
    rehash(path)


def broken_python_rng(path: Path) -> None:
    edit_state(path, lambda s: set_key(s, "rng", {"python": [3, [0] * 10, None], "numpy": ["MT19937", 0, 0, 0.0]}))


DAMAGE = {
    # what is done to the newest checkpoint: (how, what verify says)
    "random bytes everywhere": (randomise_everything, "manifest.json is not"),
    "random tensor file, consistent manifest": (random_tensors_consistent_manifest,
                                                "model.safetensors has no safetensors header"),
    "random state.json, consistent manifest": (random_state_consistent_manifest, "state.json is not text"),
    "manifest is a list": (lambda p: (p / MANIFEST).write_text("[1, 2]"), "the manifest is not a JSON object"),
    "manifest entries are strings": (
        lambda p: edit_manifest(p, lambda m: set_key(m, "files", {k: "x" for k in m["files"]})),
        "the manifest's size of model.safetensors is not a byte count"),
    "files is null": (lambda p: edit_manifest(p, lambda m: set_key(m, "files", None)),
                      "the manifest has no object of files"),
    "size is not an int": (lambda p: edit_manifest(p, lambda m: set_key(m["files"]["rng.safetensors"], "size", "12")
                                                   and m),
                           "the manifest's size of rng.safetensors is not a byte count"),
    "sha256 is not hex": (lambda p: edit_manifest(p, lambda m: set_key(m["files"][STATE_FILE], "sha256", "zz" * 32)
                                                  and m),
                          "the manifest's sha256 of state.json is not 64 hex digits"),
    "manifest of another step": (lambda p: edit_manifest(p, lambda m: set_key(m, "step", 3)),
                                 "the manifest names step 3, not 6"),
    "safetensors header is not JSON": (garble_header, "the safetensors header of model.safetensors is not JSON"),
    "data_offsets disagree with the shape": (lambda p: edit_header(p, lambda t: set_key(t, "shape", [4, 3])),
                                             "tensor w takes 64 bytes, its shape and dtype 48"),
    "unknown dtype": (lambda p: edit_header(p, lambda t: set_key(t, "dtype", "F128")), "tensor w has no known dtype"),
    "negative shape": (lambda p: edit_header(p, lambda t: set_key(t, "shape", [-4, -4])),
                       "tensor w's shape is not a list of sizes"),
    "negative step in state.json": (lambda p: edit_state(p, lambda s: set_key(s, "step", -6)),
                                    "state.json's step is -6, not 6"),
    "negative epoch in state.json": (lambda p: edit_state(p, lambda s: set_key(s, "epoch", -1)),
                                     "state.json's epoch is -1, not a count"),
    "best eval loss is NaN": (lambda p: edit_state(p, lambda s: set_key(s, "best_eval", float("nan"))),
                              "state.json's best_eval is nan, not a finite number"),
    "best step after the step": (lambda p: edit_state(p, lambda s: set_key(s, "best_step", 9)),
                                 "state.json's best_step is 9, not a step up to 6"),
    "state.json is a list": (lambda p: edit_state(p, lambda s: [s]), "state.json is not a JSON object"),
    "python rng state cut short": (broken_python_rng, "state.json's rng: python is not a Mersenne Twister state"),
}


# ------------------------------------------------------- verify, no torch


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_called_unusable_and_the_one_before_is_used(tmp_path, damage):
    how, said = DAMAGE[damage]
    warnings = []
    manager = CheckpointManager(tmp_path, keep=5, warn=warnings.append)
    save(manager, 3)
    newest = save(manager, 6)
    how(newest.path)
    problem = manager.verify(newest.path)
    assert problem is not None and said in problem
    assert manager.latest().step == 3
    assert warnings == [f"checkpoint step-000006 is unusable ({problem}); trying an older one"]
    with pytest.raises(ConfigError, match="Its verified checkpoints: step-3"):
        manager.verified(6)


def test_verify_never_raises_and_what_it_passes_loads(tmp_path):
    """Random damage to the header and the manifest, then a consistent manifest
    half the time: verify answers with a reason or passes, and what passes loads."""
    manager = CheckpointManager(tmp_path / "saved", keep=5)
    pristine = save(manager, 6).path
    rng = random.Random(19)
    passed = 0
    for trial in range(300):
        path = tmp_path / "trial" / "step-000006"
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(pristine, path)
        target = path / rng.choice(TENSOR_FILES + (STATE_FILE, MANIFEST))
        raw = bytearray(target.read_bytes())
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(min(len(raw), 160))  # mostly the header: where the shape is said
            raw[at] = rng.randrange(256)
        target.write_bytes(bytes(raw[:rng.randint(len(raw) // 2, len(raw))] if rng.random() < 0.2 else raw))
        if target.name != MANIFEST and rng.random() < 0.5:
            rehash(path)
        problem = manager.verify(path)
        assert problem is None or isinstance(problem, str)
        if problem is None:
            passed += 1
            for name in TENSOR_FILES:
                load_file(str(path / name))
            assert json.loads((path / STATE_FILE).read_text())["step"] == 6
    assert 0 < passed < 300  # some damage is harmless (a byte of padding, a digit of a float)


def test_verify_and_latest_never_import_torch(tmp_path):
    manager = CheckpointManager(tmp_path, keep=5)
    save(manager, 3)
    broken = save(manager, 6)
    random_tensors_consistent_manifest(broken.path)
    code = ("import sys; from pathlib import Path; from llmcustoms.runs.checkpoints import CheckpointManager; "
            f"found = CheckpointManager(Path({str(tmp_path)!r}), keep=5).latest(); "
            "assert found.step == 3, found; assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_tensors_are_checked_against_the_model_the_optimizer_and_the_generators():
    from llmcustoms.runs.checkpoint_content import TensorInfo, fit_problem, optimizer_fit_problem, rng_fit_problem

    a, b = TensorInfo("F32", (8, 4)), TensorInfo("F32", (8,))
    model = {"a": a, "b": b}
    assert fit_problem("model.safetensors", dict(model), model) is None
    assert fit_problem("model.safetensors", {"a": a}, model) == "model.safetensors lacks b"
    assert (fit_problem("model.safetensors", {"a": TensorInfo("F32", (1, 4)), "b": b}, model)
            == "model.safetensors: a is F32 [1, 4], the model's is F32 [8, 4]")
    assert "a is BF16 [8, 4]" in fit_problem("model.safetensors", {"a": TensorInfo("BF16", (8, 4)), "b": b}, model)
    assert "holds c, which the model does not train" in fit_problem("model.safetensors", {**model, "c": b}, model)

    groups, live = [{"params": [0]}, {"params": [1]}], [[a], [b]]
    saved = {"state.0.exp_avg": a, "state.0.exp_avg_sq": a, "state.0.step": TensorInfo("F32", ()),
             "state.1.exp_avg": b}
    assert optimizer_fit_problem(saved, groups, live) is None
    assert "state.0.step is F32 [1], not a scalar" in optimizer_fit_problem(
        {**saved, "state.0.step": TensorInfo("F32", (1,))}, groups, live)
    assert "state.1.exp_avg is F32 [8, 4], its parameter's is F32 [8]" in optimizer_fit_problem(
        {**saved, "state.1.exp_avg": a}, groups, live)
    assert "state.2.exp_avg, which is of no parameter" in optimizer_fit_problem(
        {**saved, "state.2.exp_avg": b}, groups, live)
    assert "groups of [2] parameters, the model's has [1, 1]" in optimizer_fit_problem(
        saved, [{"params": [0, 1]}], live)

    cpu = TensorInfo("U8", (5056,))
    generators = {"torch_cpu": cpu, "numpy_keys": TensorInfo("I64", (624,)), "cuda_0": TensorInfo("U8", (16,))}
    assert rng_fit_problem(generators, cpu) is None
    assert "torch_cpu is U8 [10], this torch's is U8 [5056]" in rng_fit_problem(
        {**generators, "torch_cpu": TensorInfo("U8", (10,))}, cpu)


# ------------------------------------------------------------------ deleting


@pytest.mark.parametrize("how", ["prune", "remove_after"])
def test_a_delete_interrupted_after_the_rename_leaves_no_broken_step(tmp_path, monkeypatch, how):
    manager = CheckpointManager(tmp_path, keep=1)
    for step in (2, 4, 6):
        save(manager, step)

    def interrupted(path, *args, **kwargs):
        raise KeyboardInterrupt  # what a kill between the rename and the delete leaves

    monkeypatch.setattr(checkpoints_module.shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        manager.prune(best_step=None) if how == "prune" else manager.remove_after(2)
    monkeypatch.undo()
    assert len(list(tmp_path.glob(".deleting-step-*"))) == 2  # both renamed before any file went
    assert all(manager.verify(c.path) is None for c in manager.all())
    assert manager.latest().step == (6 if how == "prune" else 2)
    save(manager, 8)
    manager.prune(best_step=None)  # a later save's pruning clears what was left
    assert [p.name for p in tmp_path.iterdir()] == ["step-000008"]


def test_a_half_deleted_old_checkpoint_is_pruned_and_never_counts(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (2, 4, 6):
        save(manager, step)
    for name in (STATE_FILE, "model.safetensors"):  # what an older version's kill mid-rmtree left
        (tmp_path / "step-000004" / name).unlink()
    assert manager.verified_state(manager.at(4)) is None
    manager.prune(best_step=None)
    # Two whole checkpoints are kept: the half-deleted one is not one of them.
    assert [c.step for c in manager.all()] == [6, 2]


# --------------------------------------------------------- real tiny runs

STEPS = 6


def prepared_run(model_dir: Path):
    settings = {"max_steps": STEPS, "lora_dropout": 0.1, "lr": 1e-2, "warmup_ratio": 0.0, "eval_every": 1,
                "save_every": 2, "keep_checkpoints": 2, "early_stopping_patience": 0, "eval_split": 0.2}
    options = TrainOptions(data=str(FIXTURES / "alpaca.jsonl"), model=str(model_dir),
                           overrides={k: (v, "flag") for k, v in settings.items()})
    return prepare_run(options, Hardware.cpu_only())


def train(prepared, run_dir: RunDirectory, resume=False, faults: str | None = None, on_evaluate=None):
    """(result, warnings) of a run in this process."""
    if not resume:
        run_dir.create()
        run_dir.write_plan(prepared.plan)
    warnings: list[str] = []
    tuner = FineTuner(prepared.plan, prepared.tokenizer, prepared.train, prepared.evaluation, run_dir,
                      SilentReporter(on_warning=warnings.append), faults=FaultInjector(faults),
                      on_evaluate=on_evaluate)
    return tuner.run(resume=resume), warnings


def adapter(run_dir: RunDirectory) -> dict:
    return load_file(str(run_dir.path / "adapter" / "adapter_model.safetensors"))


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory):
    """An uninterrupted run, and the same run stopped after step 4 (checkpoints of steps 2 and 4)."""
    root = tmp_path_factory.mktemp("damage")
    prepared = prepared_run(tiny_models["llama"])
    train(prepared, RunDirectory(root / "reference"))
    with pytest.raises(TrainingInterrupted):
        train(prepared, RunDirectory(root / "stopped"), faults="sigterm@4")
    assert sorted(p.name for p in (root / "stopped" / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    return {"prepared": prepared, "reference": RunDirectory(root / "reference"), "stopped": root / "stopped"}


def copy_of_stopped(runs, tmp_path: Path) -> RunDirectory:
    shutil.copytree(runs["stopped"], tmp_path / "run")
    return RunDirectory(tmp_path / "run")


def narrow_first_lora_weight(checkpoint: Path) -> str:
    """model.safetensors with its first LoRA A weight [r, n] replaced by [1, n], which
    `param.copy_` would broadcast; the manifest re-hashed. Returns the name."""
    tensors = load_file(str(checkpoint / "model.safetensors"))
    name = next(k for k in sorted(tensors) if "lora_A" in k)
    tensors[name] = tensors[name][:1].clone()
    from safetensors.torch import save_file

    save_file(tensors, str(checkpoint / "model.safetensors"))
    rehash(checkpoint)
    return name


def widen_first_moment(checkpoint: Path) -> str:
    from safetensors.torch import save_file

    tensors = load_file(str(checkpoint / "optimizer.safetensors"))
    name = next(k for k in sorted(tensors) if k.endswith(".exp_avg"))
    tensors[name] = torch.cat([tensors[name], tensors[name]])
    save_file(tensors, str(checkpoint / "optimizer.safetensors"))
    rehash(checkpoint)
    return name


@pytest.mark.slow
@pytest.mark.parametrize("damage", [narrow_first_lora_weight, widen_first_moment])
def test_a_newest_checkpoint_of_the_wrong_shapes_is_skipped_on_resume(tmp_path, runs, damage):
    run_dir = copy_of_stopped(runs, tmp_path)
    newest = run_dir.checkpoints_path / "step-000004"
    name = damage(newest)
    assert CheckpointManager(run_dir.checkpoints_path, keep=2).verify(newest) is None  # consistent on disk
    result, warnings = train(runs["prepared"], run_dir, resume=True)
    unusable = [w for w in warnings if "step-000004 is unusable" in w]
    assert len(unusable) == 1 and name in unusable[0] and "trying an older one" in unusable[0]
    assert result.steps == STEPS
    # Resumed from step 2: the same steps as the run that never stopped.
    assert max_difference(adapter(run_dir), adapter(runs["reference"])) <= 1e-5


@pytest.mark.slow
def test_resume_from_a_checkpoint_of_the_wrong_shapes_is_refused(tmp_path, runs, cli):
    run_dir = copy_of_stopped(runs, tmp_path)
    name = narrow_first_lora_weight(run_dir.checkpoints_path / "step-000004")
    with pytest.raises(ConfigError) as refused:
        train(runs["prepared"], run_dir, resume=ResumeFrom(step=4))
    assert f"no usable checkpoint of step 4 (model.safetensors: {name} is F32 [1," in str(refused.value)
    assert refused.value.hint == "Its verified checkpoints: step-2."
    result = cli("resume", str(run_dir.path), "--from", "step-4", "--quiet")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no usable checkpoint of step 4" in " ".join(result.stderr.split())
    assert run_dir.read_status()["status"] == "interrupted" and (run_dir.checkpoints_path / "step-000004").is_dir()


@pytest.mark.slow
def test_a_rollback_after_nan_skips_a_checkpoint_of_the_wrong_shapes(tmp_path, runs):
    run_dir = RunDirectory(tmp_path / "run")

    def damage_step_4(step: int, eval_loss: float) -> bool:
        if step == 5:  # step 4's checkpoint is written; step 6 will fail
            narrow_first_lora_weight(run_dir.checkpoints_path / "step-000004")
        return False

    result, warnings = train(runs["prepared"], run_dir, faults="nan@6", on_evaluate=damage_step_4)
    assert result.steps == STEPS
    assert any("step-000004 is unusable (model.safetensors:" in w for w in warnings)
    assert any("continuing from step 2" in w for w in warnings)


@pytest.mark.slow
def test_a_half_deleted_old_checkpoint_does_not_stop_later_saves(tmp_path, runs):
    """What a kill -9 mid-prune left in an older version: a step directory
    without state.json and model.safetensors. The run resumes from the newest,
    saves, evaluates (which reads every checkpoint's best step), prunes, and
    ends as the run that never stopped."""
    run_dir = copy_of_stopped(runs, tmp_path)
    for name in (STATE_FILE, "model.safetensors"):
        (run_dir.checkpoints_path / "step-000002" / name).unlink()
    result, warnings = train(runs["prepared"], run_dir, resume=True)
    assert result.steps == STEPS and not warnings
    assert max_difference(adapter(run_dir), adapter(runs["reference"])) <= 1e-5
    manager = CheckpointManager(run_dir.checkpoints_path, keep=2)
    assert [c.step for c in manager.all()] == [6, 4]
    assert all(manager.verify(c.path) is None for c in manager.all())
    assert not [p for p in run_dir.checkpoints_path.iterdir() if p.name.startswith(".")]


def test_generate_refuses_a_checkpoint_whose_tensors_would_broadcast(tmp_path):
    """`generate --checkpoint` puts a checkpoint's weights into the model: a
    [1, n] tensor must not be broadcast into an [r, n] weight."""
    import torch
    from safetensors.torch import save_file

    from llmcustoms.errors import ModelError
    from llmcustoms.models.generation import put_in

    model = torch.nn.Linear(4, 3)
    save_file({"weight": torch.ones(1, 4), "bias": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    before = model.weight.detach().clone()
    with pytest.raises(ModelError, match=r"weight is \[1, 4\], the model's \[3, 4\]"):
        put_in(model, tmp_path / "model.safetensors")
    assert torch.equal(model.weight, before)
    (tmp_path / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(ModelError, match="Cannot read"):
        put_in(model, tmp_path / "broken.safetensors")
