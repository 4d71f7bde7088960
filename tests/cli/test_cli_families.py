"""Today's families end to end through the command line: a tiny model of
each (Qwen3, Qwen3.5, Llama 3.2, Gemma 3, Phi-3.5; their real config class and
original chat template, `tiny_models.TEMPLATE_FAMILIES`) trains on multi-turn
rows, resumes, answers a prompt, and exports to GGUF where this export writes
the architecture, or says clearly why not."""

from __future__ import annotations

import json

import pytest

from test_cli_train import flat, invoke
from tiny_models import FIXTURES

DATA = FIXTURES / "shapes" / "multi_turn_chat.jsonl"
# The catalog family each tiny model falls in, from its config alone.
FAMILY = {"qwen3": "qwen3", "qwen3_5": "qwen3", "llama3_2": "tinyllama", "gemma3": "gemma3", "phi3_5": "phi"}
# What `export --format gguf` does with each: written and checked, or refused naming why.
GGUF = {"qwen3": None, "qwen3_5": None, "phi3_5": "a partial rotary embedding (0.75 of each head)",
        "llama3_2": "llama3 rotary scaling", "gemma3": "does not write gemma3_text models"}


@pytest.mark.parametrize("family", sorted(FAMILY))
def test_a_family_trains_resumes_answers_and_exports(tmp_path, family_models, family):
    model, run = str(family_models[family]), tmp_path / "run"
    trained = invoke("train", str(DATA), "--model", model, "--max-steps", "2", "--batch-size", "2", "--grad-accum", "1",
                     "--mixed-precision", "no", "--yes", "--quiet", "--output-dir", str(tmp_path), "--run-name", "run")
    assert trained.exit_code == 0, trained.output
    plan = json.loads((run / "plan.json").read_text())
    assert plan["family"] == FAMILY[family]

    resumed = invoke("resume", str(run), "--max-steps", "3", "--quiet")  # a completed run goes on
    assert resumed.exit_code == 0, resumed.output
    status = json.loads((run / "status.json").read_text())
    assert (status["status"], status["step"]) == ("completed", 3)

    answered = invoke("generate", str(run), "What is the biggest ocean?", "--max-new-tokens", "8")
    assert answered.exit_code == 0, answered.output

    exported = invoke("export", str(run), "--format", "gguf", "--quant", "f16", "--output", str(tmp_path / "gguf"))
    if GGUF[family] is None:
        assert exported.exit_code == 0, exported.output
        assert (tmp_path / "gguf" / "model.gguf").is_file()
    else:
        assert exported.exit_code == 2, exported.output
        assert GGUF[family] in flat(exported.output) and "Traceback" not in exported.output
