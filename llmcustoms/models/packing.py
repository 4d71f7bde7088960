"""Padding-free packing: a micro-batch's rows run as one sequence.

Rows are concatenated into a [1, total] batch with per-row `position_ids`
(each row starts again at 0) and the cumulative row boundaries
(`cu_seq_lens`). Attention over it is varlen attention: each token attends
only to earlier tokens of its own row, so a row computes exactly what it
would alone, with no compute spent on padding. The loss is then the same as
unpacked: the first token of each row predicts nothing (its label is
ignored), as position 0 of an unpacked row never does.

With packing a micro-batch is a token budget (micro-batch x max_seq_len, the
memory the plan sized), not a row count: a step's rows are split into as few
forward passes as fit, which keeps a GPU busy on short rows.

Attention, by what is installed: FlashAttention-2's varlen kernel
(`flash-attn`), else torch's own (`torch.nn.attention.varlen`, torch >= 2.11),
both on an Ampere or newer GPU in bf16/fp16; else plain SDPA per row (CPUs,
fp32: correct, not faster). A sliding window (Mistral, Phi-3) is kept.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from llmcustoms.data.tokenization import IGNORE_INDEX, TokenizedExample
from llmcustoms.errors import ModelError

# The attention implementation name models are switched to (`use_varlen_attention`).
ATTENTION = "llmcustoms_varlen"
# Keys of a packed batch that go to the model's forward as they are.
MODEL_KEYS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def pack(examples: list[TokenizedExample]) -> dict[str, Any]:
    """The rows as one [1, total] sequence, with what varlen attention needs."""
    lengths = [len(e.input_ids) for e in examples]
    input_ids = torch.tensor([t for e in examples for t in e.input_ids], dtype=torch.long).unsqueeze(0)
    labels = torch.tensor([t for e in examples for t in e.labels], dtype=torch.long).unsqueeze(0)
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    labels[0, starts] = IGNORE_INDEX  # a row's first token is predicted by nothing of its own row
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu_seq_lens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    longest = max(lengths)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "cu_seq_lens_q": cu_seq_lens,
            "cu_seq_lens_k": cu_seq_lens, "max_length_q": longest, "max_length_k": longest}


def packed_micro_batches(step: list[int], lengths: list[int], token_budget: int, cap: int) -> list[list[int]]:
    """A step's rows in as few micro-batches of at most `token_budget` tokens as
    first-fit decreasing finds; rows count as at most `cap` tokens (they were cut there)."""
    batches: list[list[int]] = []
    used: list[int] = []
    for row in sorted(step, key=lambda i: -lengths[i]):
        tokens = min(lengths[row], cap)
        slot = next((b for b, total in enumerate(used) if total + tokens <= token_budget), None)
        if slot is None:
            batches.append([row])
            used.append(tokens)
        else:
            batches[slot].append(row)
            used[slot] += tokens
    return batches


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The packing keys of `batch` for the model's forward ({} for an unpacked batch)."""
    return {key: batch[key] for key in MODEL_KEYS if key in batch}


def varlen_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                     sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [1, heads, total, dim], key and
    value [1, kv_heads, total, dim]; returns [1, total, heads, dim]. A batch that
    is not packed (evaluation, generation) takes transformers' SDPA.
    `sliding_window` W: a token sees itself and the W - 1 before it (transformers' rule)."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [total, heads, dim]
    if q.is_cuda and torch.is_autocast_enabled("cuda"):
        # Full fine-tuning and QLoRA keep fp32 rotary embeddings, so q and k arrive in fp32 under autocast.
        dtype = torch.get_autocast_dtype("cuda")
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    fast = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _ampere_or_newer(q.device.index or 0)
    window = (sliding_window - 1 if sliding_window else -1, 0)
    if fast and _flash_attn() is not None:
        out = _flash_attn()(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, dropout_p=dropout,
                            softmax_scale=scaling, causal=True, window_size=window)
    elif fast and _torch_varlen() is not None:
        groups = q.shape[1] // k.shape[1]  # torch's kernel wants as many key/value heads as query heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = _torch_varlen()(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling,
                              window_size=window)
    else:
        out = _per_row(query, key, value, cu_seq_lens_q.tolist(), scaling, sliding_window)
    return out.unsqueeze(0), None


def _per_row(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int],
             scaling: float | None, sliding_window: int | None) -> torch.Tensor:
    """Causal SDPA on each row's slice: what varlen attention computes, without its kernel."""
    rows = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (t[:, :, start:end] for t in (query, key, value))
        mask = None
        if sliding_window and end - start > sliding_window:
            offsets = torch.arange(end - start, device=q.device)
            distance = offsets[:, None] - offsets[None, :]
            mask = (distance >= 0) & (distance < sliding_window)
        rows.append(torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]))
    return torch.cat(rows, dim=2)[0].transpose(0, 1)


@functools.cache
def _ampere_or_newer(device: int) -> bool:
    """FlashAttention's kernels need compute capability 8.0 (Ampere) or newer."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


@functools.cache
def _flash_attn() -> Any:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


@functools.cache
def _torch_varlen() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _no_mask_for_packed(*args: Any, attention_mask: torch.Tensor | None = None, config: Any = None,
                        **kwargs: Any) -> Any:
    """The mask for `ATTENTION`: none for rows without a padding mask in a model
    without a sliding window (packed rows, right-padded rows: attention is causal,
    within each row), else SDPA's (generation; a window to keep)."""
    if attention_mask is None and getattr(config, "sliding_window", None) is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, config=config, **kwargs)


def use_varlen_attention(model: Any) -> None:
    """Switch `model` to `varlen_attention` (registered with transformers once)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, varlen_attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask_for_packed)
    model.set_attn_implementation(ATTENTION)
    if model.config._attn_implementation != ATTENTION:  # transformers only warns
        raise ModelError("This model's code does not use transformers' attention functions, so its rows cannot be "
                         "packed: they would attend to each other.", "Train it with --no-packing.")
