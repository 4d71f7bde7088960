"""Per-process peak training memory of full fine-tuning over 2 processes:
data-parallel (`ddp`, each holds everything) against sharded (`fsdp`), each
measured and predicted.

    python benchmarks/sharding_memory.py [--json]

Each mode runs as 2 real processes through accelerate's launcher (gloo, CPU),
with llmcustoms' own `FineTuner` on rows of exactly `seq_len` tokens. Every
process measures its own peak resident memory during the training steps
(Linux `clear_refs` after set-up, as benchmarks/memory_accuracy.py does) minus
its resident memory before the model was loaded. The prediction is
`MemoryEstimator` with `shards=2` for FSDP. On CPU both processes share one
machine's RAM; on GPUs each would have its own card.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llmcustoms.training.launching import _free_port  # noqa: E402
from memory_accuracy import _rss, build_model, small_arch  # noqa: E402

# About 59M parameters, most of them in the blocks (where sharding pays):
# full fine-tuning keeps 16 bytes per parameter, ~0.9 GiB unsharded.
ARCH = small_arch("bench-llama", hidden=768, layers=8, heads=12, kv_heads=4, intermediate=2048, vocab=8000)
MICRO_BATCH, SEQ_LEN, STEPS, WORLD = 2, 256, 3, 2


def measure(model_dir: Path, distributed: str) -> dict:
    """Runs in each launched process."""
    import torch

    from llmcustoms.reporting import SilentReporter
    from llmcustoms.training.finetuner import FineTuner
    from llmcustoms.planning.plan import Plan
    from llmcustoms.runs.run_directory import RunDirectory
    from llmcustoms.data.tokenization import TokenizedExample

    rows_per_step = MICRO_BATCH * WORLD
    plan = Plan(model=str(model_dir), family="bench", model_type="llama", preset="quality", method="full",
                micro_batch_size=MICRO_BATCH, grad_accum=1, effective_batch_size=rows_per_step, max_seq_len=SEQ_LEN,
                gradient_checkpointing=False, mixed_precision="no", lr=1e-4, lr_scheduler="constant",
                warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, epochs=1.0, steps_per_epoch=STEPS,
                total_steps=STEPS, eval_every=0, early_stopping_patience=0, save_every=100, keep_checkpoints=1,
                seed=0, train_on_prompt=True, trust_remote_code=False, train_rows=rows_per_step * STEPS, eval_rows=0,
                lora=None, world_size=WORLD, distributed=distributed)

    class PadOnly:
        pad_token_id = 0

    generator = torch.Generator().manual_seed(0)
    rows = [TokenizedExample(i, ids, ids) for i, ids in enumerate(
        torch.randint(3, ARCH.vocab_size, (rows_per_step * STEPS, SEQ_LEN), generator=generator).tolist())]
    tuner = FineTuner(plan, PadOnly(), rows, [], RunDirectory(Path(tempfile.mkdtemp())), SilentReporter())
    before = _rss("VmRSS")
    tuner._setup_processes()
    tuner._setup_training()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark now starts here
    for step in range(STEPS):
        _, failure = tuner._attempt(list(range(step * rows_per_step, (step + 1) * rows_per_step)))
        assert failure is None, failure
    return {"rank": tuner.processes.rank, "measured_bytes": _rss("VmHWM") - before}


def predict(distributed: str) -> dict:
    from llmcustoms.planning.memory import MemoryEstimator

    return MemoryEstimator(ARCH, on_gpu=False, budget_bytes=0).estimate(
        "full", MICRO_BATCH, SEQ_LEN, "no", False, shards=WORLD if distributed == "fsdp" else 1).to_json()


def run_mode(model_dir: Path, distributed: str, results_dir: Path) -> list[dict]:
    # Each process writes its own file: two processes printing to one pipe can
    # interleave their lines.
    results_dir.mkdir()
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(WORLD),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
               __file__, "--child", distributed, "--model-dir", str(model_dir), "--results", str(results_dir)]
    out = subprocess.run(command, capture_output=True, text=True, env=env)
    results = [json.loads(path.read_text()) for path in results_dir.glob("rank-*.json")]
    if len(results) != WORLD:
        raise SystemExit(f"{distributed}: failed\n{out.stderr[-3000:]}")
    return sorted(results, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON line at the end")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = measure(Path(args.model_dir), args.child)
        (Path(args.results) / f"rank-{result['rank']}.json").write_text(json.dumps(result))
        return
    summary = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        build_model(ARCH, model_dir)
        for mode in ("ddp", "fsdp"):
            ranks = run_mode(model_dir, mode, Path(tmp) / f"results-{mode}")
            predicted = predict(mode)
            peak = max(r["measured_bytes"] for r in ranks)
            summary[mode] = {"measured_bytes": [r["measured_bytes"] for r in ranks],
                             "predicted": predicted, "ratio": peak / predicted["total_bytes"]}
            if not args.json:
                measured = ", ".join(f"{r['measured_bytes'] / 2**20:.0f}" for r in ranks)
                print(f"{mode:5} per process: measured {measured} MiB, "
                      f"predicted {predicted['total_bytes'] / 2**20:.0f} MiB (ratio {summary[mode]['ratio']:.2f}; "
                      f"weights {predicted['weights_bytes'] / 2**20:.0f}, gradients {predicted['gradients_bytes'] / 2**20:.0f}, "
                      f"optimizer {predicted['optimizer_bytes'] / 2**20:.0f}, gathered {predicted['gathered_bytes'] / 2**20:.0f})",
                      flush=True)
    fsdp_vs_ddp = max(summary["fsdp"]["measured_bytes"]) / max(summary["ddp"]["measured_bytes"])
    within = all(0.8 <= summary[m]["ratio"] <= 1.25 for m in summary)
    if args.json:
        print(json.dumps({"modes": summary, "fsdp_vs_ddp_measured": fsdp_vs_ddp, "all_within_0.8_1.25": within}))
    else:
        print(f"fsdp / ddp measured peak per process: {fsdp_vs_ddp:.2f}; all within 0.8-1.25x of predicted: {within}")


if __name__ == "__main__":
    main()
