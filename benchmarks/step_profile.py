"""Where a LoRA training step's time goes on a real model, and what each lever is worth.

    python benchmarks/step_profile.py [--model DIR] [--rows 4] [--tokens 160] [--steps 4] [--profile] [--json]

One LoRA forward + backward + AdamW step (r=16 on every linear layer, dropout 0), rows of
`--tokens` tokens whose second half is learned, the last row 3 tokens shorter (padded, as
real batches are). Each variant runs in its own process, two warm-up steps, then `--steps`
timed ones; tokens/s counts every position. The variants add one lever at a time:

  fp32            fp32, every logit, attention mask: what a hand-written loop does
  fp32_selective  logits only at learned positions
  bf16_autocast   + bf16 autocast, weights fp32 (what Trainer(bf16=True) does)
  bf16_weights    + the frozen base held in bf16
  no_mask         + no attention mask for the right-padded rows: llmcustoms on a bf16 CPU

--profile prints torch profiler's table of the last variant's step. The model defaults
to SmolLM2-135M-Instruct, built by ../shared/tools/make_real_model.py as throughput.py does.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from throughput import TARGETS, real_model  # noqa: E402

VARIANTS = ("fp32", "fp32_selective", "bf16_autocast", "bf16_weights", "no_mask")


def batch(rows: int, tokens: int, vocab: int) -> dict:
    import torch

    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (rows, tokens))
    labels = ids.clone()
    labels[:, :tokens // 2] = -100
    mask = torch.ones_like(ids)
    mask[-1, -3:], labels[-1, -3:] = 0, -100  # one padded row
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def measure(variant: str, model_dir: str, rows: int, tokens: int, steps: int, profile: bool) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from llmcustoms.losses.sft import select_logits, token_cross_entropy

    level = VARIANTS.index(variant)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if level >= 3 else torch.float32)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # trained weights stay fp32
    data = batch(rows, tokens, base.config.vocab_size)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    if level >= 1:
        select_logits(base)
    learned = torch.tensor(float((data["labels"][:, 1:] != -100).sum()))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=level >= 2):
            if level == 0:
                loss = model(**data).loss
            elif level < 4:  # the selective head, with the mask a hand-written loop passes
                head = base.get_output_embeddings()
                head.logit_selection = torch.zeros_like(data["labels"], dtype=torch.bool)
                head.logit_selection[:, :-1] = data["labels"][:, 1:] != -100
                logits = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits
                head.logit_selection = None
                loss = torch.nn.functional.cross_entropy(logits.float(), data["labels"][:, 1:][data["labels"][:, 1:] != -100],
                                                         reduction="sum") / learned
            else:  # llmcustoms' own loss
                loss = token_cross_entropy(model, data, learned)[0]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = (time.perf_counter() - started) / steps
    result = {"variant": variant, "seconds_per_step": seconds, "tokens_per_s": rows * tokens / seconds}
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), file=sys.stderr)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--profile", action="store_true", help="torch profiler table of the last variant")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", choices=VARIANTS, action="append")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    model_dir = str(args.model) if args.child else str(real_model(args.model))
    if args.child:
        print("RESULT " + json.dumps(measure(args.child, model_dir, args.rows, args.tokens, args.steps, args.profile)))
        return
    results = []
    variants = args.only or VARIANTS
    for variant in variants:
        command = [sys.executable, __file__, "--child", variant, "--model", model_dir, "--rows", str(args.rows),
                   "--tokens", str(args.tokens), "--steps", str(args.steps)]
        out = subprocess.run(command + (["--profile"] if args.profile and variant == variants[-1] else []),
                             capture_output=True, text=True)
        line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(f"{variant} failed:\n{out.stderr[-3000:]}", file=sys.stderr)
            continue
        results.append(json.loads(line[len("RESULT "):]))
        if args.profile and variant == variants[-1]:
            print(out.stderr[out.stderr.find("----"):], file=sys.stderr)
        if not args.json:
            r = results[-1]
            print(f"{variant:16} {r['tokens_per_s']:7.1f} tokens/s  {r['seconds_per_step']:.3f} s a step", flush=True)
    if args.json:
        print(json.dumps({"model": model_dir, "rows": args.rows, "tokens": args.tokens, "results": results}))


if __name__ == "__main__":
    main()
