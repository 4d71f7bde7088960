"""The by-hand systems `throughput.py` compares llmcustoms with: transformers'
Trainer + PEFT and TRL's SFTTrainer, each as its docs set it up.

Each runs in a child process of throughput.py; `run(name, assets)` trains and
measures one. `assets["device"]` is cpu or cuda, `assets["method"]` lora or
qlora (every system then loads the base in 4-bit, see common.load_base), and
`assets["bf16"]` whether the device has bf16.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from common import SETTINGS, _rss, load_base, load_rows, lora_config, timed

# Systems that need liger-kernel (installed on the GPU machine only).
NEEDS_LIGER = ("trainer_liger", "trl_liger")
# The strong set-ups: the frozen base in bf16 on a GPU (the adapters stay fp32: PEFT upcasts them).
BF16_BASE = ("trainer_liger", "trl_padding_free", "trl_liger")


def base_dtype(name: str, assets: dict):
    import torch

    return torch.bfloat16 if name in BF16_BASE and assets["device"] == "cuda" else torch.float32


def run(name: str, assets: dict) -> dict:
    if name == "trainer_pad_max":
        return run_trainer(name, assets, pad_to_max=True)
    if name == "trainer_dynamic":
        return run_trainer(name, assets)
    if name == "trainer_grouped":
        return run_trainer(name, assets, grouped=True)
    if name in ("trainer_bf16", "trainer_grouped_bf16"):
        return run_trainer(name, assets, bf16=True, grouped=name == "trainer_grouped_bf16")
    if name == "trainer_liger":
        return run_trainer(name, assets, bf16=True, liger=True)
    if name == "trl_sft":
        return run_trl(assets)
    if name in ("trl_padding_free", "trl_liger"):
        return run_trl_padding_free(name, assets, liger=name == "trl_liger")
    raise ValueError(f"unknown system {name}")


def run_trainer(name: str, assets: dict, pad_to_max: bool = False, bf16: bool = False, grouped: bool = False,
                liger: bool = False) -> dict:
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments, default_data_collator

    train, evaluation, tokenizer = load_rows(assets)
    cap = SETTINGS["max_len"]

    def record(e):
        if not pad_to_max:
            return {"input_ids": e.input_ids, "attention_mask": [1] * len(e.input_ids), "labels": e.labels}
        pad = cap - len(e.input_ids)
        return {"input_ids": e.input_ids + [tokenizer.pad_token_id] * pad,
                "attention_mask": [1] * len(e.input_ids) + [0] * pad, "labels": e.labels + [-100] * pad}

    dataset = Dataset.from_list([record(e) for e in train])
    collator = default_data_collator if pad_to_max else DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    before = _rss("VmRSS")
    model = get_peft_model(load_base(assets, base_dtype(name, assets)), lora_config())
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=SETTINGS["micro_batch"],
                             gradient_accumulation_steps=SETTINGS["grad_accum"], learning_rate=SETTINGS["lr"],
                             num_train_epochs=1, lr_scheduler_type="cosine", warmup_steps=0, logging_steps=10,
                             save_strategy="no", report_to="none", seed=SETTINGS["seed"], use_cpu=assets["device"] == "cpu",
                             dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False, bf16=bf16,
                             train_sampling_strategy="group_by_length" if grouped else "random",
                             use_liger_kernel=liger)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    return timed(lambda: trainer.train(), model, assets, train, evaluation, tokenizer, before)


def _sft_config(assets: dict, **changes):
    from trl import SFTConfig

    return SFTConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=SETTINGS["micro_batch"],
                     gradient_accumulation_steps=SETTINGS["grad_accum"], learning_rate=SETTINGS["lr"],
                     num_train_epochs=1, lr_scheduler_type="cosine", warmup_steps=0, logging_steps=10,
                     save_strategy="no", report_to="none", seed=SETTINGS["seed"], use_cpu=assets["device"] == "cpu",
                     disable_tqdm=True, **changes)


def run_trl(assets: dict) -> dict:
    """SFTTrainer with its documented defaults (fp32 model, bf16 autocast, gradient checkpointing,
    TRL's own tokenization of prompt/completion rows)."""
    import torch
    from datasets import Dataset
    from trl import SFTTrainer

    train, evaluation, tokenizer = load_rows(assets)
    raw = json.loads(Path(assets["rows"]).read_text())["train"]
    # Conversational prompt/completion: TRL's documented way to learn on the reply only.
    dataset = Dataset.from_list([{"prompt": [{"role": r, "content": c} for r, c in m[:-1]],
                                  "completion": [{"role": m[-1][0], "content": m[-1][1]}]} for m in raw])
    before = _rss("VmRSS")
    model = load_base(assets, torch.float32)
    # bf16 is SFTConfig's default already; said outright on a GPU so the run is never fp32 there.
    config = _sft_config(assets, max_length=SETTINGS["max_len"], **({"bf16": True} if assets["device"] == "cuda" else {}))
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=lora_config())
    tokens = sum(len(ids) for ids in trainer.train_dataset["input_ids"])
    result = timed(lambda: trainer.train(), trainer.model, assets, train, evaluation, tokenizer, before)
    result["train_tokens"] = tokens  # TRL tokenizes on its own; count what it trained on
    result["tokens_per_s"] = tokens / result["seconds"]
    return result


def run_trl_padding_free(name: str, assets: dict, liger: bool = False) -> dict:
    """SFTTrainer at its fastest without packing: padding-free batches (the rows of a micro-batch
    joined into one sequence, position_ids marking where each starts: with SDPA transformers
    builds a block mask from them), bf16, no gradient checkpointing, and with `liger` Liger's
    kernels. TRL does not truncate padding-free rows itself, so it is given llmcustoms' token
    ids and labels, already cut to the cap: the same tokens llmcustoms trains on."""
    from datasets import Dataset
    from trl import SFTTrainer

    train, evaluation, tokenizer = load_rows(assets)
    dataset = Dataset.from_list([{"input_ids": e.input_ids, "labels": e.labels} for e in train])
    before = _rss("VmRSS")
    model = load_base(assets, base_dtype(name, assets))
    config = _sft_config(assets, max_length=None, padding_free=True, bf16=assets["bf16"], gradient_checkpointing=False,
                         use_liger_kernel=liger)
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=lora_config())
    return timed(lambda: trainer.train(), trainer.model, assets, train, evaluation, tokenizer, before)
