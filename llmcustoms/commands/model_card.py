"""The model card (README.md) an export writes beside the weights: what the
model was trained from, how, and how it scores against its base (eval loss,
how many sample replies stopped, and how many general questions it answers,
`runs/forgetting.py`); never the sample replies themselves, which are the
user's data, nor the general questions' replies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmcustoms.models.loading import card_base_model
from llmcustoms.runs import measures
from llmcustoms.runs.forgetting import general_line
from llmcustoms.runs.run_directory import RunDirectory
from llmcustoms.runs.stop_rates import stop_rate_line
from llmcustoms.training.samples import side_by_side


def model_card(run: RunDirectory, plan: Any, merged: bool, gguf: bool = False, chat_template: bool = True) -> str:
    """The card; `chat_template`: whether the exported tokenizer has one (its snippet prompts through it)."""
    status = run.read_status()
    base = card_base_model(plan.model)
    lora = (f"LoRA r={plan.lora.r}, alpha={plan.lora.alpha}, dropout={plan.lora.dropout}, "
            f"targets {', '.join(plan.lora.target_modules)}" if plan.lora else "full fine-tuning")
    how = OLLAMA_USE if gguf else python_use(merged or plan.method == "full", chat_template, base)
    # A Hub id in the card's metadata links the model to its base there; a local folder's name would link nowhere.
    from_hub = "/" in base
    return "\n".join([
        "---", "library_name: " + ("transformers" if merged or plan.method == "full" else "peft"),
        *([f"base_model: {base}"] if from_hub else []),
        "tags: [llmcustoms, " + plan.method + (", gguf" if gguf else "") + "]", "---", "",
        f"# {run.path.name}", "",
        f"Fine-tuned from {'' if from_hub else 'a local model, '}`{base}`, with [llmcustoms](https://pypi.org/project/llmcustoms/) "
        f"({plan.method}{', merged into the base' if merged else ''}).", "",
        "| | |", "|---|---|",
        f"| method | {lora} |", f"| preset | {plan.preset} |",
        f"| data | {Path(plan.data).name} ({plan.data_format or 'unknown format'}), {plan.train_rows} training rows, "
        f"{plan.eval_rows} evaluation rows |",
        f"| training | {status.get('step', 0)} optimizer steps, effective batch {plan.effective_batch_size}, "
        f"lr {plan.lr:.1e} ({plan.lr_scheduler}), {plan.max_seq_len} tokens |",
        f"| final train loss | {status.get('final_loss', float('nan')):.4f} |" if status.get("final_loss") is not None else "",
        *_quality_rows(status),
        *_stop_rows(run),
        *_general_rows(status),
        "", "## Use", "", how, "",
    ])


def python_use(whole: bool, chat_template: bool, base: str) -> str:
    """How to load and prompt the export in Python, as code that runs as written
    from the export's folder (tested by running it): "." is the folder, never a
    name such as the base model's that `from_pretrained` cannot find. An adapter
    loads its base from adapter_config.json, which holds the base as training
    loaded it: a Hub id, or a folder's path on the machine that trained it."""
    if whole:
        load = "from transformers import AutoModelForCausalLM, AutoTokenizer\n\nmodel = AutoModelForCausalLM.from_pretrained(\".\")\n"
        where = "Run from this folder (or put its path in place of `\".\"`)."
    else:
        load = ("from peft import AutoPeftModelForCausalLM\nfrom transformers import AutoTokenizer\n\n"
                "# The base model comes from adapter_config.json's base_model_name_or_path.\n"
                "model = AutoPeftModelForCausalLM.from_pretrained(\".\")\n")
        where = ("Run from this folder (or put its path in place of `\".\"`), with `pip install peft`. The adapter "
                 "loads its base model from `base_model_name_or_path` in adapter_config.json: "
                 + ("its Hub id." if "/" in base else f"the path of `{base}` on the machine that trained it; "
                    "elsewhere, set it to where that model is."))
    prompt = ('inputs = tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True,\n'
              '                                       return_dict=True, return_tensors="pt")\n'
              if chat_template else 'inputs = tokenizer("Hello!", return_tensors="pt")\n')
    return (f"{where}\n\n```python\n{load}tokenizer = AutoTokenizer.from_pretrained(\".\")\n{prompt}"
            "output = model.generate(**inputs, max_new_tokens=64)\n"
            'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))\n```')


def has_chat_template(folder: Path) -> bool:
    """Whether the tokenizer saved in `folder` has a chat template (in its own
    file, as transformers writes it now, or in tokenizer_config.json, as it did)."""
    if (folder / "chat_template.jinja").is_file():
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):  # none, not JSON, not an object
        return False


OLLAMA_USE = ("In Ollama, from this folder:\n\n```bash\nollama create my-model -f Modelfile\nollama run my-model\n```\n\n"
              "In llama.cpp: `llama-cli -m model.gguf -cnv`. In LM Studio: put model.gguf in its models folder.")


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


def _stop_rows(run: RunDirectory) -> list[str]:
    """How many sample replies stopped, before training and after: numbers only, never a prompt or a reply."""
    line = stop_rate_line(side_by_side(run.read_samples()))
    return [f"| replies that stop | {line} (held-out prompts, greedy) |"] if line else []


def _general_rows(status: dict[str, Any]) -> list[str]:
    """How many of llmcustoms' general questions the base and the trained model
    answered right (the forgetting check): numbers only, never a reply."""
    line = general_line(status.get("general_knowledge"))
    return [f"| general questions | {line} answered right (llmcustoms' general questions, greedy) |"] if line else []
