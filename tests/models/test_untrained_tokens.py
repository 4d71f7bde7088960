"""The warning for a base model whose stop tokens look untrained (issue 35,
item 4): an embedding row near zero, or the same as many others'."""

from __future__ import annotations

import pytest
import torch

from llmcustoms.planning.train_options import TrainOptions

from llmcustoms.preparation.preparing import prepare_run
from llmcustoms.models.loading import load_model
from llmcustoms.models.untrained_tokens import check_stop_tokens, stop_token_warnings, untrained_rows
from llmcustoms.planning.hardware import Hardware
from llmcustoms.reporting import SilentReporter
from llmcustoms.runs.run_directory import RunDirectory
from tiny_models import FIXTURES, build_model


def prepared(model_dir, tmp_path, **overrides):
    settings = {"max_steps": 1, "eval_split": 0.0, **overrides}
    options = TrainOptions(data=str(FIXTURES / "messages.jsonl"), model=str(model_dir), cache_dir=str(tmp_path / "cache"),
                           overrides={k: (v, "flag") for k, v in settings.items()})
    return prepare_run(options, Hardware.cpu_only())


def edited(model_dir, change) -> None:
    """The model at `model_dir` with its weights changed by `change(model)`, saved again."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        change(model)
    model.save_pretrained(model_dir)


def test_untrained_rows_are_near_zero_or_the_same_as_many_others():
    torch.manual_seed(0)
    matrix = torch.randn(50, 16)
    matrix[3] = 0.001 * matrix[3]  # near zero
    matrix[10:15] = matrix[40]  # token 40's row, copied to five others: a block never trained
    matrix[20] = matrix[21]  # one twin is not "many"
    found = untrained_rows(matrix.to(torch.bfloat16), [3, 7, 12, 20, 40])
    assert set(found) == {3, 12, 40}
    assert found[3].startswith("near zero (0.") and found[3].endswith("% of a typical token's)")
    assert found[40].startswith("the same as 5 other tokens'") and found[12].startswith("the same as 5 other")


@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_zeroed_eos_embedding_warns_and_an_untouched_model_does_not(tmp_path, method):
    model_dir = build_model("llama", tmp_path / "llama")
    run = prepared(model_dir, tmp_path, method=method)
    assert stop_token_warnings(load_model(run.plan), run.tokenizer, run.plan)[1] == []

    eos = run.tokenizer.eos_token_id
    edited(model_dir, lambda model: model.get_input_embeddings().weight[eos].zero_())
    end, (warning,) = stop_token_warnings(load_model(run.plan), run.tokenizer, run.plan)
    assert end.name == "</s>"  # the template ends a reply with EOS
    assert warning.startswith("The base model's end-of-turn token (EOS) </s> looks untrained: its input embedding is "
                              "near zero (0.0% of a typical token's).")  # the LM head is not tied: its row is fine
    assert "may never stop" in warning
    if method == "lora":
        assert "LoRA does not train the embeddings" in warning and "instruct version" in warning
        assert "--method full" in warning
    else:
        assert "--method full trains that row" in warning and "stop rate" in warning


def same_as_four_others(token: int):
    """A change making the output row of `token` the same as four other tokens'."""
    def change(model):
        head = model.get_output_embeddings().weight
        head[[token, 4, 5, 6]] = head[0].clone()
    return change


def test_the_output_row_of_an_untied_head_is_checked_and_a_run_records_it_once(tmp_path):
    model_dir = build_model("llama", tmp_path / "llama")  # its LM head is not tied to the embeddings
    run = prepared(model_dir, tmp_path)
    edited(model_dir, same_as_four_others(run.tokenizer.eos_token_id))
    run_dir = RunDirectory(tmp_path / "run")
    run_dir.create()
    run_dir.write_status("running", step=0)
    warned = []
    check_stop_tokens(load_model(run.plan), run.tokenizer, run.plan, run_dir, warned.append)
    (warning,) = warned
    assert "(EOS) </s> looks untrained: its output row is the same as 4 other tokens' (as every token never " in warning
    status = run_dir.read_status()
    assert status["status"] == "running"
    assert status["stop_tokens"] == {"end_of_turn": "</s>", "untrained": [warning]}
    # Once per run: a resumed run found it already; a process that does not write the run checks nothing.
    check_stop_tokens(load_model(run.plan), run.tokenizer, run.plan, run_dir, warned.append)
    check_stop_tokens(None, None, None, RunDirectory(tmp_path / "other", writable=False), warned.append)
    assert len(warned) == 1


def test_a_tied_head_is_the_embeddings_and_is_said_once(tmp_path):
    model_dir = build_model("qwen2", tmp_path / "qwen")  # ChatML: <|im_end|> ends a reply, and is EOS
    run = prepared(model_dir, tmp_path)
    edited(model_dir, same_as_four_others(run.tokenizer.convert_tokens_to_ids("<|im_end|>")))
    end, (warning,) = stop_token_warnings(load_model(run.plan), run.tokenizer, run.plan)
    assert end.name == "<|im_end|>" and "output row" not in warning
    assert "<|im_end|> looks untrained: its input embedding is the same as 4 other tokens'" in warning


def test_training_warns_in_the_live_output_and_records_it_in_the_run(tmp_path):
    from llmcustoms.training.finetuner import FineTuner

    model_dir = build_model("llama", tmp_path / "llama")
    run = prepared(model_dir, tmp_path)
    edited(model_dir, lambda model: model.get_input_embeddings().weight[run.tokenizer.eos_token_id].zero_())
    run_dir = RunDirectory(tmp_path / "run")
    run_dir.create()
    run_dir.write_plan(run.plan)
    warnings: list[str] = []
    FineTuner(run.plan, run.tokenizer, run.train, run.evaluation, run_dir, SilentReporter(warnings.append)).run()
    (warning,) = [text for text in warnings if "looks untrained" in text]
    assert run_dir.read_status()["stop_tokens"]["untrained"] == [warning]
    # A tuning trial (no artifacts) does not check: every trial starts from the same base model.
    warnings.clear()
    trial = RunDirectory(tmp_path / "trial")
    trial.create()
    FineTuner(run.plan, run.tokenizer, run.train, run.evaluation, trial, SilentReporter(warnings.append),
              save_artifacts=False).run()
    assert not [text for text in warnings if "looks untrained" in text] and "stop_tokens" not in trial.read_status()
