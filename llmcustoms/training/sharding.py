"""FSDP (`--distributed fsdp`): what changes when the model is sharded.

Each process holds 1/N of every weight, gradient and optimizer moment: torch's
FSDP2 (`fully_shard`), one unit per decoder layer and one for the rest, which
is what accelerate's FSDP2 plugin sets up. It is applied here rather than
through the plugin because accelerate enables FSDP only on GPUs, and the same
code must run (and be tested) on CPU processes with gloo. Two things follow
for the rest of llmcustoms:

- Checkpoints stay in the one format every run uses: whole tensors, keyed as
  in a plain model and a plain `torch.optim` state_dict. Saving gathers the
  shards onto the main process; loading hands every process the whole tensors
  and keeps its own shard. So a run saved sharded over 4 processes resumes
  with 1, 2 or 8, sharded or not.
- Gathering weights and reducing gradients are collectives inside forward and
  backward, so every process must run the same number of them: callers pad
  with zero-weight micro-batches (see `processes.Processes`).

Every function but `shard` is a collective: every process must call it.
"""

from __future__ import annotations

from typing import Any

from llmcustoms.runs.checkpoints import flatten_optimizer_state, unflatten_optimizer_state


def shard(model: Any, mixed_precision: str) -> Any:
    """Shard `model` over the processes, in place; each shard moves to this process's device."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if mixed_precision != "no":  # compute in 16 bits, keep fp32 weights and reduce gradients in fp32
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if mixed_precision == "bf16" else torch.float16,
                                      reduce_dtype=torch.float32)
    # A decoder layer is gathered whole only while it runs (reshard_after_forward),
    # so a process holds its shards plus about one layer at a time.
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mp_policy=policy)
    return model


def _full_options(**extra: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **extra)


def gather_weights(model: Any, names: list[str]) -> dict[str, Any]:
    """The named weights, whole, on the main process (empty elsewhere)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    full = get_model_state_dict(model, options=_full_options(cpu_offload=True))
    return {name: full[name] for name in names if name in full}


def load_weights(model: Any, weights: dict[str, Any]) -> None:
    """Whole tensors from the main process (others pass {}): each process keeps its
    shard. Only the main process reads the checkpoint, so the machine holds one
    copy in RAM, not one per process. Tied weights come in once."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, weights, options=_full_options(strict=False, broadcast_from_rank0=True))


def _names_in_group_order(model: Any, optimizer: Any) -> list[str]:
    names = {id(param): name for name, param in model.named_parameters()}
    return [names[id(param)] for group in optimizer.param_groups for param in group["params"]]


def gather_optimizer(model: Any, optimizer: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The optimizer state, whole, numbered as a plain optimizer numbers it (flat
    tensors and JSON groups, as `checkpoints.optimizer_state`); empty off the main process."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    full = get_optimizer_state_dict(model, optimizer, options=_full_options(cpu_offload=True))
    if not full.get("param_groups"):
        return {}, []
    index = {name: i for i, name in enumerate(_names_in_group_order(model, optimizer))}
    plain = {"state": {index[name]: values for name, values in full["state"].items()},
             "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                              for group in full["param_groups"]]}
    return flatten_optimizer_state(plain)


def load_optimizer(model: Any, optimizer: Any, tensors: dict[str, Any], groups: list[dict[str, Any]]) -> None:
    """Like `load_weights`: the whole state from the main process (others pass no
    tensors, but the same groups), sharded on arrival."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    plain = unflatten_optimizer_state(tensors, groups)
    names = _names_in_group_order(model, optimizer)
    by_name = {"state": {names[index]: values for index, values in plain["state"].items()},
               "param_groups": [{**group, "params": [names[index] for index in group["params"]]}
                                for group in plain["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=_full_options(broadcast_from_rank0=True))
