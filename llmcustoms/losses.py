"""The training loss: a function `loss(model, batch, normaliser) -> (Tensor, sums)`.

`FineTuner` takes the loss as an argument; this module holds the default,
`token_cross_entropy` (DPO's is in `preferenceloss.py`). A loss returns the
summed loss of `batch` divided by `normaliser`, the count of whatever it sums
over in the whole optimizer step (or evaluation), so that any split of a step
into micro-batches, or over processes, gives the same update; and beside it a
1-D tensor of sums to report (DPO's rewards), or None. It runs under the
accelerator's autocast.

The default computes the LM head's logits only at positions the loss uses
(`select_logits`): for a big vocabulary the head is a large share of the
compute, and its fp32 logits a large share of the memory.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from llmcustoms.tokenization import IGNORE_INDEX

Loss = Callable[[Any, dict[str, torch.Tensor], torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


def select_logits(model: Any) -> None:
    """Let the LM head compute logits only at `head.logit_selection` (a boolean
    mask over batch and position; None: every position, as an unpatched head).

    The head's forward is patched (not replaced) so every call still goes
    through the top-level model (FSDP's hooks are there) and the state dict is
    unchanged."""
    head = model.get_output_embeddings()
    original = head.forward

    def selective_forward(hidden: torch.Tensor) -> torch.Tensor:
        if head.logit_selection is not None:
            hidden = hidden[head.logit_selection]
        return original(hidden)

    head.logit_selection = None
    head.forward = selective_forward


def learned_logits(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, targets, selection): the logits of the positions whose next
    token is learned (the replies, not prompts or padding), flattened in
    order, the tokens they predict, and the boolean mask they were taken at."""
    labels = batch["labels"]
    selection = torch.zeros_like(labels, dtype=torch.bool)
    selection[:, :-1] = labels[:, 1:] != IGNORE_INDEX  # position i predicts token i + 1
    head = model.get_output_embeddings()
    head.logit_selection = selection
    try:
        # No attention mask: rows are right-padded (`batching.collate`), so in a causal model
        # no real token attends to padding, and what padding computes is neither selected nor
        # learned. The loss and its gradients are the same; attention then takes its plain
        # causal path, which made a SmolLM2 LoRA step about 17% faster on a CPU (benchmarks/NOTES.md).
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits
    finally:
        head.logit_selection = None
    return logits, labels[:, 1:][selection[:, :-1]], selection


def token_cross_entropy(model: Any, batch: dict[str, torch.Tensor],
                        normaliser: torch.Tensor) -> tuple[torch.Tensor, None]:
    """Summed cross-entropy over the trained tokens of `batch`, divided by
    `normaliser` (the trained-token count of the whole step or evaluation).

    Only the logits of positions whose next token is trained are computed."""
    logits, targets, _ = learned_logits(model, batch)
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum") / normaliser, None
