"""Is the trained model better than the base model? Presets and `tune` on a real pretrained model.

    python benchmarks/quality.py --model ~/.cache/llmcustoms-dev/smollm2-135m-instruct \\
        [--data-dir ../shared/data] [--only identity:quality,code:base,sentiment:quality:1] [--seeds 3] \\
        [--tune-seeds 1] [--trials 4] [--redo] [--json]
    python benchmarks/quality.py --table [--results FILE]     # the table of what FILE holds

For each dataset the rows are split once (seeded, the same split for every
seed) into a training file, a validation file (the run's own evaluation: which
weights to keep, early stopping) and a test file nothing trains or selects on.
Then, each as a user would run it, through the CLI:

  base           the model as downloaded
  highspeed      llmcustoms train TRAIN --eval-data VAL --preset highspeed
  quality        ... --preset quality (the default)
  bestaccuracy   ... --preset bestaccuracy
  tune           llmcustoms tune --trials N (20 by default), each trial as long
                 as a whole `quality` run (successive halving stops most at a
                 ninth or a third of it), then train with the preset it wrote
                 for `quality`'s steps; the row's `found` says what it chose
                 and what the study cost in `quality` runs. Run again on the
                 same --work, it continues the study with N more trials.

With --peers, the recipes people copy instead, each on the same training rows
(`benchmarks/peer_recipes.py` says what each is):

  default        llmcustoms train TRAIN, with nothing else (it holds out its own rows)
  unsloth        the Unsloth notebook recipe, with transformers + peft + TRL
  trl            `trl sft --use_peft` with the installed TRL's defaults
  equal-time     llmcustoms train TRAIN --eval-data VAL --max-steps N, N chosen so
                 it takes the wall time of the fastest peer recipe (sized once,
                 by seed 0, from the fastest measured run of each; later seeds
                 run seed 0's N, so every seed runs the same configuration)

Seeds: each trained configuration runs once per seed index 0..N-1 (--seeds,
3 by default): index S is `--seed 42+S` for llmcustoms (42, its default) and a
peer recipe's own seed plus S (Unsloth's 3407, TRL's default 42), so seed 0 is
each system as published. `base` runs once (it trains nothing, replies
greedily); `tune` --tune-seeds times, 1 by default (a study costs 4-5 `quality`
runs). The data split is the same for every seed; `default`'s own held-out
rows are not (llmcustoms draws them with its seed).

Datasets: identity (`sharegpt_identity.json`), code (`code_alpaca_2k.json`),
sentiment (one-word "Positive"/"Negative" answers about words of the VADER
lexicon, built from the installed `vaderSentiment` package by
`sentiment_data.py`; none of the presets was tuned on it).

Reported per configuration: test eval loss (mean per reply token) and
perplexity, the share by which perplexity fell from the base model's, time
(status.json's, and the command's whole wall time), the machine's load, how
many of the forgetting check's general questions the model answers
(`training/general_questions.json`), and task success. identity: the share of
held-out identity questions whose greedy reply names the identity the data
teaches; sentiment: the share of held-out words whose greedy reply's first
word is the right label; code: none (test loss only; a sample reply is kept).
Results accumulate in --results (JSON) per (dataset, configuration, seed), so
configurations and seeds can be run one at a time; what is there already is
skipped (--redo measures it again). The Markdown table (`quality_table.py`)
shows each configuration's mean and spread over its seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import forked_cli  # noqa: E402  (next to this script: on sys.path when it runs)
import quality_table  # noqa: E402
import sentiment_data  # noqa: E402

DATASETS = {
    # name: (file, training rows, test rows, validation rows); the rest of the file is unused.
    "identity": ("sharegpt_identity.json", 160, 60, 30),
    "code": ("code_alpaca_2k.json", 160, 60, 30),
    "sentiment": (sentiment_data.FILE, 160, 60, 30),  # built from the vaderSentiment package when absent
}
CONFIGS = ("base", "highspeed", "quality", "bestaccuracy", "tune")
PEERS = ("default", "unsloth", "trl", "equal-time")
IDENTITY = "vicuna"  # the name sharegpt_identity.json teaches (72 of its 500 rows ask for it)
IDENTITY_TEST_ROWS = 12  # of the test rows, how many ask for the identity (its 12 questions come 6 times each)
MAX_NEW_TOKENS = 32  # the identity comes early in a reply; a code sample is a glimpse
LABEL_TOKENS = 8  # a sentiment reply is scored by its first word: more tokens would only cost time


def split_files(data_dir: Path, name: str, work: Path, sizes: tuple[int, int, int] | None = None) -> dict[str, Path]:
    """train/val/test files for one dataset (the same for the same file: seeded).
    `sizes`: (train, test, validation) rows instead of DATASETS' (small test runs)."""
    file, n_train, n_test, n_val = DATASETS[name]
    if sizes:
        n_train, n_test, n_val = sizes
    source = sentiment_data.ensure_file(data_dir, work) if name == "sentiment" else data_dir / file
    rows = [r for r in json.loads(source.read_text()) if _usable(r)]
    random.Random(1234).shuffle(rows)
    if name == "identity":  # enough identity questions in the test set to score them
        asking = [r for r in rows if _names_identity(r)]
        rest = [r for r in rows if not _names_identity(r)]
        k = min(IDENTITY_TEST_ROWS, n_test, len(asking))
        test = asking[:k] + rest[:n_test - k]
        rows = test + sorted(asking[k:] + rest[n_test - k:], key=lambda r: random.Random(r["id"]).random())
    parts = {"test": rows[:n_test], "val": rows[n_test:n_test + n_val],
             "train": rows[n_test + n_val:n_test + n_val + n_train]}
    paths = {}
    for part, chosen in parts.items():
        paths[part] = work / f"{name}-{part}.json"
        paths[part].write_text(json.dumps(chosen))
    return paths


def _names_identity(row: dict) -> bool:
    return any(IDENTITY in turn["value"].lower() for turn in row["conversations"] if turn["from"] == "gpt")


def _usable(row: dict) -> bool:
    return bool(row.get("output", True)) and bool(row.get("conversations", True))


def cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    env = {**os.environ, "COLUMNS": "100"}
    done = forked_cli.run(list(args), env)  # a fresh interpreter unless --fork started the server
    if done.returncode != 0:
        raise SystemExit(f"llmcustoms {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done, time.perf_counter() - started


def train(model: str, paths: dict[str, Path], out: Path, name: str, *extra: str,
          held_out: bool = True) -> tuple[Path, float]:
    """One llmcustoms run (with the validation rows as its evaluation unless not
    `held_out`); its directory and status.json's time. The command's wall time
    goes in WALL[name]."""
    validation = ["--eval-data", str(paths["val"])] if held_out else []
    _, WALL[name] = cli("train", str(paths["train"]), *validation, "--model", model, "--output-dir", str(out),
                        "--run-name", name, "--yes", "--quiet", "--overwrite", *extra)
    status = json.loads((out / name / "status.json").read_text())
    seconds = _seconds(status)
    return out / name, seconds


WALL: dict[str, float] = {}  # each configuration's whole wall time, command start to exit


def peer(recipe: str, model: str, paths: dict[str, Path], out: Path, seed: int) -> tuple[Path, float]:
    """A peer recipe (`peer_recipes.py`) in its own process, at its own seed plus
    `seed`: its directory and its training time."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peer_recipes.py"), recipe, "--model", model,
                           "--train", str(paths["train"]), "--out", str(out / recipe), "--seed-index", str(seed)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"peer recipe {recipe} failed:\n{done.stderr[-3000:]}")
    WALL[recipe] = time.perf_counter() - started
    return out / recipe, json.loads((out / recipe / "peer.json").read_text())["training_seconds"]


def _seconds(status: dict) -> float:
    from datetime import datetime

    parse = lambda text: datetime.strptime(text, "%Y-%m-%dT%H:%M:%S%z")  # noqa: E731
    return (parse(status["updated_at"]) - parse(status["started_at"])).total_seconds()


def tune_then_train(model: str, paths: dict[str, Path], out: Path, trials: int, budget_steps: int, seed: str
                    ) -> tuple[Path, float, dict]:
    """`tune` with trials as long as a whole `quality` run (successive halving cuts
    most short; the full-length check then needs no extra run), then `train`
    with the preset it wrote, for `quality`'s steps. `found` says what it chose
    and how many optimizer steps the study ran in all (trials and checks)."""
    started = time.perf_counter()
    done, _ = cli("tune", str(paths["train"]), "--eval-data", str(paths["val"]), "--model", model, "--output-dir",
                  str(out), "--trials", str(trials), "--max-steps", str(budget_steps), "--study-name", "bench",
                  "--seed", seed)
    study = out / "tune-bench"
    preset = study / "best_preset.yaml"
    tune_seconds = time.perf_counter() - started
    run, _ = train(model, paths, out, "tune", "--preset", str(preset), "--max-steps", str(budget_steps), "--seed", seed)
    import csv

    import yaml

    found = yaml.safe_load(preset.read_text())
    chosen = {k: found.get(k) for k in ("lr", "lora_r", "lora_alpha", "lora_dropout", "warmup_ratio")}
    with open(study / "trials.csv", newline="", encoding="utf-8") as f:
        trial_steps = sum(int(row["steps"] or 0) for row in csv.DictReader(f))
    check_steps = sum(sum(1 for row in _metrics(full) if "loss" in row) for full in study.glob("full-*"))
    chosen.update(trial_steps=trial_steps, check_steps=check_steps, tune_seconds=round(tune_seconds, 1),
                  study_steps_per_quality_run=round((trial_steps + check_steps) / budget_steps, 2))
    return run, time.perf_counter() - started, chosen


# ------------------------------------------------------------------ measuring

def load(model: str, run: Path | None):
    """(model, tokenizer, plan-like) for the base model (run None) or a trained run's kept adapter."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmcustoms.models.generation import load_trained
    from llmcustoms.runs.run_directory import RunDirectory
    from llmcustoms.runs.run_weights import choose_weights

    if run is not None and not (run / "peer.json").exists():
        trained = load_trained(choose_weights(RunDirectory(run), None))
        return trained.model, trained.tokenizer, trained.plan
    tokenizer = AutoTokenizer.from_pretrained(model)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    if run is not None:  # a peer recipe's adapter on the base model
        from peft import PeftModel

        base = PeftModel.from_pretrained(base, str(run / "adapter")).eval()
    return base, tokenizer, argparse.Namespace(data_format="sharegpt", raw_prompts=False, data_report={"base": True},
                                               model=model)


def test_loss(model, tokenizer, plan, test: Path) -> float:
    """Mean loss per reply token over the test file, tokenized as training does."""
    import torch

    from llmcustoms.models import loading
    from llmcustoms.training.batching import TrainingRows, count_loss_tokens
    from llmcustoms.data.dataset import usable_examples
    from llmcustoms.losses.sft import select_logits, token_cross_entropy
    from llmcustoms.data.chat_templates import ensure_chat_template
    from llmcustoms.data.tokenization import Tokenizer

    ensure_chat_template(tokenizer)
    encoder = Tokenizer(tokenizer, stop_token_ids=loading.stop_token_ids(plan.model))
    rows = [encoder.encode(e) for e in usable_examples(test)]
    batches = TrainingRows([], rows, tokenizer.pad_token_id, 1).evaluation_batches(8)
    total = torch.tensor(sum(count_loss_tokens(b["labels"]) for b in batches))
    select_logits(model)
    with torch.no_grad():
        return float(sum(token_cross_entropy(model, b, total)[0] for b in batches))


def prompts(dataset: str, test: Path) -> list[tuple[list[dict], str]]:
    """(conversation before a reply, the reply the data gives) to ask the model:
    identity, each test row's question whose answer names the identity (with
    the conversation before it); sentiment, every test row's question; code,
    the first row's first prompt (a sample to look at)."""
    from llmcustoms.data.dataset import usable_examples
    from llmcustoms.data.prompt_draws import prompt_of

    chosen = []
    for example in usable_examples(test):
        if dataset != "identity":
            sample = prompt_of(example)
            chosen.append((list(sample.messages), sample.reference))
            if dataset == "code":
                break
            continue
        for index, message in enumerate(example.messages):
            if message.role == "assistant" and IDENTITY in message.content.lower():
                chosen.append(([{"role": m.role, "content": m.content} for m in example.messages[:index]],
                               message.content))
                break
    return chosen


def task(model, tokenizer, plan, dataset: str, test: Path) -> dict:
    """The dataset's task success (none for code) and a sample (prompt, greedy reply)."""
    from llmcustoms.models.generation import generate

    tokens = LABEL_TOKENS if dataset == "sentiment" else MAX_NEW_TOKENS
    asked = [(messages[-1]["content"], generate(model, tokenizer, plan, messages, tokens, 0.0), reference)
             for messages, reference in prompts(dataset, test)]
    result = {"sample": asked[0][:2] if asked else None}
    if dataset == "identity":
        success = sum(IDENTITY in reply.lower() for _, reply, _ in asked) / max(1, len(asked))
        # identity_accuracy: the name results files before "task_success" used
        result.update(task_success=success, identity_accuracy=success, identity_questions=len(asked))
    elif dataset == "sentiment":
        right = sum(sentiment_data.is_right(reply, label) for _, reply, label in asked)
        result.update(task_success=right / max(1, len(asked)), task_questions=len(asked))
    return result


def measure(model_path: str, run: Path | None, dataset: str, test: Path) -> dict:
    from llmcustoms.runs.measures import perplexity

    model, tokenizer, plan = load(model_path, run)
    loss = test_loss(model, tokenizer, plan, test)
    result = {"test_loss": loss, "test_ppl": perplexity(loss), **task(model, tokenizer, plan, dataset, test)}
    result["general"], result["general_asked"] = general_knowledge(model, tokenizer, plan)
    if run is not None and (run / "peer.json").exists():
        record = json.loads((run / "peer.json").read_text())
        result.update(steps=record["steps"], planned_steps=record["steps"], kept_step=record["steps"],
                      lr=record["settings"]["learning_rate"], lora_r=record["settings"]["lora_r"],
                      training_seconds=record["training_seconds"], settings=record["settings"])
    elif run is not None:
        plan_json = json.loads((run / "plan.json").read_text())
        status = json.loads((run / "status.json").read_text())
        result.update(steps=status["step"], planned_steps=plan_json["total_steps"], kept_step=status.get("kept_step"),
                      lr=plan_json["lr"], lora_r=(plan_json.get("lora") or {}).get("r"), epochs=plan_json["epochs"],
                      step_seconds=round(sum(row.get("seconds", 0.0) for row in _metrics(run)), 1))
    return result


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def general_knowledge(model, tokenizer, plan) -> tuple[int, int]:
    """How many of the forgetting check's general questions the model answers
    (greedy, as every run scores them), and how many were asked."""
    from llmcustoms.training.general_knowledge import answer_questions, is_right, load_questions

    questions = load_questions()
    replies = answer_questions(model, tokenizer, plan, [q.question for q in questions])
    return sum(is_right(reply, q.answers) for reply, q in zip(replies, questions)), len(questions)


# ------------------------------------------------------------------ seeds and runs

def llmcustoms_seed(seed: int) -> str:
    """llmcustoms' --seed for seed index `seed`: its default plus `seed`, so index 0 is a run as a user gets it."""
    from llmcustoms.planning.planner import DEFAULT_SEED

    return str(DEFAULT_SEED + seed)


def seeds_of(config: str, args) -> range:
    """The seed indices a configuration runs at: `base` once (it trains nothing and
    replies greedily: another seed gives the same numbers), `tune` --tune-seeds
    times (a study costs 4-5 `quality` runs), the rest --seeds times."""
    return range(1) if config == "base" else range(args.tune_seeds) if config == "tune" else range(args.seeds)


def jobs(args) -> list[tuple[str, str, int]]:
    """(dataset, configuration, seed index) to measure: --only's, each DATASET:CONFIG
    at all its seeds or DATASET:CONFIG:SEED at one; by default everything, every
    configuration at seed 0 first, then at seed 1, ..., so a comparison is whole early."""
    if not args.only:
        configs = CONFIGS + (PEERS if args.peers else ())
        last = max(args.seeds, args.tune_seeds, 1)
        return [(d, c, s) for d in DATASETS for s in range(last) for c in configs if s in seeds_of(c, args)]
    wanted = []
    for item in filter(None, args.only.split(",")):
        dataset, config, *seed = item.split(":")
        if dataset not in DATASETS or config not in CONFIGS + PEERS or len(seed) > 1:
            raise SystemExit(f"--only {item}: DATASET:CONFIG[:SEED], DATASET one of {', '.join(DATASETS)}, "
                             f"CONFIG one of {', '.join(CONFIGS + PEERS)}")
        wanted += [(dataset, config, int(s)) for s in (seed or seeds_of(config, args))]
    return wanted


def configuration(args, results: dict, dataset: str, config: str, seed: int, paths: dict[str, Path],
                  out: Path) -> dict:
    """Train (or not: `base`) one configuration at seed index `seed` and measure it;
    `results`: everything measured so far (tune is sized from seed 0's `quality` run,
    equal-time as `quality_table.equal_time_steps` says)."""
    first = {c: quality_table.runs(results, dataset, c).get(0) for c in CONFIGS + PEERS}
    first = {c: measures for c, measures in first.items() if measures is not None}
    load_before, started = os.getloadavg()[0], time.perf_counter()
    chosen, at = None, ("--seed", llmcustoms_seed(seed))
    if config == "base":
        run = None
    elif config in ("tune", "equal-time") and "quality" not in first:
        raise SystemExit(f"run {dataset}:quality:0 first: {config} is sized from it")
    elif config == "tune":
        budget = first["quality"]["planned_steps"]
        run, seconds, chosen = tune_then_train(args.model, paths, out, args.trials, budget, at[1])
    elif config == "equal-time":
        steps = quality_table.equal_time_steps(results, dataset)
        run, seconds = train(args.model, paths, out, config, "--max-steps", str(steps), *at)
    elif config in ("unsloth", "trl"):
        run, seconds = peer(config, args.model, paths, out, seed)
    elif config == "default":
        run, seconds = train(args.model, paths, out, config, *at, held_out=False)
    else:
        run, seconds = train(args.model, paths, out, config, "--preset", config, *at)
    result = measure(args.model, run, dataset, paths["test"])
    result["seconds"] = time.perf_counter() - started if run is None else seconds
    if run is not None:
        result["wall_seconds"] = round(WALL[config] + (chosen["tune_seconds"] if chosen else 0.0), 1)
        result["seed"] = result.get("settings", {}).get("seed", int(at[1]))  # the seed the system itself ran at
    result["load"] = round((load_before + os.getloadavg()[0]) / 2, 2)  # 1-minute averages at start and end
    if chosen is not None:
        result.update(found=chosen, trials=args.trials)
    return result


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(Path.home() / ".cache/llmcustoms-dev/smollm2-135m-instruct"))
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    parser.add_argument("--only", default="", help="DATASET:CONFIG (all its seeds) or DATASET:CONFIG:SEED, "
                        "comma-separated (default: all)")
    parser.add_argument("--seeds", type=int, default=3, help="seed indices 0..N-1 per trained configuration")
    parser.add_argument("--tune-seeds", type=int, default=1, help="seed indices for tune (each is a whole study)")
    parser.add_argument("--redo", action="store_true", help="measure again what --results holds already")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--peers", action="store_true", help="also the peer recipes (see benchmarks/peer_recipes.py)")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "quality.json"))
    parser.add_argument("--work", default=None, help="where runs go (default: a temporary directory)")
    parser.add_argument("--table", action="store_true", help="only print the table of what --results holds")
    parser.add_argument("--rows", default="", help="TRAIN,TEST,VAL rows per dataset instead of the defaults")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--fork", action="store_true", help="fork llmcustoms' commands from a server that imported "
                        "torch once (the test suite's speed; wall times then leave out the interpreter's start)")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    if args.fork:
        forked_cli.start_server({**os.environ, "COLUMNS": "100"})
    results_path = Path(args.results)
    results = quality_table.normalize(json.loads(results_path.read_text())) if results_path.exists() else {}
    if args.table:
        print(quality_table.table(results, DATASETS, CONFIGS + PEERS))
        return
    work = Path(args.work or tempfile.mkdtemp(prefix="llmcustoms-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    sizes = tuple(int(n) for n in args.rows.split(",")) if args.rows else None
    splits: dict[str, dict[str, Path]] = {}
    for dataset, config, seed in jobs(args):
        if seed in quality_table.runs(results, dataset, config) and not args.redo:
            print(f"{dataset} / {config} / seed {seed}: in {results_path.name} already", file=sys.stderr, flush=True)
            continue
        if dataset not in splits:
            splits[dataset] = split_files(Path(args.data_dir), dataset, work, sizes)
        print(f"{dataset} / {config} / seed {seed} ...", file=sys.stderr, flush=True)
        # Seed 0 where runs went before seeds (a --work's tune study goes on there); other seeds beside it.
        out = work / (dataset if seed == 0 else f"{dataset}-seed{seed}")
        result = configuration(args, results, dataset, config, seed, splits[dataset], out)
        quality_table.record(results, dataset, config, seed, result)
        results_path.parent.mkdir(parents=True, exist_ok=True)
        results_path.write_text(json.dumps(results, indent=2))
        print(f"  {json.dumps({k: v for k, v in result.items() if k != 'sample'})}", file=sys.stderr, flush=True)
    print(quality_table.table(results, DATASETS, CONFIGS + PEERS))
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
