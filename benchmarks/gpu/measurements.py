"""The kit's steps, in the order they run: the most telling first, so that a budget cut short
loses the least. Each step is a function `(kit, deadline) -> dict` that runs the project's own
benchmark scripts (or the CLI) in processes of their own and returns what they measured, with
"status": "passed" when the step's own checks held and "failed" when they did not. It raises
StepFailed when nothing usable came back. Each cap is for one H100 or H200 at the default
budget (kit.DEFAULT_BUDGET_S); each part's caps add up to it. On the dry run the same steps run on two-layer
models and a few rows (SIZES).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import screen

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent

# The work each step does, on a GPU and in the dry run.
SIZES = {
    "gpu": {"llama": "tinyllama-1.1b", "qwen": "qwen2.5-0.5b", "user_steps": 20, "lora_rows": 384, "qlora_rows": 256,
            "batch": "16x1", "memory": ["qwen0.5b-lora-b8-s512", "qwen0.5b-qlora-b8-s512", "qwen0.5b-full-b4-s512",
                                        "mistral7b-qlora-b4-s512"],
            "oom": ["--rows", "128", "--steps", "4", "--batch-size", "32"], "precision_steps": 10},
    "dry": {"llama": "tiny-llama", "qwen": "tiny-qwen2", "user_steps": 3, "lora_rows": 16, "qlora_rows": 8,
            "batch": "4x1", "memory": ["tiny-lora-b4-s128", "tiny-qlora-b4-s128", "tiny-full-b4-s128"],
            "oom": [], "precision_steps": 2},
}
# Part 3: the side by side with Unsloth (peer_speed.py) and the profile of a step (step_trace.py).
# At least 16k input tokens an optimizer step, sequences of up to 2,048 tokens.
PEER_SIZES = {
    "gpu": {"peers_lora": {"shape": "qwen3-1.7b", "steps": 8, "seq": 2048, "tokens": 16384, "micro": 16},
            "peers_qlora": {"shape": "llama3.1-8b", "steps": 6, "seq": 2048, "tokens": 16384, "micro": 16},
            "trace": {"shape": "tinyllama-1.1b", "batch": "16x1", "seq": 512, "steps": 6, "active": 3}},
    "dry": {"peers_lora": {"shape": "tiny-qwen3", "steps": 3, "seq": 256, "tokens": 2048, "micro": 4},
            "peers_qlora": {"shape": "tiny-llama", "steps": 3, "seq": 256, "tokens": 2048, "micro": 4},
            "trace": {"shape": "tiny-llama", "batch": "4x1", "seq": 256, "steps": 5, "active": 2}},
}
THROUGHPUT_SYSTEMS = ("llmcustoms", "trainer_grouped_bf16", "trainer_liger", "trl_padding_free")
NEEDS_CUDA = ("trainer_liger",)  # Liger's kernels are Triton: left out of the dry run


class StepFailed(Exception):
    def __init__(self, message: str, timed_out: bool = False, partial: dict | None = None):
        super().__init__(message)
        self.message, self.timed_out, self.partial = message, timed_out, partial or {}


@dataclass(frozen=True)
class Step:
    name: str
    cap_s: float
    what: str
    run: Callable[[Any, float], dict] = field(repr=False)
    cuda_only: bool = False
    parts: tuple[int, ...] = (1,)  # the device calls (run.sh --part N) this step runs in
    models: tuple[str, ...] = ()  # the models step builds these for it (keys of SIZES or PEER_SIZES)


def sizes(kit) -> dict:
    return SIZES["dry" if kit.dry_run else "gpu"]


def last_json(text: str) -> dict | None:
    """The last line of `text` that is a JSON object: the benchmarks print their result so, last."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def result_line(text: str) -> dict | None:
    line = next((l for l in reversed(text.splitlines()) if l.startswith("RESULT ")), None)
    return json.loads(line[len("RESULT "):]) if line else None


def finished(ran) -> dict:
    """{system: result} from the `done NAME {...}` lines a benchmark prints as each system ends:
    what a run stopped at its cap had measured."""
    return {l.split(" ", 2)[1]: json.loads(l.split(" ", 2)[2]) for l in ran.output(400000).splitlines()
            if l.startswith("done ")}


def python(kit, *args: str) -> list[str]:
    return [kit.python, *args]


def model(kit, key: str) -> str:
    if key not in kit.models:
        raise StepFailed("no model to train: the models step did not build it")
    return kit.models[key]


# ----------------------------------------------------------------- the steps

def check_environment(kit, deadline: float) -> dict:
    ran = kit.command("env", python(kit, str(HERE / "envcheck.py"), *(["--dry-run"] if kit.dry_run else [])), deadline)
    facts = result_line(ran.output(20000))
    if facts is None:
        raise StepFailed(f"envcheck printed nothing (exit {ran.returncode}): {ran.output(1500)}", ran.timed_out)
    return {"status": "passed" if ran.returncode == 0 else "failed", "result": facts,
            **({"error": f"missing: {', '.join(facts['missing'])}"} if facts.get("missing") else {})}


def model_shape(kit, key: str) -> str:
    size = sizes(kit).get(key) or PEER_SIZES["dry" if kit.dry_run else "gpu"][key]
    return size if isinstance(size, str) else size["shape"]


def build(kit, log: str, keys: list[str], deadline: float, where: Path | None = None) -> dict:
    """Builds the random models of `keys` (into `where`, else the work folder); {key: directory}."""
    wanted = {key: model_shape(kit, key) for key in keys}
    ran = kit.command(log, python(kit, str(HERE / "buildmodels.py"), str(where or kit.work / "models"),
                                  str(kit.tokenizer), str(kit.data), json.dumps(wanted)), deadline)
    built = result_line(ran.output(20000))
    if built is None:
        raise StepFailed(f"no models built (exit {ran.returncode}): {ran.output(1500)}", ran.timed_out)
    kit.models.update(built)
    return built


def build_models(kit, deadline: float) -> dict:
    """The random models the chosen steps train (kit.model_keys), each built once. The side by
    side's two large ones are built by their own steps, inside their caps."""
    built = build(kit, "models", kit.model_keys, deadline)
    return {"status": "passed", "result": {"shapes": {k: model_shape(kit, k) for k in kit.model_keys},
                                           "directories": built}}


def cuda_tests(kit, deadline: float) -> dict:
    report = kit.work / "test_cuda.xml"
    # -o addopts=: one process, every test of the file (the GPU image may lack pytest-xdist).
    ran = kit.command("test_cuda", python(kit, "-m", "pytest", "tests/training/test_cuda.py", "-q", "-o", "addopts=",
                                         "-p", "no:cacheprovider",
                                         f"--junitxml={report}"), deadline)
    if not report.exists():
        raise StepFailed(f"pytest wrote no report (exit {ran.returncode}): {ran.output(1500)}", ran.timed_out)
    suite = ElementTree.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    problems = [{"test": case.get("name"), "message": (bad.get("message") or bad.text or "")[:600]}
                for case in suite.iter("testcase") for bad in case if bad.tag in ("failure", "error")]
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    ok = ran.returncode == 0 and (passed > 0 or kit.dry_run)
    return {"status": "passed" if ok else "failed", "result": {**counts, "passed": passed, "problems": problems}}


def user_run(kit, deadline: float) -> dict:
    """`llmcustoms plan`, then `llmcustoms train` in an 80-column terminal, as a person runs them;
    the plan's memory and time against what the run measured."""
    steps = str(sizes(kit)["user_steps"])
    common = [str(kit.data), "--model", model(kit, "qwen"), "--max-steps", steps]
    plan_log = kit.command("user_plan", python(kit, "-m", "llmcustoms", "plan", *common, "--json"), deadline)
    plan = _json_block(plan_log.output(200000))
    if plan is None:
        raise StepFailed(f"`llmcustoms plan --json` gave no plan (exit {plan_log.returncode}): {plan_log.output(1500)}",
                         plan_log.timed_out)
    runs = kit.work / "runs"
    argv = python(kit, "-m", "llmcustoms", "train", *common, "--output-dir", str(runs), "--run-name", "user-run",
                  "--overwrite", "--yes")  # --yes: the "Start training?" a person answers
    transcript = kit.out / "logs" / "user_train.ansi"
    started = time.time()
    code, timed_out = screen.run_in_terminal(argv, kit.env(), BENCHMARKS.parent, deadline, transcript)
    wall = time.time() - started
    shown = screen.render(transcript.read_bytes().decode(errors="replace"))
    (kit.out / "logs" / "user_train.txt").write_text(shown)
    run = runs / "user-run"
    if (run / "train.log").exists():  # its timestamps say where a slow run spent its time
        shutil.copy(run / "train.log", kit.out / "logs" / "user_train.log")
    measured = _run_measures(run)
    result = {"plan": _plan_facts(plan), "measured": {**measured, "wall_s": round(wall, 1), "exit": code},
              "display": shown.splitlines()[-45:]}
    if timed_out or code != 0:
        raise StepFailed(f"`llmcustoms train` {'timed out' if timed_out else f'exited {code}'}", timed_out,
                         {"result": result})
    return {"status": "passed" if measured.get("status") == "completed" else "failed", "result": result}


def throughput(method: str) -> Callable[[Any, float], dict]:
    def run(kit, deadline: float) -> dict:
        size = sizes(kit)
        rows = size["lora_rows" if method == "lora" else "qlora_rows"]
        systems = [s for s in THROUGHPUT_SYSTEMS if not (kit.dry_run and s in NEEDS_CUDA)]
        argv = python(kit, str(BENCHMARKS / "throughput.py"), "--model", model(kit, "llama"), "--data", str(kit.data),
                      "--device", "cpu" if kit.dry_run else "cuda", "--method", method, "--rows", str(rows),
                      "--batch", size["batch"], "--json", *[a for s in systems for a in ("--only", s)])
        name = f"throughput_{method}"
        ran = kit.command(name, argv, deadline)
        summary = last_json(ran.output(200000))
        if summary is None:  # stopped part-way: the systems that finished said so one line each
            done = finished(ran)
            raise StepFailed(f"throughput.py ended without a summary (exit {ran.returncode}); "
                             f"finished: {', '.join(done) or 'none'}", ran.timed_out,
                             {"result": {"llmcustoms": done.pop("llmcustoms", None), "baselines": done,
                                         # what the summary's title names, which a finished run prints itself
                                         "model": Path(model(kit, "llama")).name, "rows": rows,
                                         "settings": dict(zip(("micro_batch", "grad_accum"),
                                                              size["batch"].split("x")))}})
        missing = [s for s in systems if s != "llmcustoms" and s not in summary["baselines"]]
        complete = summary.get("llmcustoms") is not None and not missing
        return {"status": "passed" if complete else "failed", "result": summary,
                **({"error": f"no result for {', '.join(missing)} (see the log)"} if missing else {})}
    return run


def peers(method: str) -> Callable[[Any, float], dict]:
    """llmcustoms, Unsloth and Trainer + PEFT on the same card (peer_speed.py)."""
    key = f"peers_{method}"

    def run(kit, deadline: float) -> dict:
        size = PEER_SIZES["dry" if kit.dry_run else "gpu"][key]
        # Loaded three times, once a system: from memory where there is room (an 8B model is 16 GB).
        shm = Path("/dev/shm/llmcustoms-kit")
        build(kit, f"{key}_model", [key], deadline, shm if not kit.dry_run and _free_bytes("/dev/shm") > 40e9 else None)
        argv = python(kit, str(BENCHMARKS / "peer_speed.py"), "--model", model(kit, key), "--data", str(kit.data),
                      "--method", method, "--device", "cpu" if kit.dry_run else "cuda", "--steps", str(size["steps"]),
                      "--seq-len", str(size["seq"]), "--tokens-per-step", str(size["tokens"]),
                      "--micro-batch", str(size["micro"]), "--unsloth-site", kit.unsloth_site, "--json",
                      # last, so that a cap stops it rather than a peer: whether --compile pays off (LoRA only)
                      *[a for s in ("llmcustoms", "unsloth", "trainer_peft") + (("llmcustoms_compile",)
                        if method == "lora" and not kit.dry_run else ()) for a in ("--only", s)])
        ran = kit.command(key, argv, deadline)
        summary = last_json(ran.output(400000))
        if summary is None:  # stopped part-way: the systems that finished said so one line each
            done = finished(ran)
            raise StepFailed(f"peer_speed.py ended without a summary (exit {ran.returncode}); finished: "
                             f"{', '.join(done) or 'none'}", ran.timed_out,
                             {"result": {"systems": done, "model": Path(model(kit, key)).name, "method": method}})
        systems = summary["systems"]
        # Unsloth may be absent only in a dry run without its site (CI): never on the GPU.
        excused = kit.dry_run and not kit.unsloth_site
        failed = [n for n, r in systems.items() if isinstance(r, str) and not (excused and n.startswith("unsloth"))]
        return {"status": "failed" if failed else "passed", "result": summary,
                **({"error": "; ".join(f"{n}: {systems[n][-300:]}" for n in failed)} if failed else {})}
    return run


def step_trace(kit, deadline: float) -> dict:
    size = PEER_SIZES["dry" if kit.dry_run else "gpu"]["trace"]
    argv = python(kit, str(BENCHMARKS / "step_trace.py"), "--model", model(kit, "trace"), "--data", str(kit.data),
                  "--device", "cpu" if kit.dry_run else "cuda", "--batch", size["batch"], "--seq-len", str(size["seq"]),
                  "--steps", str(size["steps"]), "--active", str(size["active"]), "--json")
    ran = kit.command("step_trace", argv, deadline)
    summary = last_json(ran.output(200000))
    if summary is None:
        raise StepFailed(f"step_trace.py gave no result (exit {ran.returncode}): {ran.output(1500)}", ran.timed_out)
    return {"status": "passed", "result": summary}


def memory(kit, deadline: float) -> dict:
    """The memory estimate against the measured peak, one configuration per process."""
    rows, problems = [], []
    # Each configuration saves its random model before training it: 14.5 GB for the 7B, quicker in memory.
    env = kit.env(TMPDIR="/dev/shm") if not kit.dry_run and _free_bytes("/dev/shm") > 40e9 else kit.env()
    for name in sizes(kit)["memory"]:
        # A log per configuration: one that times out must not be read as the one before it.
        ran = kit.command(f"memory_{name}", python(kit, str(BENCHMARKS / "memory_accuracy.py"), "--only", name,
                                           "--device", "cpu" if kit.dry_run else "cuda", "--json"), deadline, env)
        result = last_json(ran.output(50000))
        if result and result.get("results"):
            rows.extend(result["results"])
        else:
            problems.append(f"{name}: {'timed out' if ran.timed_out else f'exit {ran.returncode}'}")
        if ran.timed_out:
            break
    if not rows:
        raise StepFailed("; ".join(problems) or "no configuration measured", False)
    # The 0.8-1.25 target is for real shapes on a GPU; a two-layer model's peak is mostly fixed overhead.
    within = kit.dry_run or all(0.8 <= r["ratio"] <= 1.25 for r in rows)
    return {"status": "passed" if within and not problems else "failed", "result": {"rows": rows},
            **({"error": "; ".join(problems)} if problems else {})}


def cuda_out_of_memory(kit, deadline: float) -> dict:
    argv = python(kit, str(BENCHMARKS / "cuda_oom.py"), "--model", model(kit, "qwen"), "--data", str(kit.data),
                  *sizes(kit)["oom"], "--work", str(kit.work / "oom"), "--json")
    ran = kit.command("cuda_oom", argv, deadline)
    summary = last_json(ran.output(400000))
    if summary is None:
        raise StepFailed(f"cuda_oom.py gave no result (exit {ran.returncode}): {ran.output(1500)}", ran.timed_out)
    summary.pop("adapter_diff_per_tensor", None)
    return {"status": "passed" if summary.get("passed") else "failed", "result": summary}


def precision(kit, deadline: float) -> dict:
    argv = python(kit, str(BENCHMARKS / "precision_gpu.py"), "--model", model(kit, "qwen"), "--data", str(kit.data),
                  "--steps", str(sizes(kit)["precision_steps"]), "--json")
    ran = kit.command("precision", argv, deadline)
    summary = last_json(ran.output(200000))
    if summary is None:
        raise StepFailed(f"precision_gpu.py gave no result (exit {ran.returncode}): {ran.output(1500)}", ran.timed_out)
    return {"status": "passed" if summary.get("passed") else "failed", "result": summary}


# ------------------------------------------------------------- what they read

def _free_bytes(path: str) -> float:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0.0


def _json_block(text: str) -> dict | None:
    """`llmcustoms plan --json` prints one indented JSON object: from its first "{" line to its last "}"."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l == "{"), None)
    end = next((i for i in range(len(lines) - 1, -1, -1) if lines[i] == "}"), None)
    if start is None or end is None:
        return None
    try:
        return json.loads("\n".join(lines[start:end + 1]))
    except json.JSONDecodeError:
        return None


def _plan_facts(plan: dict) -> dict:
    keys = ("model", "method", "micro_batch_size", "grad_accum", "max_seq_len", "gradient_checkpointing",
            "mixed_precision", "optimizer", "packing", "total_steps", "estimated_seconds")
    return {**{k: plan.get(k) for k in keys}, "estimated_peak_bytes": (plan.get("memory") or {}).get("total_bytes")}


def _run_measures(run: Path) -> dict:
    """What the run directory says it measured: status, peak memory, step times, tokens/s."""
    if not (run / "status.json").exists():
        return {"status": "no run directory"}
    status = json.loads((run / "status.json").read_text())
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()] \
        if (run / "metrics.jsonl").exists() else []
    steps = [r for r in rows if "loss" in r and "seconds" in r]
    memory = status.get("memory") or {}
    return {"status": status.get("status"), "steps": status.get("step"), "peak_bytes": memory.get("peak_bytes"),
            "predicted_bytes": memory.get("predicted_bytes"), "memory_ratio": memory.get("ratio"),
            "train_seconds": round(sum(r["seconds"] for r in steps), 2),
            "tokens_per_s_median": sorted(r["tokens_per_s"] for r in steps)[len(steps) // 2] if steps else None,
            "first_loss": steps[0]["loss"] if steps else None, "last_loss": steps[-1]["loss"] if steps else None,
            "recoveries": status.get("recoveries", [])}


# Two parts, one device call each: on a machine just started every process spends 10-25 s
# importing (torch, peft) before it measures anything, so the nine steps need about 760 s, more
# than one call may take and more than leaves a second try in 15 minutes of device time. Part 1
# holds what a user meets first (the run itself, the speed claim, the out-of-memory recovery),
# part 2 the rest; `env` and `models` run in both. The caps were set from the first runs on an
# H200 (2026-11-27, docs/benchmarks.md).
# Part 3 (a third call) is the side by side with Unsloth: two model builds of 3.4 and 16 GB and
# three systems per shape, each importing its stack cold. Its env step is shorter: the import
# times of a first call are known.
STEPS = [
    Step("env", 30, "card, driver, torch/CUDA, every package imported", check_environment, parts=(1, 2, 3)),
    Step("models", 25, "the random models the part's steps train, at real shapes", build_models, parts=(1, 2, 3)),
    Step("user_run", 115, "llmcustoms plan, then train in an 80-column terminal: estimates vs measured", user_run,
         models=("qwen",)),
    Step("throughput_lora", 135, "LoRA tokens/s, peak, eval loss: llmcustoms vs Trainer, Liger, TRL", throughput("lora"),
         models=("llama",)),
    Step("cuda_oom", 75, "a real CUDA out-of-memory recovered; adapter vs an uncapped run", cuda_out_of_memory,
         cuda_only=True, models=("qwen",)),
    Step("test_cuda", 30, "tests/training/test_cuda.py: varlen kernel, Liger loss, 8-bit/paged AdamW", cuda_tests,
         parts=(2,)),
    Step("memory", 125, "memory estimate vs max_memory_allocated: LoRA, QLoRA, full, 7B QLoRA", memory, parts=(2,)),
    Step("throughput_qlora", 105, "QLoRA tokens/s, peak, eval loss: the same systems", throughput("qlora"),
         parts=(2,), models=("llama",)),
    Step("precision", 65, "bf16 vs fp32 losses on the same steps", precision, parts=(2,), models=("qwen",)),
    Step("peers_lora", 100, "Qwen3-1.7B LoRA, 2,048-token rows, 16k tokens a step: llmcustoms vs Unsloth vs "
         "Trainer+PEFT (its model built first)", peers("lora"), parts=(3,)),
    Step("peers_qlora", 185, "Llama-3.1-8B QLoRA, the same (its 16 GB model built first)", peers("qlora"),
         parts=(3,)),
    Step("step_trace", 40, "torch.profiler over llmcustoms' 1.1B LoRA step: kernel time, gaps, syncs, launches",
         step_trace, parts=(3,), models=("trace",)),
]
PARTS = (1, 2, 3)


def chosen(only: list[str] | None, part: int | None = None) -> list[Step]:
    """The steps to run: those named (with models and env, which the others need or explain),
    else one part's, else all of them (the dry run)."""
    if only:
        return [s for s in STEPS if s.name in only or s.name in ("env", "models")]
    return [s for s in STEPS if part is None or part in s.parts]


def models_for(steps: list[Step]) -> list[str]:
    """The models the `models` step builds for `steps`, each once, in the order first needed."""
    return list(dict.fromkeys(key for step in steps for key in step.models))


if __name__ == "__main__":
    sys.exit("run benchmarks/gpu/run.sh, not this module")
