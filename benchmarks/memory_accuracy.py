"""Predicted vs measured peak training memory, for several configurations.

    python benchmarks/memory_accuracy.py [--json] [--device cpu|cuda] [--only NAME] [--mixed-precision no|bf16]
    python benchmarks/memory_accuracy.py --device cuda --real-shapes [--json]
    python benchmarks/memory_accuracy.py --simulate-cuda [--only NAME] [--json]

Each configuration runs in a fresh subprocess: build a small random model of a
real architecture locally (no download), set up llmcustoms' own `FineTuner`
(model, LoRA/QLoRA, optimizer), then run real optimizer steps on rows of
exactly `seq_len` tokens and record the peak.

Measured on CPU: peak resident memory during the training steps (Linux
`clear_refs` resets the high-water mark after the model has loaded) minus the
resident memory before the model was loaded, with glibc returning freed
blocks at once (MALLOC_MMAP_THRESHOLD_), so the peak follows live tensors.
On a GPU: `torch.cuda.max_memory_allocated()`, plus the CUDA context the
estimate also counts.

The prediction comes from `MemoryEstimator` with architecture facts only.
Target: every ratio measured/predicted within 0.8-1.25.

--real-shapes runs other configurations instead, at the real sizes of TinyLlama-1.1B
and Qwen2.5-0.5B (benchmarks/shapes.py; TinyLlama with its 49,152-token vocabulary
there): LoRA and QLoRA at 8 x 512, full fine-tuning at 4 x 512 (Qwen only), LoRA with
gradient checkpointing at 4 x 2048. They are for a GPU: with --device cuda every model
is built in bf16 on the GPU, so even 1.1B builds in seconds. None was used in the fit.

--simulate-cuda needs no GPU: it runs benchmarks/cuda_simulation.py's configurations
(TinyLlama-1.1B, Qwen2.5-1.5B, Phi-3-mini, Mistral-7B at their real sizes) on fake
tensors and compares the tracked peak with the on_gpu estimate less the CUDA context
(benchmarks/gpu/SIMULATION.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmcustoms.planning.presets import ModelSpec  # noqa: E402
from shapes import SHAPES  # noqa: E402  (benchmarks/shapes.py, beside this file)


def small_arch(name: str, model_type: str = "llama", hidden: int = 512, layers: int = 4, heads: int = 8,
               kv_heads: int = 4, intermediate: int = 1408, vocab: int = 32000, tied: bool = False) -> ModelSpec:
    return ModelSpec(hub_id=name, family="bench", model_type=model_type, params=0, hidden_size=hidden,
                     num_layers=layers, num_attention_heads=heads, num_kv_heads=kv_heads,
                     intermediate_size=intermediate, vocab_size=vocab, tie_word_embeddings=tied, max_context=4096)


LLAMA = small_arch("small-llama")
QWEN = small_arch("small-qwen", model_type="qwen2", hidden=448, heads=7, kv_heads=1, intermediate=2432,
                  vocab=151936, tied=True, layers=4)
PHI3 = small_arch("small-phi3", model_type="phi3", hidden=384, heads=6, kv_heads=6, intermediate=1024, vocab=32064)
MISTRAL_DEEP = small_arch("small-mistral", model_type="mistral", hidden=256, layers=12, heads=8, kv_heads=2,
                          intermediate=896, vocab=32768)


@dataclass(frozen=True)
class Config:
    name: str
    arch: ModelSpec
    method: str
    micro_batch: int
    seq_len: int
    gradient_checkpointing: bool = False
    lora_rank: int = 16
    # False: not used when the constants in llmcustoms/planning/memory.py were fitted.
    fitted: bool = True
    optimizer: str = "adamw"


CONFIGS = [
    Config("llama-lora-s256", LLAMA, "lora", 4, 256),
    Config("llama-lora-s1024", LLAMA, "lora", 4, 1024),
    Config("llama-qlora-s256", LLAMA, "qlora", 4, 256),
    Config("llama-qlora-s1024", LLAMA, "qlora", 4, 1024),
    Config("llama-full-s256", LLAMA, "full", 2, 256),
    Config("llama-full-s1024", LLAMA, "full", 2, 1024),
    Config("llama-lora-ckpt-s1024", LLAMA, "lora", 4, 1024, gradient_checkpointing=True),
    Config("qwen-lora-s512", QWEN, "lora", 2, 512),
    Config("phi3-lora-s512", PHI3, "lora", 4, 512),
    Config("mistral-lora-s1024", MISTRAL_DEEP, "lora", 4, 1024),
    # Held out: shapes, batch sizes and combinations the fit never saw.
    Config("llama-lora-r64-b8-s512", LLAMA, "lora", 8, 512, lora_rank=64, fitted=False),
    Config("phi3-qlora-ckpt-s1024", PHI3, "qlora", 2, 1024, gradient_checkpointing=True, fitted=False),
    Config("qwen-full-s256", QWEN, "full", 1, 256, fitted=False),
    Config("mistral-full-ckpt-s512", MISTRAL_DEEP, "full", 2, 512, gradient_checkpointing=True, fitted=False),
    # Issue 21's memory savers: a batch of Qwen's 152k-word logits (chunked by the loss;
    # --full-logits measures it without), and bitsandbytes' 8-bit AdamW.
    Config("qwen-lora-b8-s512", QWEN, "lora", 8, 512, fitted=False),
    Config("llama-full-8bit-s256", LLAMA, "full", 2, 256, fitted=False, optimizer="adamw_8bit"),
]


def real_arch(shape: str) -> ModelSpec:
    """A real model's architecture facts, from benchmarks/shapes.py."""
    s = SHAPES[shape]
    return small_arch(shape, model_type=s["model_type"], hidden=s["hidden_size"], layers=s["num_hidden_layers"],
                      heads=s["num_attention_heads"], kv_heads=s["num_key_value_heads"],
                      intermediate=s["intermediate_size"], vocab=s["vocab_size"], tied=s["tie_word_embeddings"])


TINYLLAMA, QWEN_05B = real_arch("tinyllama-1.1b"), real_arch("qwen2.5-0.5b")
REAL_CONFIGS = [
    Config("tinyllama-lora-b8-s512", TINYLLAMA, "lora", 8, 512, fitted=False),
    Config("tinyllama-qlora-b8-s512", TINYLLAMA, "qlora", 8, 512, fitted=False),
    Config("tinyllama-lora-ckpt-b4-s2048", TINYLLAMA, "lora", 4, 2048, gradient_checkpointing=True, fitted=False),
    Config("qwen0.5b-lora-b8-s512", QWEN_05B, "lora", 8, 512, fitted=False),
    Config("qwen0.5b-qlora-b8-s512", QWEN_05B, "qlora", 8, 512, fitted=False),
    Config("qwen0.5b-full-b4-s512", QWEN_05B, "full", 4, 512, fitted=False),
    Config("qwen0.5b-lora-ckpt-b4-s2048", QWEN_05B, "lora", 4, 2048, gradient_checkpointing=True, fitted=False),
    # The GPU kit's 7B step (benchmarks/gpu/): the largest model a 24 GB card trains, in 4-bit.
    Config("mistral7b-qlora-b4-s512", real_arch("mistral-7b"), "qlora", 4, 512, fitted=False),
]
# The GPU kit's dry run on a CPU: the kit's memory step, on a two-layer model.
TINY = small_arch("tiny-llama", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512)
DRY_RUN_CONFIGS = [Config(f"tiny-{method}-b4-s128", TINY, method, 4, 128, fitted=False)
                   for method in ("lora", "qlora", "full")]
ALL_CONFIGS = CONFIGS + REAL_CONFIGS + DRY_RUN_CONFIGS


def build_model(arch: ModelSpec, directory: Path, device: str = "cpu") -> None:
    """A random model of `arch`: fp32 on a CPU; on a GPU built there, in bf16 (quick even at 1.1B)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "phi3": Phi3Config, "mistral": MistralConfig}[arch.model_type]
    config = config_class(vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, num_hidden_layers=arch.num_layers,
                          num_attention_heads=arch.num_attention_heads, num_key_value_heads=arch.num_kv_heads,
                          intermediate_size=arch.intermediate_size, max_position_embeddings=arch.max_context,
                          tie_word_embeddings=arch.tie_word_embeddings, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    if device != "cuda":
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
        return
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    del model
    torch.cuda.empty_cache()


def _rss(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def measure(config: Config, model_dir: Path, device: str, precision: str) -> dict:
    """Runs inside the child process: real FineTuner set-up and steps, then the peak."""
    import torch

    from llmcustoms.reporting import SilentReporter
    from llmcustoms.training.finetuner import FineTuner
    from llmcustoms.planning.plan import LoraSettings, Plan
    from llmcustoms.runs.run_directory import RunDirectory
    from llmcustoms.data.tokenization import TokenizedExample

    torch.set_num_threads(os.cpu_count() or 1)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    if config.arch.model_type == "phi3":
        targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    plan = Plan(model=str(model_dir), family="bench", model_type=config.arch.model_type, preset="quality",
                method=config.method, optimizer=config.optimizer, micro_batch_size=config.micro_batch, grad_accum=1,
                effective_batch_size=config.micro_batch, max_seq_len=config.seq_len,
                gradient_checkpointing=config.gradient_checkpointing, mixed_precision=precision, lr=1e-4,
                lr_scheduler="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, epochs=1.0,
                steps_per_epoch=3, total_steps=3, eval_every=0, early_stopping_patience=0, save_every=100,
                keep_checkpoints=1, seed=0, train_on_prompt=True, trust_remote_code=False,
                train_rows=config.micro_batch * 3, eval_rows=0,
                lora=None if config.method == "full" else LoraSettings(config.lora_rank, 2 * config.lora_rank, 0.0, targets))

    class PadOnly:
        pad_token_id = 0

    generator = torch.Generator().manual_seed(0)
    rows = [TokenizedExample(i, ids, ids) for i, ids in enumerate(
        torch.randint(3, config.arch.vocab_size, (config.micro_batch * 3, config.seq_len), generator=generator).tolist())]
    tuner = FineTuner(plan, PadOnly(), rows, [], RunDirectory(Path(tempfile.mkdtemp())), SilentReporter())
    before = _rss("VmRSS")
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tuner._setup_processes()
    tuner._setup_training()
    after_load = _rss("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark now starts here
    for step in range(3):
        _, failure = tuner._attempt(list(range(step * config.micro_batch, (step + 1) * config.micro_batch)))
        assert failure is None, failure
    if device == "cuda":
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated()
    else:
        measured = _rss("VmHWM") - before
    return {"measured_bytes": measured, "loaded_bytes": after_load - before}


def predict(config: Config, device: str, precision: str) -> dict:
    from llmcustoms.planning.memory import MemoryEstimator

    targets = ("all-linear",)
    estimate = MemoryEstimator(config.arch, on_gpu=device == "cuda", budget_bytes=0).estimate(
        config.method, config.micro_batch, config.seq_len, precision,
        config.gradient_checkpointing, lora_rank=config.lora_rank, lora_targets=targets, optimizer=config.optimizer)
    data = estimate.to_json()
    if device == "cuda":
        # max_memory_allocated does not see the CUDA context; compare like with like.
        from llmcustoms.planning.memory import CUDA_CONTEXT_BYTES

        data["total_bytes"] -= CUDA_CONTEXT_BYTES
    else:
        # Measured with MALLOC_MMAP_THRESHOLD_, the heap holds no freed blocks: its
        # share (what a real run's resident size also counts) is left out here.
        data["total_bytes"] -= data["heap_bytes"]
    return data


def run_one(name: str, device: str, precision: str, full_logits: bool = False) -> dict:
    config = next(c for c in ALL_CONFIGS if c.name == name)
    if full_logits:  # the loss as before issue 21: every trained position's logits at once
        from llmcustoms.losses import sft
        from llmcustoms.planning import memory

        sft.CHUNK_LOGITS = memory.CHUNK_LOGITS = 2 ** 62
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        build_model(config.arch, model_dir, device)
        result = measure(config, model_dir, device, precision)
    return {"name": name, "fitted": config.fitted, "method": config.method, "micro_batch": config.micro_batch, "seq_len": config.seq_len,
            "gradient_checkpointing": config.gradient_checkpointing, "arch": config.arch.hub_id,
            "mixed_precision": precision, **result, "predicted": predict(config, device, precision)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON line at the end")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--only", help="run one configuration by name (of either set)")
    parser.add_argument("--real-shapes", action="store_true",
                        help="the configurations at TinyLlama-1.1B's and Qwen2.5-0.5B's real sizes (for --device cuda)")
    parser.add_argument("--held-out", action="store_true", help="run only the configurations the fit never saw")
    parser.add_argument("--mixed-precision", choices=["no", "bf16"], help="default: bf16 on cuda, no (fp32) on cpu")
    parser.add_argument("--full-logits", action="store_true",
                        help="the loss without chunks (all trained positions' logits at once), for comparison")
    parser.add_argument("--simulate-cuda", action="store_true",
                        help="a GPU's peak at real model sizes, simulated on fake tensors (benchmarks/cuda_simulation.py)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.simulate_cuda:  # the script beside this one, as its own process: it imports this module, not back
        simulation = [sys.executable, str(Path(__file__).with_name("cuda_simulation.py"))]
        sys.exit(subprocess.call(simulation + (["--only", args.only] if args.only else []) + (["--json"] if args.json else [])))
    precision = args.mixed_precision or ("bf16" if args.device == "cuda" else "no")
    if args.child:
        print("RESULT " + json.dumps(run_one(args.child, args.device, precision, args.full_logits)))
        return
    if args.real_shapes and args.device == "cpu" and not args.only:
        parser.error("--real-shapes is for --device cuda (1.1B parameters at 2,048 tokens); on a CPU pick one with --only")
    configs = [c for c in (ALL_CONFIGS if args.only else REAL_CONFIGS if args.real_shapes else CONFIGS)
               if (not args.only or c.name == args.only) and not (args.held_out and c.fitted)]
    if not configs:
        parser.error(f"no configuration {args.only!r}: {', '.join(c.name for c in ALL_CONFIGS)}")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    results = []
    for config in configs:
        out = subprocess.run([sys.executable, __file__, "--child", config.name, "--device", args.device,
                              "--mixed-precision", precision] + (["--full-logits"] if args.full_logits else []),
                             capture_output=True, text=True, env=env)
        line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(f"{config.name}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        result = json.loads(line[len("RESULT "):])
        result["ratio"] = result["measured_bytes"] / result["predicted"]["total_bytes"]
        results.append(result)
        if not args.json:
            p = result["predicted"]
            print(f"{config.name:28} {'fit ' if config.fitted else 'held'} predicted {p['total_bytes'] / 2**20:6.0f} MiB  measured "
                  f"{result['measured_bytes'] / 2**20:8.0f} MiB  ratio {result['ratio']:.2f}  "
                  f"(weights {p['weights_bytes'] / 2**20:.0f}, act {p['activations_bytes'] / 2**20:.0f}, "
                  f"logits {p['logits_bytes'] / 2**20:.0f}, loaded {result['loaded_bytes'] / 2**20:.0f})", flush=True)
    within = bool(results) and len(results) == len(configs) and all(0.8 <= r["ratio"] <= 1.25 for r in results)
    if args.json:
        print(json.dumps({"device": args.device, "mixed_precision": precision, "real_shapes": args.real_shapes,
                          "results": results,
                          "all_within_0.8_1.25": within}))
    else:
        print(f"all within 0.8-1.25x: {within}")


if __name__ == "__main__":
    main()
