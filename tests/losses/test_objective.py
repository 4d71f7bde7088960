"""The loop knows nothing of the objective: a loss written here, with nothing
of SFT's or DPO's code, trains through the same `FineTuner`, its own sums
reach every step and evaluation row, and it owns its model setup."""

from __future__ import annotations

import torch

from llmcustoms.data.tokenization import IGNORE_INDEX
from llmcustoms.training.finetuner import FineTuner
from test_finetuner import train


class PlainCrossEntropy:
    """A third loss, minimal: the full logits of every position (no head trick,
    no chunking), cross-entropy on the learned tokens, and the rows it saw as a sum."""
    sums = ("rows",)

    def __init__(self):
        self.set_up = []

    def setup(self, model, loop):
        self.set_up.append((type(model).__name__, loop.plan.objective))

    def __call__(self, model, batch, normaliser):
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits.float()
        targets = batch["labels"][:, 1:]
        summed = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                   ignore_index=IGNORE_INDEX, reduction="sum")
        return summed / normaliser, torch.tensor([float(batch["input_ids"].shape[0])], device=logits.device)

    def step_metrics(self, sums, count):
        return {"rows_seen": sums[0], "rows_in_step": count}

    def eval_metrics(self, eval_loss, sums, count):
        return {"eval_rows_seen": sums[0]}

    def untrained(self):
        return None

    def held_out(self, rows, step):
        return {"step": step}


def test_a_loss_defined_here_trains_through_the_same_loop(tmp_path, tiny_models):
    loss = PlainCrossEntropy()
    tuner, result, run_dir, reporter = train(tmp_path / "plain", tiny_models["llama"], max_steps=12, micro_batch_size=4,
                                             grad_accum=2, eval_every=6, tuner_args={"loss": loss})
    assert loss.set_up and loss.set_up[0][1] == "sft"  # set up once the model loaded, told the plan
    steps = reporter.steps
    assert len(steps) == 12 and max(row["rows_in_step"] for row in steps) == 8  # an epoch's last step may hold fewer
    assert all(row["rows_seen"] == row["rows_in_step"] for row in steps)  # its sums, over every micro-batch of a step
    assert steps[-1]["loss"] < 0.7 * steps[0]["loss"]  # it learns
    evaluations = [row for row in run_dir.read_metrics() if "eval_loss" in row]
    assert [row["step"] for row in evaluations] == [0, 6, 12]
    assert all(row["eval_rows_seen"] == len(tuner.data.evaluation) for row in evaluations)
    assert "eval_ppl" not in evaluations[0]  # what SFT adds is SFT's, not the loop's
    assert result.held_out == {"step": result.best_eval_step}


def test_the_same_loss_computed_plainly_trains_the_same_weights_as_sft(tmp_path, tiny_models):
    """SFT's loss computes logits only where it learns, chunk by chunk; computed
    plainly through the same loop the steps' losses are the same."""
    _, _, _, plain = train(tmp_path / "plain", tiny_models["llama"], max_steps=4, eval_every=0,
                           tuner_args={"loss": PlainCrossEntropy()})
    _, _, _, sft = train(tmp_path / "sft", tiny_models["llama"], max_steps=4, eval_every=0)
    for a, b in zip(plain.steps, sft.steps, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-4 * b["loss"]


def test_the_loop_imports_no_objective():
    import ast
    import inspect

    from llmcustoms.training import evaluation, finetuner, step

    for module in (finetuner, evaluation, step):
        tree = ast.parse(inspect.getsource(module))
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
        assert not imported & {"llmcustoms.losses.dpo", "llmcustoms.losses.dpo_reference", "llmcustoms.losses.sft",
                               "llmcustoms.runs.preference_report", "llmcustoms.planning.objectives"}, module.__name__
        assert not {n for n in names if "preference" in n.lower() or "dpo" in n.lower() or "reference" in n.lower()}
    assert FineTuner.__init__.__defaults__  # the loss is an argument (None: the plan's)
