"""The recipes people copy instead of using llmcustoms, for `quality.py --peers`.

    python benchmarks/peer_recipes.py unsloth --model MODEL --train TRAIN.json --out DIR
    python benchmarks/peer_recipes.py trl --model MODEL --train TRAIN.json --out DIR [--seed-index N]
    python benchmarks/peer_recipes.py --show      # each recipe's settings, TRL's defaults as installed

Each trains a LoRA adapter on the training file's rows (read by llmcustoms'
own reader, so every system sees the same conversations) and saves it in
DIR/adapter with DIR/peer.json (the recipe, its settings, steps, wall time).
--seed-index N runs a recipe at its own seed plus N (below): 0, the default, is
the recipe as published, so `quality.py --seeds` repeats each at other seeds.
`quality.py` then scores DIR like an llmcustoms run: the same evaluator on
the same test rows.

  unsloth  The Unsloth notebook recipe (its Llama 3.x / SmolLM2 notebooks),
           written with plain transformers + peft + TRL's SFTTrainer because
           Unsloth itself needs a GPU: LoRA r=16, alpha=16, dropout 0 on every
           attention and MLP projection; micro-batch 2 x accumulation 4; 5
           warmup steps; 60 steps; lr 2e-4, linear; weight decay 0.01; seed
           3407; max_seq_length 2048; the loss on the assistant's tokens only
           (the notebooks' `train_on_responses_only`, redone here: everything
           from each "<|im_start|>assistant\\n" to the next user turn is
           learned); bf16 where the CPU has native bf16. The notebooks'
           `adamw_8bit` is `adamw_torch` here: bitsandbytes' 8-bit Adam is a
           GPU kernel, and 8-bit optimizer states barely move the result.
  trl      `trl sft --use_peft` as it runs: the installed SFTConfig's defaults
           (conversational rows, the loss on every token, lr 2e-5, 3 epochs,
           batch 8, 1024 tokens, gradient checkpointing, linear, no warmup,
           seed 42; `--show` prints them) with TRL's documented LoraConfig:
           r=16, alpha=32, dropout 0.05, all-linear.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.perf_counter()  # the wall time counts the imports, as the CLI's does

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RECIPES = ("unsloth", "trl")
UNSLOTH = {"lora_r": 16, "lora_alpha": 16, "lora_dropout": 0.0,
           "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "warmup_steps": 5, "max_steps": 60,
           "learning_rate": 2e-4, "lr_scheduler_type": "linear", "weight_decay": 0.01, "seed": 3407,
           "max_length": 2048, "optim": "adamw_torch"}
TRL_LORA = {"lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "targets": "all-linear"}
TRL_SHOWN = ("learning_rate", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
             "max_length", "lr_scheduler_type", "warmup_steps", "weight_decay", "seed", "gradient_checkpointing",
             "assistant_only_loss", "packing", "optim", "max_grad_norm")
# Unsloth's notebooks name the two parts of a ChatML conversation that `train_on_responses_only` looks for.
CHATML_PARTS = ("<|im_start|>user\n", "<|im_start|>assistant\n")


def conversations(train: Path) -> list[list[dict]]:
    """The training file's rows as chat messages, read as llmcustoms reads them."""
    from llmcustoms.data.dataset import usable_examples

    return [[{"role": m.role, "content": m.content} for m in example.messages] for example in usable_examples(train)]


def native_bf16() -> bool:
    """Whether bf16 is what the recipe would use here: a GPU, or a CPU with native bf16 math."""
    import torch

    from llmcustoms.planning.hardware import _read_cpuinfo, cpu_bf16

    return torch.cuda.is_available() or bool(cpu_bf16(_read_cpuinfo()))


def responses_only(ids: list[int], instruction: list[int], response: list[int]) -> list[int]:
    """Labels as Unsloth's `train_on_responses_only` makes them: -100 everywhere
    but from the end of each `response` marker to the start of the next
    `instruction` marker (or the end), so each reply and its end-of-turn are learned."""
    labels = [-100] * len(ids)
    at, learning = 0, False
    while at < len(ids):
        if ids[at:at + len(response)] == response:
            at, learning = at + len(response), True
            continue
        if ids[at:at + len(instruction)] == instruction:
            learning = False
        if learning:
            labels[at] = ids[at]
        at += 1
    return labels


def unsloth_rows(tokenizer, rows: list[list[dict]], max_length: int) -> list[dict]:
    if "<|im_start|>" not in (tokenizer.chat_template or ""):
        raise SystemExit("the unsloth recipe here knows ChatML templates only (its notebooks name the parts per template)")
    instruction, response = (tokenizer(part, add_special_tokens=False).input_ids for part in CHATML_PARTS)
    out = []
    for messages in rows:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False).input_ids[:max_length]
        out.append({"input_ids": ids, "labels": responses_only(ids, instruction, response)})
    return out


def lora(settings: dict):
    from peft import LoraConfig

    return LoraConfig(r=settings["lora_r"], lora_alpha=settings["lora_alpha"], lora_dropout=settings["lora_dropout"],
                      target_modules=settings["targets"], bias="none", task_type="CAUSAL_LM")


def sft_config(**settings):
    """An SFTConfig that saves nothing and logs nowhere; everything else as given, or TRL's default."""
    import torch
    from trl import SFTConfig

    return SFTConfig(output_dir=tempfile.mkdtemp(prefix="peer-"), save_strategy="no", report_to="none",
                     disable_tqdm=True, logging_steps=1, use_cpu=not torch.cuda.is_available(), **settings)


def trl_defaults() -> dict:
    """The installed SFTConfig's defaults that shape a run (what `trl sft` uses when not told otherwise)."""
    config = sft_config(bf16=native_bf16())
    return {k: getattr(config, k).value if k in ("lr_scheduler_type", "optim") else getattr(config, k)
            for k in TRL_SHOWN}


def train_unsloth(model_path: str, rows: list[list[dict]], seed_index: int = 0):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset = Dataset.from_list(unsloth_rows(tokenizer, rows, UNSLOTH["max_length"]))
    bf16 = native_bf16()
    settings = {**UNSLOTH, "seed": UNSLOTH["seed"] + seed_index}
    model = AutoModelForCausalLM.from_pretrained(model_path)
    config = sft_config(**{k: v for k, v in settings.items() if not k.startswith("lora") and k != "targets"},
                        bf16=bf16, packing=False)
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=lora(UNSLOTH))
    return trainer, {**settings, "bf16": bf16}


def train_trl(model_path: str, rows: list[list[dict]], seed_index: int = 0):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset = Dataset.from_list([{"messages": messages} for messages in rows])
    settings = {**trl_defaults(), **TRL_LORA}  # before the trainer: a new SFTConfig resets accelerate's state
    settings["seed"] += seed_index  # TRL's default seed (42) at index 0: `trl sft` as it runs
    model = AutoModelForCausalLM.from_pretrained(model_path)
    trainer = SFTTrainer(model=model, args=sft_config(bf16=native_bf16(), seed=settings["seed"]), train_dataset=dataset,
                         processing_class=tokenizer, peft_config=lora(TRL_LORA))
    return trainer, settings


def run(recipe: str, model_path: str, train: Path, out: Path, max_steps: int | None = None,
        seed_index: int = 0) -> dict:
    """Train `recipe` on `train`'s rows at its own seed plus `seed_index`; the adapter
    in out/adapter and out/peer.json. `max_steps` caps the run (tests)."""
    rows = conversations(train)
    trainer, settings = (train_unsloth if recipe == "unsloth" else train_trl)(model_path, rows, seed_index)
    if max_steps is not None:
        trainer.args.max_steps = max_steps
    started = time.perf_counter()
    result = trainer.train()
    training_seconds = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    trainer.model.save_pretrained(str(out / "adapter"))
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    record = {"recipe": recipe, "settings": settings, "steps": trainer.state.global_step, "rows": len(rows),
              "training_seconds": round(training_seconds, 1), "wall_seconds": round(time.perf_counter() - STARTED, 1),
              "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
              "train_loss": result.training_loss}
    (out / "peer.json").write_text(json.dumps(record, indent=2))
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe", nargs="?", choices=RECIPES)
    parser.add_argument("--model")
    parser.add_argument("--train", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--max-steps", type=int, default=None, help="cap the steps (tests)")
    parser.add_argument("--seed-index", type=int, default=0,
                        help="run at the recipe's own seed plus this (0: the recipe as published)")
    parser.add_argument("--show", action="store_true", help="print each recipe's settings and exit")
    args = parser.parse_args()
    if args.show or args.recipe is None:
        print(json.dumps({"unsloth": UNSLOTH, "trl": {**trl_defaults(), **TRL_LORA}}, indent=2))
        return
    if not (args.model and args.train and args.out):
        parser.error("a recipe needs --model, --train and --out")
    print(json.dumps(run(args.recipe, args.model, args.train, args.out, args.max_steps, args.seed_index)))


if __name__ == "__main__":
    main()
