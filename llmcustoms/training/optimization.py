"""The optimizer and its learning-rate schedule.

AdamW, with weight decay on matrices only: torch's (fused on a GPU), or
bitsandbytes' 8-bit and paged versions (`plan.optimizer`), which keep the two
moments in 8 bits with a scale per block of 256 (a quarter of the memory), or
in memory that moves to CPU RAM when the GPU runs short (paged).

The learning rate of optimizer step `step` is the plan's peak times a factor;
`FineTuner` takes the function that gives it as an argument, `lr_multiplier`
by default (linear warmup, then constant, linear or cosine decay).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from llmcustoms.planning.plan import Plan

Schedule = Callable[[int, Plan], float]


def lr_multiplier(step: int, plan: Plan) -> float:
    """Learning-rate factor for optimizer step `step` (0-based): linear warmup, then decay."""
    if step < plan.warmup_steps:
        # (step + 1): the first step already learns; HF's schedule wastes it at lr 0.
        return (step + 1) / (plan.warmup_steps + 1)
    if plan.lr_scheduler == "constant":
        return 1.0
    progress = (step - plan.warmup_steps) / max(1, plan.total_steps - plan.warmup_steps)
    if plan.lr_scheduler == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def parameter_groups(model: Any, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only: decaying biases and norm scales only hurts."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def make_optimizer(model: Any, plan: Plan) -> torch.optim.Optimizer:
    """The plan's optimizer over the trainable weights of `model` (under FSDP,
    made after sharding, so it holds the shards)."""
    groups = parameter_groups(model, plan.weight_decay)
    if plan.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=plan.lr, fused=torch.cuda.is_available())
    import bitsandbytes as bnb

    kinds = {"adamw_8bit": bnb.optim.AdamW8bit, "paged_adamw": bnb.optim.PagedAdamW,
             "paged_adamw_8bit": bnb.optim.PagedAdamW8bit}
    # torch's AdamW defaults (betas, eps), so switching optimizer changes only how the moments are stored.
    return kinds[plan.optimizer](groups, lr=plan.lr, betas=(0.9, 0.999), eps=1e-8)


def set_learning_rate(optimizer: Any, scheduler: Any, peak: float, factor: float) -> None:
    """Make optimizer and scheduler follow a new peak learning rate (recovery
    may lower it) from a step whose factor is `factor`."""
    scheduler.base_lrs = [peak for _ in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["initial_lr"] = peak
        group["lr"] = peak * factor
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
