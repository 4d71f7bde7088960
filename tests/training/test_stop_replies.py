"""Sample replies say whether they stopped, from real generation; a run whose
rows never learn the end-of-turn token is flagged by `report` (issue 35, item 4)."""

from __future__ import annotations

import pytest
import torch

from llmcustoms.planning.train_options import TrainOptions

from llmcustoms.preparation.preparing import prepare_run
from llmcustoms.commands.report import analyse
from llmcustoms.models.generation import generate, generation_stops, reply_and_stop
from llmcustoms.planning.hardware import Hardware
from llmcustoms.reporting import SilentReporter
from llmcustoms.runs.run_directory import RunDirectory
from llmcustoms.training.finetuner import FineTuner
from llmcustoms.training.samples import SampleReplies, held_out_prompts
from test_stop_tokens import masked_end_token
from tiny_models import FIXTURES, build_model

NEW_TOKENS = 12


def prepared_run(model_dir, tmp_path, **overrides):
    settings = {"max_steps": 4, "lr": 1e-2, "lora_dropout": 0.0, "warmup_ratio": 0.0, "eval_split": 0.2,
                "eval_every": 0, "early_stopping_patience": 0, **overrides}
    options = TrainOptions(data=str(FIXTURES / "alpaca.jsonl"), model=str(model_dir), cache_dir=str(tmp_path / "cache"),
                           overrides={k: (v, "flag") for k, v in settings.items()})
    return prepare_run(options, Hardware.cpu_only())


def test_a_reply_stopped_when_it_ended_on_a_stop_token_before_the_limit(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = build_model("llama", tmp_path / "llama")
    run = prepared_run(model_dir, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        model.model.norm.weight.zero_()  # every logit 0: greedy writes token 0 (<unk>) every time
    messages = [{"role": "user", "content": "What do bees make?"}]
    assert run.tokenizer.convert_ids_to_tokens(0) == "<unk>"
    assert reply_and_stop(model, run.tokenizer, run.plan, messages, NEW_TOKENS, 0.0) == ("", False)
    run.tokenizer.eos_token = "<unk>"  # now token 0 ends a reply: the first one stops it
    assert 0 in generation_stops(run.tokenizer, run.plan)
    assert reply_and_stop(model, run.tokenizer, run.plan, messages, NEW_TOKENS, 0.0) == ("", True)
    assert generate(model, run.tokenizer, run.plan, messages, NEW_TOKENS, 0.0) == ""


@pytest.fixture
def generated(monkeypatch):
    """Every sequence `generate` returns, with the prompt's length and the stop tokens it was given."""
    from transformers.generation.utils import GenerationMixin

    calls = []
    original = GenerationMixin.generate

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls.append({"prompt": kwargs["input_ids"].shape[1], "ids": out[0].tolist(), "stops": set(kwargs["eos_token_id"]),
                      "limit": kwargs["max_new_tokens"]})
        return out

    monkeypatch.setattr(GenerationMixin, "generate", spy)
    return calls


def test_a_run_whose_rows_never_learn_the_end_token_records_its_replies_and_report_flags_it(tmp_path, monkeypatch,
                                                                                           generated):
    masked_end_token(monkeypatch)  # the end-of-turn token stays in the rows, left out of the labels on purpose
    model_dir = build_model("llama", tmp_path / "llama")
    run = prepared_run(model_dir, tmp_path)
    found = run.plan.data_report["replies_without_end_token"]  # the plan saw it: every row
    assert found["rows"] == found["of"] == run.plan.train_rows and found["token"] == "</s>"
    assert any("never learns to end with </s>" in line for line in run.plan.data_report["advice"])

    run_dir = RunDirectory(tmp_path / "run")
    run_dir.create()
    run_dir.write_plan(run.plan)
    replies = SampleReplies(held_out_prompts(run), run.tokenizer, run.plan, run_dir, max_new_tokens=NEW_TOKENS)
    result = FineTuner(run.plan, run.tokenizer, run.train, run.evaluation, run_dir, SilentReporter(),
                       samples=replies).run()

    rows = [r for r in run_dir.read_samples() if r["label"] in ("base", "trained")]
    assert [r["label"] for r in rows] == ["base"] * 3 + ["trained"] * 3 and len(generated) == 6
    for row, call in zip(rows, generated):
        new = call["ids"][call["prompt"]:]
        assert call["stops"] >= {run.tokenizer.eos_token_id} and call["limit"] == NEW_TOKENS
        assert row["stopped"] is (bool(new) and new[-1] in call["stops"])  # what generation did
        assert row["stopped"] or len(new) == NEW_TOKENS  # a reply that did not stop ran to the limit
    assert not any(r["stopped"] for r in rows[:3])  # a random model never says </s> in 12 tokens

    assert result.samples[0].keys() >= {"base_stopped", "trained_stopped"}
    report = analyse(run_dir)
    verdicts = {f.topic: f.verdict for f in report.findings}
    assert verdicts["end token"] == f"not learned by {found['rows']} rows"
    assert verdicts["stopping"].endswith("stopped") or verdicts["stopping"] == "stops less than the base model"
    assert any("never learns to end with </s>" in r for r in report.recommendations)
    assert run_dir.read_status()["stop_tokens"] == {"end_of_turn": "</s>", "untrained": []}
