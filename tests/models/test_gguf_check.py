"""models/gguf_check.py: a GGUF reply that parts from the model's counts as equal only
where the model's own logits for the two tokens tie within the file's rounding."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from llmcustoms.models.gguf_check import GgufCheck, _greedy, _parts_at_a_tie


def test_a_reply_parts_at_a_tie_only_within_the_tolerance(tiny_models):
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"]).eval()
    batch = torch.tensor([[1, 5, 9, 14]])
    reply = _greedy(model, batch, [model.config.vocab_size - 1])
    assert len(reply) > 3
    with torch.no_grad():
        logits = model(torch.cat([batch, torch.tensor([reply[:3]])], dim=1)).logits[0, -1]
    second = int(logits.topk(2).indices[1])  # the runner-up at the fourth token
    margin = float(logits[reply[3]] - logits[second])
    assert margin > 0
    other = reply[:3] + [second] + reply[4:]
    assert _parts_at_a_tie(model, batch, reply, other, margin * 1.01)
    assert not _parts_at_a_tie(model, batch, reply, other, margin * 0.5)
    assert not _parts_at_a_tie(model, batch, reply, reply, 1e9)  # nothing parts


def test_a_tie_is_reported_and_only_real_differences_fail():
    check = GgufCheck(quant="f16", prompts=4, replies_equal=3, replies_tied=1)
    assert "greedy replies equal 3/4 (1 more part only at a tie)" in check.summary()
