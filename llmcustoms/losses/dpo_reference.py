"""DPO's reference log-probabilities, computed once before training, for runs
whose model has no adapter to switch off: full fine-tuning, and a run that
starts from another run's adapter (`--from-run`, whose reference is that run's
model, adapter included).

They are computed with the model as it is loaded, before any step: the
reference by definition. Every token of a reply gets its log-probability
(0 elsewhere), laid out flat in the order of the run's rows, so a batch's
per-sequence sums are range sums, and stay exact when recovery later
shortens the rows (a shorter row sums a shorter range). They are kept in the
run directory (`reference/`): a resumed run reads them instead of running the
model over every row again; one without them computes them again, from the
model as loaded (the starting weights, before its checkpoint is restored).
Memory holds one model throughout. Every process computes all of them (the
forwards are collectives under FSDP); the main one writes them.

The pass is as long as an evaluation over the training rows, and comes before
the loop: it installs the stop signals itself, and a stop (SIGINT, SIGTERM),
agreed between micro-batches, ends the run there. What was computed of the
rows being computed is lost; nothing else is.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from llmcustoms.data.pair_rows import PairRows
from llmcustoms.losses.sft import learned_logits
from llmcustoms.recovery.recovery_system import TrainingInterrupted
from llmcustoms.recovery.stop_signals import StopRequested, stop_agreed, stopped_by
from llmcustoms.runs.checkpoints import CheckpointManager

DIRECTORY = "reference"


class ReferenceLogps:
    """Per-token reference log-probabilities of some sequences: sequence k's
    tokens are `values[starts[k]:starts[k + 1]]`, 0 where nothing is learned."""

    def __init__(self, values: np.ndarray, starts: np.ndarray):
        self.values, self.starts = values, starts
        self.cumulative = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])

    def __len__(self) -> int:
        return len(self.starts) - 1

    def sums(self, sequences: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
        """Each sequence's summed log-probability over its first `lengths[i]` tokens."""
        begin = self.starts[np.asarray(sequences, np.int64)]
        end = begin + np.minimum(np.asarray(lengths, np.int64), np.diff(self.starts)[np.asarray(sequences, np.int64)])
        return torch.tensor(self.cumulative[end] - self.cumulative[begin], dtype=torch.float32)

    def save(self, directory: Path, name: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        for suffix, array in (("values", self.values), ("starts", self.starts)):
            temporary = directory / f".{name}-{suffix}.npy.tmp"
            with open(temporary, "wb") as f:
                np.save(f, array)
            temporary.replace(directory / f"{name}-{suffix}.npy")

    @classmethod
    def load(cls, directory: Path, name: str, sequences: int) -> "ReferenceLogps | None":
        """The saved values, or None when missing, damaged or of other rows."""
        try:
            # open_memmap reads plain numeric .npy files only: never a pickle.
            values = np.asarray(np.lib.format.open_memmap(directory / f"{name}-values.npy", mode="r"))
            starts = np.asarray(np.lib.format.open_memmap(directory / f"{name}-starts.npy", mode="r"))
        except (OSError, ValueError):
            return None
        if len(starts) != sequences + 1 or int(starts[-1]) != len(values):
            return None
        return cls(values, starts)


@torch.no_grad()
def compute(model: Any, rows: Any, collate: Callable[[list], dict[str, torch.Tensor]], micro_batch: int,
            device: torch.device, autocast: Callable[[], AbstractContextManager],
            progress: Callable[[int, int], None] = lambda done, total: None,
            stopped: Callable[[], bool] = lambda: False) -> ReferenceLogps:
    """The reference log-probabilities of every sequence of `rows` (a `PairRows`,
    or no rows), with `model` as it is now, in eval mode; `micro_batch`
    sequences (half as many pairs) at a time, read from the store as they go.
    StopRequested when `stopped()`, asked before each micro-batch, says so."""
    lengths = rows.rows.lengths if isinstance(rows, PairRows) else np.zeros(0, np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.zeros(int(starts[-1]), np.float32)
    pairs_at_once = max(1, micro_batch // 2)
    was_training = model.training
    model.eval()
    try:
        for pair in range(0, len(lengths) // 2, pairs_at_once):
            if stopped():
                raise StopRequested
            progress(pair, len(lengths) // 2)
            first = 2 * pair
            halves = rows.examples(list(range(pair, min(pair + pairs_at_once, len(lengths) // 2))))
            batch = {k: v.to(device) for k, v in collate(halves).items()}
            with autocast():
                logits, targets, selection = learned_logits(model, batch)
            token_logps = -torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")
            sequence, position = selection.nonzero(as_tuple=True)  # position i predicts token i + 1
            where = starts[first + sequence.cpu().numpy()] + position.cpu().numpy() + 1
            values[where] = token_logps.cpu().numpy()
    finally:
        model.train(was_training)
    return ReferenceLogps(values, starts)


def cached_reference(model: Any, data: Any, run_dir: Any, micro_batch: int, processes: Any,
                     autocast: Callable[[], AbstractContextManager],
                     say: Callable[[str | None], None]) -> tuple[ReferenceLogps, ReferenceLogps]:
    """(training, evaluation) reference log-probabilities of a `TrainingRows`'
    pairs: from the run directory, or computed now with `model` (in
    micro-batches of `micro_batch` sequences) on every one of the run's
    `processes.Processes`, and kept there. A stop ends the run with
    TrainingInterrupted, once status.json says so."""
    directory = run_dir.path / DIRECTORY
    out = []
    with processes.signals:
        try:
            for name, rows in (("train", data.train), ("eval", data.evaluation)):
                kept = ReferenceLogps.load(directory, name, 2 * len(rows))
                # Every process computes, or none: under FSDP the forwards are collectives, and each agrees on a stop.
                if processes.main_decides(kept is None):
                    kept = compute(model, rows, data.collate_examples, micro_batch, processes.device, autocast,
                                   lambda done, total: say(f"reference log-probabilities ({name} pairs) {done}/{total}"),
                                   lambda: stop_agreed(processes) is not None)
                    if run_dir.writable:
                        kept.save(directory, name)
                out.append(kept)
        except StopRequested:
            say(None)
            _interrupted(run_dir, processes.stopping())
    say(None)
    return out[0], out[1]


def _interrupted(run_dir: Any, signum: int) -> None:
    """Stopped before the loop began: nothing to save. The step said is the
    newest checkpoint's (a resumed run's), where `resume` goes on from."""
    step = max((c.step for c in CheckpointManager(run_dir.checkpoints_path, 1).all()), default=0)
    run_dir.write_status("interrupted", step=step, reason=f"{stopped_by(signum)} while computing DPO's reference")
    raise TrainingInterrupted(signum, step)
