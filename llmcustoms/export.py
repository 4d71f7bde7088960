"""Take a trained model elsewhere: `llmcustoms export RUN --output DIR [--merge]`.

Without --merge: the PEFT adapter, tokenizer and chat template, and a model
card. With --merge: the base is reloaded in its own saved dtype (or --dtype;
never the 4-bit weights QLoRA trained on, since merging into those loses
quality), the adapter is merged in, and a standalone model is written that
`AutoModelForCausalLM.from_pretrained(DIR)` loads with no peft at all; the
message names the dtype it was written in. Either way nothing is written when
the disk of DIR cannot take it: exit 2 with the sizes (`preflight.py`). A merge
loads the base as this command's flags allow (`modeling.Allowed`): a copy loads
nothing, so it needs no flag.
"""

from __future__ import annotations

import shutil
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcustoms import measures
from llmcustoms.diskspace import TOKENIZER_BYTES
from llmcustoms.errors import ConfigError
from llmcustoms.filemodes import make_readable
from llmcustoms.generation import Say, Waiting
from llmcustoms.modeling import Allowed, adapter_weights, card_base_model, check_weight_files
from llmcustoms.preflight import bytes_under, check_export_space
from llmcustoms.rundir import RunDirectory
from llmcustoms.runweights import model_name, trained_output

DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Exported:
    """What `export_run` wrote, for the line the command prints."""

    path: Path
    what: str  # "the adapter", "the model", or "a merged model (float32 weights)"


def model_card(run: RunDirectory, plan: Any, merged: bool) -> str:
    status = run.read_status()
    base = card_base_model(plan.model)
    lora = (f"LoRA r={plan.lora.r}, alpha={plan.lora.alpha}, dropout={plan.lora.dropout}, "
            f"targets {', '.join(plan.lora.target_modules)}" if plan.lora else "full fine-tuning")
    how = ("```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
           "model = AutoModelForCausalLM.from_pretrained(\"PATH\")\ntokenizer = AutoTokenizer.from_pretrained(\"PATH\")\n```"
           if merged or plan.method == "full" else
           "```python\nfrom peft import PeftModel\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
           f"base = AutoModelForCausalLM.from_pretrained(\"{base}\")\n"
           "model = PeftModel.from_pretrained(base, \"PATH\")\ntokenizer = AutoTokenizer.from_pretrained(\"PATH\")\n```")
    return "\n".join([
        "---", "library_name: " + ("transformers" if merged or plan.method == "full" else "peft"),
        f"base_model: {base}", "tags: [llmcustoms, " + plan.method + "]", "---", "",
        f"# {run.path.name}", "",
        f"Fine-tuned from `{base}` with [llmcustoms](https://pypi.org/project/llmcustoms/) "
        f"({plan.method}{', merged into the base' if merged else ''}).", "",
        "| | |", "|---|---|",
        f"| method | {lora} |", f"| preset | {plan.preset} |",
        f"| data | {Path(plan.data).name} ({plan.data_format or 'unknown format'}), {plan.train_rows} training rows, "
        f"{plan.eval_rows} evaluation rows |",
        f"| training | {status.get('step', 0)} optimizer steps, effective batch {plan.effective_batch_size}, "
        f"lr {plan.lr:.1e} ({plan.lr_scheduler}), {plan.max_seq_len} tokens |",
        f"| final train loss | {status.get('final_loss', float('nan')):.4f} |" if status.get("final_loss") is not None else "",
        *_quality_rows(status),
        "", "## Use", "", how, "",
    ])


def _quality_rows(status: dict[str, Any]) -> list[str]:
    """Eval loss and perplexity, before and after; never the sample replies (they are the user's data)."""
    best, base = status.get("best_eval_loss"), status.get("base_eval_loss")
    rows = []
    if base is not None:
        rows.append(f"| base model eval loss | {base:.4f} (perplexity {measures.perplexity(base):.2f}) |")
    if best is not None:
        rows.append(f"| best eval loss | {best:.4f} (step {status.get('best_eval_step')}); "
                    f"{measures.describe(base, best)} |")
    if status.get("kept"):
        rows.append(f"| weights | {status['kept']} |")
    return rows


def _no_display(what: str) -> Any:
    return nullcontext(lambda text: None)


def export_run(path: Path, output: Path, merge: bool, dtype: str = "auto", overwrite: bool = False,
               waiting: Waiting = _no_display, allowed: Allowed = Allowed()) -> Exported:
    """Write the export of the run at `path`; `waiting` shows the merge (a
    minute or more for real models) as it goes."""
    run = RunDirectory.existing(path)
    plan, trained = trained_output(run)
    if merge and dtype not in DTYPES:  # before anything is deleted
        raise ConfigError(f"Unknown --dtype {dtype}.", f"Use one of {', '.join(DTYPES)}.")
    if merge and plan.method != "full":  # what the merge would refuse to load, refused before anything is deleted
        allowed.check(plan)
        check_weight_files(plan.model, allowed.pickle_weights)
        adapter_weights(trained)
    if output.exists() and any(output.iterdir()):
        if not overwrite:
            raise ConfigError(f"{output} already exists and is not empty.", "Choose another --output, or pass --overwrite.")
        shutil.rmtree(output)
    if not merge or plan.method == "full":
        check_export_space(output, bytes_under(trained), f"a copy of {trained}")
        shutil.copytree(trained, output, dirs_exist_ok=True)
        make_readable(output)  # runs trained before the weights were written readable
        what = "the model" if plan.method == "full" else "the adapter"
    else:
        with waiting(f"Merging the adapter into {model_name(plan.model)}") as say:
            what = f"a merged model ({_merge(plan, trained, output, dtype, say, allowed)} weights)"
    (output / "README.md").write_text(model_card(run, plan, merged=merge and plan.method != "full"))
    return Exported(output, what)


def _merge(plan: Any, adapter: Path, output: Path, dtype: str, say: Say, allowed: Allowed) -> str:
    """Write the merged model; the dtype its weights were written in ("float32").
    `say` hears each stage."""
    from llmcustoms import modeling

    modeling.quiet_libraries()
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say(f"Loading {model_name(plan.model)}")
    # "auto": the dtype the base model was saved in (bf16 for the models in the
    # presets). Never 4-bit, even for a QLoRA run.
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    trust = plan.trust_remote_code and allowed.remote_code
    base = modeling.from_pretrained(AutoModelForCausalLM, plan.model, dtype=torch_dtype, trust_remote_code=trust,
                                     use_safetensors=modeling.safetensors_only(allowed.pickle_weights))
    say("Merging the adapter in")
    merged = PeftModel.from_pretrained(base, adapter_weights(adapter)).merge_and_unload()
    # Before a byte is written: the weights as they will be saved (a tied head once), and the tokenizer.
    weights = sum(p.numel() * p.element_size() for p in merged.parameters())
    check_export_space(output, weights + TOKENIZER_BYTES, "the merged model", str(merged.dtype).removeprefix("torch."))
    say(f"Writing the merged model to {output}")
    merged.save_pretrained(output, safe_serialization=True)
    # With the chat template the run used; trust_remote_code given, else transformers asks on the terminal.
    modeling.from_pretrained(AutoTokenizer, str(adapter), trust_remote_code=trust).save_pretrained(output)
    make_readable(Path(output))
    # What was written, not what was asked for: "auto" is whatever the base was saved in.
    return str(merged.dtype).removeprefix("torch.")
