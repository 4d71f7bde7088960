"""DPO's loss (Rafailov et al. 2023), as a `losses.Loss` for `FineTuner`.

A batch holds preference pairs as consecutive sequences, chosen then rejected
(`pairrows.PairRows`), so both replies of a pair go through the model in one
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

from typing import Any

import torch

from llmcustoms.losses import sft as losses
from llmcustoms.losses.sft import Loss, learned_logits

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

    def __init__(self, beta: float):
        self.beta = beta

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


def loss_for(plan: Any) -> Loss:
    """The loss a plan trains with."""
    return PreferenceLoss(plan.beta) if plan.objective == "dpo" else losses.token_cross_entropy


def preference_metrics(sums: list[float], pairs: int, prefix: str = "") -> dict[str, float]:
    """The reported metrics from `SUMS` over `pairs` pairs."""
    chosen, rejected, correct = (value / max(1, pairs) for value in sums)
    return {f"{prefix}reward_accuracy": correct, f"{prefix}reward_margin": chosen - rejected,
            f"{prefix}chosen_reward": chosen, f"{prefix}rejected_reward": rejected}
