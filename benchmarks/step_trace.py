"""Where llmcustoms' own training step spends its time: torch.profiler over steps of its loop.

    python benchmarks/step_trace.py --model DIR [--device cuda|cpu] [--batch 16x1] [--seq-len 512]
        [--steps 6] [--active 3] [--data FILE] [--json]

The GPU kit's part 3 runs it at TinyLlama-1.1B's shape with the micro-batch the kit's
throughput step uses (16 rows of code_alpaca a step, about 2,000 tokens): the size at which
the first H200 run found a step taking ten times what its FLOPs need. It runs llmcustoms'
FineTuner as planned for a GPU (packing, bf16), profiles `--active` steps after two warm-up
steps, and reports per step:

  step_ms         the step's wall time (llmcustoms' own clock)
  kernel_ms       time some GPU kernel ran (the union of kernel intervals)
  busy            kernel_ms / step_ms: how much of a step the GPU works
  launches        kernel launches (cudaLaunchKernel and the driver's own)
  syncs           host waits on the GPU (stream/device/event synchronize, copies to the host)
  gaps            the largest idle stretches between kernels, with the kernels either side
  top_host_ops    operators by their own CPU time: where the host spends a launch-bound step

MFU is the model FLOPs a step needs (LoRA: docs/benchmarks.md writes them out) over the step
time at the card's bf16 peak, computed by the kit's tables from tokens/s. On a CPU there are no
kernels: only the step time and the host operators are reported (the dry run checks the script).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402  (beside this file)
import peer_speed  # noqa: E402

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping (start, end) intervals joined: kernels on several streams count once."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def kernel_facts(kernels: list[tuple[float, float, str]], steps: int, top: int = 5) -> dict:
    """Busy time and the largest gaps from kernels' (start_us, end_us, name) over `steps` steps."""
    if not kernels:
        return {"kernel_ms": None, "gaps": []}
    kernels = sorted(kernels)
    busy = sum(end - start for start, end in merged([(s, e) for s, e, _ in kernels]))
    gaps, last_end, last_name = [], kernels[0][1], kernels[0][2]
    for start, end, name in kernels[1:]:
        if start > last_end:
            gaps.append({"us": round(start - last_end, 1), "after": last_name[:80], "before": name[:80]})
        if end > last_end:
            last_end, last_name = end, name
    gaps.sort(key=lambda g: -g["us"])
    return {"kernel_ms": busy / 1000 / steps, "gaps": gaps[:top]}


def profile(assets: dict, active: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, schedule

    import throughput
    from llmcustoms.reporting import SilentReporter
    from llmcustoms.runs.run_directory import RunDirectory
    from llmcustoms.training.finetuner import FineTuner

    common.SETTINGS.update(max_len=assets["seq_len"])
    train, _, tokenizer = common.load_rows(assets)
    cuda = torch.cuda.is_available()
    plan = throughput.llmcustoms_plan({**assets, "llmcustoms_plan": {"packing": True, "max_seq_len": assets["seq_len"]}},
                                      train, assets["micro_batch"], assets["grad_accum"],
                                      "bf16" if assets["bf16"] else "no", steps=assets["steps"])
    run = RunDirectory(Path(tempfile.mkdtemp()) / "run")
    run.create()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=active, repeat=1)) as prof:
        class Stepping(SilentReporter):
            def step(self, row):  # each finished step moves the profiler's schedule on
                super().step(row)
                prof.step()

        reporter = Stepping()
        tuner = FineTuner(plan, tokenizer, train, [], run, reporter, save_artifacts=False)
        throughput.set_up_once(tuner)
        tuner.run()
    events = prof.events()
    profiled = reporter.steps[2:2 + active]
    step_ms = 1000 * sum(s["seconds"] for s in profiled) / max(1, len(profiled))
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in events
               if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    facts = kernel_facts(kernels, len(profiled))
    count = lambda names: sum(1 for e in events if e.name in names) / max(1, len(profiled))  # noqa: E731
    top = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:10]
    return {"step_ms": step_ms, **facts, "busy": facts["kernel_ms"] / step_ms if facts["kernel_ms"] else None,
            "launches": count(LAUNCHES) if cuda else None, "syncs": count(SYNCS) if cuda else None,
            # tokens/s times seconds: the step's input tokens (the row the loop reports leaves the count out)
            "tokens_per_step": sum(s["tokens_per_s"] * s["seconds"] for s in profiled) / max(1, len(profiled)),
            "top_host_ops": [{"op": a.key[:60], "self_cpu_ms": a.self_cpu_time_total / 1000 / max(1, len(profiled)),
                              "calls": a.count // max(1, len(profiled))} for a in top],
            "gpu": torch.cuda.get_device_name(0) if cuda else None, "profiled_steps": len(profiled)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=HERE.parent.parent / "shared" / "data" / "code_alpaca_2k.json")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--batch", default="16x1", help="MICROxACCUM rows a step")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6, help="steps the run takes (two warm-up, then profiled ones)")
    parser.add_argument("--active", type=int, default=3, help="steps profiled")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    micro, accum = (int(n) for n in args.batch.lower().split("x"))
    work = Path(tempfile.mkdtemp(prefix="llmcustoms-trace-"))
    args.method, args.warm_up = "lora", 2
    assets = peer_speed.assets_for(args, work, (micro, accum))  # the rows, as the side by side writes them
    result = {**profile(assets, min(args.active, args.steps - 2)),
              "model": args.model.name, "batch": args.batch, "seq_len": args.seq_len,
              "flops_per_token": assets["flops_per_token"]}
    if args.json:
        print(json.dumps(result))
        return
    print(f"step {result['step_ms']:.1f} ms, {result['tokens_per_step']:.0f} tokens"
          + (f"; GPU busy {result['busy']:.0%} ({result['kernel_ms']:.1f} ms of kernels), "
             f"{result['launches']:.0f} launches, {result['syncs']:.0f} syncs a step" if result["busy"] else ""))
    for gap in result["gaps"]:
        print(f"  gap {gap['us']:8.1f} us  after {gap['after']}  before {gap['before']}")
    for op in result["top_host_ops"]:
        print(f"  {op['op']:60} {op['self_cpu_ms']:8.2f} ms  {op['calls']:5} calls")


if __name__ == "__main__":
    main()
