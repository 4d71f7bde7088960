"""llmcustoms against what users write by hand: throughput, memory and eval loss.

    python benchmarks/throughput.py [--model DIR | --toy] [--data FILE] [--rows 256] [--json] [--device cpu|cuda]

Trains the same rows of the data for one epoch, with the same LoRA config
(r=16 on every linear layer, dropout 0), effective batch, sequence cap,
learning rate and seed, using:

  trainer_pad_max   transformers.Trainer + PEFT, every row padded to the cap (--toy only, unless --only)
  trainer_dynamic   Trainer + PEFT, each batch padded to its longest row: what users write (fp32 on a CPU)
  trainer_grouped   the same with group_by_length=True (batches of rows of similar length)
  trainer_bf16      Trainer + PEFT, per-batch padding, bf16=True: the stronger by-hand baseline, where the device has bf16
  trainer_grouped_bf16  both: the strongest Trainer set-up here
  trl_sft           TRL SFTTrainer with its documented defaults (TRL is a
                    benchmark-only dependency: pip install trl)
  llmcustoms        llmcustoms' FineTuner, with the precision its planner picks for this machine

The model is a real one: --model DIR, by default SmolLM2-135M-Instruct built (once,
offline) by ../shared/tools/make_real_model.py into ~/.cache/llmcustoms-dev/. --toy
instead builds a small random Llama-architecture model and a BPE tokenizer trained on
the data (the README's footnote row).

Each system runs in its own process. Reported for each: real (non-padding)
training tokens per second, peak memory during training, and eval loss on the
same held-out rows after the same training tokens. The eval loss comes from one
shared evaluator: each system's trained LoRA weights are put on a fresh fp32
copy of the model and scored the same way (mean loss per response token), so
a system's precision cannot flatter its own number. With --json the last line
is {"llmcustoms": {...}, "baselines": {NAME: {...}}, ...}.
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

SYSTEMS = ("trainer_pad_max", "trainer_dynamic", "trainer_grouped", "trainer_bf16", "trainer_grouped_bf16", "trl_sft",
           "llmcustoms")
REAL_MODEL = Path.home() / ".cache" / "llmcustoms-dev" / "smollm2-135m-instruct"
MAKE_REAL_MODEL = ROOT.parent / "shared" / "tools" / "make_real_model.py"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# lr 1e-3: high enough that a few dozen steps visibly move the eval loss.
SETTINGS = {"micro_batch": 4, "grad_accum": 4, "lr": 1e-3, "max_len": 512, "rank": 16, "alpha": 32, "seed": 42,
            "eval_rows": 64}


# ------------------------------------------------------------------ set-up

def real_model(given: Path | None) -> Path:
    """The model directory to benchmark: the one given, or SmolLM2 built by the shared script."""
    if given is not None:
        return given
    if not (REAL_MODEL / "config.json").exists():
        print(f"building {REAL_MODEL.name} with {MAKE_REAL_MODEL} (once, 1-5 min)", file=sys.stderr)
        subprocess.run([sys.executable, str(MAKE_REAL_MODEL), str(REAL_MODEL)], check=True)
    return REAL_MODEL


def build_assets(data: Path, workdir: Path, rows: int, device: str, model: Path | None) -> dict:
    """Model + the rows every system trains and evaluates on; `model` None: a toy model built here."""
    from llmcustoms.data import usable_examples
    from llmcustoms.splits import split_eval

    examples = list(usable_examples(data))  # bad rows skipped
    train_idx, eval_idx = split_eval(len(examples), SETTINGS["eval_rows"] / len(examples), SETTINGS["seed"])
    train = [examples[i] for i in train_idx][:rows]
    evaluation = [examples[i] for i in eval_idx][:SETTINGS["eval_rows"]]
    model_dir = model if model is not None else build_toy_model(examples, workdir)
    rows_file = workdir / "rows.json"
    pairs = lambda rows: [[[m.role, m.content] for m in e.messages] for e in rows]  # noqa: E731
    rows_file.write_text(json.dumps({"train": pairs(train), "eval": pairs(evaluation)}))
    return {"model": str(model_dir), "rows": str(rows_file), "device": device}


def build_toy_model(examples: list, workdir: Path) -> Path:
    """A 4-layer random Llama and a BPE tokenizer trained on the data (no download)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
    return model_dir


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


def eval_loss(trained, assets: dict, rows: list, pad_id: int) -> float:
    """The shared evaluator: `trained`'s LoRA weights on a fresh fp32 copy of the model,
    mean loss per response token over the held-out rows, without autocast."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from llmcustoms.batching import collate, count_loss_tokens

    lora = {k: v.detach().float().cpu() for k, v in trained.state_dict().items() if "lora_" in k}
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32), lora_config())
    missing = [k for k in model.state_dict() if "lora_" in k and k not in lora]
    assert lora and not missing, f"trained LoRA weights not found: {missing[:3]}"
    model.load_state_dict(lora, strict=False)
    model.to("cuda" if assets["device"] == "cuda" else "cpu")
    model.eval()
    total = sum(count_loss_tokens(collate([r], pad_id)["labels"]) for r in rows)
    loss = 0.0
    with torch.no_grad():
        for start in range(0, len(rows), 8):
            batch = {k: v.to(model.device) for k, v in collate(rows[start:start + 8], pad_id).items()}
            loss += float(model(**batch, num_items_in_batch=torch.tensor(total)).loss)
    return loss


# ---------------------------------------------------------------- systems

def run_trainer(assets: dict, pad_to_max: bool, bf16: bool = False, grouped: bool = False) -> dict:
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
                             dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False, bf16=bf16,
                             train_sampling_strategy="group_by_length" if grouped else "random")
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    return _timed(lambda: trainer.train(), model, assets, train, evaluation, tokenizer, before)


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
    result = _timed(lambda: trainer.train(), trainer.model, assets, train, evaluation, tokenizer, before)
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
                gradient_checkpointing=False, mixed_precision=assets["llmcustoms_precision"],
                lr=SETTINGS["lr"], lr_scheduler="cosine", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                epochs=1.0, steps_per_epoch=steps, total_steps=steps, eval_every=0, early_stopping_patience=0,
                save_every=steps + 1, keep_checkpoints=1, seed=SETTINGS["seed"], train_on_prompt=False,
                trust_remote_code=False, train_rows=len(train), eval_rows=0,
                lora=LoraSettings(SETTINGS["rank"], SETTINGS["alpha"], 0.0, tuple(TARGETS)))
    run = RunDirectory(Path(tempfile.mkdtemp()) / "run")
    run.create()
    tuner = FineTuner(plan, tokenizer, train, [], run, SilentReporter(), save_artifacts=False)
    before = _rss("VmRSS")
    return _timed(lambda: tuner.run(), lambda: tuner.accelerator.unwrap_model(tuner.model), assets, train, evaluation,
                  tokenizer, before, setup=lambda: (tuner._setup_processes(), tuner._setup_training()))


def _timed(train_fn, model, assets: dict, train: list, evaluation: list, tokenizer, rss_before: int,
           setup=None) -> dict:
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
            "eval_loss": eval_loss(trained, assets, evaluation, tokenizer.pad_token_id)}


# ------------------------------------------------------------------- main

def planned_precision(device: str) -> str:
    """What llmcustoms' planner picks here: bf16 on a GPU or a CPU with native bf16, else fp32 ("no")."""
    if device == "cuda":
        return "bf16"
    from llmcustoms.hardware import detect

    return detect().mixed_precision


def machine() -> dict:
    """What the numbers were measured on, and how busy it was."""
    import platform

    import psutil

    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    field = lambda name: next((l.split(":", 1)[1].strip() for l in info if l.startswith(name)), "")  # noqa: E731
    flags = field("flags")
    return {"cpu": field("model name") or platform.machine(), "cores": psutil.cpu_count(logical=False),
            "ram_gib": round(psutil.virtual_memory().total / 2**30, 1), "load_avg_at_start": os.getloadavg(),
            "cpu_bf16": [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()]}


def child(name: str, assets: dict) -> dict:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    if name == "trainer_pad_max":
        return run_trainer(assets, pad_to_max=True)
    if name == "trainer_dynamic":
        return run_trainer(assets, pad_to_max=False)
    if name == "trainer_grouped":
        return run_trainer(assets, pad_to_max=False, grouped=True)
    if name in ("trainer_bf16", "trainer_grouped_bf16"):
        return run_trainer(assets, pad_to_max=False, bf16=True, grouped=name == "trainer_grouped_bf16")
    if name == "trl_sft":
        return run_trl(assets)
    return run_llmcustoms(assets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "code_alpaca_2k.json")
    parser.add_argument("--model", type=Path, help=f"a model directory (default: {REAL_MODEL}, built if missing)")
    parser.add_argument("--toy", action="store_true", help="a small random model built here instead of a real one")
    parser.add_argument("--rows", type=int, help="training rows (default: 256; 512 with --toy)")
    parser.add_argument("--mixed-precision", choices=["no", "bf16"],
                        help="llmcustoms' precision (default: what its planner picks on this machine)")
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
    rows = args.rows or (512 if args.toy else 256)
    assets = build_assets(args.data, workdir, rows, args.device, None if args.toy else real_model(args.model))
    assets["llmcustoms_precision"] = args.mixed_precision or planned_precision(args.device)
    has_bf16 = assets["llmcustoms_precision"] == "bf16" or args.device == "cuda"
    systems = args.only or [s for s in SYSTEMS if (s != "trainer_pad_max" or args.toy) and ("bf16" not in s or has_bf16)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0") if args.device == "cuda" else ""}
    results = {}
    for name in systems:
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
               "model": assets["model"], "rows": rows, "settings": SETTINGS, "machine": machine(),
               "llmcustoms_precision": assets["llmcustoms_precision"]}
    if results.get("llmcustoms") and baselines:
        fastest = max(baselines, key=lambda k: baselines[k]["tokens_per_s"])
        ours = results["llmcustoms"]
        summary["fastest_baseline"] = fastest
        summary["speedup_vs_fastest"] = ours["tokens_per_s"] / baselines[fastest]["tokens_per_s"]
        summary["eval_loss_vs_fastest"] = ours["eval_loss"] / baselines[fastest]["eval_loss"]
        summary["speedup"] = {name: ours["tokens_per_s"] / b["tokens_per_s"] for name, b in baselines.items()}
        summary["eval_loss_ratio"] = {name: ours["eval_loss"] / b["eval_loss"] for name, b in baselines.items()}
        if not args.json:
            for name in baselines:
                print(f"llmcustoms vs {name}: {summary['speedup'][name]:.2f}x tokens/s, "
                      f"eval loss ratio {summary['eval_loss_ratio'][name]:.4f}")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
