"""What a large data file costs: memory and time of `plan` and `train` as the file grows.

    python benchmarks/large_data.py [--sizes 0.1,0.3,1.0] [--model DIR] [--work-dir DIR] [--json]
    python benchmarks/large_data.py --table

For each size (GiB: 1.0 is at least 1,073,741,824 bytes) a seeded JSONL file of
OpenAI `messages` rows is generated, streamed to disk and kept in --work-dir for
the next time: varied English-like text from a word list, 200-3000 characters a
row with a long tail, a system message in some rows, and a few huge rows (one of
up to 50 MiB, four of up to 5 MiB; capped at a share of small files). Then,
each in its own process, through the CLI:

  plan         llmcustoms plan FILE                  (fresh --cache-dir)
  train cold   llmcustoms train FILE --max-steps 1   (another fresh --cache-dir: tokenization is measured)
  train warm   the same again                        (its cache from the cold run)
  baseline     train on a tiny file with the same model: the model's own share of memory

Reported per run: peak RSS of the process tree (psutil polled every 0.2 s, and
the kernel's own peak from wait4; the larger is reported), wall time, and for
train the time to first step: from launch until the run's metrics.jsonl holds
a training row (one with `loss`) of step >= 1. Evaluation is off
(--eval-split 0, which also skips sample replies), so what is measured is data
and one step. Results accumulate in --results by size, so sizes can be run one
at a time; --table prints the Markdown table of what it holds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from itertools import accumulate
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GiB, MiB = 2 ** 30, 2 ** 20
GENERATOR = 1  # bump when the generated text changes, so cached files are made again
POLL_S = 0.2
TRAIN_FLAGS = ("--max-seq-len", "512", "--batch-size", "1", "--grad-accum", "1", "--eval-split", "0",
               "--max-steps", "1", "--save-every", "1000")
# (share of the file where it goes, role, at most bytes, at most this share of the file)
# Full size from 0.1 GiB up, so every default file holds the same huge rows and the growth between
# sizes is about ordinary rows; smaller files (tests) get smaller ones.
HUGE_ROWS = ((0.1, "assistant", 50 * MiB, 0.5), (0.3, "user", 5 * MiB, 0.05), (0.5, "assistant", 5 * MiB, 0.05),
             (0.7, "user", 5 * MiB, 0.05), (0.9, "assistant", 5 * MiB, 0.05))
BASELINE_BYTES = 64 * 1024
WORDS = """the of and to a in is it you that he was for on are with as I his they be at one have this from or had by
word but what some we can out other were all there when up use your how said an each she which do their time if will
way about many then them write would like so these her long make thing see him two has look more day could go come
did number sound no most people my over know water than call first who may down side been now find any new work part
take get place made live where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move right boy old too
same tell does set three want air well also play small end put home read hand port large spell add even land here
must big high such follow act why ask men change went light kind off need house picture try us again animal point
mother world near build self earth father head stand own page should country found answer school grow study still
learn plant cover food sun four between state keep eye never last let thought city tree cross farm hard start might
story saw far sea draw left late run while press close night real life few north open seem together next white
children begin got walk example ease paper group always music those both mark often letter until mile river car feet
care second book carry took science eat room friend began idea fish mountain stop once base hear horse cut sure watch
color face wood main enough plain girl usual young ready above ever red list though feel talk bird soon body dog
family direct pose leave song measure door product black short numeral class wind question happen complete ship area
half rock order fire south problem piece told knew pass since top whole king space heard best hour better true during
hundred five remember step early hold west ground interest reach fast verb sing listen six table travel less morning
ten simple several vowel toward war lay against pattern slow center love person money serve appear road map rain rule
govern pull cold notice voice unit power town fine certain fly fall lead cry dark machine note wait plan figure star
box noun field rest correct able pound done beauty drive stood contain front teach week final gave green oh quick
develop ocean warm free minute strong special mind behind clear tail produce fact street inch multiply nothing course
stay wheel full force blue object decide surface deep moon island foot system busy test record boat common gold
possible plane stead dry wonder laugh thousand ago ran check game shape equate hot miss brought heat snow tire bring
yes distant fill east paint language among""".split()
CUM_WEIGHTS = list(accumulate(1 / (rank + 1) for rank in range(len(WORDS))))  # Zipf-like, as in real text
ENDINGS = (". ", ". ", ". ", ", ", "? ", "! ", ": ", "; ")


# ------------------------------------------------------------------ data

def text(rng: random.Random, chars: int) -> str:
    """About `chars` characters of sentences: Zipf-distributed words, varied sentence lengths, some numbers."""
    words = rng.choices(WORDS, cum_weights=CUM_WEIGHTS, k=chars // 3 + 2)  # more than enough: words average ~4.5
    parts, i, size = [], 0, 0
    while i < len(words) and size < chars:
        n = rng.randint(3, 22)
        sentence = words[i:i + n]
        sentence[0] = sentence[0].capitalize()
        if rng.random() < 0.1:
            sentence.append(str(rng.randint(0, 9999)))
        part = " ".join(sentence) + rng.choice(ENDINGS)
        parts.append(part + ("\n\n" if rng.random() < 0.08 else ""))
        size += len(parts[-1])
        i += n
    return "".join(parts)[:chars].rstrip() or "Hello."


def row_length(rng: random.Random) -> int:
    """Characters in a row: mostly 200-3000 (log-normal around 900), one row in a hundred up to 30,000."""
    if rng.random() < 0.01:
        return rng.randint(3000, 30000)
    return min(3000, max(200, int(rng.lognormvariate(6.8, 0.6))))


def row(rng: random.Random) -> str:
    total = row_length(rng)
    user = max(20, int(total * rng.uniform(0.1, 0.5)))
    messages = [{"role": "system", "content": text(rng, rng.randint(40, 300))}] if rng.random() < 0.3 else []
    messages += [{"role": "user", "content": text(rng, user)},
                 {"role": "assistant", "content": text(rng, max(20, total - user))}]
    return json.dumps({"messages": messages}) + "\n"


def write_huge_row(f, rng: random.Random, role: str, size: int) -> int:
    """One row whose `role` message holds `size` characters, written in 1 MiB pieces (never whole in memory)."""
    question = {"role": "user", "content": "Please write it all out in full."}
    head = '{"messages": [' + (json.dumps(question) + ", " if role == "assistant" else "")
    head += '{"role": "' + role + '", "content": "'
    tail = '"}' + ("" if role == "assistant" else ', {"role": "assistant", "content": "Done."}') + "]}\n"
    written = f.write(head.encode())
    for start in range(0, size, MiB):
        written += f.write(json.dumps(text(rng, min(MiB, size - start)))[1:-1].encode())
    return written + f.write(tail.encode())


def generate(path: Path, target: int, seed: int, huge: bool = True) -> dict:
    """Rows appended until the file holds at least `target` bytes; the huge rows at their share of it."""
    rng = random.Random(seed)
    pending = sorted(HUGE_ROWS) if huge else []
    written, rows, huge_sizes = 0, 0, []
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        while written < target:
            if pending and written >= pending[0][0] * target:
                _, role, most, share = pending.pop(0)
                size = max(1000, min(most, int(share * target)))
                written += write_huge_row(f, rng, role, size)
                huge_sizes.append(size)
            else:
                written += f.write(row(rng).encode())
            rows += 1
    os.replace(tmp, path)
    return {"bytes": written, "rows": rows, "huge_row_chars": huge_sizes, "seed": seed, "target_bytes": target,
            "generator": GENERATOR}


def data_file(work: Path, size_gb: float, seed: int, huge: bool = True) -> tuple[Path, dict]:
    """The generated file for this size and seed, made once and reused from `work`."""
    target = int(size_gb * GiB)
    path = work / f"messages-{target}b-seed{seed}{'' if huge else '-plain'}.jsonl"
    meta_path = path.with_suffix(".meta.json")
    if path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("generator") == GENERATOR and meta.get("bytes") == path.stat().st_size:
            return path, meta
    started = time.perf_counter()
    meta = generate(path, target, seed, huge)
    meta["generate_s"] = time.perf_counter() - started
    meta_path.write_text(json.dumps(meta))
    return path, meta


# ------------------------------------------------------------------ measuring

def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (0 once it is gone)."""
    import psutil

    try:
        parent = psutil.Process(pid)
        procs = [parent, *parent.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass  # exited between listing and reading
    return total


class FirstStep:
    """Watches a metrics.jsonl as it grows for the first training row of step >= 1."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""
        self.row: dict | None = None  # the row found: its tokens_per_s shows how busy the machine was

    def seen(self) -> bool:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return False
        self.offset += len(chunk)
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        for line in lines:
            try:
                metrics = json.loads(line)
            except ValueError:
                continue
            if "loss" in metrics and metrics.get("step", 0) >= 1:
                self.row = metrics
                return True
        return False


def measure(command: list[str], log: Path, metrics: Path | None = None, timeout: float = 3600) -> dict:
    """Run `command` (output to `log`); its peak RSS, wall time and, with `metrics`, its time to first step."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "100"}
    with open(log, "wb") as out:
        # Its own process group, so a timeout (or Ctrl-C here) ends the whole tree.
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        first = FirstStep(metrics) if metrics else None
        try:
            result = watch(proc.pid, first, timeout)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        proc.returncode = result["returncode"]  # reaped by watch(); keep Popen from waiting again
    result["load_avg_1m_after"] = os.getloadavg()[0]  # other work on the machine skews the times
    if metrics:
        result["first_step_row"] = first.row
    else:
        result.pop("first_step_s")
    if result["returncode"] != 0:
        result["log_tail"] = log.read_text(errors="replace")[-2000:]
        print(f"  llmcustoms {command[3]} exited {result['returncode']}; see {log}", file=sys.stderr, flush=True)
    return result


def watch(pid: int, first: FirstStep | None, timeout: float) -> dict:
    """Poll a child until it exits: its tree's RSS, and when `first` sees the first step."""
    started, peak, first_step, killed = time.perf_counter(), 0, None, False
    while True:
        # wait4 reaps the child itself, so it also gives the kernel's peak RSS of that process.
        done, status, usage = os.wait4(pid, os.WNOHANG)
        elapsed = time.perf_counter() - started
        if first_step is None and first is not None and first.seen():
            first_step = elapsed
        if done:
            break
        peak = max(peak, tree_rss(pid))
        if elapsed > timeout and not killed:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            killed = True
        time.sleep(POLL_S)
    kernel = usage.ru_maxrss * 1024  # KiB on Linux
    return {"returncode": os.waitstatus_to_exitcode(status), "seconds": elapsed, "first_step_s": first_step,
            "peak_rss_mib": max(peak, kernel) / MiB, "polled_peak_rss_mib": peak / MiB,
            "kernel_peak_rss_mib": kernel / MiB, "timed_out": killed}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmcustoms", *args]


def plan(model: str, data: Path, work: Path, timeout: float) -> dict:
    cache = fresh(work / "cache-plan")
    return measure(cli("plan", str(data), "--model", model, *TRAIN_FLAGS, "--cache-dir", str(cache)),
                   work / "plan.log", timeout=timeout)


def train(model: str, data: Path, work: Path, name: str, cache: Path, timeout: float) -> dict:
    from llmcustoms.runs.run_directory import RunDirectory

    runs = work / "runs"
    command = cli("train", str(data), "--model", model, *TRAIN_FLAGS, "--cache-dir", str(cache), "--output-dir",
                  str(runs), "--run-name", name, "--overwrite", "--yes", "--quiet")
    return measure(command, work / f"{name}.log", RunDirectory.inside(runs, name).metrics_path, timeout)


def fresh(directory: Path) -> Path:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return directory


def measure_baseline(model: str, work: Path, seed: int, timeout: float = 3600) -> dict:
    """`train` on a tiny file: the model, optimizer and one step, with next to no data."""
    data, meta = data_file(work, BASELINE_BYTES / GiB, seed, huge=False)
    runs = fresh(work / "baseline")
    result = train(model, data, runs, "baseline", fresh(runs / "cache"), timeout)
    return {"bytes": meta["bytes"], "rows": meta["rows"], "train": result}


def measure_size(size_gb: float, model: str, work: Path, seed: int, baseline: dict, timeout: float = 3600) -> dict:
    """Generate (or reuse) the file of `size_gb` GiB, then plan, train cold and train warm on it."""
    data, meta = data_file(work, size_gb, seed)
    runs = fresh(work / f"size-{meta['target_bytes']}")
    print(f"{size_gb:g} GiB: {meta['bytes']:,} bytes, {meta['rows']:,} rows", file=sys.stderr, flush=True)
    entry = {"size_gb": size_gb, "model": model, "file": str(data), "bytes": meta["bytes"], "rows": meta["rows"],
             "huge_row_chars": meta["huge_row_chars"],
             "generate_s": meta.get("generate_s"), "load_avg_at_start": list(os.getloadavg()),
             "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    entry["plan"] = plan(model, data, runs, timeout)
    cache = fresh(runs / "cache-train")
    entry["train_cold"] = train(model, data, runs, "cold", cache, timeout)
    entry["train_warm"] = train(model, data, runs, "warm", cache, timeout)
    entry["baseline_rss_mib"] = baseline["train"]["peak_rss_mib"]
    entry["train_beyond_baseline_mib"] = entry["train_cold"]["peak_rss_mib"] - entry["baseline_rss_mib"]
    return entry


def machine() -> dict:
    import psutil
    from importlib.metadata import version

    return {"cpu_count": os.cpu_count(), "ram_gib": psutil.virtual_memory().total / GiB,
            "load_avg_at_start": list(os.getloadavg()), "platform": platform.platform(),
            "python": platform.python_version(),
            "versions": {p: version(p) for p in ("torch", "transformers", "tokenizers", "peft")}, "git": _git()}


def _git() -> dict:
    """Which llmcustoms was measured: the commit, and whether llmcustoms/ differs from it."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""
    return {"commit": git("rev-parse", "HEAD"), "llmcustoms_changed": bool(git("status", "--porcelain", "llmcustoms"))}


# ------------------------------------------------------------------ report

def growth(entries: list[dict]) -> dict:
    """Extra RSS per extra byte of data, from the smallest file to the largest (None with fewer than two)."""
    ok = [e for e in entries if e["train_cold"]["returncode"] == 0 and e["plan"]["returncode"] == 0]
    if len(ok) < 2:
        return {"plan_rss_per_data_byte": None, "train_rss_per_data_byte": None}
    small, large = min(ok, key=lambda e: e["bytes"]), max(ok, key=lambda e: e["bytes"])
    extra = (large["bytes"] - small["bytes"]) / MiB
    rise = lambda run: large[run]["peak_rss_mib"] - small[run]["peak_rss_mib"]  # noqa: E731
    return {"plan_rss_per_data_byte": rise("plan") / extra, "train_rss_per_data_byte": rise("train_cold") / extra,
            "from_bytes": small["bytes"], "to_bytes": large["bytes"]}


def _size(size: int) -> str:
    return f"{size / GiB:.2f} GiB" if size >= GiB / 10 else f"{size / MiB:.1f} MiB"


def _mib(run: dict) -> str:
    return f"{run['peak_rss_mib']:,.0f} MiB" if run["returncode"] == 0 else f"failed ({run['returncode']})"


def _secs(run: dict, key: str = "seconds") -> str:
    return f"{run[key]:.1f} s" if run["returncode"] == 0 and run.get(key) is not None else "-"


def table(results: dict) -> str:
    lines = ["| size | rows | plan: peak RSS | plan: time | train: peak RSS | beyond baseline | "
             "first step (cold cache) | first step (warm cache) |", "|---|---|---|---|---|---|---|---|"]
    baseline = results.get("baseline")
    if baseline:
        run = baseline["train"]
        lines.append(f"| baseline {_size(baseline['bytes'])} | {baseline['rows']:,} | | | {_mib(run)} | | "
                     f"{_secs(run, 'first_step_s')} | |")
    for e in sorted(results.get("sizes", {}).values(), key=lambda e: e["bytes"]):
        cold, warm = e["train_cold"], e["train_warm"]
        beyond = f"{e['train_beyond_baseline_mib']:,.0f} MiB" if cold["returncode"] == 0 else "-"
        lines.append(f"| {_size(e['bytes'])} | {e['rows']:,} | {_mib(e['plan'])} | {_secs(e['plan'])} | "
                     f"{_mib(cold)} | {beyond} | {_secs(cold, 'first_step_s')} | {_secs(warm, 'first_step_s')} |")
    g = growth(list(results.get("sizes", {}).values()))
    if g["train_rss_per_data_byte"] is not None:
        lines.append(f"\nRSS growth from {_size(g['from_bytes'])} to {_size(g['to_bytes'])} of data: "
                     f"plan {g['plan_rss_per_data_byte']:.3f}, train {g['train_rss_per_data_byte']:.3f} "
                     "bytes of RSS per byte of data.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="0.1,0.3,1.0", help="file sizes in GiB, comma-separated")
    parser.add_argument("--model", default=str(Path.home() / ".cache/llmcustoms-dev/smollm2-135m-instruct"))
    parser.add_argument("--work-dir", default=None, help="where generated files and runs go (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before a command is killed")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "large_data.json"))
    parser.add_argument("--table", action="store_true", help="only print the table of what --results holds")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    results_path = Path(args.results)
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    if args.table:
        print(table(results))
        return
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="llmcustoms-large-data-")).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    results.update(machine=machine(), model=args.model, train_flags=list(TRAIN_FLAGS), seed=args.seed)
    print("baseline ...", file=sys.stderr, flush=True)
    results["baseline"] = measure_baseline(args.model, work, args.seed, args.timeout)
    for size in (float(s) for s in args.sizes.split(",") if s):
        entry = measure_size(size, args.model, work, args.seed, results["baseline"], args.timeout)
        results.setdefault("sizes", {})[str(size)] = entry
        results["growth"] = growth(list(results["sizes"].values()))
        results_path.parent.mkdir(parents=True, exist_ok=True)
        results_path.write_text(json.dumps(results, indent=2))
    print(table(results))
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
