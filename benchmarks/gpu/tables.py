"""The kit's summary.md: one table per step from kit.json, the card named at the top, so the
tables can go into docs/benchmarks.md as they are. Reads only what the steps wrote; computes ratios."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import model_flops  # noqa: E402  (benchmarks/model_flops.py: LoRA's FLOPs, the cards' peaks)

MIB = 2 ** 20
GIB = 2 ** 30


def status_line(step: dict) -> str:
    why = step.get("error") or step.get("reason") or ""
    return f"{step['name']:18} {step['status']:9} {step.get('seconds', 0):6.1f} s of {step['cap_s']:.0f}" + \
        (f"  ({why[:160]})" if why and step["status"] != "passed" else "")


def summary(kit_json: dict) -> str:
    steps = {s["name"]: s for s in kit_json["steps"]}
    parts = [_header(kit_json, steps.get("env"))]
    for name, render in (("test_cuda", _tests), ("user_run", _user_run), ("throughput_lora", _throughput),
                         ("memory", _memory), ("throughput_qlora", _throughput), ("cuda_oom", _oom),
                         ("precision", _precision), ("peers_lora", _peers), ("peers_qlora", _peers),
                         ("step_trace", _trace)):
        step = steps.get(name)
        if step is not None and step.get("result"):
            parts.append(render(step))
    return "\n\n".join(parts) + "\n"


def _card(env: dict | None) -> str:
    facts = (env or {}).get("result") or {}
    if facts.get("gpu"):
        return (f"{facts['gpu']} ({facts['gpu_memory_gib']} GiB, compute capability {facts['compute_capability']}, "
                f"driver {facts.get('driver', '?')})")
    return "no GPU (a CPU dry run)" if facts else "unknown (the env step did not run)"


def _header(kit_json: dict, env: dict | None) -> str:
    facts = (env or {}).get("result") or {}
    packages = facts.get("packages", {})
    versions = ", ".join(f"{name} {packages[name]}" for name in ("torch", "transformers", "peft", "bitsandbytes",
                                                                   "liger_kernel", "trl", "accelerate")
                         if name in packages and not packages[name].startswith("not importable"))
    kit = kit_json["kit"]
    lines = [f"# GPU kit{' (dry run: tiny shapes on a CPU)' if kit['dry_run'] else ''}", "",
             f"Card: {_card(env)}. Python {facts.get('python', kit['python'])}, CUDA {facts.get('torch_cuda')}; "
             f"{versions}.", f"Started {kit['started_at']}; budget {kit['budget_s']:.0f} s, "
             f"{kit_json['elapsed_s']:.0f} s used.", "", "| step | status | seconds | cap | note |", "|---|---|---|---|---|"]
    for step in kit_json["steps"]:
        note = (step.get("error") or step.get("reason") or "").replace("|", "/").replace("\n", " ")[:140]
        lines.append(f"| {step['name']} | {step['status']} | {step.get('seconds', 0):.1f} | {step['cap_s']:.0f} | {note} |")
    return "\n".join(lines)


def _tests(step: dict) -> str:
    r = step["result"]
    lines = [f"## tests/training/test_cuda.py: {r['passed']} passed, {r['failures'] + r['errors']} failed, {r['skipped']} skipped"]
    lines += [f"- `{p['test']}`: {p['message'][:300]}" for p in r.get("problems", [])]
    return "\n".join(lines)


def _user_run(step: dict) -> str:
    plan, measured = step["result"]["plan"], step["result"]["measured"]
    estimate, peak = plan.get("estimated_peak_bytes"), measured.get("peak_bytes")
    seconds = plan.get("estimated_seconds")
    lines = ["## `llmcustoms plan` then `llmcustoms train`, as a user runs them",
             f"Plan: {plan['method']}, micro-batch {plan['micro_batch_size']} x {plan['grad_accum']}, "
             f"{plan['max_seq_len']} tokens, {plan['mixed_precision']}, optimizer {plan['optimizer']}, packing "
             f"{'on' if plan['packing'] else 'off'}, checkpointing {'on' if plan['gradient_checkpointing'] else 'off'}, "
             f"{plan['total_steps']} steps.", "", "| | planned | measured | measured / planned |", "|---|---|---|---|"]
    lines.append(f"| peak memory | {_gib(estimate)} | {_gib(peak)} | {_ratio(peak, estimate)} |")
    lines.append(f"| training time | {_secs(seconds)} | {_secs(measured.get('train_seconds'))} (steps), "
                 f"{_secs(measured.get('wall_s'))} (whole command) | {_ratio(measured.get('train_seconds'), seconds)} |")
    lines.append(f"| loss | | {measured.get('first_loss') or 0:.4f} -> {measured.get('last_loss') or 0:.4f} | |")
    lines += ["", "What the terminal showed last (80 columns):", "", "```", *step["result"]["display"], "```"]
    return "\n".join(lines)


def _throughput(step: dict) -> str:
    r = step["result"]
    ours = r.get("llmcustoms")
    title = "LoRA" if step["name"].endswith("lora") and "qlora" not in step["name"] else "QLoRA"
    lines = [f"## Throughput, {title}: {r.get('shape') or r.get('model', '')}, {r.get('rows', '?')} rows, "
             f"micro-batch x accumulation {r.get('settings', {}).get('micro_batch', '?')} x "
             f"{r.get('settings', {}).get('grad_accum', '?')}",
             "", "| system | tokens/s | llmcustoms is | peak memory | eval loss | time |", "|---|---|---|---|---|---|"]
    systems = {**({"llmcustoms": ours} if ours else {}), **r.get("baselines", {})}
    for name, result in systems.items():
        speedup = f"{ours['tokens_per_s'] / result['tokens_per_s']:.2f}x" if ours and name != "llmcustoms" else ""
        lines.append(f"| {name} | {result['tokens_per_s']:,.0f} | {speedup} | {result['peak_mem_bytes'] / MIB:,.0f} MiB "
                     f"| {result['eval_loss']:.4f} | {result['seconds']:.1f} s |")
    return "\n".join(lines)


def _memory(step: dict) -> str:
    lines = ["## Memory estimate against the measured peak (max_memory_allocated on a GPU)", "",
             "| configuration | predicted | measured | measured / predicted |", "|---|---|---|---|"]
    for row in step["result"]["rows"]:
        lines.append(f"| {row['name']} | {row['predicted']['total_bytes'] / MIB:,.0f} MiB | "
                     f"{row['measured_bytes'] / MIB:,.0f} MiB | {row['ratio']:.2f} |")
    return "\n".join(lines)


def _oom(step: dict) -> str:
    r = step["result"]
    checks = ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in r.get("checks", {}).items())
    diff = r.get("adapter_diff") or {}
    return "\n".join([f"## A real CUDA out-of-memory: {'passed' if r.get('passed') else 'FAILED'}",
                      f"Uncapped peak {_gib(r.get('uncapped_peak_bytes'))}, cap {_gib(r.get('cap_bytes'))}; "
                      f"recoveries: {len(r.get('recoveries', []))}; adapter max abs difference "
                      f"{diff.get('max_abs', float('nan')):.3g} (tolerance {r.get('tolerance')}).", f"Checks: {checks}."])


def _precision(step: dict) -> str:
    r = step["result"]
    return "\n".join([f"## bf16 against fp32 on the same {r['steps']} steps: {'passed' if r['passed'] else 'FAILED'}",
                      f"Per-step loss difference: max {r['max_step_rel_diff']:.3%} (step {r['worst_step']}), mean "
                      f"{r['mean_step_rel_diff']:.3%}; eval loss {r['eval_loss_rel_diff']:.3%} (tolerance "
                      f"{r['tolerance']:.0%}). bf16 {r['bf16']['tokens_per_s']:,.0f} tokens/s, fp32 "
                      f"{r['fp32']['tokens_per_s']:,.0f} tokens/s."])


def _peers(step: dict) -> str:
    r = step["result"]
    systems = r.get("systems", {})
    ours = systems.get("llmcustoms") if isinstance(systems.get("llmcustoms"), dict) else None
    method = {"lora": "LoRA", "qlora": "QLoRA"}.get(r.get("method"), "?")
    lines = [f"## Side by side, {method}: {r.get('model', '')}, {r.get('seq_len', '?')}-token "
             f"rows, {r.get('tokens_per_step', '?')} tokens a step ({r.get('micro_batch', '?')} x "
             f"{r.get('grad_accum', '?')} rows), {r.get('steps', '?')} steps, the first {r.get('warm_up', '?')} untimed",
             "", "| system | tokens/s | llmcustoms is | peak memory | MFU | losses, first steps |", "|---|---|---|---|---|---|"]
    for name, result in systems.items():
        if isinstance(result, str):
            lines.append(f"| {name} | {result.splitlines()[-1][:120].replace('|', '/') if result else 'failed'} | | | | |")
            continue
        speed = f"{ours['tokens_per_s'] / result['tokens_per_s']:.2f}x" if ours and name != "llmcustoms" else ""
        peak = f"{result['peak_mem_bytes'] / MIB:,.0f} MiB" if result.get("peak_mem_bytes") else "-"
        losses = ", ".join(f"{x:.3f}" for x in result.get("losses", [])[:4] if x is not None)
        lines.append(f"| {name} | {result['tokens_per_s']:,.0f} | {speed} | {peak} | "
                     f"{_mfu(result['tokens_per_s'], r.get('flops_per_token'), result.get('gpu'))} | {losses} |")
    return "\n".join(lines)


def _trace(step: dict) -> str:
    r = step["result"]
    busy = (f"GPU busy {r['busy']:.0%} of a step ({r['kernel_ms']:.1f} ms of kernels), {r['launches']:.0f} kernel "
            f"launches and {r['syncs']:.0f} host syncs a step" if r.get("busy") is not None else "no GPU kernels (CPU)")
    lines = [f"## llmcustoms' step, profiled: {r.get('model')}, batch {r.get('batch')}, {r.get('seq_len')} tokens",
             f"{r['step_ms']:.1f} ms a step of {r['tokens_per_step']:.0f} tokens; {busy}; MFU "
             f"{_mfu(r['tokens_per_step'] * 1000 / r['step_ms'], r.get('flops_per_token'), r.get('gpu'))}.", ""]
    if r.get("gaps"):
        lines += ["Largest gaps between kernels:", "", "| idle | after | before |", "|---|---|---|"]
        lines += [f"| {g['us']:,.0f} us | `{g['after'][:50]}` | `{g['before'][:50]}` |" for g in r["gaps"]]
        lines.append("")
    lines += ["Host operators by their own CPU time, a step:", "", "| operator | ms | calls |", "|---|---|---|"]
    lines += [f"| `{o['op']}` | {o['self_cpu_ms']:.2f} | {o['calls']} |" for o in r.get("top_host_ops", [])]
    return "\n".join(lines)


def _mfu(tokens_per_s, flops_per_token, gpu) -> str:
    peak = model_flops.peak_flops(gpu)
    return f"{tokens_per_s * flops_per_token / peak:.1%}" if peak and flops_per_token and tokens_per_s else "-"


def _gib(value) -> str:
    return f"{value / GIB:.2f} GiB" if value else "?"


def _secs(value) -> str:
    return f"{value:.1f} s" if value is not None else "?"


def _ratio(measured, planned) -> str:
    return f"{measured / planned:.2f}" if measured and planned else "?"
