"""How the steps run, beyond their shape: how processes share them, padding-free
packing, torch.compile and replay.

Planning, so pure like the rest (no torch). Packing and compiling change nothing
that is learned: packing gives the same loss as padded rows (`models/packing.py`), and
compiling the model gives the same function. Replay adds rows to each step: the base
model's own replies to general prompts (`training/replay.py`). The optimizer is chosen with the batch it lets
fit (`sizing.fit_with_optimizer`).
"""

from __future__ import annotations

from llmcustoms.errors import ConfigError
from llmcustoms.planning.hardware import Hardware
from llmcustoms.planning.objective_kinds import Objective
from llmcustoms.planning.plan import DEFAULT_REPLAY
from llmcustoms.planning.resolver import Resolver

KERNELS = {"flash-attn": "FlashAttention-2 from flash-attn", "torch": "torch's varlen FlashAttention"}


def choose_packing(r: Resolver, hardware: Hardware, objective: Objective, precision: str) -> bool:
    """On with Ampere or newer GPUs, varlen attention and half precision (what the
    kernels need), for SFT; preference pairs are never packed, and a model with
    its own code may not use transformers' attention functions. `r`: the planner's resolver."""
    if not objective.packable:
        if r.given_value("packing"):
            r.note("--packing ignored: preference pairs run as padded pairs")
        r.forget("packing")
        return False
    if r.given("packing"):
        return bool(r.get("packing"))
    if hardware.supports_bf16 and hardware.varlen_attention and precision != "no" \
            and not r.given_value("trust_remote_code"):
        return r.chose("packing", True, f"packing on: each micro-batch's rows run as one sequence with per-row "
                                        f"positions ({KERNELS[hardware.varlen_attention]}), so no compute goes to "
                                        "padding and short rows share a forward pass; same loss (--no-packing: off)")
    r.record("packing", "default")
    return False


def choose_compile(r: Resolver) -> bool:
    """Off unless asked for: compiling costs minutes up front, and where it pays off (long GPU runs) is not measured yet."""
    compiled = bool(r.get("compile", False))
    if compiled:
        r.note("torch.compile on: the first steps compile the model (slower), later ones run faster")
    return compiled


def choose_replay(r: Resolver, objective: Objective, world_size: int) -> float:
    """--replay as given; by default DEFAULT_REPLAY for supervised rows in one process (`training/replay.py`:
    preference pairs are not a language model's loss, and several processes would each generate the replies)."""
    if r.given_value("replay") is not None:
        return float(r.get("replay"))
    return DEFAULT_REPLAY if objective.token_loss and world_size == 1 else 0.0


def choose_distributed(r: Resolver, world_size: int) -> str:
    """"none", "ddp" or "fsdp"; FSDP means full fine-tuning (it sets the method
    when none was given; an adapter method was refused with the given values,
    since its few trained weights gain nothing from sharding while every layer
    would pay for gathering)."""
    if world_size == 1:
        if r.given("distributed"):
            r.note(f"--distributed {r.get('distributed')} ignored: one process")
            r.forget("distributed")
        return "none"
    if not r.given("distributed"):
        r.record("distributed", "planner")
        return "ddp"
    choice = r.get("distributed")
    if choice == "fsdp" and r.given_value("optimizer") not in (None, "adamw"):
        raise ConfigError(f"--optimizer {r.given_value('optimizer')} cannot work on FSDP's shards.",
                          "Use --optimizer adamw with --distributed fsdp.")
    if choice == "fsdp" and not r.given("method"):
        r.imply("method", "full", r.source_of("distributed"))
        r.note("method full: --distributed fsdp shards full fine-tuning over the processes")
    return choice
