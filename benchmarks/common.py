"""What every system of `throughput.py` shares: the settings, the rows, the LoRA
config, loading the base model (fp32, bf16 or 4-bit), the timing and the one
shared evaluator. Imported by throughput.py, baselines.py and precision_gpu.py.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# lr 1e-3: high enough that a few dozen steps visibly move the eval loss.
SETTINGS = {"micro_batch": 4, "grad_accum": 4, "lr": 1e-3, "max_len": 512, "rank": 16, "alpha": 32, "seed": 42,
            "eval_rows": 64}


def _rss(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def load_rows(assets: dict) -> tuple[list, list, object]:
    """The same token ids and labels for every system (llmcustoms' own masking)."""
    from transformers import AutoTokenizer

    from llmcustoms.data.row_formats import Example
    from llmcustoms.data.tokenization import Tokenizer, truncate

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


def quantization():
    """QLoRA's 4-bit base, as the QLoRA paper and PEFT's docs set it up (llmcustoms' own is the same)."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                              bnb_4bit_use_double_quant=True)


def load_base(assets: dict, dtype, prepare: bool = True):
    """The base model for a baseline: `dtype` weights, or with --method qlora 4-bit (then
    PEFT's `prepare_model_for_kbit_training`, what its docs say to call, when `prepare`)."""
    from transformers import AutoModelForCausalLM

    if assets.get("method", "lora") != "qlora":
        return AutoModelForCausalLM.from_pretrained(assets["model"], dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=dtype, quantization_config=quantization(),
                                                 device_map={"": 0} if assets["device"] == "cuda" else None)
    if prepare:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return model


def eval_loss(trained, assets: dict, rows: list, pad_id: int) -> float:
    """The shared evaluator: `trained`'s LoRA weights on a fresh copy of the model (fp32, or
    with --method qlora the same 4-bit base every system trained on, its other weights fp32),
    mean loss per response token over the held-out rows, without autocast."""
    import torch
    from peft import get_peft_model

    from llmcustoms.training.batching import collate, count_loss_tokens

    lora = {k: v.detach().float().cpu() for k, v in trained.state_dict().items() if "lora_" in k}
    model = get_peft_model(load_base(assets, torch.float32, prepare=False), lora_config())
    missing = [k for k in model.state_dict() if "lora_" in k and k not in lora]
    assert lora and not missing, f"trained LoRA weights not found: {missing[:3]}"
    model.load_state_dict(lora, strict=False)
    if assets.get("method", "lora") != "qlora":  # a 4-bit model was placed as it loaded
        model.to("cuda" if assets["device"] == "cuda" else "cpu")
    model.eval()
    total = sum(count_loss_tokens(collate([r], pad_id)["labels"]) for r in rows)
    loss = 0.0
    with torch.no_grad():
        for start in range(0, len(rows), 8):
            batch = {k: v.to(model.device) for k, v in collate(rows[start:start + 8], pad_id).items()}
            loss += float(model(**batch, num_items_in_batch=torch.tensor(total)).loss)
    return loss


def timed(train_fn, model, assets: dict, train: list, evaluation: list, tokenizer, rss_before: int,
          setup=None) -> dict:
    """Runs `train_fn` (after `setup`, which is not timed) and measures it: wall time (with the
    GPU's queue drained at both ends), peak memory from after the model loaded, and the shared eval loss."""
    import torch

    if setup is not None:
        setup()  # model loading is not training time
    cuda = torch.cuda.is_available()
    Path("/proc/self/clear_refs").write_text("5")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    train_fn()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if cuda else _rss("VmHWM") - rss_before
    trained = model if isinstance(model, torch.nn.Module) else model()  # a model, or what gives it after training
    tokens = sum(len(e.input_ids) for e in train)
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "train_tokens": tokens, "peak_mem_bytes": peak,
            "eval_loss": eval_loss(trained, assets, evaluation, tokenizer.pad_token_id)}
