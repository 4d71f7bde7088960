"""The training loss computes logits only where it learns and drops the padding
mask of right-padded rows: neither changes the loss or its gradients."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from llmcustoms.losses import sft
from llmcustoms.training.batching import collate
from llmcustoms.losses.sft import select_logits, token_cross_entropy
from llmcustoms.data.tokenization import IGNORE_INDEX, TokenizedExample

FAMILIES = ("llama", "mistral", "qwen2", "phi", "phi3")


def rows(vocab: int) -> list[TokenizedExample]:
    """Rows of different lengths (so the batch is padded), each learning its second half."""
    generator = torch.Generator().manual_seed(0)
    examples = []
    for row, length in enumerate((23, 9, 16, 4)):
        ids = torch.randint(5, vocab, (length,), generator=generator).tolist()
        labels = [IGNORE_INDEX] * (length // 2) + ids[length // 2:]
        examples.append(TokenizedExample(row=row, input_ids=ids, labels=labels))
    return examples


def plain_loss(model, batch) -> torch.Tensor:
    """What a hand-written loop computes: every logit, with the padding mask, summed over learned tokens."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
                                             ignore_index=IGNORE_INDEX, reduction="sum")


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_gradients_equal_the_plain_masked_computation(tiny_models, family):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_models[family], dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    batch = collate(rows(base.config.vocab_size), pad_token_id=0)
    assert (batch["attention_mask"] == 0).any()  # padded: the mask would matter if it were needed
    normaliser = torch.tensor(float((batch["labels"][:, 1:] != IGNORE_INDEX).sum()))
    trained = [p for p in model.parameters() if p.requires_grad]

    expected = plain_loss(model, batch) / normaliser
    expected_grads = torch.autograd.grad(expected, trained)
    select_logits(model.get_base_model())
    loss, _ = token_cross_entropy(model, batch, normaliser)
    grads = torch.autograd.grad(loss, trained)

    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
    for got, want in zip(grads, expected_grads):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", ("llama", "phi"))  # phi's head has a bias
def test_chunked_loss_equals_one_pass(tiny_models, family, monkeypatch):
    """The head and cross-entropy over chunks of positions, each chunk's logits
    recomputed in backward, give the loss and gradients of one plain pass."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_models[family], dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    select_logits(model.get_base_model())
    batch = collate(rows(base.config.vocab_size), pad_token_id=0)
    normaliser = torch.tensor(float((batch["labels"][:, 1:] != IGNORE_INDEX).sum()))
    trained = [p for p in model.parameters() if p.requires_grad]
    one_pass, _ = token_cross_entropy(model, batch, normaliser)
    one_pass_grads = torch.autograd.grad(one_pass, trained)

    chunks = []
    original = sft._chunk_loss
    monkeypatch.setattr(sft, "_chunk_loss", lambda h, *rest: chunks.append(len(h)) or original(h, *rest))
    monkeypatch.setattr(sft, "CHUNK_LOGITS", 5 * base.config.vocab_size)  # 5 positions a chunk
    chunked, _ = token_cross_entropy(model, batch, normaliser)
    grads = torch.autograd.grad(chunked, trained)

    assert int(normaliser) > 10 and max(chunks) == 5  # several chunks, none over the limit
    assert float(chunked.detach()) == pytest.approx(float(one_pass.detach()), rel=1e-6)
    for got, want in zip(grads, one_pass_grads):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)  # the float order of other sums


def test_chunked_loss_bounds_the_logits_in_the_memory_estimate():
    from llmcustoms.planning.memory import CHUNK_LOGITS, MemoryEstimator
    from llmcustoms.planning.presets import ModelSpec

    qwen = ModelSpec(hub_id="q", family="qwen", model_type="qwen2", params=0, hidden_size=896, num_layers=24,
                     num_attention_heads=14, num_kv_heads=2, intermediate_size=4864, vocab_size=151936,
                     tie_word_embeddings=True, max_context=4096)
    memory = MemoryEstimator(qwen, on_gpu=True, budget_bytes=80 * 2 ** 30)
    small, large = (memory.estimate("lora", micro, 1024, "bf16", False).logits_bytes for micro in (1, 16))
    assert small == large  # a chunk's logits, whatever the batch
    assert small <= CHUNK_LOGITS * 4 * 3
    sharded = memory.estimate("full", 16, 1024, "bf16", False, shards=2).logits_bytes
    assert sharded > 16 * small  # under FSDP the head computes every position's logits


def test_on_a_cpu_in_bf16_the_head_meets_row_counts_in_multiples_and_learns_the_same(tiny_models, monkeypatch):
    """oneDNN keeps kernels for each row count a bf16 matmul meets on a CPU: a head run on however many
    positions a batch learns made a run's memory grow every step. Padded with zero rows, the head meets
    multiples of HEAD_ROWS_MULTIPLE only (summed loss, and DPO's logits alike), and what is learned is unchanged."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    head, rows_met = model.get_output_embeddings(), []
    head_forward = head.forward
    head.forward = lambda hidden: rows_met.append(hidden.shape[0]) or head_forward(hidden)
    select_logits(model.get_base_model())
    chunk_loss = sft._chunk_loss
    monkeypatch.setattr(sft, "_chunk_loss", lambda h, *rest: rows_met.append(len(h)) or chunk_loss(h, *rest))
    batch = collate(rows(base.config.vocab_size), pad_token_id=0)
    learned = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    assert learned % sft.HEAD_ROWS_MULTIPLE  # a count that needs padding
    trained = [p for p in model.parameters() if p.requires_grad]

    def learn(multiple: int):
        monkeypatch.setattr(sft, "HEAD_ROWS_MULTIPLE", multiple)
        rows_met.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = token_cross_entropy(model, batch, torch.tensor(float(learned)))
            logits, targets, _ = sft.learned_logits(model, batch)
        return loss, torch.autograd.grad(loss, trained), logits, list(rows_met)

    multiple = sft.HEAD_ROWS_MULTIPLE
    loss, grads, logits, met = learn(multiple)
    plain_loss_, plain_grads, plain_logits, plain_met = learn(1)
    assert plain_met == [learned, learned]  # the summed loss's rows, then the logits' rows
    assert met == [learned + -learned % multiple] * 2
    assert logits.shape == plain_logits.shape and torch.allclose(logits.float(), plain_logits.float(), atol=1e-2)
    assert float(loss.detach()) == pytest.approx(float(plain_loss_.detach()), rel=1e-3)
    for got, want in zip(grads, plain_grads):
        assert torch.allclose(got, want, rtol=1e-2, atol=1e-4)

    rows_met.clear()
    token_cross_entropy(model, batch, torch.tensor(float(learned)))  # fp32: nothing padded
    assert rows_met == [learned]
