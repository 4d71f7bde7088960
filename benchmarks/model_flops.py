"""The FLOPs a LoRA training step needs per input token, from a Llama-family config: the
numerator of MFU (model FLOPs utilisation) in the GPU kit's tables. docs/benchmarks.md
("LoRA's FLOPs") writes the same out.

For a linear layer of W (in x out) a token costs 2*in*out FLOPs forward. The frozen weights
get no weight gradient, only the gradient of their input: 2*in*out more backward, 4*in*out
in all (a full fine-tune's 6*in*out less the weight gradient). Each LoRA pair (A: in x r,
B: r x out) is trained: 6*r*(in+out). Attention's two products (scores and the weighted sum)
cost 4*ctx*heads*head_dim a token forward, where ctx is how many positions the token attends
to (its row's, causal), and twice that backward (both operands are activations). The head
counts every position, as model FLOPs do (a loss computed only at learned positions does less
work for the same tokens: it shows as a higher MFU). Gradient checkpointing's second forward
is not counted: it is work the model does not need, so it lowers MFU.
"""

from __future__ import annotations

import json
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Dense bf16 tensor-core peaks (the makers' sheets, no sparsity), by a name in torch's device name.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each decoder linear layer of one layer, by its name."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    return {"q_proj": (h, heads * head_dim), "k_proj": (h, kv * head_dim), "v_proj": (h, kv * head_dim),
            "o_proj": (heads * head_dim, h), "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def mean_context(lengths: list[int]) -> float:
    """Positions a token attends to, averaged over the tokens of causal rows of these lengths."""
    tokens = sum(lengths)
    return sum(n * (n + 1) / 2 for n in lengths) / tokens if tokens else 0.0


def lora_flops_per_token(config: dict, lengths: list[int], rank: int, targets=TARGETS) -> float:
    layers = config["num_hidden_layers"]
    shapes = linear_shapes(config)
    frozen = layers * sum(i * o for i, o in shapes.values()) + config["hidden_size"] * config["vocab_size"]
    lora = layers * sum(rank * (i + o) for name, (i, o) in shapes.items() if name in targets)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    attention = layers * 3 * 4 * mean_context(lengths) * heads * head_dim
    return 4 * frozen + 6 * lora + attention


def for_model(model_dir: str | Path, lengths: list[int], rank: int) -> float:
    return lora_flops_per_token(json.loads((Path(model_dir) / "config.json").read_text()), lengths, rank)


def peak_flops(device_name: str | None) -> float | None:
    """The card's dense bf16 peak, when its name is one of PEAK_BF16's."""
    return next((peak for name, peak in PEAK_BF16.items() if device_name and name in device_name), None)
