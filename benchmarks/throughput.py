"""llmcustoms against what users write by hand: throughput, memory and eval loss.

    python benchmarks/throughput.py --data ../shared/data/code_alpaca_2k.json [--rows 512] [--json] [--device cpu|cuda]

Builds a small Llama-architecture model and a BPE tokenizer trained on the data
itself, locally (no download), then trains the same rows for one epoch, with
the same LoRA config (r=16 on every linear layer), effective batch, sequence
cap, learning rate and seed, using:

  trainer_pad_max   transformers.Trainer + PEFT, every row padded to the cap
  trainer_dynamic   Trainer + PEFT, each batch padded to its longest row
  trl_sft           TRL SFTTrainer with its documented defaults (TRL is a
                    benchmark-only dependency: pip install trl)
  llmcustoms        llmcustoms' FineTuner

Each system runs in its own process. Reported for each: real (non-padding)
training tokens per second, peak memory during training, and eval loss (mean
per response token, one shared evaluator) on the same held-out rows after the
same training tokens. With --json the last line is
{"llmcustoms": {...}, "baselines": {NAME: {...}}, ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SYSTEMS = ("trainer_pad_max", "trainer_dynamic", "trl_sft", "llmcustoms")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# lr 1e-3: high enough that a few dozen steps visibly move the eval loss.
SETTINGS = {"micro_batch": 4, "grad_accum": 4, "lr": 1e-3, "max_len": 512, "rank": 16, "alpha": 32, "seed": 42,
            "eval_rows": 64}


# ------------------------------------------------------------------ set-up

def build_assets(data: Path, workdir: Path, rows: int, device: str) -> dict:
    """Tokenizer + model + the rows every system trains and evaluates on."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from llmcustoms.data import usable_examples
    from llmcustoms.splits import split_eval

    examples = list(usable_examples(data))  # bad rows skipped
    train_idx, eval_idx = split_eval(len(examples), SETTINGS["eval_rows"] / len(examples), SETTINGS["seed"])
    train = [examples[i] for i in train_idx][:rows]
    evaluation = [examples[i] for i in eval_idx][:SETTINGS["eval_rows"]]

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    special = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend.train_from_iterator([m.content for e in examples for m in e.messages],
                                trainers.BpeTrainer(vocab_size=8000, special_tokens=special, show_progress=False,
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        unk_token="<unk>")
    tokenizer.chat_template = CHATML
    model_dir = workdir / "model"
    tokenizer.save_pretrained(model_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                         # A random model's frozen head with the default 0.02 barely moves its logits,
                         # so no adapter could learn; 0.1 lets the eval loss compare something.
                         initializer_range=0.1)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    rows_file = workdir / "rows.json"
    pairs = lambda rows: [[[m.role, m.content] for m in e.messages] for e in rows]  # noqa: E731
    rows_file.write_text(json.dumps({"train": pairs(train), "eval": pairs(evaluation)}))
    return {"model": str(model_dir), "rows": str(rows_file), "device": device}


def load_rows(assets: dict) -> tuple[list, list, object]:
    """The same token ids and labels for every system (llmcustoms' own masking)."""
    from transformers import AutoTokenizer

    from llmcustoms.rowformats import Example
    from llmcustoms.tokenization import Tokenizer, truncate

    hf = AutoTokenizer.from_pretrained(assets["model"])
    encoder = Tokenizer(hf)
    raw = json.loads(Path(assets["rows"]).read_text())
    encode = lambda rows: truncate([encoder.encode(Example(i, messages=tuple(map(tuple, m)))) for i, m in enumerate(rows)],
                                   SETTINGS["max_len"]).examples  # noqa: E731
    return encode(raw["train"]), encode(raw["eval"]), hf


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=SETTINGS["rank"], lora_alpha=SETTINGS["alpha"], lora_dropout=0.0, target_modules=TARGETS,
                      task_type="CAUSAL_LM")


def _rss(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def eval_loss(model, rows: list, pad_id: int) -> float:
    """The shared evaluator: mean loss per response token over the held-out rows."""
    import torch

    from llmcustoms.batching import collate, count_loss_tokens

    model.eval()
    total = sum(count_loss_tokens(collate([r], pad_id)["labels"]) for r in rows)
    loss = 0.0
    with torch.no_grad():
        for start in range(0, len(rows), 8):
            batch = {k: v.to(model.device) for k, v in collate(rows[start:start + 8], pad_id).items()}
            loss += float(model(**batch, num_items_in_batch=torch.tensor(total)).loss)
    return loss


# ---------------------------------------------------------------- systems

def run_trainer(assets: dict, pad_to_max: bool) -> dict:
    import torch
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments, default_data_collator

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
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32), lora_config())
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=SETTINGS["micro_batch"],
                             gradient_accumulation_steps=SETTINGS["grad_accum"], learning_rate=SETTINGS["lr"],
                             num_train_epochs=1, lr_scheduler_type="cosine", warmup_steps=0, logging_steps=10,
                             save_strategy="no", report_to="none", seed=SETTINGS["seed"], use_cpu=assets["device"] == "cpu",
                             dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    return _timed(lambda: trainer.train(), model, train, evaluation, tokenizer, before)


def run_trl(assets: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    train, evaluation, tokenizer = load_rows(assets)
    raw = json.loads(Path(assets["rows"]).read_text())["train"]
    # Conversational prompt/completion: TRL's documented way to learn on the reply only.
    dataset = Dataset.from_list([{"prompt": [{"role": r, "content": c} for r, c in m[:-1]],
                                  "completion": [{"role": m[-1][0], "content": m[-1][1]}]} for m in raw])
    before = _rss("VmRSS")
    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    config = SFTConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=SETTINGS["micro_batch"],
                       gradient_accumulation_steps=SETTINGS["grad_accum"], learning_rate=SETTINGS["lr"],
                       num_train_epochs=1, lr_scheduler_type="cosine", warmup_steps=0, logging_steps=10,
                       save_strategy="no", report_to="none", seed=SETTINGS["seed"], max_length=SETTINGS["max_len"],
                       use_cpu=assets["device"] == "cpu", disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=lora_config())
    tokens = sum(len(ids) for ids in trainer.train_dataset["input_ids"])
    result = _timed(lambda: trainer.train(), trainer.model, train, evaluation, tokenizer, before)
    result["train_tokens"] = tokens  # TRL tokenizes on its own; count what it trained on
    result["tokens_per_s"] = tokens / result["seconds"]
    return result


def run_llmcustoms(assets: dict) -> dict:
    from llmcustoms.reporting import SilentReporter
    from llmcustoms.finetuner import FineTuner
    from llmcustoms.plan import LoraSettings, Plan
    from llmcustoms.planning import steps_per_epoch
    from llmcustoms.rundir import RunDirectory

    train, evaluation, tokenizer = load_rows(assets)
    steps = steps_per_epoch(len(train), SETTINGS["micro_batch"], SETTINGS["grad_accum"])
    plan = Plan(model=assets["model"], family="tinyllama", model_type="llama", preset="quality", method="lora",
                micro_batch_size=SETTINGS["micro_batch"], grad_accum=SETTINGS["grad_accum"],
                effective_batch_size=SETTINGS["micro_batch"] * SETTINGS["grad_accum"], max_seq_len=SETTINGS["max_len"],
                gradient_checkpointing=False, mixed_precision="bf16" if assets["device"] == "cuda" else "no",
                lr=SETTINGS["lr"], lr_scheduler="cosine", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                epochs=1.0, steps_per_epoch=steps, total_steps=steps, eval_every=0, early_stopping_patience=0,
                save_every=steps + 1, keep_checkpoints=1, seed=SETTINGS["seed"], train_on_prompt=False,
                trust_remote_code=False, train_rows=len(train), eval_rows=0,
                lora=LoraSettings(SETTINGS["rank"], SETTINGS["alpha"], 0.0, tuple(TARGETS)))
    run = RunDirectory(Path(tempfile.mkdtemp()) / "run")
    run.create()
    tuner = FineTuner(plan, tokenizer, train, [], run, SilentReporter(), save_artifacts=False)
    before = _rss("VmRSS")
    return _timed(lambda: tuner.run(), lambda: tuner.accelerator.unwrap_model(tuner.model), train, evaluation,
                  tokenizer, before, setup=lambda: (tuner._setup_processes(), tuner._setup_training()))


def _timed(train_fn, model, train: list, evaluation: list, tokenizer, rss_before: int, setup=None) -> dict:
    import torch

    if setup is not None:
        setup()  # model loading is not training time
    Path("/proc/self/clear_refs").write_text("5")
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    train_fn()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else _rss("VmHWM") - rss_before
    trained = model() if callable(model) and not hasattr(model, "forward") else model
    tokens = sum(len(e.input_ids) for e in train)
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "train_tokens": tokens, "peak_mem_bytes": peak,
            "eval_loss": eval_loss(trained, evaluation, tokenizer.pad_token_id)}


# ------------------------------------------------------------------- main

def child(name: str, assets: dict) -> dict:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    if name == "trainer_pad_max":
        return run_trainer(assets, pad_to_max=True)
    if name == "trainer_dynamic":
        return run_trainer(assets, pad_to_max=False)
    if name == "trl_sft":
        return run_trl(assets)
    return run_llmcustoms(assets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "code_alpaca_2k.json")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", choices=SYSTEMS, action="append", help="run only these systems")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--assets", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, json.loads(args.assets))), flush=True)
        return
    workdir = Path(tempfile.mkdtemp(prefix="llmcustoms-bench-"))
    assets = build_assets(args.data, workdir, args.rows, args.device)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0") if args.device == "cuda" else ""}
    results = {}
    for name in args.only or SYSTEMS:
        out = subprocess.run([sys.executable, __file__, "--child", name, "--assets", json.dumps(assets)],
                             capture_output=True, text=True, env=env)
        line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(f"{name} failed:\n{out.stderr[-3000:]}", file=sys.stderr)
            continue
        results[name] = json.loads(line[len("RESULT "):])
        if not args.json:
            r = results[name]
            print(f"{name:16} {r['tokens_per_s']:9,.0f} tokens/s  {r['seconds']:7.1f} s  peak {r['peak_mem_bytes'] / 2**20:7.0f} MiB"
                  f"  eval loss {r['eval_loss']:.4f}", flush=True)
    baselines = {k: v for k, v in results.items() if k != "llmcustoms"}
    summary = {"llmcustoms": results.get("llmcustoms"), "baselines": baselines, "device": args.device,
               "rows": args.rows, "settings": SETTINGS}
    if results.get("llmcustoms") and baselines:
        fastest = max(baselines, key=lambda k: baselines[k]["tokens_per_s"])
        ours = results["llmcustoms"]
        summary["fastest_baseline"] = fastest
        summary["speedup_vs_fastest"] = ours["tokens_per_s"] / baselines[fastest]["tokens_per_s"]
        summary["eval_loss_vs_fastest"] = ours["eval_loss"] / baselines[fastest]["eval_loss"]
        if not args.json:
            print(f"llmcustoms vs fastest baseline ({fastest}): {summary['speedup_vs_fastest']:.2f}x tokens/s, "
                  f"eval loss ratio {summary['eval_loss_vs_fastest']:.3f}")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
