"""The kit's summary.md: one table per step from kit.json, the card named at the top, so the
tables can go into docs/benchmarks.md as they are. Reads only what the steps wrote; computes ratios."""

from __future__ import annotations

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
                         ("precision", _precision)):
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


def _gib(value) -> str:
    return f"{value / GIB:.2f} GiB" if value else "?"


def _secs(value) -> str:
    return f"{value:.1f} s" if value is not None else "?"


def _ratio(measured, planned) -> str:
    return f"{measured / planned:.2f}" if measured and planned else "?"
