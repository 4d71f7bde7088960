"""Labels are -100 exactly on prompt and padding tokens, checked token by token.

The check decodes the trained tokens and the masked tokens separately and
compares them with text written out by hand for each template style, so it
does not trust the code under test to say where the boundaries are.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from llmcustoms.training.batching import collate
from llmcustoms.data.chat_templates import ensure_chat_template
from llmcustoms.data.dataset import usable_examples
from llmcustoms.data.row_formats import Example, Message
from llmcustoms.data.tokenization import IGNORE_INDEX, Tokenizer, first_loss_position, truncate
from tiny_models import FIXTURES

CONVERSATION = Example(row=1, messages=(
    ("system", "Be brief."),
    ("user", "What do bees make?"),
    ("assistant", "Bees make honey."),
    ("user", "How many legs does a spider have?"),
    ("assistant", "A spider has eight legs."),
))

# For each tokenizer style: the exact text of the trained spans, in order.
# A reply ends at its end-of-turn token: the model stops there, so what the
# template writes after it is prompt.
EXPECTED_REPLIES = {
    "llama": ["Bees make honey.</s>", "A spider has eight legs.</s>"],
    "qwen2": ["Bees make honey.<|im_end|>", "A spider has eight legs.<|im_end|>"],
    # Phi-2 style: no template of its own, so the fallback template is used.
    "phi": ["Bees make honey.<|endoftext|>", "A spider has eight legs.<|endoftext|>"],
}
EXPECTED_PROMPTS = {
    "llama": ["<|system|>\nBe brief.</s>\n<|user|>\nWhat do bees make?</s>\n<|assistant|>\n",
              "\n<|user|>\nHow many legs does a spider have?</s>\n<|assistant|>\n"],
    "qwen2": ["<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat do bees make?<|im_end|>\n<|im_start|>assistant\n",
              "\n<|im_start|>user\nHow many legs does a spider have?<|im_end|>\n<|im_start|>assistant\n"],
    "phi": ["### System:\nBe brief.\n\n### User:\nWhat do bees make?\n\n### Assistant:\n",
            "\n\n### User:\nHow many legs does a spider have?\n\n### Assistant:\n"],
}


def load_tokenizer(path):
    tokenizer = AutoTokenizer.from_pretrained(path)
    ensure_chat_template(tokenizer)
    return tokenizer


def spans(tokenizer, ids: list[int], labels: list[int], trained: bool) -> list[str]:
    """Decode maximal runs of tokens that are (or are not) trained on."""
    out, run = [], []
    for token, label in zip(ids, labels):
        if (label != IGNORE_INDEX) == trained:
            run.append(token)
        elif run:
            out.append(tokenizer.decode(run)), run.clear()
    if run:
        out.append(tokenizer.decode(run))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi"])
def test_chat_labels_cover_exactly_the_assistant_replies(tiny_models, family):
    tokenizer = load_tokenizer(tiny_models[family])
    encoded = Tokenizer(tokenizer).encode(CONVERSATION)
    for token, label in zip(encoded.input_ids, encoded.labels):
        assert label in (IGNORE_INDEX, token)  # a label is the token itself or masked
    assert spans(tokenizer, encoded.input_ids, encoded.labels, trained=True) == EXPECTED_REPLIES[family]
    assert spans(tokenizer, encoded.input_ids, encoded.labels, trained=False) == EXPECTED_PROMPTS[family]


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi"])
def test_every_sequence_ends_with_the_stop_token(tiny_models, family):
    tokenizer = load_tokenizer(tiny_models[family])
    encoder = Tokenizer(tokenizer)
    for name in ("alpaca.jsonl", "sharegpt.json", "messages.jsonl", "prompt_completion.csv", "text.jsonl"):
        for example in list(usable_examples(FIXTURES / name))[:5]:
            encoded = encoder.encode(example)
            assert encoded.input_ids[-1] == tokenizer.eos_token_id, name
            assert encoded.labels[-1] == tokenizer.eos_token_id, name


def test_raw_prompt_completion_trains_on_completion_only_and_keeps_bos(tiny_models):
    # --raw-prompts; without it the model's own template renders the row (tests/data/test_formats.py).
    tokenizer = load_tokenizer(tiny_models["llama"])
    example = Example(row=1, prompt="Question: What do bees make?\nAnswer:", completion=" Honey.")
    encoded = Tokenizer(tokenizer, raw_prompts=True).encode(example)
    assert encoded.input_ids[0] == tokenizer.bos_token_id
    assert spans(tokenizer, encoded.input_ids, encoded.labels, trained=False) == ["<s>Question: What do bees make?\nAnswer:"]
    assert spans(tokenizer, encoded.input_ids, encoded.labels, trained=True) == [" Honey.</s>"]


def test_plain_text_is_trained_everywhere_after_bos(tiny_models):
    tokenizer = load_tokenizer(tiny_models["qwen2"])  # no BOS in this style
    encoded = Tokenizer(tokenizer).encode(Example(row=1, completion="Bees make honey."))
    assert encoded.labels == encoded.input_ids
    assert tokenizer.decode(encoded.input_ids) == "Bees make honey.<|im_end|>"


def test_train_on_prompt_trains_on_every_token(tiny_models):
    tokenizer = load_tokenizer(tiny_models["llama"])
    encoded = Tokenizer(tokenizer, train_on_prompt=True).encode(CONVERSATION)
    assert encoded.labels == encoded.input_ids


def test_padding_is_masked_and_excluded_from_attention(tiny_models):
    tokenizer = load_tokenizer(tiny_models["llama"])
    encoder = Tokenizer(tokenizer)
    short = encoder.encode(Example(row=1, messages=(("user", "Hi"), ("assistant", "Hello."))))
    long = encoder.encode(CONVERSATION)
    batch = collate([short, long], tokenizer.pad_token_id)
    width = len(long.input_ids)
    assert batch["input_ids"].shape == (2, width)  # padded to the batch's longest row, no further
    n = len(short.input_ids)
    assert torch.equal(batch["labels"][0, :n], torch.tensor(short.labels))
    assert (batch["labels"][0, n:] == IGNORE_INDEX).all()
    assert (batch["attention_mask"][0, n:] == 0).all() and (batch["attention_mask"][0, :n] == 1).all()
    assert (batch["input_ids"][0, n:] == tokenizer.pad_token_id).all()
    assert torch.equal(batch["labels"][1], torch.tensor(long.labels))


def test_truncation_counts_truncated_and_drops_rows_without_a_reply(tiny_models):
    tokenizer = load_tokenizer(tiny_models["llama"])
    encoder = Tokenizer(tokenizer)
    long = encoder.encode(CONVERSATION)
    first = first_loss_position(long)
    kept = truncate([long], first + 3)
    assert kept.truncated == 1 and kept.dropped == 0
    assert len(kept.examples[0].input_ids) == first + 3 and kept.examples[0].trainable_tokens == 3
    gone = truncate([long], first)  # cut right before the first reply token
    assert gone.truncated == 1 and gone.dropped == 1 and gone.examples == []
    untouched = truncate([long], len(long.input_ids))
    assert untouched.truncated == 0 and untouched.examples == [long]


def test_prepared_rows_are_cached_exactly_and_keyed_by_what_shapes_them(tmp_path, tiny_models, monkeypatch):
    from llmcustoms.planning.hardware import Hardware
    from llmcustoms.planning.train_options import TrainOptions
    from llmcustoms.preparation.preparing import prepare_run

    monkeypatch.setenv("LLMCUSTOMS_CACHE_DIR", str(tmp_path))
    options = TrainOptions(data=str(FIXTURES / "sharegpt.json"), model=str(tiny_models["qwen2"]))
    fresh = prepare_run(options, Hardware.cpu_only())
    assert len(list((tmp_path / "tokenized").glob("*/meta.json"))) == 1 and not fresh.cached
    cached = prepare_run(options, Hardware.cpu_only())
    assert cached.cached and cached.tokenize_seconds < fresh.tokenize_seconds
    assert list(cached.train) == list(fresh.train) and list(cached.evaluation) == list(fresh.evaluation)
    prompts_too = TrainOptions(data=options.data, model=options.model, overrides={"train_on_prompt": (True, "flag")})
    other = prepare_run(prompts_too, Hardware.cpu_only())
    assert len(list((tmp_path / "tokenized").glob("*/meta.json"))) == 2
    assert all(e.labels == e.input_ids for e in other.train)


def test_a_plan_made_before_templated_prompts_resumes_with_its_raw_rows(tmp_path, tiny_models, monkeypatch):
    from dataclasses import replace

    from llmcustoms.planning.hardware import Hardware
    from llmcustoms.planning.train_options import TrainOptions
    from llmcustoms.preparation.preparing import prepare_resume, prepare_run

    monkeypatch.setenv("LLMCUSTOMS_CACHE_DIR", str(tmp_path))
    raw = TrainOptions(data=str(FIXTURES / "prompt_completion.csv"), model=str(tiny_models["qwen2"]),
                       overrides={"raw_prompts": (True, "flag")})
    began = prepare_run(raw, Hardware.cpu_only())
    templated = prepare_run(replace(raw, overrides={}), Hardware.cpu_only())
    assert list(templated.train) != list(began.train)  # the chat template changes the tokens
    older = replace(began.plan, raw_prompts=False, data_report={})  # plan.json as written before either existed
    assert list(prepare_resume(older).train) == list(began.train)
    assert list(prepare_resume(templated.plan).train) == list(templated.train)


def test_resume_refuses_rows_that_would_be_tokenized_another_way(tmp_path, tiny_models, monkeypatch):
    from dataclasses import replace

    from llmcustoms.errors import DataError
    from llmcustoms.planning.hardware import Hardware
    from llmcustoms.planning.train_options import TrainOptions
    from llmcustoms.preparation.preparing import prepare_resume, prepare_run

    monkeypatch.setenv("LLMCUSTOMS_CACHE_DIR", str(tmp_path))
    began = prepare_run(TrainOptions(data=str(FIXTURES / "sharegpt.json"), model=str(tiny_models["qwen2"])),
                        Hardware.cpu_only())
    assert began.plan.tokens_key and list(prepare_resume(began.plan).train) == list(began.train)
    with pytest.raises(DataError, match="tokenized differently"):
        prepare_resume(replace(began.plan, tokens_key="made by another version"))


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi"])
def test_a_reply_marked_weight_0_is_masked_exactly_in_every_template_style(tiny_models, family):
    tokenizer = load_tokenizer(tiny_models[family])
    first, second = (i for i, m in enumerate(CONVERSATION.messages) if m.role == "assistant")
    messages = list(CONVERSATION.messages)
    messages[first] = Message("assistant", messages[first].content, learned=False)
    encoded = Tokenizer(tokenizer).encode(Example(row=1, messages=tuple(messages)))
    assert spans(tokenizer, encoded.input_ids, encoded.labels, trained=True) == EXPECTED_REPLIES[family][1:]
    prompts, replies = EXPECTED_PROMPTS[family], EXPECTED_REPLIES[family]
    assert spans(tokenizer, encoded.input_ids, encoded.labels, trained=False) == [prompts[0] + replies[0] + prompts[1]]
    with_prompts = Tokenizer(tokenizer, train_on_prompt=True).encode(Example(row=1, messages=tuple(messages)))
    assert spans(tokenizer, with_prompts.input_ids, with_prompts.labels, trained=False) == [replies[0]]


def test_reasoning_a_template_cannot_show_is_counted_in_the_data_report(tmp_path, tiny_models, monkeypatch):
    import json

    from llmcustoms.planning.hardware import Hardware
    from llmcustoms.planning.train_options import TrainOptions
    from llmcustoms.preparation.preparing import prepare_run

    monkeypatch.setenv("LLMCUSTOMS_CACHE_DIR", str(tmp_path))
    row = json.loads((FIXTURES / "shapes" / "messages_value_parts.jsonl").read_text().splitlines()[0])
    path = tmp_path / "reasoning.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps({"messages": row["messages"][1:]}) + "\n")
    prepared = prepare_run(TrainOptions(data=str(path), model=str(tiny_models["qwen2"])), Hardware.cpu_only())
    report = prepared.plan.data_report
    assert report["reasoning_parts"] == 2 and report["reasoning_parts_dropped"] == 2
    assert [line for line in report["advice"] if "reasoning" in line] == [
        "2 reasoning parts left out: this model's chat template does not show reasoning (reasoning_content); "
        "a model whose template does would learn them"]
