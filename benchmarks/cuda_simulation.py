"""A training step's peak GPU memory, simulated on fake tensors at real model sizes (issue 31).

    python benchmarks/cuda_simulation.py [--only NAME] [--json]
    python benchmarks/memory_accuracy.py --simulate-cuda [--only NAME] [--json]   (the same)

No GPU needed. In a subprocess per configuration, the model is built on the meta
device and set up by llmcustoms' own `loading.load_model` (frozen base in
`weights_dtype`, use_cache off, gradient checkpointing, `attach_lora` all-linear
r16; for QLoRA NF4 weights, the rest in 16 bits as for LoRA); then every
weight becomes a fake tensor (FakeTensorMode: shape, dtype, storage size, no
data). Two optimizer steps run as `FineTuner` runs them on a GPU: rows of exactly
seq_len random tokens (`batching.collate`), `sft.select_logits`, the plan's
loss under bf16 autocast, backward, clipping, fused AdamW (`make_optimizer`'s GPU
choice), zero_grad(set_to_none). The batch, and what is computed from it alone
(labels, the loss's mask), stay real and small, so data-dependent steps work.
torch's MemTracker follows every storage created and freed; its peak is compared
with the on_gpu estimate less the CUDA context (`memory_accuracy.predict`).

The fake device is "cpu": on torch's CPU-only build the first autograd op on a
fake "cuda" tensor aborts ("PyTorch is not linked with support for cuda devices").
So it measures the tensors a step holds, with CPU kernels' choices (which SDPA
kernel runs and what it saves), the chunked loss instead of Liger's, padded rows
(no packing: varlen attention is CUDA-only), and no caching allocator rounding
or fragmentation, cuBLAS workspace or CUDA context. On a tiny model the fake
step's peak equals the real step's, to the byte (tests/benchmarks/test_cuda_simulation.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from memory_accuracy import LLAMA, Config, predict, small_arch  # noqa: E402

# The real models' config.json sizes; EXTRA: other fields that change memory.
TINYLLAMA = small_arch("TinyLlama-1.1B", hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632)
QWEN_15B = small_arch("Qwen2.5-1.5B", model_type="qwen2", hidden=1536, layers=28, heads=12, kv_heads=2,
                      intermediate=8960, vocab=151936, tied=True)
PHI3_MINI = small_arch("Phi-3-mini-4k", model_type="phi3", hidden=3072, layers=32, heads=32, kv_heads=32,
                       intermediate=8192, vocab=32064)
MISTRAL_7B = small_arch("Mistral-7B-v0.1", model_type="mistral", hidden=4096, layers=32, heads=32, kv_heads=8,
                        intermediate=14336)
# Today's families (issue 45): Qwen3's and Gemma 3's heads are wider than hidden / heads.
QWEN3_17B = replace(small_arch("Qwen3-1.7B", model_type="qwen3", hidden=2048, layers=28, heads=16, kv_heads=8,
                               intermediate=6144, vocab=151936, tied=True), head_dim=128)
LLAMA32_3B = replace(small_arch("Llama-3.2-3B", hidden=3072, layers=28, heads=24, kv_heads=8, intermediate=8192,
                                vocab=128256, tied=True), head_dim=128)
GEMMA3_1B = replace(small_arch("gemma-3-1b", model_type="gemma3_text", hidden=1152, layers=26, heads=4, kv_heads=1,
                               intermediate=6912, vocab=262144, tied=True), head_dim=256)
PHI4_MINI = small_arch("Phi-4-mini", model_type="phi3", hidden=3072, layers=32, heads=24, kv_heads=8,
                       intermediate=8192, vocab=200064, tied=True)
EXTRA = {"Phi-3-mini-4k": {"sliding_window": 2047}, "Mistral-7B-v0.1": {"sliding_window": 4096},
         "gemma-3-1b": {"sliding_window": 512}, "Phi-4-mini": {"partial_rotary_factor": 0.75}}

CONFIGS = [
    Config("small-llama-lora-b4-s256", LLAMA, "lora", 4, 256),  # memory_accuracy's llama-lora-s256, on a "GPU"
    Config("tinyllama-lora-b8-s512", TINYLLAMA, "lora", 8, 512),
    Config("tinyllama-lora-ckpt-b4-s2048", TINYLLAMA, "lora", 4, 2048, gradient_checkpointing=True),
    Config("tinyllama-qlora-b8-s512", TINYLLAMA, "qlora", 8, 512),
    Config("tinyllama-full-b4-s512", TINYLLAMA, "full", 4, 512),
    Config("qwen1.5b-lora-b8-s512", QWEN_15B, "lora", 8, 512),
    Config("qwen1.5b-lora-ckpt-b4-s2048", QWEN_15B, "lora", 4, 2048, gradient_checkpointing=True),
    Config("qwen1.5b-qlora-b8-s512", QWEN_15B, "qlora", 8, 512),
    Config("qwen1.5b-full-b4-s512", QWEN_15B, "full", 4, 512),
    Config("phi3-mini-lora-b8-s512", PHI3_MINI, "lora", 8, 512),
    Config("phi3-mini-full-b4-s512", PHI3_MINI, "full", 4, 512),
    Config("mistral7b-lora-b8-s512", MISTRAL_7B, "lora", 8, 512),
    Config("mistral7b-qlora-b8-s512", MISTRAL_7B, "qlora", 8, 512),
    Config("mistral7b-qlora-ckpt-b2-s1024", MISTRAL_7B, "qlora", 2, 1024, gradient_checkpointing=True),  # 8 GB plan
    Config("mistral7b-full-ckpt-b4-s512", MISTRAL_7B, "full", 4, 512, gradient_checkpointing=True),
    Config("qwen3-1.7b-lora-b8-s512", QWEN3_17B, "lora", 8, 512),
    Config("llama3.2-3b-lora-b8-s512", LLAMA32_3B, "lora", 8, 512),
    Config("gemma3-1b-lora-b8-s512", GEMMA3_1B, "lora", 8, 512),
    Config("phi4-mini-lora-b8-s512", PHI4_MINI, "lora", 8, 512),
]
STEPS = 2  # the second step runs with the optimizer's state in memory
CATEGORIES = {"Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients", "Optstate": "optimizer_state",
              "Activation": "activations", "Temp": "backward_temporaries", "Other": "other"}


def hf_config(arch: Any) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(
        arch.model_type, vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size, num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads, num_key_value_heads=arch.num_kv_heads,
        max_position_embeddings=arch.max_context, tie_word_embeddings=arch.tie_word_embeddings,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **({"head_dim": arch.head_dim} if arch.head_dim else {}),
        **EXTRA.get(arch.hub_id, {}))


def sim_plan(config: Config) -> Any:
    """The plan a GPU run of `config` would train with (bf16, all-linear LoRA, AdamW)."""
    from llmcustoms.planning.plan import LoraSettings, Plan

    return Plan(model=f"/simulated/{config.arch.hub_id}", family="bench", model_type=config.arch.model_type,
                preset="quality", method=config.method, optimizer=config.optimizer,
                micro_batch_size=config.micro_batch, grad_accum=1, effective_batch_size=config.micro_batch,
                max_seq_len=config.seq_len, gradient_checkpointing=config.gradient_checkpointing,
                mixed_precision="bf16", lr=1e-4, lr_scheduler="constant", warmup_steps=0, weight_decay=0.0,
                max_grad_norm=1.0, epochs=1.0, steps_per_epoch=STEPS, total_steps=STEPS, eval_every=0,
                early_stopping_patience=0, save_every=100, keep_checkpoints=1, seed=0, train_on_prompt=True,
                trust_remote_code=False, train_rows=config.micro_batch * STEPS, eval_rows=0,
                lora=None if config.method == "full" else
                LoraSettings(config.lora_rank, 2 * config.lora_rank, 0.0, ("all-linear",)))


@contextmanager
def fake_tensors() -> Iterator[Any]:
    """A FakeTensorMode whose `nonzero` knows the answer for masks that came from real
    tensors. The loss's selection mask (`sft._selection`) is computed from the real
    labels; `hidden[mask]` needs its count of True, which a fake tensor cannot know."""
    import torch
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode, unset_fake_temporarily

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    converter = mode.fake_tensor_converter
    convert = converter.from_real_tensor

    def from_real_tensor(fake_mode: Any, real: Any, *args: Any, **kwargs: Any) -> Any:
        fake = convert(fake_mode, real, *args, **kwargs)
        if real.dtype == torch.bool:
            with unset_fake_temporarily():
                fake.known_nonzero = int(real.count_nonzero())
        return fake

    def nonzero(fake_mode: Any, func: Any, arg: Any) -> Any:
        count = getattr(arg, "known_nonzero", None)
        if count is None:
            raise DynamicOutputShapeException(func)
        return arg.new_empty_strided((count, arg.dim()), (1, count), dtype=torch.int64)

    op, impls = torch.ops.aten.nonzero.default, fake_impls.op_implementations_dict
    original, converter.from_real_tensor, impls[op] = impls[op], from_real_tensor, nonzero
    try:
        yield mode
    finally:
        impls[op] = original


def tracker() -> Any:
    """torch's MemTracker, but frozen weights get no gradient hook (it would raise) and
    only the global peak is kept (per-module peaks cost minutes with LoRA's thousands
    of modules); it notes when the peak came and which attention kernels ran."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

    class Tracker(MemTracker):
        def __init__(self) -> None:
            super().__init__()
            self.step, self.peak_at, self.attention = 0, "", set()

        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> tuple[int, int]:
            sizes = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            for param in module.parameters() if install_grad_hooks else ():
                if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    def as_gradient(grad: Any) -> None:
                        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(as_gradient),
                        param.register_post_accumulate_grad_hook(lambda p: as_gradient(p.grad)))
            return sizes

        def _update_peak_stats(self, peak_state: Any) -> None:
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                    self._peak_mem[device], self._peak_mem_snap[device] = snapshot[_TOTAL_KEY], dict(snapshot)
                    phase = "optimizer" if self._in_opt else "backward" if self._mod_tracker.is_bw else "forward"
                    self.peak_at = f"step {self.step}, {phase}"

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if "attention" in func.__name__:
                self.attention.add(func.__name__.split(".")[0])
            return super().__torch_dispatch__(func, types, args, kwargs)

    return Tracker()


def materialize(model: Any, mode: Any | None) -> Any:
    """Every weight and buffer on the meta device (all but 4-bit weights, already
    fake) as a fake CPU tensor, or an empty real one without `mode`; a tensor shared
    by several modules (tied embeddings) stays shared."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    made: dict[int, tuple[Any, Any]] = {}  # id -> (original, fake): the originals stay alive, so ids stay unique
    with mode if mode is not None else nullcontext():
        for module in model.modules():
            for tensors in (module._parameters, module._buffers):
                for name, t in tensors.items():
                    if t is not None and (t.is_meta or mode is not None and not isinstance(t, FakeTensor)):
                        if id(t) not in made:
                            fake = torch.empty_like(t, device="cpu")
                            made[id(t)] = (t, torch.nn.Parameter(fake, t.requires_grad)
                                           if isinstance(t, torch.nn.Parameter) else fake)
                        tensors[name] = made[id(t)][1]
    return model


def quantize(model: Any, quantization: Any, mode: Any | None) -> Any:
    """What from_pretrained does with `quantization` (NF4, double quantization): each
    block linear becomes bitsandbytes' Linear4bit holding packed 4-bit weights. A
    Params4bit cannot wrap a fake tensor, so the weight is a plain Parameter with the
    attributes Linear4bit and PEFT read."""
    import bitsandbytes as bnb
    import torch
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    model = replace_with_bnb_linear(model, modules_to_not_convert=["lm_head"], quantization_config=quantization)
    # Computed with real tensors (it calls .tolist()), before any fake one needs it.
    bnb.functional.name2qmap.setdefault("dynamic", bnb.functional.create_dynamic_map())
    with mode if mode is not None else nullcontext():
        for module in model.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                w = module.weight
                layout = {n: getattr(w, n) for n in ("blocksize", "compress_statistics", "quant_type", "quant_storage")}
                packed, module.quant_state = bnb.functional.quantize_4bit(
                    torch.randn(w.shape, dtype=quantization.bnb_4bit_compute_dtype), **layout)
                module.weight = torch.nn.Parameter(packed, requires_grad=False)
                for name, value in {**layout, "quant_state": module.quant_state, "bnb_quantized": True,
                                    "module": module}.items():
                    setattr(module.weight, name, value)
    model.is_loaded_in_4bit = True  # what PEFT reads (prepare_model_for_kbit_training, its LoRA layers)
    return model


def quant_states(model: Any) -> list[Any]:
    """The 4-bit weights' scales and codes: attributes, which the tracker would not see."""
    import torch

    states = [m.quant_state for m in model.modules() if getattr(m, "quant_state", None) is not None]
    states += [s.state2 for s in states if s.state2 is not None]
    return [v for state in states for v in vars(state).values() if isinstance(v, torch.Tensor)]


def load(config: Config, plan: Any, mode: Any | None) -> Any:
    """`loading.load_model(plan)` on a model built on the meta device (fake tensors
    after), or with real random weights when `mode` is None."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmcustoms.models import loading

    def from_pretrained(loader: Any, name: str, **kwargs: Any) -> Any:
        with torch.device("meta") if mode is not None else nullcontext():
            model = AutoModelForCausalLM.from_config(hf_config(config.arch), dtype=kwargs["dtype"])
        return quantize(model, kwargs["quantization_config"], mode) if "quantization_config" in kwargs else model

    with mock.patch.object(loading, "from_pretrained", from_pretrained):
        model = loading.load_model(plan)
    return materialize(model, mode)


def simulate(config: Config, fake: bool = True) -> dict[str, Any]:
    """`STEPS` training steps of `config`, tracked; on fake tensors, or on real CPU ones."""
    import torch

    from llmcustoms.training import batching, optimization

    from llmcustoms.losses import sft
    from llmcustoms.losses.choice import loss_for
    from llmcustoms.data.tokenization import TokenizedExample

    started = time.perf_counter()
    plan = sim_plan(config)
    with warnings.catch_warnings(), fake_tensors() if fake else nullcontext() as mode:
        warnings.simplefilter("ignore")
        model = load(config, plan, mode)
        sft.select_logits(model)
        with mock.patch("torch.cuda.is_available", return_value=True):  # make_optimizer's GPU choice: fused AdamW
            optimizer = optimization.make_optimizer(model, plan)
        trainable = [p for p in model.parameters() if p.requires_grad]
        loss_fn, generator = loss_for(plan), torch.Generator().manual_seed(0)
        mt = tracker()
        mt.track_external(model, optimizer, *quant_states(model))
        with mt:
            for step in range(1, STEPS + 1):
                mt.step = step
                mt.reset_mod_stats()  # MemTracker refuses a module's second call otherwise
                ids = torch.randint(3, config.arch.vocab_size, (config.micro_batch, config.seq_len), generator=generator)
                rows = [TokenizedExample(i, row, row) for i, row in enumerate(ids.tolist())]
                batch = batching.collate(rows, 0, pad_to_multiple_of=8)  # 8 on a GPU
                normaliser = torch.tensor(max(1, batching.count_loss_tokens(batch["labels"])))
                model.train()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss, _ = loss_fn(model, batch, normaliser)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(trainable, plan.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del loss
    [peak] = mt.get_tracker_snapshot("peak").values()  # one device: cpu
    return {"simulated_bytes": peak["Total"], "peak_at": mt.peak_at, "attention_kernels": sorted(mt.attention),
            "breakdown": {CATEGORIES[str(kind.value)]: n for kind, n in peak.items() if kind != "Total"},
            "fake": fake, "seconds": round(time.perf_counter() - started, 1)}


def run_one(name: str) -> dict[str, Any]:
    config = next(c for c in CONFIGS if c.name == name)
    result = simulate(config)
    predicted = predict(config, "cuda", "bf16")
    return {"name": name, "arch": config.arch.hub_id, "method": config.method, "micro_batch": config.micro_batch,
            "seq_len": config.seq_len, "gradient_checkpointing": config.gradient_checkpointing, **result,
            "predicted": predicted, "ratio": result["simulated_bytes"] / predicted["total_bytes"]}


def main(only: str | None = None, as_json: bool = False) -> int:
    """Every configuration (or `only`), each in its own subprocess; prints the table."""
    configs = [c for c in CONFIGS if only in (None, c.name)]
    if not configs:
        print(f"no configuration {only!r}: {', '.join(c.name for c in CONFIGS)}", file=sys.stderr)
        return 2
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    results = []
    for config in configs:
        out = subprocess.run([sys.executable, __file__, "--child", config.name], capture_output=True, text=True, env=env)
        line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(f"{config.name}: failed\n{out.stderr[-3000:]}", file=sys.stderr)
            continue
        result = json.loads(line[len("RESULT "):])
        results.append(result)
        if not as_json:
            b, mib = result["breakdown"], 2 ** 20
            weights = b["parameters"] + b["buffers"] + b["other"]  # other: 4-bit scales
            print(f"{config.name:29} predicted {result['predicted']['total_bytes'] / mib:7.0f} MiB  simulated "
                  f"{result['simulated_bytes'] / mib:7.0f} MiB  ratio {result['ratio']:.2f}  (weights "
                  f"{weights / mib:.0f}, grads {b['gradients'] / mib:.0f}, optimizer "
                  f"{b['optimizer_state'] / mib:.0f}, activations {b['activations'] / mib:.0f}, backward temps "
                  f"{b['backward_temporaries'] / mib:.0f}; peak at {result['peak_at']}; {result['seconds']:.0f} s)",
                  flush=True)
    within = len(results) == len(configs) and all(0.8 <= r["ratio"] <= 1.25 for r in results)
    if as_json:
        print(json.dumps({"device": "simulated cuda (fake tensors on cpu)", "mixed_precision": "bf16",
                          "results": results, "all_within_0.8_1.25": within}))
    else:
        print(f"all within 0.8-1.25x: {within}")
    return 0 if len(results) == len(configs) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="one configuration by name")
    parser.add_argument("--json", action="store_true", help="print one JSON line at the end")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_one(args.child)), flush=True)
    else:
        sys.exit(main(args.only, args.json))
