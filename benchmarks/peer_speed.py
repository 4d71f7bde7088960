"""llmcustoms, Unsloth and Trainer + PEFT side by side on one card: tokens/s, peak memory, losses.

    python benchmarks/peer_speed.py --model DIR --method lora|qlora [--device cuda|cpu] [--steps 8]
        [--seq-len 2048] [--tokens-per-step 16384] [--micro-batch 16] [--unsloth-site DIR]
        [--only llmcustoms --only unsloth ...] [--data FILE] [--json]

The GPU kit's part 3 runs it at Qwen3-1.7B's shape (LoRA, bf16) and Llama-3.1-8B's (QLoRA),
random weights at real shapes (`benchmarks/shapes.py`). Every system gets the same token ids
and labels (llmcustoms' own tokenization of the data, each row cut to --seq-len), the same
rows in each optimizer step, as many rows a step as carry --tokens-per-step input tokens on
average, the same LoRA (r=16, alpha 32, every linear layer, dropout 0), learning rate, seed
and optimizer (AdamW), each in a process of its own and each with the batching its docs
recommend:

  llmcustoms         its FineTuner as its planner sets it up on a GPU: packing (a micro-batch
                     is one sequence, varlen attention), bf16, its chunked loss
  unsloth            FastLanguageModel + SFTTrainer as Unsloth's notebooks do, padding-free
                     (Unsloth's own default), its gradient checkpointing ("unsloth")
  unsloth_no_checkpointing  the same without gradient checkpointing (faster, more memory)
  trainer_peft       transformers' Trainer + PEFT, the base in bf16, bf16=True, padding-free
                     batches (DataCollatorWithFlattening: transformers' documented way); for
                     QLoRA, PEFT's prepare_model_for_kbit_training
  llmcustoms_compile llmcustoms with --compile (torch.compile of the model): whether it pays

Unsloth pins other versions than the project (transformers <= 5.17, TRL <= 1.15, datasets < 5),
so it runs from a site of its own (--unsloth-site: the GPU kit installs .gpukit/peers there);
without one it is skipped and said so. Counted the same way for all: tokens/s is non-padding
input tokens over the time in optimizer steps, each step timed with the GPU's queue drained,
after --warm-up steps (2: the first compile and allocate); peak memory is
torch.cuda.max_memory_allocated from the start of training (weights included); losses at
equal steps show the same computation (random weights: not quality). With --json the last
line is {"systems": {NAME: {...}}, "ratios": {...}, ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402  (beside this file: rows, LoRA settings, the 4-bit config)
import model_flops  # noqa: E402
import step_clock  # noqa: E402

SYSTEMS = ("llmcustoms", "unsloth", "unsloth_no_checkpointing", "trainer_peft", "llmcustoms_compile")
DEFAULT_SYSTEMS = ("llmcustoms", "unsloth", "trainer_peft")
UNSLOTH = ("unsloth", "unsloth_no_checkpointing")


def rows_per_step(lengths: list[int], tokens_per_step: int, micro_batch: int) -> tuple[int, int]:
    """(micro-batch, accumulation) so that a step's rows carry at least `tokens_per_step` input
    tokens on average; the micro-batch is `micro_batch` rows, or fewer when that is already enough."""
    mean = sum(lengths) / max(1, len(lengths))
    wanted = max(1, -(-tokens_per_step // max(1, round(mean))))
    micro = min(micro_batch, wanted)
    return micro, -(-wanted // micro)


def assets_for(args, work: Path, batch: tuple[int, int] | None = None) -> dict:
    """The rows every system trains on, written once: chat rows for llmcustoms' shared loader,
    token ids and labels for the others (the same tokens). `batch`: (micro-batch, accumulation)
    as given, else sized from --tokens-per-step."""
    from llmcustoms.data.dataset import usable_examples

    examples = list(usable_examples(args.data))
    rows_file = work / "rows.json"
    rows_file.write_text(json.dumps({"train": [[[m.role, m.content] for m in e.messages] for e in examples],
                                     "eval": []}))
    assets = {"model": str(args.model), "rows": str(rows_file), "device": args.device, "method": args.method}
    common.SETTINGS["max_len"] = args.seq_len
    train, _, _ = common.load_rows(assets)
    micro, accum = batch or rows_per_step([len(e.input_ids) for e in train], args.tokens_per_step, args.micro_batch)
    needed = micro * accum * args.steps
    train = (train * (needed // max(1, len(train)) + 1))[:needed]  # a small file comes round again
    tokens_file = work / "tokens.json"
    tokens_file.write_text(json.dumps([{"input_ids": e.input_ids, "labels": e.labels} for e in train]))
    rows_file.write_text(json.dumps({"train": [[[m.role, m.content] for m in examples[i % len(examples)].messages]
                                               for i in range(needed)], "eval": []}))
    return {**assets, "tokens": str(tokens_file), "seq_len": args.seq_len, "micro_batch": micro, "grad_accum": accum,
            "steps": args.steps, "warm_up": args.warm_up, "lr": common.SETTINGS["lr"], "rank": common.SETTINGS["rank"],
            "alpha": common.SETTINGS["alpha"], "targets": common.TARGETS, "seed": common.SETTINGS["seed"],
            "bf16": args.device == "cuda" or _cpu_bf16(), "rows_trained": needed,
            "tokens_per_step": sum(len(e.input_ids) for e in train) / args.steps,
            "flops_per_token": model_flops.for_model(args.model, [len(e.input_ids) for e in train],
                                                     common.SETTINGS["rank"])}


def _cpu_bf16() -> bool:
    from llmcustoms.planning.hardware import detect

    return detect().mixed_precision == "bf16"


# ------------------------------------------------------------------ the children

def run_llmcustoms(assets: dict, compiled: bool = False) -> dict:
    import torch

    import throughput  # beside this file: the benchmark Plan and the untimed set-up
    from llmcustoms.reporting import SilentReporter
    from llmcustoms.runs.run_directory import RunDirectory
    from llmcustoms.training.finetuner import FineTuner

    common.SETTINGS.update(max_len=assets["seq_len"])
    train, _, tokenizer = common.load_rows(assets)
    overrides = {"packing": True, "max_seq_len": assets["seq_len"], "compile": compiled}
    plan = throughput.llmcustoms_plan({**assets, "llmcustoms_plan": overrides}, train, assets["micro_batch"],
                                      assets["grad_accum"], "bf16" if assets["bf16"] else "no", steps=assets["steps"])
    run = RunDirectory(Path(tempfile.mkdtemp()) / "run")
    run.create()
    reporter = SilentReporter()
    tuner = FineTuner(plan, tokenizer, train, [], run, reporter, save_artifacts=False)
    throughput.set_up_once(tuner)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    tuner.run()
    steps = [{"seconds": s["seconds"], "loss": s["loss"]} for s in reporter.steps]
    return {**step_clock.summary(steps, assets["tokens_per_step"], assets["warm_up"]),
            "peak_mem_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
            "plan": {"packing": plan.packing, "micro_batch_size": plan.micro_batch_size, "grad_accum": plan.grad_accum,
                     "mixed_precision": plan.mixed_precision, "gradient_checkpointing": plan.gradient_checkpointing,
                     "compile": plan.compile}}


def run_trainer_peft(assets: dict) -> dict:
    import torch
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    rows = json.loads(Path(assets["tokens"]).read_text())
    dataset = Dataset.from_list(rows)
    model = get_peft_model(common.load_base(assets, torch.bfloat16), common.lora_config())
    if assets["method"] != "qlora":
        model.to("cuda" if assets["device"] == "cuda" else "cpu")
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=assets["micro_batch"],
                             gradient_accumulation_steps=assets["grad_accum"], max_steps=assets["steps"],
                             learning_rate=assets["lr"], lr_scheduler_type="cosine", warmup_steps=0, logging_steps=1,
                             save_strategy="no", report_to="none", seed=assets["seed"], bf16=assets["bf16"],
                             use_cpu=assets["device"] == "cpu", dataloader_num_workers=0, disable_tqdm=True,
                             remove_unused_columns=False, train_sampling_strategy="sequential")
    clock = step_clock.clock()
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=DataCollatorWithFlattening(),
                      callbacks=[clock])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    return {**step_clock.summary(clock.steps, assets["tokens_per_step"], assets["warm_up"]),
            "peak_mem_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None}


def child(name: str, assets: dict) -> dict:
    if name.startswith("llmcustoms"):
        result = run_llmcustoms(assets, compiled=name == "llmcustoms_compile")
    else:
        result = run_trainer_peft(assets)
    import torch

    return {**result, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


# ------------------------------------------------------------------ the parent

def start(name: str, assets: dict, args) -> dict | str:
    """Runs one system in its own process; its result, or why there is none."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    if name in UNSLOTH:
        if not args.unsloth_site or not (Path(args.unsloth_site) / "unsloth").is_dir():
            return f"no Unsloth site (--unsloth-site {args.unsloth_site or 'not given'}): skipped"
        # Unsloth's site alone: the project's own carried packages (transformers 5.24, TRL 1.16) must not shadow its pins.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.unsloth_site, os.environ.get("UNSLOTH_BASE_PATH")]))
        checkpointing = "none" if name == "unsloth_no_checkpointing" else "unsloth"
        argv = [sys.executable, str(HERE / "unsloth_run.py"), json.dumps({**assets, "checkpointing": checkpointing})]
    else:
        argv = [sys.executable, __file__, "--child", name, "--assets", json.dumps(assets)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        return f"exit {done.returncode}: {(done.stderr or done.stdout)[-2500:]}"
    return json.loads(line[len("RESULT "):])


def ratios(systems: dict) -> dict:
    """llmcustoms' tokens/s and peak memory against each other system's."""
    ours = systems.get("llmcustoms")
    if not isinstance(ours, dict):
        return {}
    out = {}
    for name, other in systems.items():
        if name.startswith("llmcustoms") or not isinstance(other, dict) or not other.get("tokens_per_s"):
            continue
        memory = (ours["peak_mem_bytes"] / other["peak_mem_bytes"]
                  if ours.get("peak_mem_bytes") and other.get("peak_mem_bytes") else None)
        out[name] = {"speed": ours["tokens_per_s"] / other["tokens_per_s"], "memory": memory}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a model directory (the kit builds random ones at real shapes)")
    parser.add_argument("--data", type=Path, default=HERE.parent.parent / "shared" / "data" / "code_alpaca_2k.json")
    parser.add_argument("--method", choices=["lora", "qlora"], default="lora")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warm-up", type=int, default=2, help="steps left out of tokens/s")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--tokens-per-step", type=int, default=16384)
    parser.add_argument("--micro-batch", type=int, default=16, help="rows per micro-batch at most")
    parser.add_argument("--unsloth-site", default=os.environ.get("UNSLOTH_SITE", ""))
    parser.add_argument("--only", choices=SYSTEMS, action="append")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--assets", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, json.loads(args.assets))), flush=True)
        return
    if args.model is None:
        parser.error("--model DIR is needed (benchmarks/shapes.py builds one at a real model's shape)")
    assets = assets_for(args, Path(tempfile.mkdtemp(prefix="llmcustoms-peers-")))
    systems: dict = {}
    for name in args.only or DEFAULT_SYSTEMS:
        systems[name] = start(name, assets, args)
        # One line per finished system, so that a run stopped part-way (the kit's cap) keeps them.
        print(f"done {name} {json.dumps(systems[name])}", file=sys.stderr, flush=True)
    summary = {"systems": systems, "ratios": ratios(systems), "model": Path(args.model).name, "method": args.method,
               "device": args.device, "seq_len": args.seq_len, "micro_batch": assets["micro_batch"],
               "grad_accum": assets["grad_accum"], "steps": args.steps, "warm_up": args.warm_up,
               "tokens_per_step": round(assets["tokens_per_step"]), "rows_trained": assets["rows_trained"],
               "flops_per_token": assets["flops_per_token"]}
    if args.json:
        print(json.dumps(summary))
        return
    for name, result in systems.items():
        if isinstance(result, str):
            print(f"{name:26} {result.splitlines()[-1] if result else ''}")
            continue
        peak = f"{result['peak_mem_bytes'] / 2**20:8,.0f} MiB" if result.get("peak_mem_bytes") else "       -"
        print(f"{name:26} {result['tokens_per_s']:9,.0f} tokens/s  peak {peak}  losses {result['losses'][:4]}")
    for name, ratio in summary["ratios"].items():
        print(f"llmcustoms vs {name}: {ratio['speed']:.2f}x tokens/s"
              + (f", {ratio['memory']:.2f}x the memory" if ratio["memory"] else ""))


if __name__ == "__main__":
    main()
