"""One Unsloth training run for the side by side (`peer_speed.py` starts it in a process of its own).

    PYTHONPATH=UNSLOTH_SITE python benchmarks/unsloth_run.py ASSETS_JSON

It runs in Unsloth's own site (its pins differ from the project's: transformers <= 5.17,
TRL <= 1.15, datasets < 5), so it imports nothing of llmcustoms. Set up as Unsloth's
notebooks do: `FastLanguageModel.from_pretrained` (4-bit for QLoRA), `get_peft_model` with
its gradient checkpointing ("unsloth", unless the assets say "none"), TRL's SFTTrainer,
padding-free batches (Unsloth turns them on itself when `padding_free` is left unset). The
rows are the token ids and labels llmcustoms made, so every system trains on the same
tokens; the labels become TRL's completion mask. On a GPU it refuses Unsloth's CPU
fallback, so a missing GPU is an error and never a slow number. Prints `RESULT {...}`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import step_clock  # noqa: E402  (beside this file)


def main() -> None:
    assets = json.loads(sys.argv[1])
    if assets["device"] == "cuda":
        os.environ["UNSLOTH_DISABLE_CPU_FALLBACK"] = "1"
    import unsloth  # noqa: F401  (first, as Unsloth asks: it patches transformers and TRL)
    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer
    from unsloth import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=assets["model"], max_seq_length=assets["seq_len"], dtype=torch.bfloat16,
        load_in_4bit=assets["method"] == "qlora", local_files_only=True)
    checkpointing = "unsloth" if assets["checkpointing"] == "unsloth" else False
    model = FastLanguageModel.get_peft_model(
        model, r=assets["rank"], lora_alpha=assets["alpha"], lora_dropout=0, target_modules=assets["targets"],
        bias="none", use_gradient_checkpointing=checkpointing, random_state=assets["seed"])
    rows = json.loads(Path(assets["tokens"]).read_text())
    dataset = Dataset.from_list([{"input_ids": r["input_ids"],
                                  "completion_mask": [int(label != -100) for label in r["labels"]]} for r in rows])
    config = SFTConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=assets["micro_batch"],
                       gradient_accumulation_steps=assets["grad_accum"], max_steps=assets["steps"],
                       learning_rate=assets["lr"], lr_scheduler_type="cosine", warmup_steps=0, logging_steps=1,
                       save_strategy="no", report_to="none", seed=assets["seed"], bf16=assets["bf16"],
                       max_length=assets["seq_len"], completion_only_loss=True, optim="adamw_torch",
                       dataloader_num_workers=0, disable_tqdm=True)
    clock = step_clock.clock()
    trainer = SFTTrainer(model=model, train_dataset=dataset, processing_class=tokenizer, args=config,
                         callbacks=[clock])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    result = step_clock.summary(clock.steps, assets["tokens_per_step"], assets["warm_up"])
    result.update(peak_mem_bytes=torch.cuda.max_memory_allocated() if cuda else None,
                  padding_free=bool(getattr(trainer.args, "padding_free", False)),
                  checkpointing=assets["checkpointing"], unsloth=unsloth.__version__,
                  gpu=torch.cuda.get_device_name(0) if cuda else None)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
