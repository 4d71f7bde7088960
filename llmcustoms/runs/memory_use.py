"""The memory a run used against its plan, in words: one line that the summary,
`report` and train.log share, from status.json's `memory`
(`training/resource_use.compare`).

Two estimates are in it, each under its own name. The plan is the total of
the plan's memory table (`plan`, `train`'s plan and the live display's "plan"
give the same number): the peak for the longest micro-batch the run can see.
The ratio is the measured peak over the plan's estimate for the largest
micro-batch the run did train (its activations and logits scaled to that
batch's tokens; on a GPU without the CUDA context, which the allocator does
not see): a short run may never meet its longest rows, and the plan's total
would then make a correct estimate look too high.
"""

from __future__ import annotations

from typing import Any

GIB = 1024 ** 3


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def memory_line(memory: dict[str, Any]) -> str:
    """"peak 1.40 GiB; plan 1.77 GiB; 1.21x the estimate for the largest batch
    trained (1.16 GiB)", or "peak 1.40 GiB; plan 1.77 GiB (0.79x)" when that
    estimate is the plan's total; "" without a measured peak."""
    peak = memory.get("peak_bytes")
    if not peak:
        return ""
    plan, predicted, ratio = memory.get("plan_peak_bytes"), memory.get("predicted_bytes"), memory.get("ratio")
    text = f"peak {gib(peak)}" + (f"; plan {gib(plan)}" if plan else "")
    if predicted and ratio:
        if plan and gib(predicted) == gib(plan):
            text += f" ({ratio:.2f}x)"
        else:
            text += f"; {ratio:.2f}x the estimate for the largest batch trained ({gib(predicted)})"
    return text
