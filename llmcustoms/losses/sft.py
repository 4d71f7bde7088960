"""Supervised fine-tuning's loss: cross-entropy on the learned tokens (the
replies), as a `losses.objective.Loss` (`TokenCrossEntropy`), and the pieces
other losses share (`select_logits`, `learned_logits`).

`token_cross_entropy` returns the summed loss of `batch` divided by
`normaliser`, the trained-token count of the whole optimizer step (or
evaluation), so that any split of a step into micro-batches, or over
processes, gives the same update. It runs under the accelerator's autocast.

The default computes the LM head's logits only at positions the loss uses
(`select_logits`): for a big vocabulary the head is a large share of the
compute, and its fp32 logits a large share of the memory. Beyond that it
never holds the logits of every trained position at once: the head and the
cross-entropy run over chunks of positions, each chunk's logits recomputed in
the backward pass rather than kept (`head_cross_entropy`), so a 152k-word
vocabulary costs a chunk's logits, not a batch's. On a GPU with Liger-Kernel
installed its fused linear cross-entropy (Triton) does the same in one kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from llmcustoms.data.tokenization import IGNORE_INDEX
from llmcustoms.losses.objective import LoopParts
from llmcustoms.models.packing import model_inputs
from llmcustoms.planning.memory import CHUNK_LOGITS
from llmcustoms.planning.objective_kinds import SFT
from llmcustoms.runs.measures import perplexity


def select_logits(model: Any) -> None:
    """Let the LM head compute logits only at `head.logit_selection` (a boolean
    mask over batch and position; None: every position, as an unpatched head),
    or, with `head.hidden_only`, return its input there instead (the chunked
    loss applies the head itself).

    The head's forward is patched (not replaced) so every call still goes
    through the top-level model (FSDP's hooks are there) and the state dict is
    unchanged."""
    head = model.get_output_embeddings()
    original = head.forward

    def selective_forward(hidden: torch.Tensor) -> torch.Tensor:
        if head.logit_selection is None:
            return hidden if head.hidden_only else original(hidden)
        hidden = hidden[head.logit_selection]
        if head.hidden_only:
            return hidden
        if not _pads_head_rows(hidden):
            return original(hidden)
        return original(_with_zero_rows(hidden))[:hidden.shape[0]]  # a new count each batch: HEAD_ROWS_MULTIPLE

    head.logit_selection = None
    head.hidden_only = False
    head.forward = selective_forward


# On a CPU in bf16, oneDNN builds kernels for each row count a matmul meets and keeps them. The head
# runs on the positions a batch learns, a count new nearly every step: a tiny Llama on the example data
# grew about 0.9 MB a step without end (0.28 GiB resident at step 25, 0.61 at step 400), and stayed at
# 0.24-0.25 GiB with its rows padded to a multiple, as `training/batching.pad_multiple` bounds the
# lengths. Zero rows, learning nothing; fp32 and GPUs keep no kernel per shape, and pad nothing.
HEAD_ROWS_MULTIPLE = 64


def _pads_head_rows(hidden: torch.Tensor) -> bool:
    return hidden.device.type == "cpu" and torch.is_autocast_enabled("cpu")


def _with_zero_rows(hidden: torch.Tensor) -> torch.Tensor:
    """`hidden` with zero rows after its own, up to a multiple of HEAD_ROWS_MULTIPLE."""
    added = -hidden.shape[0] % HEAD_ROWS_MULTIPLE
    return torch.cat([hidden, hidden.new_zeros(added, hidden.shape[-1])]) if added else hidden


def _selection(labels: torch.Tensor) -> torch.Tensor:
    """Positions whose next token is learned: position i predicts token i + 1."""
    selection = torch.zeros_like(labels, dtype=torch.bool)
    selection[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return selection


def _head_output(model: Any, batch: dict[str, torch.Tensor], selection: torch.Tensor, hidden_only: bool) -> torch.Tensor:
    head = model.get_output_embeddings()
    head.logit_selection, head.hidden_only = selection, hidden_only
    try:
        # No attention mask: rows are right-padded (`batching.collate`), so in a causal model
        # no real token attends to padding, and what padding computes is neither selected nor
        # learned. The loss and its gradients are the same; attention then takes its plain
        # causal path, which made a SmolLM2 LoRA step about 17% faster on a CPU (benchmarks/NOTES.md).
        # A packed batch (`models/packing.py`) brings its per-row positions and boundaries instead.
        return model(input_ids=batch["input_ids"], use_cache=False, **model_inputs(batch)).logits
    finally:
        head.logit_selection, head.hidden_only = None, False


def learned_logits(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, targets, selection): the logits of the positions whose next
    token is learned (the replies, not prompts or padding), flattened in
    order, the tokens they predict, and the boolean mask they were taken at."""
    labels = batch["labels"]
    selection = _selection(labels)
    logits = _head_output(model, batch, selection, hidden_only=False)
    return logits, labels[:, 1:][selection[:, :-1]], selection


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum")


def head_cross_entropy(hidden: torch.Tensor, head: Any, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of `head(hidden)` against `targets`, holding at most
    `CHUNK_LOGITS` logits at once: each chunk's logits are recomputed in the
    backward pass instead of kept. The same loss and gradients as the plain
    computation, up to float summation order."""
    fused = _liger_loss(hidden, head, targets) if targets.numel() else None  # Liger divides by the count
    if fused is not None:
        return fused
    chunk = max(1, CHUNK_LOGITS // head.weight.shape[0])
    if _pads_head_rows(hidden):  # rows and chunks in multiples, so each matmul is a shape met before
        chunk = max(HEAD_ROWS_MULTIPLE, chunk - chunk % HEAD_ROWS_MULTIPLE)
        count, hidden = hidden.shape[0], _with_zero_rows(hidden)
        targets = torch.cat([targets, targets.new_full((hidden.shape[0] - count,), IGNORE_INDEX)])
    if hidden.shape[0] <= chunk:
        return _chunk_loss(hidden, head.weight, head.bias, targets)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk):
        part = slice(start, start + chunk)
        total = total + checkpoint(_chunk_loss, hidden[part], head.weight, head.bias, targets[part],
                                   use_reentrant=False)
    return total


def _liger_loss(hidden: torch.Tensor, head: Any, targets: torch.Tensor) -> torch.Tensor | None:
    """Liger-Kernel's fused linear cross-entropy (one Triton kernel, chunked
    inside) on a GPU where it is installed; None elsewhere."""
    if not hidden.is_cuda:
        return None
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else head.weight.dtype
    if dtype == torch.float16:  # Liger computes gradients in the forward pass, before fp16's loss scaling
        return None
    bias = head.bias.to(dtype) if head.bias is not None else None
    # fp32 accumulation of the head's gradient over chunks (full fine-tuning trains it).
    return liger_fused_linear_cross_entropy(hidden.to(dtype), head.weight.to(dtype), targets, bias,
                                            reduction="sum", accum_dtype=torch.float32).float()


def token_cross_entropy(model: Any, batch: dict[str, torch.Tensor],
                        normaliser: torch.Tensor) -> tuple[torch.Tensor, None]:
    """Summed cross-entropy over the trained tokens of `batch`, divided by
    `normaliser` (the trained-token count of the whole step or evaluation).

    The head runs only at positions whose next token is trained, chunk by
    chunk (`head_cross_entropy`). Under FSDP the head's weight is a shard
    outside its own forward, and some models change the head's logits in
    their forward (`LOGIT_TRANSFORMS`): there the head computes them itself."""
    labels = batch["labels"]
    selection = _selection(labels)
    targets = labels[:, 1:][selection[:, :-1]]
    head = model.get_output_embeddings()
    if _is_sharded(head.weight) or _changes_logits(model.config):
        logits = _head_output(model, batch, selection, hidden_only=False)
        return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum") / normaliser, None
    hidden = _head_output(model, batch, selection, hidden_only=True)
    return head_cross_entropy(hidden, head, targets) / normaliser, None


class TokenCrossEntropy:
    """SFT: the mean cross-entropy per learned token; evaluations add perplexity."""
    objective = SFT
    sums: tuple[str, ...] = ()

    def setup(self, model: Any, loop: LoopParts) -> None:
        select_logits(model)

    def __call__(self, model: Any, batch: dict[str, torch.Tensor],
                 normaliser: torch.Tensor) -> tuple[torch.Tensor, None]:
        return token_cross_entropy(model, batch, normaliser)

    def step_metrics(self, sums: list[float], count: int) -> dict[str, float]:
        return {}

    def eval_metrics(self, eval_loss: float, sums: list[float], count: int) -> dict[str, float]:
        return {"eval_ppl": perplexity(eval_loss)}

    def untrained(self) -> None:
        return None  # only a forward pass says

    def held_out(self, rows: list[dict[str, Any]], step: int | None) -> dict[str, Any]:
        return {}  # the eval loss and perplexity are in the result already


# Config fields of models whose forward changes the head's logits (Gemma's softcap,
# Cohere's and Granite's scales): the loss must see the logits the model makes.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _changes_logits(config: Any) -> bool:
    return any(getattr(config, name, None) not in (None, 1.0) for name in LOGIT_TRANSFORMS)


def _is_sharded(weight: torch.Tensor) -> bool:
    """A DTensor: FSDP2's shard of the head, not its whole matrix."""
    return type(weight).__name__ == "DTensor"
