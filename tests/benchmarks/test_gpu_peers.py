"""The GPU kit's part 3 (the side by side with Unsloth, the profiled step) and the order in
which the parts run: what a GPU session relies on without a chance to debug it there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DATA_FILES

BENCHMARKS = Path(__file__).parent.parent.parent / "benchmarks"
KIT = BENCHMARKS / "gpu"
sys.path.insert(0, str(KIT))
sys.path.insert(0, str(BENCHMARKS))

import measurements  # noqa: E402  (benchmarks/gpu/measurements.py)
import model_flops  # noqa: E402  (benchmarks/model_flops.py)
import peer_speed  # noqa: E402
import schedule  # noqa: E402


def _record(tmp_path: Path, name: str, day: str, results: dict[str, str], dry_run: bool = False) -> None:
    steps = [{"name": step, "status": status, "result": {"x": 1} if status != "skipped" else {}}
             for step, status in results.items()]
    (tmp_path / name).mkdir(parents=True, exist_ok=True)
    (tmp_path / name / "kit.json").write_text(json.dumps({"kit": {"started_at": day, "dry_run": dry_run},
                                                          "steps": steps}))


def test_the_next_part_is_the_one_never_measured_then_the_oldest(tmp_path):
    part1 = {s.name: "passed" for s in measurements.STEPS if 1 in s.parts}
    part2 = {s.name: "passed" for s in measurements.STEPS if 2 in s.parts}
    part3 = {s.name: "passed" for s in measurements.STEPS if 3 in s.parts}
    assert schedule.next_part(schedule.last_measured(tmp_path))[0] == 1  # nothing measured: the first
    _record(tmp_path, "a", "2026-11-27 10:00", part1)
    _record(tmp_path, "b", "2026-11-28 10:00", {**part2, "precision": "skipped"})
    part, why = schedule.next_part(schedule.last_measured(tmp_path))
    assert part == 3 and "peers_lora" in why  # all of part 3 unmeasured comes before part 2's one step
    _record(tmp_path, "c", "2026-11-29 10:00", part3)
    part, why = schedule.next_part(schedule.last_measured(tmp_path))
    assert part == 2 and "precision" in why
    _record(tmp_path, "d", "2026-11-30 10:00", part2)
    assert schedule.next_part(schedule.last_measured(tmp_path)) == (1, "its oldest table is from 2026-11-27 10:00")
    # A dry run's record and a step stopped before it measured anything count for nothing.
    _record(tmp_path, "e", "2026-12-01 10:00", part1, dry_run=True)
    _record(tmp_path, "f", "2026-12-01 11:00", {name: "skipped" for name in part1})
    assert schedule.next_part(schedule.last_measured(tmp_path))[0] == 1


def test_each_part_asks_only_for_the_models_its_steps_train():
    assert measurements.models_for(measurements.chosen(None, 1)) == ["qwen", "llama"]
    assert measurements.models_for(measurements.chosen(None, 3)) == ["trace"]  # the side by side builds its own
    assert measurements.models_for(measurements.chosen(["precision"])) == ["qwen"]


def test_lora_flops_count_every_frozen_linear_layer_of_a_real_model():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "vocab_size": 500,
              "tie_word_embeddings": False}
    fields = dict(config)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    linear = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    # rank 0, one-token rows: nothing but the frozen weights, forward and input gradient (4 FLOPs a weight).
    assert model_flops.lora_flops_per_token(config, [1], rank=0) == pytest.approx(4 * linear + 3 * 3 * 4 * 4 * 24)
    # Each LoRA weight costs 6 FLOPs a token: a rank-8 adapter on every layer adds 6 * 8 * (in + out) each.
    lora = 3 * sum(8 * (i + o) for i, o in model_flops.linear_shapes(config).values())
    gained = model_flops.lora_flops_per_token(config, [1], rank=8) - model_flops.lora_flops_per_token(config, [1], rank=0)
    assert gained == pytest.approx(6 * lora)
    # Causal rows: a row of n tokens attends to (n + 1) / 2 positions on average.
    assert model_flops.mean_context([3]) == pytest.approx(2.0) and model_flops.mean_context([1, 3]) == pytest.approx(7 / 4)
    assert model_flops.peak_flops("NVIDIA H200") == 989e12 and model_flops.peak_flops("cpu") is None


def test_a_step_carries_the_tokens_asked_in_as_few_accumulations_as_the_micro_batch_allows():
    assert peer_speed.rows_per_step([200] * 10, 16384, 16) == (16, 6)  # 82 rows of 200 tokens: 16 x 6
    assert peer_speed.rows_per_step([2048] * 4, 16384, 16) == (8, 1)  # 8 long rows fit one micro-batch
    micro, accum = peer_speed.rows_per_step([150, 250], 4096, 4)
    assert micro * accum * 200 >= 4096


@pytest.mark.slow
def test_the_dry_run_of_part_3_runs_the_side_by_side_and_the_profile_on_this_cpu(tmp_path):
    rows = [json.loads(line) for line in DATA_FILES["alpaca"].read_text().splitlines()]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({**r, "instruction": f"{r['instruction']} ({k})"}) + "\n"
                            for k in range(3) for r in rows))
    out = tmp_path / "out"
    # No Unsloth site here (nothing is downloaded at test time): Unsloth is skipped and said so.
    env = {**os.environ, "PYTHON": sys.executable, "KIT_STARTED": "", "UNSLOTH_SITE": "", "HOME": str(tmp_path)}
    done = subprocess.run(["bash", str(KIT / "run.sh"), "--dry-run", str(out), "--data", str(data), "--part", "3"],
                          capture_output=True, text=True, timeout=1200, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    report = json.loads((out / "kit.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert {n: s["status"] for n, s in steps.items()} == {"env": "passed", "models": "passed", "peers_lora": "passed",
                                                          "peers_qlora": "passed", "step_trace": "passed"}
    for name, method in (("peers_lora", "lora"), ("peers_qlora", "qlora")):
        result = steps[name]["result"]
        systems = result["systems"]
        assert result["method"] == method and "no Unsloth site" in systems["unsloth"]
        assert systems["llmcustoms"]["tokens_per_s"] > 0 and systems["trainer_peft"]["tokens_per_s"] > 0
        assert result["ratios"]["trainer_peft"]["speed"] > 0
        # The same tokens and the same start: the first steps' losses agree (random weights, ~ln of the vocabulary).
        first = [systems[n]["losses"][0] for n in ("llmcustoms", "trainer_peft")]
        assert abs(first[0] - first[1]) / first[1] < 0.02
        assert result["tokens_per_step"] >= measurements.PEER_SIZES["dry"][name]["tokens"] * 0.9
    trace = steps["step_trace"]["result"]
    assert trace["step_ms"] > 0 and trace["top_host_ops"] and trace["flops_per_token"] > 0
    summary = (out / "summary.md").read_text()
    assert "Side by side, LoRA" in summary and "Side by side, QLoRA" in summary and "step, profiled" in summary
