"""`llmcustoms export RUN --output DIR --format gguf [--quant q8_0]`: the
trained model as model.gguf, for Ollama, llama.cpp and LM Studio, with an
Ollama Modelfile beside it, and both checked against the trained model.

The stages, each shown with its time: the model is loaded and merged
(`merging.load_merged`, never into 4-bit weights), written
(`models/gguf_writing.py`), given a Modelfile (`models/modelfile.py`), and
unless --no-verify read back and compared (`models/gguf_check.py`). Then:

    ollama create my-model -f DIR/Modelfile
    ollama run my-model
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcustoms.commands.merging import MergedModel, load_merged, system_prompt
from llmcustoms.data import stop_tokens
from llmcustoms.data.chat_templates import starts_with_bos
from llmcustoms.errors import ConfigError
from llmcustoms.models import loading, modelfile
from llmcustoms.models.generation import Waiting
from llmcustoms.models.gguf_check import check_gguf, cost_note, expected_metadata
from llmcustoms.models.gguf_vocab import tokens_past_rows
from llmcustoms.models.gguf_writing import QUANTS, check_exportable, write_gguf
from llmcustoms.models.llama_cpp_run import llama_cpp_check
from llmcustoms.models.loading import Allowed
from llmcustoms.recovery import faults
from llmcustoms.runs.run_directory import RunDirectory
from llmcustoms.runs.run_weights import model_name
from llmcustoms.training.preflight import check_export_space
from llmcustoms.ui.train_progress import counting

GGUF_NAME = "model.gguf"
# Bytes per weight of each quantization, for the disk check before writing (q8_0: 34 bytes per block
# of 32, q4_0: 18; the embedding and output matrices of q4_0 stay q8_0, so it is counted a little high).
BYTES_PER_WEIGHT = {"f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 0.75}


@dataclass(frozen=True)
class GgufOptions:
    quant: str = "q8_0"
    verify: bool = True


def check_gguf_options(options: GgufOptions) -> None:
    if options.quant not in QUANTS:
        raise ConfigError(f"Unknown --quant {options.quant}.",
                          f"Use one of {', '.join(QUANTS)} (q8_0, the default, is half the size of f16 and answers "
                          "nearly always the same).")


def write_small_file(path: Path, text: str) -> None:
    """One of the export's small files (the Modelfile, README.md), written after
    the space check counted only the weights: a full disk can still stop it
    (`diskfull_export` makes it so, for tests)."""
    faults.fail_export_write_if_due(path)
    path.write_text(text)


def check_vocabulary(plan: Any, trained: Path, allowed: Allowed) -> None:
    """Before anything loads or is written (a merge takes minutes): a tokenizer
    whose tokens past the model's embedding rows the GGUF cannot leave out is
    refused (`gguf_vocab.tokens_past_rows`), read off the tokenizer and config alone."""
    from transformers import AutoTokenizer


    trust = plan.trust_remote_code and allowed.remote_code
    tokenizer = loading.from_pretrained(AutoTokenizer, str(trained), trust_remote_code=trust)
    config = loading.load_config(str(trained) if plan.method == "full" else plan.model, trust)
    end_of_turn = stop_tokens.end_of_turn(tokenizer, templated=bool(tokenizer.chat_template)).token_id
    tokens_past_rows(tokenizer, config.vocab_size, end_of_turn)


def write_gguf_export(run: RunDirectory, plan: Any, trained: Path, partial: Path, dtype: str, options: GgufOptions,
                      waiting: Waiting, allowed: Allowed) -> tuple[tuple[str, ...], str | None]:
    """Write model.gguf and the Modelfile into `partial`; what the checks found
    (a line each) and, when one failed, why."""
    with waiting(f"Merging the adapter into {model_name(plan.model)}" if plan.method != "full"
                 else f"Loading the trained {model_name(plan.model)}") as say:
        merged = load_merged(plan, run.path, trained, dtype, say, allowed)
    architecture = check_exportable(merged.model.config)
    pieces, stops, end_of_turn = _chat_shape(merged)
    modelfile_text = modelfile.modelfile(GGUF_NAME, pieces, stops, system_prompt(plan, run.path))  # refused before the writing
    rows = merged.model.config.vocab_size
    past = tokens_past_rows(merged.tokenizer, rows, end_of_turn)
    weights = sum(p.numel() for p in merged.model.parameters())
    check_export_space(partial, int(weights * BYTES_PER_WEIGHT[options.quant]) + 8 * 2**20, "the GGUF file",
                       options.quant)
    path = partial / GGUF_NAME
    with waiting(f"Writing {GGUF_NAME} ({options.quant})") as say:
        written = write_gguf(merged.model, merged.tokenizer, path, options.quant, _general_name(run.path.name),
                             end_of_turn, counting(say, f"Writing {GGUF_NAME}: tensor"))
    write_small_file(partial / "Modelfile", modelfile_text)
    lines = [f"{GGUF_NAME}: {written.bytes / 2**20:.1f} MiB, {written.architecture}, {written.tensors} tensors, "
             f"{options.quant}",
             "Modelfile: " + ("TEMPLATE matches the run's chat template on every probe conversation"
                              if pieces else "no TEMPLATE (Ollama reads the chat template stored in the GGUF)")
             + f"; stops at {', '.join(stops)}"]
    if past:
        lines.append(f"tokenizer: {len(past)} token{'s' * (len(past) > 1)} past the model's {rows} embedding rows "
                     f"left out (id {', '.join(map(str, past[:3]))}{', ...' * (len(past) > 3)}): the model has no "
                     f"weights for {'them' if len(past) > 1 else 'it'}")
    if merged.replies_equal is not None:
        lines.append(f"merged model's greedy replies equal the adapter's for {merged.replies_equal}/"
                     f"{len(merged.prompts)} check prompts")
    if not options.verify:
        return tuple(lines + ["not verified (--no-verify)"]), None
    stop_ids = sorted({merged.tokenizer.eos_token_id} | ({end_of_turn} if end_of_turn is not None else set()))
    with waiting(f"Checking {GGUF_NAME} against the trained model") as say:
        say(f"Reading {GGUF_NAME} back with transformers")
        stages = {"tensors": counting(say, f"Reading {GGUF_NAME} back with transformers: tensor"),
                  "prompts": counting(say, "Answering the check prompts")}
        check = check_gguf(path, merged.model, merged.tokenizer, options.quant,
                           expected_metadata(merged.model, merged.tokenizer, architecture, end_of_turn),
                           merged.prompts, stop_ids, lambda stage, done, total: stages[stage](done, total))
        say(f"Running {GGUF_NAME} in llama.cpp")
        in_llama_cpp = llama_cpp_check(path, merged.tokenizer, merged.prompts, check.stopped)
    lines.append("check: " + check.summary())
    if cost_note(check):
        lines.append(cost_note(check))
    lines.append(in_llama_cpp.removeprefix("failed: ") if in_llama_cpp
                 else "llama.cpp: not installed (pip install 'llmcustoms[llama-cpp]' runs the file in it too)")
    problems = check.problems + ([in_llama_cpp.removeprefix("failed: ")]
                                 if in_llama_cpp and in_llama_cpp.startswith("failed:") else [])
    return tuple(lines), ("; ".join(problems) if problems else None)


def _chat_shape(merged: MergedModel) -> tuple[modelfile.Pieces | None, list[str], int | None]:
    """The template's pieces for the Modelfile (None when Go cannot mirror it),
    the tokens a reply stops at, and the end-of-turn token's id."""
    tokenizer = merged.tokenizer

    def render(messages: list[dict[str, str]], generation: bool) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

    bos = tokenizer.bos_token if starts_with_bos(tokenizer) else None
    pieces = modelfile.template_pieces(render, bos) if tokenizer.chat_template else None
    if pieces is not None and modelfile.mismatches(pieces, render, bos):
        pieces = None
    end_of_turn = stop_tokens.end_of_turn(tokenizer, templated=bool(tokenizer.chat_template)).token_id
    stops = [tokenizer.convert_ids_to_tokens(i) for i in dict.fromkeys([end_of_turn, tokenizer.eos_token_id])
             if i is not None]
    return pieces, stops, end_of_turn


def _general_name(name: str) -> str:
    # transformers' GGUF reader takes a llama file named exactly "mistral" for a Mistral model.
    return f"{name} (llmcustoms)" if name.lower() == "mistral" else name
