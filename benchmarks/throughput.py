"""llmcustoms against what users write by hand: throughput, memory and eval loss.

    python benchmarks/throughput.py [--model DIR | --toy | --shape NAME] [--data FILE] [--rows N] [--json]
                                    [--device cpu|cuda] [--method lora|qlora] [--systems cpu|gpu|all]

Trains the same rows of the data for one epoch, with the same LoRA config
(r=16 on every linear layer, dropout 0), effective batch, sequence cap,
learning rate and seed, using:

  trainer_pad_max   transformers.Trainer + PEFT, every row padded to the cap (--toy only, unless --only)
  trainer_dynamic   Trainer + PEFT, each batch padded to its longest row: what users write (fp32)
  trainer_grouped   the same with group_by_length=True (batches of rows of similar length)
  trainer_bf16      Trainer + PEFT, per-batch padding, bf16=True (fp32 weights, bf16 autocast: HF's
                    documented set-up), where the device has bf16
  trainer_grouped_bf16  both: the strongest plain Trainer set-up here
  trainer_liger     Trainer + PEFT, bf16=True, use_liger_kernel=True, the frozen base in bf16 on a GPU
                    (liger-kernel is needed: skipped where it is not installed)
  trl_sft           TRL SFTTrainer with its documented defaults (fp32 model, bf16 autocast, gradient
                    checkpointing, its own tokenization; TRL is a benchmark-only dependency)
  trl_padding_free  SFTTrainer, padding_free=True (a micro-batch is one sequence, position_ids mark the
                    rows), bf16, no gradient checkpointing, the base in bf16 on a GPU
  trl_liger         trl_padding_free with use_liger_kernel=True (skipped without liger-kernel)
  llmcustoms        llmcustoms' FineTuner, with the precision its planner picks for this machine

--systems picks the set: cpu (the default on a CPU: the first six and llmcustoms, the bf16
ones where the CPU has bf16), gpu (the default with --device cuda: the bf16 and fused ones
and llmcustoms; the fp32 ones are slow there and no fair "fastest baseline") or all; --only
names systems one by one. --method qlora loads every system's base in 4-bit (NF4, double
quantization, bf16 compute; PEFT's prepare_model_for_kbit_training for the baselines) and
llmcustoms' plan is a QLoRA one; the shared evaluator then uses the same 4-bit base.

The model is a real one: --model DIR, by default SmolLM2-135M-Instruct built (once,
offline) by ../shared/tools/make_real_model.py into ~/.cache/llmcustoms-dev/; --shape a
random model at a real model's shape (benchmarks/shapes.py) with --tokenizer's tokenizer;
--toy a small random Llama-architecture model and a BPE tokenizer trained on the data (the
footnote row in docs/benchmarks.md). Rows: 256 by default (512 with --toy, every row with --device cuda).

Each system runs in its own process. Reported for each: real (non-padding)
training tokens per second (on a GPU the clock is read with its queue drained),
peak memory during training (from after the model loaded: torch.cuda.max_memory_allocated
on a GPU), and eval loss on the same held-out rows after the same training tokens.
The eval loss comes from one shared evaluator: each system's trained LoRA weights
are put on a fresh fp32 copy of the model and scored the same way (mean loss per
response token), so a system's precision cannot flatter its own number. With --json
the last line is {"llmcustoms": {...}, "baselines": {NAME: {...}}, "fastest_baseline": ...}.

--llmcustoms-plan KEY=VALUE (repeatable) sets a field of llmcustoms' Plan (values read as
JSON, else as text: packing=true, optimizer=adamw_fused); --micro-batch N changes
llmcustoms' micro-batch only, the accumulation following so that each step still takes
16 rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import shapes  # noqa: E402  (benchmarks/shapes.py, beside this file)
from common import SETTINGS, TARGETS, _rss, load_rows, timed  # noqa: E402  (TARGETS: step_profile.py too)
from shapes import SHAPES  # noqa: E402

CPU_SYSTEMS = ("trainer_pad_max", "trainer_dynamic", "trainer_grouped", "trainer_bf16", "trainer_grouped_bf16",
               "trl_sft", "llmcustoms")
GPU_SYSTEMS = ("trainer_bf16", "trainer_grouped_bf16", "trainer_liger", "trl_sft", "trl_padding_free", "trl_liger",
               "llmcustoms")
SYSTEMS = CPU_SYSTEMS[:-1] + ("trainer_liger", "trl_padding_free", "trl_liger", "llmcustoms")
BF16_SYSTEMS = ("trainer_bf16", "trainer_grouped_bf16", "trainer_liger", "trl_padding_free", "trl_liger")
NEEDS_LIGER = ("trainer_liger", "trl_liger")
REAL_MODEL = Path.home() / ".cache" / "llmcustoms-dev" / "smollm2-135m-instruct"
MAKE_REAL_MODEL = ROOT.parent / "shared" / "tools" / "make_real_model.py"
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ROWS_PER_STEP = SETTINGS["micro_batch"] * SETTINGS["grad_accum"]


# ------------------------------------------------------------------ set-up

def real_model(given: Path | None) -> Path:
    """The model directory to benchmark: the one given, or SmolLM2 built by the shared script."""
    if given is not None:
        return given
    if not (REAL_MODEL / "config.json").exists():
        print(f"building {REAL_MODEL.name} with {MAKE_REAL_MODEL} (once, 1-5 min)", file=sys.stderr)
        subprocess.run([sys.executable, str(MAKE_REAL_MODEL), str(REAL_MODEL)], check=True)
    return REAL_MODEL


def build_assets(data: Path, workdir: Path, rows: int | None, device: str, model: Path | None,
                 toy_layers: int = 4) -> dict:
    """Model + the rows every system trains and evaluates on (`rows` None: all of them);
    `model` None: a toy model built here."""
    from llmcustoms.data.dataset import usable_examples
    from llmcustoms.data.splits import split_eval

    examples = list(usable_examples(data))  # bad rows skipped
    train_idx, eval_idx = split_eval(len(examples), SETTINGS["eval_rows"] / len(examples), SETTINGS["seed"])
    train = [examples[i] for i in train_idx][:rows]
    evaluation = [examples[i] for i in eval_idx][:SETTINGS["eval_rows"]]
    model_dir = model if model is not None else build_toy_model(examples, workdir, toy_layers)
    rows_file = workdir / "rows.json"
    pairs = lambda rows: [[[m.role, m.content] for m in e.messages] for e in rows]  # noqa: E731
    rows_file.write_text(json.dumps({"train": pairs(train), "eval": pairs(evaluation)}))
    return {"model": str(model_dir), "rows": str(rows_file), "device": device, "train_rows": len(train)}


def toy_tokenizer(texts: list[str]):
    """A byte-level BPE tokenizer of 8k words trained on `texts`, with ChatML as its chat template (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    special = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=8000, special_tokens=special, show_progress=False,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        unk_token="<unk>")
    tokenizer.chat_template = CHATML
    return tokenizer


def build_toy_model(examples: list, workdir: Path, layers: int = 4) -> Path:
    """A random Llama (4 layers unless said) and a BPE tokenizer trained on the data (no download)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = toy_tokenizer([m.content for e in examples for m in e.messages])
    model_dir = workdir / "model"
    tokenizer.save_pretrained(model_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=704, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                         # A random model's frozen head with the default 0.02 barely moves its logits,
                         # so no adapter could learn; 0.1 lets the eval loss compare something.
                         initializer_range=0.1)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    return model_dir


def llmcustoms_plan(assets: dict, train: list, micro_batch: int, grad_accum: int, mixed_precision: str,
                    steps: int | None = None):
    """llmcustoms' Plan at the benchmark's settings: one epoch (or `steps`), no evaluation,
    no checkpoint, then the fields --llmcustoms-plan sets."""
    from dataclasses import fields, replace

    from llmcustoms.planning.plan import LoraSettings, Plan
    from llmcustoms.planning.planner import steps_per_epoch

    per_epoch = steps_per_epoch(len(train), micro_batch, grad_accum)
    total = steps or per_epoch
    plan = Plan(model=assets["model"], family="tinyllama",
                model_type=json.loads((Path(assets["model"]) / "config.json").read_text())["model_type"], preset="quality",
                method=assets.get("method", "lora"), micro_batch_size=micro_batch, grad_accum=grad_accum,
                effective_batch_size=micro_batch * grad_accum, max_seq_len=SETTINGS["max_len"],
                gradient_checkpointing=False, mixed_precision=mixed_precision,
                lr=SETTINGS["lr"], lr_scheduler="cosine", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                epochs=total / per_epoch, steps_per_epoch=per_epoch, total_steps=total, eval_every=0,
                early_stopping_patience=0, save_every=total + 1, keep_checkpoints=1, seed=SETTINGS["seed"],
                train_on_prompt=False, trust_remote_code=False, train_rows=len(train), eval_rows=0,
                lora=LoraSettings(SETTINGS["rank"], SETTINGS["alpha"], 0.0, tuple(TARGETS)))
    known = {f.name for f in fields(Plan)}
    return replace(plan, **{k: v for k, v in assets.get("llmcustoms_plan", {}).items() if k in known})


def set_up_once(tuner) -> None:
    """Loads the model (and the rest) now, so that the `tuner.run()` timed next does not
    load it again: its first set-up calls are skipped, later ones (a rollback to step 0) are real."""
    tuner._setup_processes()
    tuner._setup_training()
    for name in ("_setup_processes", "_setup_training"):
        setattr(tuner, name, lambda name=name: delattr(tuner, name))  # once skipped, the method is the class's again


def run_llmcustoms(assets: dict) -> dict:
    from llmcustoms.reporting import SilentReporter
    from llmcustoms.training.finetuner import FineTuner
    from llmcustoms.runs.run_directory import RunDirectory

    train, evaluation, tokenizer = load_rows(assets)
    micro = assets.get("llmcustoms_micro_batch") or SETTINGS["micro_batch"]
    rows_per_step = SETTINGS["micro_batch"] * SETTINGS["grad_accum"]
    plan = llmcustoms_plan(assets, train, micro, max(1, rows_per_step // micro), assets["llmcustoms_precision"])
    run = RunDirectory(Path(tempfile.mkdtemp()) / "run")
    run.create()
    tuner = FineTuner(plan, tokenizer, train, [], run, SilentReporter(), save_artifacts=False)
    before = _rss("VmRSS")
    result = timed(lambda: tuner.run(), lambda: tuner.accelerator.unwrap_model(tuner.model), assets, train, evaluation,
                   tokenizer, before, setup=lambda: set_up_once(tuner))
    result["plan"] = {"micro_batch_size": plan.micro_batch_size, "grad_accum": plan.grad_accum,
                      **assets.get("llmcustoms_plan", {})}
    return result


# ------------------------------------------------------------------- main

def planned_precision(device: str) -> str:
    """What llmcustoms' planner picks here: bf16 on a GPU or a CPU with native bf16, else fp32 ("no")."""
    if device == "cuda":
        return "bf16"
    from llmcustoms.planning.hardware import detect

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
    SETTINGS.update(assets.get("settings", {}))  # --batch: the same object baselines.py reads
    if name == "llmcustoms":
        result = run_llmcustoms(assets)
    else:
        import baselines  # benchmarks/baselines.py

        result = baselines.run(name, assets)
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name(0)
    return result


def plan_overrides(pairs: list[str]) -> dict:
    """--llmcustoms-plan KEY=VALUE: values read as JSON (true, 8, 0.5), else as text; fields
    the Plan does not have are dropped with a warning."""
    from dataclasses import fields

    from llmcustoms.planning.plan import Plan

    known, values = {f.name for f in fields(Plan)}, {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep:
            raise SystemExit(f"--llmcustoms-plan {pair}: expected KEY=VALUE")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        if key not in known:
            print(f"warning: llmcustoms' Plan has no field {key!r}; --llmcustoms-plan {pair} ignored", file=sys.stderr)
            continue
        values[key] = value
    return values


def has_liger() -> bool:
    import importlib

    try:
        importlib.import_module("liger_kernel")
    except ImportError:
        return False
    return True


def chosen_systems(args, has_bf16: bool) -> list[str]:
    if args.only:
        systems = list(dict.fromkeys(args.only))
    elif (args.systems or ("gpu" if args.device == "cuda" else "cpu")) == "gpu":
        systems = list(GPU_SYSTEMS)
    elif args.systems == "all":
        systems = list(SYSTEMS)
    else:
        systems = [s for s in CPU_SYSTEMS if (s != "trainer_pad_max" or args.toy) and (s not in BF16_SYSTEMS or has_bf16)]
    if any(s in NEEDS_LIGER for s in systems) and not has_liger():
        skipped = [s for s in systems if s in NEEDS_LIGER]
        print(f"skipping {', '.join(skipped)}: liger-kernel is not installed here (`import liger_kernel` failed; "
              "pip install liger-kernel, on a GPU machine)", file=sys.stderr)
        systems = [s for s in systems if s not in NEEDS_LIGER]
    return systems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "code_alpaca_2k.json")
    parser.add_argument("--model", type=Path, help=f"a model directory (default: {REAL_MODEL}, built if missing)")
    parser.add_argument("--toy", action="store_true", help="a small random model built here instead of a real one")
    parser.add_argument("--shape", choices=sorted(SHAPES),
                        help="a random model at a real model's shape (benchmarks/shapes.py), for GPUs")
    parser.add_argument("--tokenizer", type=Path, default=REAL_MODEL, help="the tokenizer --shape uses")
    parser.add_argument("--rows", type=int, help="training rows (default: 256; 512 with --toy; all with --device cuda)")
    parser.add_argument("--method", choices=["lora", "qlora"], default="lora",
                        help="lora, or qlora: every system's base in 4-bit (bitsandbytes NF4)")
    parser.add_argument("--mixed-precision", choices=["no", "bf16"],
                        help="llmcustoms' precision (default: what its planner picks on this machine)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--systems", choices=["cpu", "gpu", "all"],
                        help="which systems (default: gpu with --device cuda, else cpu; see above)")
    parser.add_argument("--only", choices=SYSTEMS, action="append", help="run only these systems")
    parser.add_argument("--llmcustoms-plan", action="append", default=[], metavar="KEY=VALUE",
                        help="set a field of llmcustoms' Plan (repeatable), e.g. packing=true")
    parser.add_argument("--micro-batch", type=int, choices=[1, 2, 4, 8, 16],
                        help=f"llmcustoms' micro-batch only (default {SETTINGS['micro_batch']}); "
                             f"accumulation follows, {ROWS_PER_STEP} rows a step")
    parser.add_argument("--batch", metavar="MICROxACCUM", help=f"every system's micro-batch and accumulation "
                        f"(default {SETTINGS['micro_batch']}x{SETTINGS['grad_accum']}), e.g. 16x1")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--assets", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, json.loads(args.assets))), flush=True)
        return
    if args.method == "qlora" and args.device == "cpu":
        print("warning: --method qlora on a CPU: bitsandbytes' CPU 4-bit path is slow, for smoke checks only",
              file=sys.stderr)
    overrides = plan_overrides(args.llmcustoms_plan)
    if args.device == "cuda":
        # What llmcustoms' planner picks on a GPU with torch's varlen attention (llmcustoms/planning/step_choices.py).
        overrides.setdefault("packing", True)
    if args.batch:
        micro, accum = (int(n) for n in args.batch.lower().split("x"))
        SETTINGS.update(micro_batch=micro, grad_accum=accum)
    workdir = Path(tempfile.mkdtemp(prefix="llmcustoms-bench-"))
    rows = args.rows or (512 if args.toy else None if args.device == "cuda" else 256)
    model = None if args.toy else shapes.build(args.shape, workdir / "model", args.tokenizer) if args.shape \
        else real_model(args.model)
    assets = build_assets(args.data, workdir, rows, args.device, model)
    assets["llmcustoms_precision"] = args.mixed_precision or planned_precision(args.device)
    has_bf16 = assets["llmcustoms_precision"] == "bf16" or args.device == "cuda"
    assets.update(method=args.method, bf16=has_bf16, llmcustoms_plan=overrides, llmcustoms_micro_batch=args.micro_batch,
                  settings={"micro_batch": SETTINGS["micro_batch"], "grad_accum": SETTINGS["grad_accum"]})
    systems = chosen_systems(args, has_bf16)
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
        # One line per finished system, so that a run stopped part-way (the GPU kit's time cap) keeps them.
        print(f"done {name} {json.dumps(results[name])}", file=sys.stderr, flush=True)
        if not args.json:
            r = results[name]
            print(f"{name:20} {r['tokens_per_s']:9,.0f} tokens/s  {r['seconds']:7.1f} s  peak {r['peak_mem_bytes'] / 2**20:7.0f} MiB"
                  f"  eval loss {r['eval_loss']:.4f}", flush=True)
    baselines = {k: v for k, v in results.items() if k != "llmcustoms"}
    summary = {"llmcustoms": results.get("llmcustoms"), "baselines": baselines, "device": args.device,
               "method": args.method, "model": assets["model"], "shape": args.shape, "rows": assets["train_rows"],
               "settings": SETTINGS, "machine": machine(), "llmcustoms_precision": assets["llmcustoms_precision"],
               "llmcustoms_plan": overrides, "llmcustoms_micro_batch": args.micro_batch or SETTINGS["micro_batch"]}
    if args.device == "cuda":
        summary["gpu"] = next((r["gpu"] for r in results.values() if "gpu" in r), None)
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
