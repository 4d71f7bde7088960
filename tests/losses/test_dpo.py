"""Preference tuning (DPO) on tiny models: the shapes, the masks, the loss
against its definition, and the loop's guarantees (any split of a step gives
the same update, exact resume, recovery)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_cli
from tiny_models import FIXTURES

PAIRS = FIXTURES / "shapes" / "preference_arithmetic.jsonl"
SYSTEM = {"role": "system", "content": "Answer briefly."}
EARLIER = [{"role": "user", "content": "What is the capital of France?"},
           {"role": "assistant", "content": "The capital of France is Paris."}]
QUESTION = {"role": "user", "content": "What is water made of?"}
CHOSEN, REJECTED = "Water is made of hydrogen and oxygen.", "The sky is blue."


def shaped_rows(shape: str) -> list[dict]:
    """The same two pairs in each shape; the second has a system turn and an
    earlier exchange in its prompt (chat shapes only)."""
    prompts = [[QUESTION], [SYSTEM, *EARLIER, QUESTION]]
    if shape == "preference":
        return [{"prompt": "What is water made of?", "chosen": CHOSEN, "rejected": REJECTED}] * 2
    if shape == "preference_chat":
        return [{"prompt": p, "chosen": [{"role": "assistant", "content": CHOSEN}],
                 "rejected": [{"role": "assistant", "content": REJECTED}]} for p in prompts]
    if shape == "preference_chat_implicit":  # TRL's implicit prompt: whole conversations, no prompt field
        return [{"chosen": [*p, {"role": "assistant", "content": CHOSEN}],
                 "rejected": [*p, {"role": "assistant", "content": REJECTED}]} for p in prompts]
    sharegpt_roles = {"system": "system", "user": "human", "assistant": "gpt"}
    return [{"conversations": [{"from": sharegpt_roles[m["role"]], "value": m["content"]} for m in p],
             "chosen": {"from": "gpt", "value": CHOSEN}, "rejected": {"from": "gpt", "value": REJECTED}}
            for p in prompts]


def prepare(data: Path, model: Path, **overrides):
    from llmcustoms.planning.hardware import Hardware
    from llmcustoms.planning.train_options import TrainOptions
    from llmcustoms.preparation.preparing import prepare_run

    settings = {"eval_split": 0.0, **overrides}
    return prepare_run(TrainOptions(data=str(data), model=str(model),
                                    overrides={k: (v, "flag") for k, v in settings.items()}), Hardware.cpu_only())


def expected_tokens(hf, prompt: list[dict], reply: str) -> tuple[list[int], list[int]]:
    """Ids and labels from the definition: the conversation rendered by the
    chat template, cut at each assistant turn, each piece tokenized on its own;
    only the final reply is learned, and it ends at its end-of-turn token."""
    conversation = [*prompt, {"role": "assistant", "content": reply}]
    render = lambda turns, gen: hf.apply_chat_template(turns, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    ids, labels, done = [], [], ""
    for k, turn in enumerate(conversation):
        if turn["role"] != "assistant":
            continue
        before, whole = render(conversation[:k], True), render(conversation[:k + 1], False)
        learned = k == len(conversation) - 1
        for text, trained in ((before[len(done):], False), (whole[len(before):], learned)):
            piece = hf(text, add_special_tokens=False)["input_ids"]
            if trained:
                piece = piece[:piece.index(hf.eos_token_id) + 1]  # "<|im_end|>\n" ends at <|im_end|>
            ids += piece
            labels += piece if trained else [-100] * len(piece)
        done = whole
    return ids, labels


@pytest.mark.parametrize("shape,detected", [("preference", "preference"), ("preference_chat", "preference_chat"),
                                            ("preference_chat_implicit", "preference_chat"),
                                            ("preference_sharegpt", "preference_sharegpt")])
def test_each_preference_shape_is_detected_and_masked_token_by_token(tmp_path, tiny_models, shape, detected):
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in shaped_rows(shape)))
    prepared = prepare(data, tiny_models["qwen2"])  # ChatML: <|im_end|> then a newline, cut after the token
    assert prepared.plan.data_format == detected and prepared.plan.objective == "dpo"
    assert len(prepared.train) == 2 and not prepared.plan.train_on_prompt
    hf = prepared.tokenizer
    prompts = [[QUESTION], [QUESTION]] if shape == "preference" else [[QUESTION], [SYSTEM, *EARLIER, QUESTION]]
    for pair, prompt in enumerate(prompts):
        chosen, rejected = prepared.train.examples([pair])
        for got, reply in ((chosen, CHOSEN), (rejected, REJECTED)):
            ids, labels = expected_tokens(hf, prompt, reply)
            assert got.input_ids == ids and got.labels == labels
            assert got.input_ids[-1] == hf.eos_token_id  # both replies end in the stop token
        # The same prompt tokens before both replies: the log-ratios compare the replies alone.
        start = next(i for i, label in enumerate(chosen.labels) if label != -100)
        assert chosen.input_ids[:start] == rejected.input_ids[:start]
        assert all(label == -100 for label in rejected.labels[:start])


def test_identical_or_empty_replies_are_bad_rows_named_by_line(tmp_path):
    from llmcustoms.data.dataset import read_dataset
    from llmcustoms.errors import DataError

    good = [{"prompt": f"What is {n} + 1?", "chosen": f"{n + 1}.", "rejected": f"{n + 2}."} for n in range(40)]
    bad = [{"prompt": "What is 2 + 2?", "chosen": "4.", "rejected": " 4. "}, {"prompt": "Hi", "chosen": "", "rejected": "x"}]
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in good + bad))
    dataset = read_dataset(data)  # 2 of 42: skipped and reported
    assert dataset.format == "preference" and dataset.rows == 40
    assert dataset.bad.by_reason == {"chosen and rejected are the same reply": 1, "field 'chosen' is empty": 1}
    with pytest.raises(DataError) as info:
        read_dataset(data, "strict")
    assert "line 41" in info.value.message and "the same reply" in info.value.message and "4." not in info.value.message


def test_the_objective_follows_the_data_and_contradictions_are_refused(tmp_path, tiny_models):
    from llmcustoms.errors import ConfigError, DataError

    with pytest.raises(DataError, match="--objective dpo needs preference pairs"):
        prepare(FIXTURES / "alpaca.jsonl", tiny_models["llama"], objective="dpo")
    with pytest.raises(ConfigError, match="would teach the rejected ones too"):
        prepare(PAIRS, tiny_models["llama"], objective="sft")
    with pytest.raises(ConfigError, match="--train-on-prompt does not apply"):
        prepare(PAIRS, tiny_models["llama"], train_on_prompt=True)
    with pytest.raises(DataError, match="this run needs preference pairs there too"):
        from llmcustoms.planning.hardware import Hardware
        from llmcustoms.planning.train_options import TrainOptions
        from llmcustoms.preparation.preparing import prepare_run

        prepare_run(TrainOptions(data=str(PAIRS), model=str(tiny_models["llama"]),
                                 eval_data=str(FIXTURES / "alpaca.jsonl")), Hardware.cpu_only())


def test_the_plan_gives_dpo_its_own_lr_and_counts_two_sequences_per_pair(tmp_path, tiny_models):
    from llmcustoms.planning.memory import MemoryEstimator
    from llmcustoms.models.loading import describe_model
    from llmcustoms.planning.presets import load_families

    dpo = prepare(PAIRS, tiny_models["llama"], eval_split=0.1).plan
    sft = prepare(FIXTURES / "alpaca.jsonl", tiny_models["llama"], eval_split=0.1).plan
    assert dpo.objective == "dpo" and sft.objective == "sft" and dpo.beta == 0.1
    assert dpo.lr == 5e-5 and dpo.sources["lr"] == "preset quality (dpo)" and dpo.lr < sft.lr / 5
    assert any(r.startswith("objective dpo (the data holds preference pairs)") for r in dpo.reasons)
    spec = describe_model(str(tiny_models["llama"]), load_families(), "flag", False).arch
    memory = MemoryEstimator(spec, on_gpu=False, budget_bytes=2**34)
    one = memory.estimate("lora", 4, 64, "no", False, sequences_per_row=2)  # 4 pairs: 8 sequences
    assert one.activations_bytes == memory.estimate("lora", 8, 64, "no", False).activations_bytes


def direct_log_probability(model, ids: list[int], labels: list[int]) -> torch.Tensor:
    """log p(reply | prompt) of one sequence, unpadded, from full logits."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    chosen = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    learned = torch.tensor([label != -100 for label in labels[1:]])
    return chosen[learned].sum()


def test_the_dpo_loss_of_a_batch_equals_the_definition(tiny_models):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from llmcustoms.training.batching import TrainingRows
    from llmcustoms.losses.sft import select_logits
    from llmcustoms.losses.dpo import PreferenceLoss

    prepared = prepare(PAIRS, tiny_models["llama"])
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_models["llama"]),
                            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                       lora_dropout=0.0, init_lora_weights=False))  # random B: the adapter matters
    select_logits(policy)
    pairs = [0, 5, 9, 30]
    batch = TrainingRows(prepared.train, [], prepared.tokenizer.pad_token_id).collate(pairs)
    assert batch["input_ids"].shape[0] == 8  # chosen and rejected of each pair, in one padded batch
    loss, sums = PreferenceLoss(beta=0.3)(policy, batch, torch.tensor(len(pairs)))

    with torch.no_grad():
        policy.eval()
        expected, rewards = torch.zeros(()), []
        for chosen, rejected in zip(*[iter(prepared.train.examples(pairs))] * 2):
            ratio = [direct_log_probability(policy, e.input_ids, e.labels) - direct_log_probability(base, e.input_ids, e.labels)
                     for e in (chosen, rejected)]
            expected -= torch.nn.functional.logsigmoid(0.3 * (ratio[0] - ratio[1]))
            rewards.append((0.3 * ratio[0], 0.3 * ratio[1]))
    assert float(loss.detach()) == pytest.approx(float(expected / len(pairs)), rel=1e-5, abs=1e-6)
    assert abs(float(loss.detach()) - 0.6931) > 1e-3  # the adapter really moved the policy from the reference
    assert sums.tolist() == pytest.approx([sum(float(c) for c, _ in rewards), sum(float(r) for _, r in rewards),
                                           sum(float(c > r) for c, r in rewards)], rel=1e-4, abs=1e-5)
    loss.backward()  # gradients reach the adapter only
    assert all(p.grad is None for n, p in policy.named_parameters() if "lora_" not in n)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in policy.named_parameters() if "lora_" in n)


def train_in_process(tmp_path: Path, model: Path, name: str, **overrides):
    from llmcustoms.training.finetuner import FineTuner
    from llmcustoms.reporting import SilentReporter
    from llmcustoms.runs.run_directory import RunDirectory

    settings = {"max_steps": 3, "lora_dropout": 0.0, "lr": 1e-2, "warmup_ratio": 0.0, "eval_split": 0.1, **overrides}
    prepared = prepare(PAIRS, model, **settings)
    run_dir = RunDirectory(tmp_path / name)
    run_dir.create()
    run_dir.write_plan(prepared.plan)
    reporter = SilentReporter()
    result = FineTuner(prepared.plan, prepared.tokenizer, prepared.train, prepared.evaluation, run_dir, reporter).run()
    rows = [json.loads(line) for line in run_dir.metrics_path.read_text().splitlines()]
    return result, rows, load_file(str(run_dir.path / "adapter" / "adapter_model.safetensors"))


def test_any_split_of_a_step_into_micro_batches_gives_the_same_update(tmp_path, tiny_models):
    _, whole_rows, whole = train_in_process(tmp_path, tiny_models["llama"], "whole", micro_batch_size=8, grad_accum=1)
    _, split_rows, split = train_in_process(tmp_path, tiny_models["llama"], "split", micro_batch_size=2, grad_accum=4)
    # A step's rows are a random draw, so the two splits pad its pairs to different lengths,
    # and a DPO loss is a small difference of summed log-probabilities: float rounding moves
    # an update at lr 1e-2 by up to about 1e-4 (9.2e-5 measured). A pair dropped or counted
    # twice moves it by about the learning rate.
    assert max(float((whole[k] - split[k]).abs().max()) for k in whole) <= 3e-4
    for a, b in zip(whole_rows, split_rows):
        for key in ("loss", "reward_accuracy", "reward_margin", "eval_loss", "eval_reward_accuracy"):
            assert (key in a) == (key in b)
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6)
    steps = [r for r in whole_rows if "loss" in r]
    evaluations = [r for r in whole_rows if "eval_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert evaluations[0]["step"] == 0 and evaluations[0]["eval_reward_accuracy"] == 0.5  # policy == reference: ties
    assert evaluations[0]["eval_loss"] == pytest.approx(0.693147, abs=1e-5)  # log 2
    assert evaluations[-1]["step"] == 3 and evaluations[-1]["eval_loss"] != evaluations[0]["eval_loss"]
    assert all(set(r) >= {"reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward"} for r in steps)
    assert "eval_ppl" not in evaluations[0]  # a perplexity of a DPO loss means nothing


# ------------------------------------------------- through the CLI, as a user runs it

def dpo_args(model: Path, output: Path, name: str, steps: int = 6, dropout: float = 0.1) -> list[str]:
    return ["train", str(PAIRS), "--model", str(model), "--max-steps", str(steps), "--save-every", "2",
            "--batch-size", "4", "--grad-accum", "2", "--lr", "1e-2", "--lora-dropout", str(dropout),
            "--output-dir", str(output), "--run-name", name, "--yes", "--quiet"]


def adapter(run: Path) -> dict:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def max_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    result = run_cli(*dpo_args(tiny_models["llama"], root, "baseline"))
    assert result.returncode == 0, result.stderr
    return root / "baseline"


@pytest.mark.slow
def test_a_dpo_run_interrupted_then_resumed_equals_the_uninterrupted_one(tmp_path, tiny_models, uninterrupted, cli):
    stopped = cli(*dpo_args(tiny_models["llama"], tmp_path, "run"), env={"LLMCUSTOMS_FAULT_INJECT": "sigint@3"})
    assert stopped.returncode == 130, stopped.stderr
    run = tmp_path / "run"
    assert json.loads((run / "status.json").read_text())["step"] == 3
    resumed = cli("resume", str(run), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert max_difference(adapter(run), adapter(uninterrupted)) <= 1e-5  # dropout 0.1: the RNG came back too
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_injected_oom_and_nan_in_a_dpo_run_are_recovered(tmp_path, tiny_models, uninterrupted, cli):
    result = cli(*dpo_args(tiny_models["llama"], tmp_path, "run"), env={"LLMCUSTOMS_FAULT_INJECT": "oom@2,nan@5"})
    assert result.returncode == 0, result.stderr
    run = tmp_path / "run"
    status = json.loads((run / "status.json").read_text())
    assert [r["kind"] for r in status["recoveries"]] == ["oom", "nan"]
    plan = json.loads((run / "plan.json").read_text())
    assert (plan["micro_batch_size"], plan["grad_accum"]) == (2, 4) and plan["lr"] == 5e-3
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(0 <= r["reward_accuracy"] <= 1 and r["loss"] == r["loss"] for r in rows)


@pytest.mark.slow
def test_a_dpo_run_over_two_processes_matches_one(tmp_path, tiny_models, cli):
    # Without dropout: each process draws its own dropout masks.
    # fp32: a split of the same work is compared, which bf16's rounding would blur.
    one = cli(*dpo_args(tiny_models["llama"], tmp_path, "one", dropout=0.0), "--mixed-precision", "no")
    assert one.returncode == 0, one.stderr
    args = [*dpo_args(tiny_models["llama"], tmp_path, "two", dropout=0.0), "--mixed-precision", "no"]
    args[args.index("--grad-accum") + 1] = "1"  # 4 pairs x 1 x 2 processes: the same 8 pairs a step
    result = cli(*args, "--num-processes", "2", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    # Summed in another order over the processes: float noise, which Adam's normalisation of
    # DPO's small early gradients magnifies (SFT's runs agree to 1e-4).
    assert max_difference(adapter(tmp_path / "two"), adapter(tmp_path / "one")) <= 1e-3
    rows = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    single = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    # The rewards are summed over both processes' pairs, as one process sums them.
    assert [r.get("reward_accuracy") for r in rows] == [r.get("reward_accuracy") for r in single]


def test_generate_answers_with_a_dpo_run(tmp_path, tiny_models, uninterrupted):
    out = run_cli("generate", str(uninterrupted), "What is 2 + 3?", "--max-new-tokens", "5", env={"COLUMNS": "80"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


# ------------------------------------------ full fine-tuning: the reference computed up front

def test_the_reference_computed_up_front_equals_the_model_before_training(tiny_models):
    from transformers import AutoModelForCausalLM

    from llmcustoms.training.batching import TrainingRows
    from llmcustoms.losses.sft import select_logits
    from llmcustoms.losses.dpo_reference import compute
    from contextlib import nullcontext

    prepared = prepare(PAIRS, tiny_models["llama"])
    data = TrainingRows(prepared.train, [], prepared.tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    select_logits(model)
    reference = compute(model, data.train, data.collate_examples, 5, torch.device("cpu"), nullcontext)
    assert len(reference) == 2 * len(prepared.train)
    halves = prepared.train.examples([0, 7, 20])
    with torch.no_grad():
        direct = [float(direct_log_probability(model, e.input_ids, e.labels)) for e in halves]
        # A row that recovery later shortens sums a shorter range: still exact.
        short = [float(direct_log_probability(model, e.input_ids[:9], e.labels[:9])) for e in halves]
    sequences = [0, 1, 14, 15, 40, 41]
    assert reference.sums(sequences, [len(e.input_ids) for e in halves]).tolist() == pytest.approx(direct, abs=1e-5)
    assert reference.sums(sequences, [9] * 6).tolist() == pytest.approx(short, abs=1e-5)
    assert short != pytest.approx(direct, abs=1e-3)


def full_args(model: Path, output: Path, name: str) -> list[str]:
    return ["train", str(PAIRS), "--model", str(model), "--method", "full", "--max-steps", "4", "--save-every", "2",
            "--batch-size", "4", "--grad-accum", "2", "--lr", "1e-3", "--output-dir", str(output), "--run-name", name,
            "--yes", "--quiet"]


@pytest.mark.slow
def test_full_fine_tuning_dpo_keeps_its_reference_and_resumes_exactly(tmp_path, tiny_models, cli):
    baseline = cli(*full_args(tiny_models["llama"], tmp_path, "baseline"))
    assert baseline.returncode == 0, baseline.stderr
    rows = [json.loads(line) for line in (tmp_path / "baseline" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if "loss" in r)
    # Before the first update the model is its own reference: every reward 0.
    assert first["loss"] == pytest.approx(0.693147, abs=1e-5) and abs(first["reward_margin"]) < 1e-4
    assert (tmp_path / "baseline" / "reference" / "train-values.npy").exists()
    assert any("log-probabilities computed once up front" in r
               for r in json.loads((tmp_path / "baseline" / "plan.json").read_text())["reasons"])
    stopped = cli(*full_args(tiny_models["llama"], tmp_path, "run"), env={"LLMCUSTOMS_FAULT_INJECT": "sigint@2"})
    assert stopped.returncode == 130, stopped.stderr
    (tmp_path / "run" / "reference" / "train-values.npy").unlink()  # lost: computed again from the starting weights
    resumed = cli("resume", str(tmp_path / "run"), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    a, b = (load_file(str(tmp_path / name / "model" / "model.safetensors")) for name in ("run", "baseline"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5


# ------------------------------------------------------- SFT, then DPO from that run

@pytest.mark.slow
def test_dpo_from_an_sft_run_goes_on_training_its_adapter_against_it(tmp_path, tiny_models, cli):
    sft = cli("train", str(FIXTURES / "alpaca.jsonl"), "--model", str(tiny_models["llama"]), "--max-steps", "3",
              "--lora-r", "4", "--lora-alpha", "8", "--lora-dropout", "0", "--output-dir", str(tmp_path), "--run-name", "sft",
              "--yes", "--quiet")
    assert sft.returncode == 0, sft.stderr
    dpo = cli(*dpo_args(tiny_models["llama"], tmp_path, "dpo", steps=3), "--from-run", str(tmp_path / "sft"))
    assert dpo.returncode == 0, dpo.stderr
    plan = json.loads((tmp_path / "dpo" / "plan.json").read_text())
    assert plan["from_run"] == str((tmp_path / "sft" / "adapter").resolve())
    assert (plan["lora"]["r"], plan["lora"]["alpha"], plan["sources"]["lora.r"]) == (4, 8, "from-run")
    assert plan["reasons"][0].startswith("starts from sft: its lora adapter")
    rows = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if "loss" in r)
    # The reference is the SFT model: before DPO's first update (no dropout, as in the SFT run), every reward is 0.
    assert first["loss"] == pytest.approx(0.693147, abs=1e-5) and abs(first["reward_margin"]) < 1e-4
    assert (tmp_path / "dpo" / "reference" / "train-values.npy").exists()
    # One adapter on the base model, different from the SFT one it started as.
    sft_weights, dpo_weights = adapter(tmp_path / "sft"), adapter(tmp_path / "dpo")
    assert sft_weights.keys() == dpo_weights.keys() and max_difference(sft_weights, dpo_weights) > 1e-4
    answer = cli("generate", str(tmp_path / "dpo"), "What is 2 + 3?", "--max-new-tokens", "4")
    assert answer.returncode == 0 and answer.stdout.strip()

    bad_method = cli(*dpo_args(tiny_models["llama"], tmp_path, "x"), "--from-run", str(tmp_path / "sft"),
                     "--method", "qlora")
    assert bad_method.returncode == 2 and "cannot go on with --from-run" in bad_method.stderr
    unfinished = cli(*dpo_args(tiny_models["llama"], tmp_path, "y"), "--from-run", str(tmp_path / "nothing"))
    assert unfinished.returncode == 2 and "not a run directory" in unfinished.stderr


def test_tune_searches_a_dpo_run_by_its_held_out_dpo_loss(tmp_path, tiny_models):
    import csv

    import yaml
    from typer.testing import CliRunner

    from llmcustoms.cli import app

    result = CliRunner().invoke(app, ["tune", str(PAIRS), "--model", str(tiny_models["llama"]), "--max-steps", "2",
                                      "--trials", "2", "--eval-split", "0.2", "--output-dir", str(tmp_path),
                                      "--study-name", "s"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(open(tmp_path / "tune-s" / "trials.csv")))
    assert len(rows) == 2
    losses = [float(r["eval_loss"]) for r in rows if r["eval_loss"]]
    assert losses and all(0 < loss < 5 for loss in losses)  # DPO losses, near log 2 after 2 steps
    preset = yaml.safe_load((tmp_path / "tune-s" / "best_preset.yaml").read_text())
    assert "for preference tuning (DPO)" in preset["description"] and preset["lr"] < 1e-3


def test_lr_find_runs_the_dpo_loss_and_refuses_full_fine_tuning(tiny_models):
    from llmcustoms.commands import lr_find as lrfind
    from llmcustoms.errors import ConfigError

    result = lrfind.run_range_test(prepare(PAIRS, tiny_models["llama"]), lrfind.RangeTest(steps=6))
    losses = [row["loss"] for row in result.curve]
    assert len(losses) == 6 and losses[0] == pytest.approx(0.693147, abs=1e-5)  # the first step: policy = reference
    with pytest.raises(ConfigError, match="cannot run DPO with --method full"):
        lrfind.run_range_test(prepare(PAIRS, tiny_models["llama"], method="full"), lrfind.RangeTest(steps=6))


def test_runs_and_report_speak_of_a_dpo_run_in_its_own_terms(tiny_models, uninterrupted):
    listed = run_cli("runs", "--output-dir", str(uninterrupted.parent), env={"COLUMNS": "80"}, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert "dpo loss" in " ".join(listed.stdout.split())
    report = run_cli("report", str(uninterrupted), "--details", timeout=120)
    assert report.returncode == 0, report.stderr
    said = " ".join(report.stdout.split())
    # Its 6 held-out pairs are too few to judge the ranking (`preference_report.MIN_HELD_OUT_PAIRS`): withheld.
    assert "6 held-out pairs are too few to judge the ranking" in said and "DPO loss" in said
    assert "ranked right (chance" not in said and "perplexity" not in said
