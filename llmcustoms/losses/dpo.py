"""DPO's loss (Rafailov et al. 2023), as a `losses.objective.Loss`.

A batch holds preference pairs as consecutive sequences, chosen then rejected
(`pair_rows.PairRows`), so both replies of a pair go through the model in one
forward. Each sequence's log-probability is the sum over its reply tokens
(labels not -100); the loss of a pair is

    -log sigmoid(beta * ((chosen - chosen_ref) - (rejected - rejected_ref)))

where `_ref` are the reference model's log-probabilities: the batch's
`reference_logps` when they were computed up front (full fine-tuning, or a
run that starts from another run's weights), else the same model with its
LoRA adapter switched off, so no second copy of the weights is held.

Beside the loss it reports sums over the batch's pairs, in `SUMS` order: the
chosen and rejected rewards (beta times the log-ratio) and how many pairs
rank the chosen reply higher (a tie counts half). Divided by the pairs they
give TRL's rewards/chosen, rewards/rejected, rewards/accuracies and
rewards/margins.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from llmcustoms.losses.dpo_reference import cached_reference
from llmcustoms.losses.objective import LoopParts
from llmcustoms.losses.sft import learned_logits, select_logits
from llmcustoms.planning.objective_kinds import DPO
from llmcustoms.planning.objectives import needs_cached_reference
from llmcustoms.runs.preference_report import evaluation_at

SUMS = ("chosen_reward", "rejected_reward", "correct")


def sequence_logps(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each sequence's summed log-probability of its learned tokens, in fp32."""
    logits, targets, selection = learned_logits(model, batch)
    token_logps = -torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")
    sequence = selection.nonzero()[:, 0]  # row-major, the order the logits come in
    return torch.zeros(selection.shape[0], device=token_logps.device).index_add(0, sequence, token_logps)


@torch.no_grad()
def adapter_off_logps(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The base model's log-probabilities: the same weights with the adapter off.
    In eval mode, so no dropout draws: the reference is deterministic and the
    random stream the policy's dropout uses is not disturbed."""
    was_training = model.training
    model.eval()
    try:
        with model.disable_adapter():
            return sequence_logps(model, batch)
    finally:
        model.train(was_training)


class PreferenceLoss:
    """`loss(model, batch, normaliser)`: summed DPO loss / normaliser (the
    step's pairs), and the `SUMS` of the batch."""
    objective = DPO
    sums = SUMS

    def __init__(self, beta: float):
        self.beta = beta

    def setup(self, model: Any, loop: LoopParts) -> None:
        select_logits(model)
        if needs_cached_reference(loop.plan) and loop.data.reference is None:  # no adapter to switch off
            loop.data.reference = cached_reference(model, loop.data, loop.run_dir, 2 * loop.plan.micro_batch_size,
                                                   loop.processes, loop.autocast, loop.activity)

    def step_metrics(self, sums: list[float], count: int) -> dict[str, float]:
        return preference_metrics(sums, count)

    def eval_metrics(self, eval_loss: float, sums: list[float], count: int) -> dict[str, float]:
        # The pairs too: on a handful, the share ranked right is withheld (`preference_report.too_few_pairs`).
        return {**preference_metrics(sums, count, "eval_"), "eval_pairs": count}

    def untrained(self) -> tuple[float, dict[str, float]]:
        """Before any training the policy is its own reference: every reward is 0,
        each pair's loss log 2 and the accuracy chance (ties count half)."""
        return math.log(2), preference_metrics([0.0, 0.0, 0.5], 1, "eval_")

    def held_out(self, rows: list[dict[str, Any]], step: int | None) -> dict[str, Any]:
        return evaluation_at(rows, step)

    def __call__(self, model: Any, batch: dict[str, torch.Tensor],
                 normaliser: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The reference first: its activations are gone before the policy's are kept for backward.
        reference = batch.get("reference_logps")
        reference = adapter_off_logps(model, batch) if reference is None else reference
        policy = sequence_logps(model, batch)
        reference = reference.to(policy.device)
        ratios = policy - reference
        chosen, rejected = ratios[0::2], ratios[1::2]
        loss = -torch.nn.functional.logsigmoid(self.beta * (chosen - rejected)).sum() / normaliser
        chosen_reward, rejected_reward = self.beta * chosen.detach(), self.beta * rejected.detach()
        # A tie (before any training the policy is the reference) counts half: chance, not failure.
        correct = (chosen_reward > rejected_reward).float() + 0.5 * (chosen_reward == rejected_reward).float()
        sums = torch.stack([chosen_reward.sum(), rejected_reward.sum(), correct.sum()])
        return loss, sums


def preference_metrics(sums: list[float], pairs: int, prefix: str = "") -> dict[str, float]:
    """The reported metrics from `SUMS` over `pairs` pairs."""
    chosen, rejected, correct = (value / max(1, pairs) for value in sums)
    return {f"{prefix}reward_accuracy": correct, f"{prefix}reward_margin": chosen - rejected,
            f"{prefix}chosen_reward": chosen, f"{prefix}rejected_reward": rejected}
