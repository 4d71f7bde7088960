"""Times a transformers Trainer's optimizer steps the way llmcustoms times its own, for the
side by side (`peer_speed.py`): the GPU's queue drained at each step's start and end, the
loss of every step. Imported by both children, in the project's environment and in
Unsloth's own, so it needs nothing but transformers and torch.
"""

from __future__ import annotations

import time


def clock():
    """A TrainerCallback whose `.steps` holds {"seconds", "loss"} per optimizer step."""
    import torch
    from transformers import TrainerCallback

    def drain() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict] = []
            self._started = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            drain()
            self._started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            drain()
            self.steps.append({"seconds": time.perf_counter() - self._started, "loss": None})

        def on_log(self, args, state, control, logs=None, **kwargs):
            # logging_steps=1: each step's loss, logged after its on_step_end.
            if logs and "loss" in logs and self.steps and self.steps[-1]["loss"] is None:
                self.steps[-1]["loss"] = float(logs["loss"])

    return StepClock()


def summary(steps: list[dict], tokens_per_step: float, warm_up: int) -> dict:
    """tokens/s over the steps after `warm_up` (a first step compiles and allocates), and over all."""
    timed = steps[warm_up:] or steps
    steady = sum(s["seconds"] for s in timed)
    total = sum(s["seconds"] for s in steps)
    return {"tokens_per_s": tokens_per_step * len(timed) / steady if steady else 0.0,
            "tokens_per_s_all_steps": tokens_per_step * len(steps) / total if total else 0.0,
            "step_seconds": [round(s["seconds"], 4) for s in steps],
            "losses": [None if s["loss"] is None else round(s["loss"], 4) for s in steps]}
