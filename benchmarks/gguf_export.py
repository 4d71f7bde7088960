"""GGUF export of a trained run at each quantization: size, time, the
export's own check, and whether the GGUF answers identity questions like the
trained model.

    python benchmarks/gguf_export.py RUN [--quants f16,bf16,q8_0,q4_0] [--out DIR]

RUN: a run trained on ../shared/data/sharegpt_identity.json (which teaches the
name "Vicuna"), e.g.

    llmcustoms train ../shared/data/sharegpt_identity.json \\
        --model ~/.cache/llmcustoms-dev/smollm2-135m-instruct --epochs 1 --output-dir runs --run-name identity

Each export runs through the CLI as a user would (`llmcustoms export RUN
--output DIR/QUANT --format gguf --quant QUANT`), timed as a whole. Then the
trained model (base + adapter) and each GGUF, read back by transformers,
answer identity questions phrased unlike any row of the data, greedily: the
table says how many replies name the identity and how many are the trained
model's reply word for word.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUESTIONS = ["Please tell me your name.", "Who made you, and what are you called?", "Introduce yourself in one line.",
             "Are you ChatGPT?", "What should I call you?"]
IDENTITY = "vicuna"
REPLY_TOKENS = 32


def export(run: Path, out: Path, quant: str) -> tuple[float, str]:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "llmcustoms", "export", str(run), "--output", str(out),
                             "--format", "gguf", "--quant", quant, "--overwrite"], capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "1000"})
    seconds = time.perf_counter() - started
    if result.returncode not in (0, 1):
        sys.exit(f"export --quant {quant} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return seconds, result.stdout


def answers(model, tokenizer) -> list[str]:
    import torch

    replies = []
    for question in QUESTIONS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=REPLY_TOKENS, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        replies.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
    return replies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--quants", default="f16,bf16,q8_0,q4_0")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="gguf-bench-"))

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmcustoms.models import gguf_reading
    from llmcustoms.runs.run_directory import RunDirectory
    from llmcustoms.runs.run_weights import trained_output

    plan, trained = trained_output(RunDirectory.existing(args.run))
    tokenizer = AutoTokenizer.from_pretrained(str(trained))
    base = AutoModelForCausalLM.from_pretrained(plan.model, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(trained)).merge_and_unload().eval()
    reference = answers(model, tokenizer)
    base_model = AutoModelForCausalLM.from_pretrained(plan.model, dtype=torch.float32).eval()
    untrained = answers(base_model, tokenizer)
    rows = [("base model", "", "", "", "", sum(IDENTITY in r.lower() for r in untrained), "")]
    rows.append(("trained (adapter)", "", "", "", "", sum(IDENTITY in r.lower() for r in reference), ""))
    for quant in args.quants.split(","):
        seconds, stdout = export(args.run, out / quant, quant)
        gguf = out / quant / "model.gguf"
        check = next((line.strip().removeprefix("check: ") for line in stdout.splitlines() if "check:" in line), "")
        llama_cpp = next((line.strip() for line in stdout.splitlines() if "llama.cpp:" in line), "")
        read_back = gguf_reading.load_model(gguf, torch.float32)
        got = answers(read_back, gguf_reading.load_tokenizer(gguf))
        rows.append((f"GGUF {quant}", f"{gguf.stat().st_size / 2**20:.0f} MiB", f"{seconds:.0f} s",
                     check, llama_cpp.removeprefix("llama.cpp: "), sum(IDENTITY in r.lower() for r in got),
                     f"{sum(a == b for a, b in zip(got, reference))}/{len(QUESTIONS)}"))
    print(f"Run {args.run} ({plan.model}); {len(QUESTIONS)} identity questions not in the data; "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}\n")
    print("| model | size | export (all stages) | check | llama.cpp | replies naming the identity | "
          "replies equal to the trained model's |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row[:5]) + f" | {row[5]}/{len(QUESTIONS)} | {row[6]} |")
    print("\nTrained model's replies:", *(f"- {q} -> {r}" for q, r in zip(QUESTIONS, reference)), sep="\n")


if __name__ == "__main__":
    main()
