"""The trained model as one standalone model in memory, for `export --merge`
and `export --format gguf`: the base reloaded in its own saved dtype (or the
one asked for; never the 4-bit weights QLoRA trained on, since merging into
those loses quality) with the adapter merged in; a full fine-tune as it was
saved.

The merge is checked, not trusted: before merging, the adapter model answers
the sample prompts greedily; after, the merged model answers the same prompts,
and the two must agree (`MergedModel.replies_equal`). A merge that changes
what the model says is the peers' most reported export complaint ("the merged
model is worse than the adapter").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from llmcustoms.data.dataset import usable_examples
from llmcustoms.data.prompt_draws import common_system_prompt, pick_prompts
from llmcustoms.models import loading
from llmcustoms.models.loading import Allowed, adapter_weights
from llmcustoms.runs import check_prompts as run_check_prompts
from llmcustoms.runs.run_weights import model_name
from llmcustoms.training.samples import CHECK_PROMPTS
from llmcustoms.ui.train_progress import counting

Say = Callable[[str], None]
CHECK_TOKENS = 32
# Asked when the run's data has no prompt to ask (or cannot be read any more).
GENERAL_PROMPTS = ("What is the capital of France?", "Write one sentence about the sea.",
                   "Explain what a list is in Python.", "What is 12 times 7?")


@dataclass
class MergedModel:
    model: Any
    tokenizer: Any
    dtype: str  # what the weights are in: "bfloat16", "float32"
    prompts: list[list[dict[str, str]]]
    replies_equal: int | None = None  # merged replies equal to the adapter's, of len(prompts); None: no adapter


def check_prompts(plan: Any, run_path: Path) -> list[list[dict[str, str]]]:
    """Prompts to check an export on: those the run drew from its own held-out (else
    training) rows when it started (`runs/check_prompts.py`), or general ones."""
    kept = run_check_prompts.read(run_path)
    drawn = kept[0] if kept is not None else _drawn_from_data(plan)
    return drawn or [[{"role": "user", "content": text}] for text in GENERAL_PROMPTS[:CHECK_PROMPTS]]


def system_prompt(plan: Any, run_path: Path) -> str | None:
    """The system prompt every chat row of the run's training data starts with, if they all share one."""
    kept = run_check_prompts.read(run_path)
    if kept is not None:
        return kept[1]
    try:  # a run from before check_prompts.json: its data file read, if it is still there
        return common_system_prompt(usable_examples(plan.data))
    except Exception:  # noqa: BLE001 - the data is gone: no system prompt to carry
        return None


def _drawn_from_data(plan: Any) -> list[list[dict[str, str]]]:
    """A run from before check_prompts.json: its data file read for them, if it is still there."""
    try:
        examples = list(usable_examples(plan.eval_data or plan.data))
    except Exception:  # noqa: BLE001 - moved, deleted, unreadable: the general prompts do
        return []
    return [list(p.messages) for p in pick_prompts(examples, CHECK_PROMPTS, plan.seed)]


def load_merged(plan: Any, run_path: Path, trained: Path, dtype: str, say: Say, allowed: Allowed) -> MergedModel:
    """The model of the run at `run_path`, merged and checked; `say` hears each stage."""
    loading.quiet_libraries()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trust = plan.trust_remote_code and allowed.remote_code
    # With the chat template the run used; trust_remote_code given, else transformers asks on the terminal.
    tokenizer = loading.from_pretrained(AutoTokenizer, str(trained), trust_remote_code=trust)
    prompts = check_prompts(plan, run_path)
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    if plan.method == "full":
        say(f"Loading the trained {model_name(plan.model)}")
        model = loading.from_pretrained(AutoModelForCausalLM, str(trained), dtype=torch_dtype, trust_remote_code=trust)
        return MergedModel(model.eval(), tokenizer, _dtype_name(model), prompts)
    from peft import PeftModel

    say(f"Loading {model_name(plan.model)}")
    base = loading.from_pretrained(AutoModelForCausalLM, plan.model, dtype=torch_dtype, trust_remote_code=trust,
                                     use_safetensors=loading.safetensors_only(allowed.pickle_weights))
    adapted = PeftModel.from_pretrained(base, adapter_weights(trained)).eval()
    before = answers(adapted, tokenizer, prompts, counting(say, "Answering the check prompts with the adapter"))
    say("Merging the adapter in")
    merged = adapted.merge_and_unload().eval()
    after = answers(merged, tokenizer, prompts, counting(say, "Answering the check prompts with the merged model"))
    return MergedModel(merged, tokenizer, _dtype_name(merged), prompts,
                       replies_equal=sum(a == b for a, b in zip(before, after)))


def answers(model: Any, tokenizer: Any, prompts: list[list[dict[str, str]]],
            told: Callable[[int, int], None]) -> list[list[int]]:
    """The greedy replies to `prompts`, each counted on `told` (done, total): on a
    busy CPU a few seconds each, 40 s for them all with a 135M model."""
    replies: list[list[int]] = []
    told(0, len(prompts))
    for messages in prompts:
        replies.append(greedy(model, tokenizer, messages))
        told(len(replies), len(prompts))
    return replies


def greedy(model: Any, tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The token ids of the greedy reply to `messages`, up to CHECK_TOKENS."""
    import torch

    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    stop = tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=CHECK_TOKENS, do_sample=False, eos_token_id=stop,
                             pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop)
    return out[0, ids.shape[1]:].tolist()


def _dtype_name(model: Any) -> str:
    return str(model.dtype).removeprefix("torch.")

