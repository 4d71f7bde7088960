"""bf16 against fp32 on the same steps: does llmcustoms' bf16 train like fp32?

    python benchmarks/precision_gpu.py [--shape qwen2.5-0.5b|tinyllama-1.1b|tiny | --model DIR] [--steps 20]
                                       [--micro-batch 8] [--grad-accum 2] [--tokenizer DIR] [--data FILE] [--json]

Trains the same rows, in the same order, at the same settings (throughput.py's: LoRA r=16 on
every linear layer, lr 1e-3 cosine, seed 42, sequences cut at --max-seq-len 512) through
llmcustoms' FineTuner twice, each in its own process: --mixed-precision bf16 (bf16
autocast, the frozen base held in bf16) and no (fp32 throughout). Reported: each step's
training loss (from the run directory's metrics.jsonl) and its relative difference
|bf16 - fp32| / fp32, max and mean over the steps, and the final eval loss of each on the
same held-out rows from the shared fp32 evaluator (common.eval_loss), with its relative
difference; tokens/s and peak memory of each too. Passes when every step's difference and
the eval loss's are within --tolerance (2%).

The model is random at a real model's shape (benchmarks/shapes.py), so it needs a CUDA
GPU; --shape tiny (a 2-layer Llama and a BPE tokenizer trained on the data, as
throughput.py --toy builds) runs anywhere, as a smoke check of the script. A random model
at the default initializer range (0.02) starts near the uniform distribution and its loss
moves little: --init-range 0.05 draws the weights wider (a harder test of bf16).
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

import common  # noqa: E402  (benchmarks/, beside this file)
import shapes  # noqa: E402
import throughput  # noqa: E402

PRECISIONS = ("bf16", "no")


def child(precision: str, assets: dict) -> dict:
    """One training run in this process: per-step losses, speed, peak, the shared eval loss."""
    import torch

    from llmcustoms.training.finetuner import FineTuner
    from llmcustoms.reporting import SilentReporter
    from llmcustoms.runs.run_directory import RunDirectory

    torch.set_num_threads(os.cpu_count() or 1)
    common.SETTINGS["max_len"] = assets["max_len"]
    train, evaluation, tokenizer = common.load_rows(assets)
    plan = throughput.llmcustoms_plan(assets, train, assets["micro_batch"], assets["grad_accum"], precision,
                                      steps=assets["steps"])
    run = RunDirectory(Path(tempfile.mkdtemp()) / "run")
    run.create()
    tuner = FineTuner(plan, tokenizer, train, [], run, SilentReporter(), save_artifacts=False)
    result = common.timed(lambda: tuner.run(), lambda: tuner.accelerator.unwrap_model(tuner.model), assets, train,
                          evaluation, tokenizer, common._rss("VmRSS"), setup=lambda: throughput.set_up_once(tuner))
    steps = [row for row in run.read_metrics() if "loss" in row and "eval_loss" not in row]
    result["losses"] = [row["loss"] for row in sorted(steps, key=lambda row: row["step"])]
    result["grad_norms"] = [row.get("grad_norm") for row in sorted(steps, key=lambda row: row["step"])]
    return result


def compare(bf16: dict, fp32: dict, tolerance: float) -> dict:
    steps = min(len(bf16["losses"]), len(fp32["losses"]))
    rel = [abs(a - b) / abs(b) for a, b in zip(bf16["losses"][:steps], fp32["losses"][:steps])]
    eval_rel = abs(bf16["eval_loss"] - fp32["eval_loss"]) / abs(fp32["eval_loss"])
    return {"steps": steps, "step_rel_diff": rel, "max_step_rel_diff": max(rel, default=float("nan")),
            "mean_step_rel_diff": sum(rel) / steps if steps else float("nan"),
            "worst_step": rel.index(max(rel)) + 1 if rel else None, "eval_loss_rel_diff": eval_rel,
            "tolerance": tolerance,
            "passed": bool(rel) and len(bf16["losses"]) == len(fp32["losses"]) and max(rel) <= tolerance
            and eval_rel <= tolerance}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(shapes.SHAPES) + ["tiny"], default="qwen2.5-0.5b")
    parser.add_argument("--tokenizer", type=Path, default=throughput.REAL_MODEL, help="the tokenizer --shape uses")
    parser.add_argument("--model", type=Path, help="a model directory built already (instead of --shape)")
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "code_alpaca_2k.json")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--init-range", type=float, help="the random model's initializer_range (default: the shape's 0.02)")
    parser.add_argument("--tolerance", type=float, default=0.02, help="relative difference allowed (default 0.02)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", choices=PRECISIONS, help=argparse.SUPPRESS)
    parser.add_argument("--assets", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, json.loads(args.assets))), flush=True)
        return

    import torch

    cuda = torch.cuda.is_available()
    if args.shape != "tiny" and not cuda and args.model is None:
        print(f"precision_gpu.py --shape {args.shape} needs a CUDA GPU (none here); --shape tiny is a CPU smoke check",
              file=sys.stderr)
        raise SystemExit(2)
    workdir = Path(tempfile.mkdtemp(prefix="llmcustoms-precision-"))
    rows = args.steps * args.micro_batch * args.grad_accum
    overrides = {"initializer_range": args.init_range} if args.init_range else {}
    model = args.model or (None if args.shape == "tiny" else
                           shapes.build(args.shape, workdir / "model", args.tokenizer, **overrides))
    assets = throughput.build_assets(args.data, workdir, rows, "cuda" if cuda else "cpu", model, toy_layers=2)
    assets.update(method="lora", steps=args.steps, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                  max_len=args.max_seq_len)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    results = {}
    for precision in PRECISIONS:
        out = subprocess.run([sys.executable, __file__, "--child", precision, "--assets", json.dumps(assets)],
                             capture_output=True, text=True, env=env)
        line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(f"{precision} failed:\n{out.stderr[-3000:]}", file=sys.stderr)
            raise SystemExit(1)
        results[precision] = json.loads(line[len("RESULT "):])
    comparison = compare(results["bf16"], results["no"], args.tolerance)
    summary = {"shape": args.shape, "device": assets["device"], "gpu": torch.cuda.get_device_name(0) if cuda else None,
               "rows": assets["train_rows"], "steps": args.steps, "micro_batch": args.micro_batch,
               "grad_accum": args.grad_accum, "max_seq_len": args.max_seq_len, "init_range": args.init_range,
               "bf16": results["bf16"], "fp32": results["no"], **comparison}
    if args.json:
        print(json.dumps(summary))
        raise SystemExit(0 if comparison["passed"] else 1)
    for name, r in (("bf16", results["bf16"]), ("fp32", results["no"])):
        print(f"{name}: {r['tokens_per_s']:9,.0f} tokens/s  peak {r['peak_mem_bytes'] / 2**20:7.0f} MiB  "
              f"eval loss {r['eval_loss']:.4f}  losses {' '.join(f'{x:.4f}' for x in r['losses'])}")
    print(f"per-step loss relative difference: max {comparison['max_step_rel_diff']:.4%} (step "
          f"{comparison['worst_step']}), mean {comparison['mean_step_rel_diff']:.4%}; eval loss "
          f"{comparison['eval_loss_rel_diff']:.4%}; tolerance {args.tolerance:.0%}: "
          f"{'PASSED' if comparison['passed'] else 'FAILED'}")
    raise SystemExit(0 if comparison["passed"] else 1)


if __name__ == "__main__":
    main()
