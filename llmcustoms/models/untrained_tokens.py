"""Whether the base model ever learned the tokens a reply ends with.

Some base models never saw their own chat tokens in pretraining: Llama 3
base's <|eot_id|> is the known case. Such a token's row of the input
embeddings (and of the output layer, when it is not tied to them) was never
updated: it is near zero, or the same as the rows of every other token never
trained on. A reply has to end with it; LoRA does not train those rows, and
the model may never learn to stop.

`check_stop_tokens` looks, once per run, as the model is loaded for training
(`training/finetuner.py`, before sharding splits the rows): one pass over each
matrix, a block of rows at a time. The end-of-turn token (`data/stop_tokens.py`)
and EOS are checked; the padding token only where it is one of them (pad =
EOS, as many tokenizers set it): padding itself is masked out of the loss and
the attention, so an untrained row costs nothing there. What it finds is a
warning in the live output and train.log, and goes to status.json
(`stop_tokens`: the end-of-turn token and the warnings), which `report` shows.
"""

from __future__ import annotations

from typing import Any, Callable

from llmcustoms.data.chat_templates import prompts_use_template
from llmcustoms.data.stop_tokens import EndOfTurn, end_of_turn
from llmcustoms.runs.run_directory import RunDirectory

# A row whose norm is under this share of the median row's is near zero.
NEAR_ZERO = 0.02
# Two rows closer than this share of the median row's norm are the same row...
SAME = 1e-3
# ...and a row the same as this many others' is one of a block never trained.
MANY = 3
# Rows of the matrix converted to float32 at a time.
BLOCK_ROWS = 8192


def untrained_rows(matrix: Any, ids: list[int]) -> dict[int, str]:
    """Of `ids`, those whose row of `matrix` (vocabulary x hidden) looks untrained, and why."""
    import torch

    if not ids:
        return {}
    with torch.no_grad():
        rows = matrix[ids].float()
        norms, distances = [], []
        for start in range(0, matrix.shape[0], BLOCK_ROWS):
            block = matrix[start:start + BLOCK_ROWS].float()
            norms.append(block.norm(dim=1))
            distances.append(torch.stack([(block - row).norm(dim=1) for row in rows], dim=1))
        norm, distance = torch.cat(norms), torch.cat(distances)
        typical = float(norm.median())
    found = {}
    for k, token in enumerate(ids):
        if typical <= 0:
            break  # an all-zero matrix: nothing to compare with
        share = float(norm[token]) / typical
        same = int((distance[:, k] <= SAME * typical).sum()) - 1  # itself left out
        if share < NEAR_ZERO:
            found[token] = f"near zero ({share:.1%} of a typical token's)"
        elif same >= MANY:
            found[token] = f"the same as {same:,} other tokens' (as every token never trained on is)"
    return found


def stop_token_warnings(model: Any, tokenizer: Any, plan: Any) -> tuple[EndOfTurn, list[str]]:
    """The end-of-turn token of the plan's rows, and a warning for each stop token
    whose embedding (or output row, if untied) looks untrained."""
    end = end_of_turn(tokenizer, prompts_use_template(tokenizer, plan.data_format, plan.raw_prompts))
    roles = {end.token_id: "end-of-turn token", tokenizer.eos_token_id: "EOS token"}
    if end.token_id == tokenizer.eos_token_id:
        roles[end.token_id] = "end-of-turn token (EOS)"
    inputs = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    outputs = output.weight if output is not None else None
    ids = [token for token in roles if token is not None and 0 <= token < inputs.shape[0]]
    where = {token: [f"its input embedding is {why}"] for token, why in untrained_rows(inputs, ids).items()}
    # Untied only (tied, it is the same matrix); a 4-bit layer has no rows to read.
    if (outputs is not None and outputs.ndim == 2 and outputs.is_floating_point()
            and outputs.data_ptr() != inputs.data_ptr() and outputs.shape[0] == inputs.shape[0]):
        for token, why in untrained_rows(outputs, ids).items():
            where.setdefault(token, []).append(f"its output row is {why}")
    return end, [_warning(roles[token], str(tokenizer.convert_ids_to_tokens(token)), found, plan.method)
                 for token, found in where.items()]


def _warning(role: str, name: str, found: list[str], method: str) -> str:
    todo = ("--method full trains that row, but from nothing: check that the trained model stops (`llmcustoms "
            "report` shows the stop rate of the sample replies), or start from the model's instruct version"
            if method == "full" else
            f"{method.upper() if method == 'qlora' else 'LoRA'} does not train the embeddings: start from the model's "
            "instruct version (which has learned it), train the embeddings too with --method full, or give the model "
            "a chat template whose end token it has learned (chat_template in a local copy, then --model DIR)")
    return (f"The base model's {role} {name} looks untrained: {'; '.join(found)}. Every reply has to end with it, "
            f"and a model that never learned it may never stop. {todo}.")


def check_stop_tokens(model: Any, tokenizer: Any, plan: Any, run_dir: RunDirectory, warn: Callable[[str], None]) -> None:
    """Warn about untrained stop tokens, and record the end-of-turn token and the
    warnings in status.json; once per run (a resumed run found them already),
    from the process that writes the run directory."""
    if not run_dir.writable or getattr(tokenizer, "eos_token_id", None) is None:
        return  # a tokenizer with no EOS (a benchmark's stand-in) ends replies with nothing to check
    status = run_dir.read_status()
    if "stop_tokens" in status:
        return
    end, warnings = stop_token_warnings(model, tokenizer, plan)
    for text in warnings:
        warn(text)
    run_dir.write_status(status.get("status", "running"), stop_tokens={"end_of_turn": end.name, "untrained": warnings})
