"""A pair objective other than DPO, defined here and nowhere in the package, trains,
evaluates, resumes and reports through the command line: the rest of the tool asks
`planning/objective_kinds.Objective` what an objective is, never its name
(CONTRIBUTING.md, "A loss or objective"). And no module outside `losses/` compares
an objective's name again.

The loss is SimPO's (Meng et al. 2024): no reference model; each reply's mean
log-probability per token, and the pair's loss -log sigmoid(beta * (chosen -
rejected) - gamma)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from llmcustoms.data.tokenization import IGNORE_INDEX
from llmcustoms.losses.choice import LOSSES
from llmcustoms.losses.dpo import SUMS, preference_metrics, sequence_logps
from llmcustoms.losses.objective import LoopParts
from llmcustoms.losses.sft import select_logits
from llmcustoms.planning.objective_kinds import OBJECTIVES, Objective
from llmcustoms.runs.preference_report import evaluation_at
from test_cli_train import flat, invoke
from tiny_models import FIXTURES

PAIRS = FIXTURES / "shapes" / "preference_arithmetic.jsonl"
PACKAGE = Path(__file__).resolve().parents[2] / "llmcustoms"
SIMPO = Objective("simpo", "to score each pair's chosen reply above its rejected one by a margin", pairs=True,
                  token_loss=False, step_work=2, evaluation_work=2, uses_beta=True)
GAMMA = 0.5


class MarginLoss:
    """SimPO: rewards are beta times each reply's mean log-probability per reply token."""
    objective = SIMPO
    sums = SUMS

    def __init__(self, beta: float):
        self.beta = beta

    def setup(self, model: Any, loop: LoopParts) -> None:
        select_logits(model)

    def __call__(self, model: Any, batch: dict[str, torch.Tensor],
                 normaliser: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1).clamp(min=1)
        rewards = self.beta * sequence_logps(model, batch) / lengths.to(torch.float32)
        chosen, rejected = rewards[0::2], rewards[1::2]
        loss = -torch.nn.functional.logsigmoid(chosen - rejected - GAMMA).sum() / normaliser
        correct = (chosen > rejected).float() + 0.5 * (chosen == rejected).float()
        return loss, torch.stack([chosen.detach().sum(), rejected.detach().sum(), correct.sum()])

    def step_metrics(self, sums: list[float], count: int) -> dict[str, float]:
        return preference_metrics(sums, count)

    def eval_metrics(self, eval_loss: float, sums: list[float], count: int) -> dict[str, float]:
        return {**preference_metrics(sums, count, "eval_"), "eval_pairs": count}

    def untrained(self) -> None:
        return None

    def held_out(self, rows: list[dict[str, Any]], step: int | None) -> dict[str, Any]:
        return evaluation_at(rows, step)


@pytest.fixture
def simpo(monkeypatch):
    """The objective and its loss, known for this test only."""
    monkeypatch.setitem(OBJECTIVES, SIMPO.name, SIMPO)
    monkeypatch.setitem(LOSSES, SIMPO.name, lambda plan: MarginLoss(plan.beta))


def train_args(model: Path, output: Path, name: str, steps: int = 8) -> list[str]:
    return ["train", str(PAIRS), "--model", str(model), "--objective", "simpo", "--max-steps", str(steps),
            "--save-every", "2", "--eval-every", "4", "--early-stopping-patience", "0", "--batch-size", "4",
            "--grad-accum", "1", "--lr", "1e-2", "--beta", "20", "--eval-split", "0.3", "--mixed-precision", "no",
            "--output-dir", str(output), "--run-name", name, "--yes", "--quiet"]


def test_a_pair_objective_defined_in_a_test_trains_resumes_and_reports(simpo, tmp_path, tiny_models, monkeypatch):
    model = tiny_models["llama"]
    planned = invoke("plan", str(PAIRS), "--model", str(model), "--objective", "simpo", "--max-steps", "4")
    assert planned.exit_code == 0, planned.output
    said = flat(planned.output)
    assert "objective simpo" in said and "2N sequences" in said and "reference" not in said.split("objective simpo")[1][:200]

    whole = invoke(*train_args(model, tmp_path, "whole"))
    assert whole.exit_code == 0, whole.output
    run = tmp_path / "whole"
    plan = json.loads((run / "plan.json").read_text())
    assert (plan["objective"], plan["packing"], plan["replay"]) == ("simpo", False, 0.0)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps, evaluations = [r for r in rows if "loss" in r], [r for r in rows if "eval_reward_accuracy" in r]
    assert [r["step"] for r in steps] == list(range(1, 9)) and [r["step"] for r in evaluations] == [0, 4, 8]
    assert all("eval_ppl" not in r for r in rows)  # a pair loss has no perplexity
    margins = [r["reward_margin"] for r in steps]
    assert sum(margins[4:]) > sum(margins[:4]), margins  # it learns to tell the replies apart

    monkeypatch.setenv("LLMCUSTOMS_FAULT_INJECT", "sigint@3")
    stopped = invoke(*train_args(model, tmp_path, "stopped"))
    monkeypatch.delenv("LLMCUSTOMS_FAULT_INJECT")
    assert stopped.exit_code == 130, stopped.output
    resumed = invoke("resume", str(tmp_path / "stopped"), "--quiet")
    assert resumed.exit_code == 0, resumed.output
    a, b = (load_file(str(tmp_path / name / "adapter" / "adapter_model.safetensors")) for name in ("whole", "stopped"))
    assert all(torch.equal(a[key], b[key]) for key in a)  # resumed equals uninterrupted, bit for bit

    listed = flat(invoke("runs", "--output-dir", str(tmp_path)).output)
    assert "completed 8/8 simpo loss" in listed  # its own loss, not a perplexity
    report = invoke("report", str(run), "--details")
    assert report.exit_code == 0, report.output
    assert "held-out pairs" in flat(report.output) and "perplexity" not in flat(report.output)


# An objective named in a comparison: `== "dpo"`, `"sft" !=`, `in ("dpo", ...)`.
NAME_COMPARED = re.compile(r"""(==|!=|\bin)\s*\(?\s*["'](sft|dpo)["']|["'](sft|dpo)["']\s*(==|!=)""")


def test_no_module_outside_losses_compares_an_objective_by_name():
    found = [f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
             for path in sorted(PACKAGE.rglob("*.py")) if "losses" not in path.parts
             for number, line in enumerate(path.read_text().splitlines(), start=1) if NAME_COMPARED.search(line)]
    assert not found, "ask planning/objective_kinds.Objective instead:\n" + "\n".join(found)
    assert NAME_COMPARED.search('if plan.objective == "dpo":') and NAME_COMPARED.search("x in ('sft', 'dpo')")
