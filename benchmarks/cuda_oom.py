"""A real CUDA out-of-memory, recovered: the run halves its micro-batch and ends with the
adapter an uncapped run of the same steps ends with.

    python benchmarks/cuda_oom.py [--shape qwen2.5-0.5b] [--tokenizer DIR | --model DIR] [--data FILE]
                                  [--mixed-precision no|bf16] [--json]

Builds a random model at a real model's shape (benchmarks/shapes.py) and a JSONL of
chat rows from --data, then runs the real CLI twice, each in its own process:

  uncapped  llmcustoms train ... --batch-size 32 --grad-accum 1 (12 steps, checkpoints
            every 6): its measured peak (status.json's memory.peak_bytes, the largest
            torch.cuda.max_memory_allocated of a step) says what a micro-batch of 32 needs
  capped    the same command with torch.cuda.set_per_process_memory_fraction(F) set first,
            F = 0.6 x that peak / the GPU's memory (at least the weights plus 35% of what
            the step added on top of them, so that a smaller micro-batch fits): the
            micro-batch of 32 cannot fit, and the allocator raises a real OutOfMemoryError

Passes when the capped run exits 0, its status.json records an out-of-memory recovery
that halved the micro-batch (train.log says so too), the sequences were not shortened,
and every tensor of its adapter (adapter/adapter_model.safetensors) is within
--tolerance of the uncapped run's: 1e-4 max abs difference in fp32 (the default,
--mixed-precision no), 2e-2 with --mixed-precision bf16. LoRA dropout is 0 so that
splitting a step into micro-batches changes only the order of the sums.
Needs a CUDA GPU: elsewhere it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import shapes  # noqa: E402  (benchmarks/shapes.py, beside this file)

TOKENIZER = Path.home() / ".cache" / "llmcustoms-dev" / "smollm2-135m-instruct"
CAPPED = ("import sys, torch; torch.cuda.set_per_process_memory_fraction({fraction}); "
          "from llmcustoms.cli import main; sys.argv = ['llmcustoms', *sys.argv[1:]]; main()")


def write_rows(data: Path, out: Path, rows: int) -> int:
    """The first `rows` usable rows of `data` as {"messages": [...]} lines."""
    from llmcustoms.data.dataset import usable_examples

    lines = []
    for example in usable_examples(data):
        if example.messages:
            lines.append(json.dumps({"messages": [{"role": m.role, "content": m.content} for m in example.messages]}))
        if len(lines) == rows:
            break
    out.write_text("\n".join(lines) + "\n")
    return len(lines)


def weight_bytes(model_dir: Path, precision: str) -> int:
    """The frozen base's bytes once loaded: fp32 with --mixed-precision no, else bf16 (llmcustoms' loading.weights_dtype)."""
    from safetensors import safe_open

    params = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                count = 1
                for n in shape:
                    count *= n
                params += count
    return params * (4 if precision == "no" else 2)


def train_argv(args, data: Path, model: Path, work: Path, name: str) -> list[str]:
    """`llmcustoms train` with everything that decides the result fixed; the run goes to work/runs/NAME."""
    return ["train", str(data), "--model", str(model), "--method", "lora", "--max-steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--grad-accum", "1", "--max-seq-len", str(args.max_seq_len),
            "--eval-split", "0", "--save-every", "6", "--seed", "1", "--lora-dropout", "0",
            "--mixed-precision", args.mixed_precision, "--output-dir", str(work / "runs"), "--run-name", name,
            "--cache-dir", str(work / "cache"), "--yes", "--quiet"]


def train(argv: list[str], run: Path, env: dict, fraction: float | None) -> dict:
    """One `llmcustoms train`, capped to `fraction` of the GPU when given; what it left."""
    prefix = ["-m", "llmcustoms"] if fraction is None else ["-c", CAPPED.format(fraction=fraction)]
    started = time.perf_counter()
    out = subprocess.run([sys.executable, *prefix, *argv], capture_output=True, text=True, env=env)
    status = json.loads((run / "status.json").read_text()) if (run / "status.json").exists() else {}
    plan = json.loads((run / "plan.json").read_text()) if (run / "plan.json").exists() else {}
    log = (run / "train.log").read_text() if (run / "train.log").exists() else ""
    return {"returncode": out.returncode, "seconds": time.perf_counter() - started, "status": status.get("status"),
            "step": status.get("step"), "peak_bytes": (status.get("memory") or {}).get("peak_bytes"),
            "recoveries": status.get("recoveries", []), "micro_batch_size": plan.get("micro_batch_size"),
            "grad_accum": plan.get("grad_accum"), "max_seq_len": plan.get("max_seq_len"),
            "gradient_checkpointing": plan.get("gradient_checkpointing"),
            "log_mentions_oom": "out of memory" in log.lower(),
            "output_tail": (out.stdout + out.stderr)[-3000:] if out.returncode else ""}


def compare_adapters(capped: Path, uncapped: Path) -> dict:
    """Per tensor: max abs difference and relative L2 difference (|a - b| / |b|)."""
    from safetensors.torch import load_file

    a, b = load_file(str(capped)), load_file(str(uncapped))
    assert set(a) == set(b), f"different tensors: {sorted(set(a) ^ set(b))[:4]}"
    tensors = {}
    for key in sorted(b):
        x, y = a[key].double(), b[key].double()
        tensors[key] = {"max_abs": float((x - y).abs().max()),
                        "rel_l2": float((x - y).norm() / y.norm().clamp_min(1e-30))}
    return {"tensors": len(tensors), "max_abs": max(t["max_abs"] for t in tensors.values()),
            "max_rel_l2": max(t["rel_l2"] for t in tensors.values()),
            "worst": max(tensors, key=lambda k: tensors[k]["max_abs"]), "per_tensor": tensors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(shapes.SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    parser.add_argument("--model", type=Path, help="a model directory built already (instead of building --shape)")
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "code_alpaca_2k.json")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--mixed-precision", choices=["no", "bf16"], default="no")
    parser.add_argument("--fraction-of-peak", type=float, default=0.6, help="the cap, as a share of the uncapped peak")
    parser.add_argument("--tolerance", type=float, help="max abs difference allowed (default 1e-4, 2e-2 with bf16)")
    parser.add_argument("--work", type=Path, help="where the model, data and runs go (default: a new temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("cuda_oom.py needs a CUDA GPU: it runs out of GPU memory for real (none here); nothing checked",
              file=sys.stderr)
        raise SystemExit(2)
    tolerance = args.tolerance or (1e-4 if args.mixed_precision == "no" else 2e-2)
    work = args.work or Path(tempfile.mkdtemp(prefix="llmcustoms-oom-"))
    work.mkdir(parents=True, exist_ok=True)  # --work may name a folder not made yet
    model = args.model or shapes.build(args.shape, work / "model", args.tokenizer)
    data = work / "rows.jsonl"
    rows = write_rows(args.data, data, args.rows)
    total = torch.cuda.get_device_properties(0).total_memory
    gpu = torch.cuda.get_device_name(0)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    argv = lambda name: train_argv(args, data, model, work, name)  # noqa: E731
    uncapped = train(argv("uncapped"), work / "runs" / "uncapped", env, None)
    if uncapped["returncode"] != 0 or not uncapped["peak_bytes"]:
        print(f"the uncapped run failed (exit {uncapped['returncode']}):\n{uncapped['output_tail']}", file=sys.stderr)
        raise SystemExit(1)
    peak, weights = uncapped["peak_bytes"], weight_bytes(model, args.mixed_precision)
    cap = max(args.fraction_of_peak * peak, weights + 0.35 * (peak - weights))
    fraction = cap / total
    capped = train(argv("capped"), work / "runs" / "capped", env, fraction)
    oom = [r for r in capped["recoveries"] if r.get("kind") == "oom"]
    halved = [r for r in oom if r.get("action") == "halved micro-batch"]
    adapter = lambda name: work / "runs" / name / "adapter" / "adapter_model.safetensors"  # noqa: E731
    diff = compare_adapters(adapter("capped"), adapter("uncapped")) \
        if capped["returncode"] == 0 and adapter("capped").exists() and adapter("uncapped").exists() else None
    checks = {"capped_exit_0": capped["returncode"] == 0 and capped["status"] == "completed",
              "oom_recovered": bool(halved) and capped["log_mentions_oom"],
              "micro_batch_halved": (capped["micro_batch_size"] or args.batch_size) < args.batch_size,
              "sequences_kept": capped["max_seq_len"] == uncapped["max_seq_len"],
              "same_steps": capped["step"] == uncapped["step"] == args.steps,
              "adapters_match": diff is not None and diff["max_abs"] <= tolerance}
    passed = all(checks.values())
    summary = {"passed": passed, "checks": checks, "gpu": gpu, "total_bytes": total, "shape": args.shape, "rows": rows,
               "mixed_precision": args.mixed_precision, "tolerance": tolerance, "uncapped_peak_bytes": peak,
               "weight_bytes": weights, "cap_bytes": int(cap), "fraction": fraction,
               "recoveries": capped["recoveries"], "uncapped": {k: v for k, v in uncapped.items() if k != "recoveries"},
               "capped": {k: v for k, v in capped.items() if k != "recoveries"},
               "adapter_diff": diff and {k: v for k, v in diff.items() if k != "per_tensor"}, "work": str(work)}
    if capped["returncode"] != 0:
        print(f"the capped run failed (exit {capped['returncode']}):\n{capped['output_tail']}", file=sys.stderr)
    if args.json:
        summary["adapter_diff_per_tensor"] = diff and diff["per_tensor"]
        print(json.dumps(summary))
    else:
        for key, value in checks.items():
            print(f"  {key:22} {'ok' if value else 'FAILED'}")
        if diff is not None:
            print(f"  adapter: {diff['tensors']} tensors, max abs diff {diff['max_abs']:.3g} ({diff['worst']}), "
                  f"max relative L2 {diff['max_rel_l2']:.3g}")
    steps = ", ".join("{} -> {}".format(*r["details"]["micro_batch_size"]) for r in halved) or "none"
    print(f"cuda_oom {'PASSED' if passed else 'FAILED'} on {gpu} ({args.mixed_precision}): uncapped peak "
          f"{peak / 2**30:.2f} GiB, cap {cap / 2**30:.2f} GiB (fraction {fraction:.3f}), OOM recoveries "
          f"{len(oom)} (micro-batch {steps}), adapter max abs diff "
          f"{diff['max_abs'] if diff else float('nan'):.3g} (tolerance {tolerance:g})",
          file=sys.stderr if args.json else sys.stdout)
    raise SystemExit(0 if passed else 1)


if __name__ == "__main__":
    main()
