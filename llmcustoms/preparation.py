"""From the user's options to a plan and tokenized data, before any weight loads.

Order matters: read and validate the data (cheap, fails fast on bad rows),
split off the evaluation rows, pick or describe the model, measure token
lengths with its tokenizer, then plan. `train`, `plan` and `tune` all start here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from llmcustoms import options
from llmcustoms.data import Dataset, Example, fingerprint, read_dataset
from llmcustoms.errors import ConfigError, DataError, ModelError
from llmcustoms.hardware import GIB, Hardware
from llmcustoms.memory import SAFETY_MARGIN
from llmcustoms.plan import DataStats, Plan
from llmcustoms.planning import ParameterOptimizer
from llmcustoms.presets import TrainingPreset, find_model_spec, load_families, load_preset
from llmcustoms.settings import Settings
from llmcustoms.tokenization import TokenizedExample, Tokenizer, ensure_chat_template, first_loss_position, truncate

DEFAULT_PRESET = "quality"
# Bump when the tokenized format or masking rules change, to ignore older cache files.
CACHE_FORMAT = "tokenized-v1"
# Without a tokenizer (planning offline), lengths are estimated from characters.
CHARS_PER_TOKEN = 3.6
TEMPLATE_TOKENS_PER_MESSAGE = 6


@dataclass
class TrainOptions:
    """What the user asked for. None means "not given": the plan decides."""

    data: str
    model: str | None = None
    preset: str | None = None
    eval_data: str | None = None
    skip_bad_rows: bool = False
    # field -> (value, source): plan values set by a flag or the environment
    overrides: dict[str, tuple[Any, str]] = field(default_factory=dict)
    model_source: str = "flag"
    preset_source: str = "default"
    cache_dir: str | None = None  # where tokenized data is cached; None: the default place

    def override(self, name: str, default: Any) -> Any:
        return self.overrides.get(name, (default, ""))[0]


def train_options(settings: Settings) -> TrainOptions:
    """What the user asked for, from the settings with the command's flags
    already merged in (flag > environment); what neither gives, the plan decides."""
    chosen = settings.values
    if chosen.get("data") is None:
        raise ConfigError("No training data given.",
                          "Pass the data file (`llmcustoms train data.jsonl`), or set LLMCUSTOMS_DATA "
                          "(`llmcustoms setup` writes it).")
    overrides = {options.BY_NAME[name].plan: pair for name, pair in chosen.items() if options.BY_NAME[name].plan}

    def value(name: str, default: Any = None) -> Any:
        return chosen[name][0] if name in chosen else default

    def source(name: str, default: str) -> str:
        return chosen[name][1] if name in chosen else default

    return TrainOptions(data=str(value("data")), model=value("model"), preset=value("preset"),
                        eval_data=value("eval_data"), skip_bad_rows=bool(value("skip_bad_rows", False)),
                        overrides=overrides, model_source=source("model", "flag"),
                        preset_source=source("preset", "default"), cache_dir=value("cache_dir"))


@dataclass
class PreparedRun:
    plan: Plan
    tokenizer: Any  # None when planning offline without the model's tokenizer
    train: list[TokenizedExample]
    evaluation: list[TokenizedExample]
    dataset: Dataset
    eval_source: str
    truncated: int
    dropped: int
    used_fallback_template: bool
    seconds: float = 0.0  # time from reading the data to the plan: the wait before the first step


def split_eval(n_rows: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded train/eval split of row indices; the same seed gives the same split."""
    if fraction <= 0 or n_rows < 2:
        return list(range(n_rows)), []
    n_eval = min(n_rows - 1, max(1, round(n_rows * fraction)))
    order = np.random.default_rng(seed).permutation(n_rows)
    eval_idx = sorted(order[:n_eval].tolist())
    held_out = set(eval_idx)
    return [i for i in range(n_rows) if i not in held_out], eval_idx


def estimated_stats(train: list[Example], eval_rows: int, fmt: str) -> DataStats:
    """Token lengths guessed from characters, for planning without a tokenizer."""
    def tokens(text_chars: int, messages: int) -> int:
        return int(text_chars / CHARS_PER_TOKEN) + TEMPLATE_TOKENS_PER_MESSAGE * messages

    lengths, firsts = [], []
    for e in train:
        if e.is_chat:
            lengths.append(tokens(e.char_count(), len(e.messages)))
            firsts.append(tokens(sum(len(c) for _, c in e.messages[:-1]), len(e.messages) - 1) + 2)
        else:
            lengths.append(tokens(e.char_count(), 1))
            firsts.append(max(1, tokens(len(e.prompt), 0)))
    return DataStats(lengths=tuple(lengths), first_loss_positions=tuple(firsts), eval_rows=eval_rows, format=fmt,
                     length_source=f"characters (about {CHARS_PER_TOKEN} per token; the tokenizer is not available offline)")


def eval_fraction(preset: TrainingPreset, total_rows: int, overrides: dict[str, tuple[Any, str]]) -> tuple[float, str]:
    """The share of rows held out for evaluation, and where it came from.
    Needed before planning proper, since the split decides the training rows;
    so before the model is known, which is why a preset cannot set it by model
    size (`NOT_BY_MODEL_SIZE`) and the dataset-size bucket alone decides it."""
    if "eval_split" in overrides:
        return overrides["eval_split"]
    values, bucket = preset.for_dataset_size(total_rows)
    return values["eval_split"], f"preset {preset.name} ({bucket} dataset)"


def _split(options: TrainOptions, dataset: Dataset, preset: Any) -> tuple[list[Example], list[Example], str, float]:
    """Training and evaluation examples, a description of the split, and the fraction held out."""
    if options.eval_data:
        eval_set = read_dataset(options.eval_data, skip_bad_rows=options.skip_bad_rows)
        return dataset.examples, eval_set.examples, f"from {Path(options.eval_data).name}", 0.0
    seed = options.override("seed", 42)
    fraction, fraction_source = eval_fraction(preset, len(dataset.examples), options.overrides)
    train_idx, eval_idx = split_eval(len(dataset.examples), fraction, seed)
    train = [dataset.examples[i] for i in train_idx]
    if not train:
        raise DataError(f"{dataset.path.name}: no rows left for training after the evaluation split.",
                        "Lower --eval-split or add more rows.")
    return (train, [dataset.examples[i] for i in eval_idx], f"{fraction:.0%} split, seed {seed}, {fraction_source}",
            fraction)


def _tokenize(model_name: str, train: list[Example], evaluation: list[Example], train_on_prompt: bool,
              trust_remote_code: bool, data_key: str = "",
              cache: str | None = None) -> tuple[Any, bool, list[TokenizedExample], list[TokenizedExample]]:
    """(tokenizer, used the fallback template, train rows, eval rows), untruncated.
    With a `data_key` (the data's checksum and split), results are cached
    under `cache_dir(cache)`."""
    from llmcustoms import modeling

    hf_tokenizer = modeling.load_tokenizer(model_name, trust_remote_code)
    used_fallback = ensure_chat_template(hf_tokenizer)
    stop_ids = modeling.stop_token_ids(model_name)
    key = tokenization_cache_key(hf_tokenizer, stop_ids, train_on_prompt, data_key) if data_key else None
    directory = cache_dir(cache) / "tokenized"
    cached = read_tokenization_cache(key, directory) if key else None
    if cached is not None:
        return hf_tokenizer, used_fallback, cached[0], cached[1]
    tokenizer = Tokenizer(hf_tokenizer, train_on_prompt=train_on_prompt, stop_token_ids=stop_ids)
    rows = [tokenizer.encode(e) for e in train], [tokenizer.encode(e) for e in evaluation]
    if key:
        write_tokenization_cache(key, directory, *rows)
    return hf_tokenizer, used_fallback, rows[0], rows[1]


def cache_dir(explicit: str | None = None) -> Path:
    """Where prepared data is cached: `--cache-dir` or LLMCUSTOMS_CACHE_DIR (from the
    settings), else the process environment's LLMCUSTOMS_CACHE_DIR, else $XDG_CACHE_HOME/llmcustoms."""
    import os

    explicit = explicit or os.environ.get("LLMCUSTOMS_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmcustoms"


def tokenization_cache_key(hf_tokenizer: Any, stop_ids: set[int], train_on_prompt: bool, data_key: str) -> str:
    """Everything the token ids and labels depend on: the data and split, the whole
    tokenizer definition, its chat template and special tokens, the masking rule."""
    import hashlib

    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else repr(sorted(hf_tokenizer.get_vocab().items()))
    parts = [CACHE_FORMAT, data_key, definition, str(hf_tokenizer.chat_template), str(hf_tokenizer.eos_token_id),
             str(hf_tokenizer.bos_token_id), str(sorted(stop_ids)), str(train_on_prompt)]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def _flatten(rows: list[TokenizedExample], prefix: str) -> dict[str, Any]:
    import torch

    offsets = np.cumsum([0] + [len(r.input_ids) for r in rows])
    flat_ids = [i for r in rows for i in r.input_ids]
    flat_labels = [i for r in rows for i in r.labels]
    return {f"{prefix}_ids": torch.tensor(flat_ids, dtype=torch.int64), f"{prefix}_labels": torch.tensor(flat_labels, dtype=torch.int64),
            f"{prefix}_offsets": torch.tensor(offsets, dtype=torch.int64),
            f"{prefix}_rows": torch.tensor([r.row for r in rows], dtype=torch.int64)}


def _unflatten(tensors: dict[str, Any], prefix: str) -> list[TokenizedExample]:
    ids, labels = tensors[f"{prefix}_ids"].tolist(), tensors[f"{prefix}_labels"].tolist()
    offsets, rows = tensors[f"{prefix}_offsets"].tolist(), tensors[f"{prefix}_rows"].tolist()
    return [TokenizedExample(row, ids[a:b], labels[a:b]) for row, a, b in zip(rows, offsets, offsets[1:])]


def write_tokenization_cache(key: str, directory: Path, train: list[TokenizedExample],
                             evaluation: list[TokenizedExample]) -> None:
    import os

    from safetensors.torch import save_file

    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{key}.{os.getpid()}.tmp"
        save_file({**_flatten(train, "train"), **_flatten(evaluation, "eval")}, str(tmp))
        os.replace(tmp, directory / f"{key}.safetensors")
    except OSError:
        pass  # a cache that cannot be written only costs time next run


def read_tokenization_cache(key: str, directory: Path) -> tuple[list[TokenizedExample], list[TokenizedExample]] | None:
    from safetensors.torch import load_file

    path = directory / f"{key}.safetensors"
    if not path.is_file():
        return None
    try:
        tensors = load_file(str(path))
        return _unflatten(tensors, "train"), _unflatten(tensors, "eval")
    except Exception:  # a damaged cache file is ignored: safetensors raises several types
        return None


def prepare_run(options: TrainOptions, hardware: Hardware, budget_bytes: int | None = None,
                tokenizer_required: bool = True, world_size: int = 1) -> PreparedRun:
    """Read, split, choose, tokenize and plan. With `tokenizer_required=False`
    (the `plan` command) a model that is not downloaded is planned from preset
    facts and character-based length estimates instead of failing."""
    from llmcustoms import modeling

    started = time.perf_counter()
    dataset = read_dataset(options.data, skip_bad_rows=options.skip_bad_rows)
    preset = load_preset(options.preset or DEFAULT_PRESET)
    families = load_families()
    catalog = tuple(spec for family in families.values() for spec in family.models)
    optimizer = ParameterOptimizer(hardware, preset, budget_bytes, catalog)
    trust_remote_code = bool(options.override("trust_remote_code", False))
    train_examples, eval_examples, eval_source, fraction = _split(options, dataset, preset)
    data_sha = fingerprint(options.data)
    eval_sha = fingerprint(options.eval_data) if options.eval_data else ""

    candidates = [modeling.choice_from_spec(find_model_spec(m, families), families, "optimizer")
                  for m in preset.model_candidates(hardware.has_gpu)]
    choice_reason = None
    if options.model:
        model = modeling.describe_model(options.model, families, options.model_source, trust_remote_code)
    else:
        rough = estimated_stats(train_examples, len(eval_examples), dataset.format)
        model, choice_reason = optimizer.choose_model(candidates, rough, options.overrides, world_size)

    hf_tokenizer, used_fallback = None, False
    train_full: list[TokenizedExample] = []
    eval_full: list[TokenizedExample] = []
    try:
        # Untruncated first: planning picks max_seq_len from these lengths.
        data_key = f"{data_sha}:{eval_sha or fraction}:{options.override('seed', 42)}:{options.skip_bad_rows}"
        hf_tokenizer, used_fallback, train_full, eval_full = _tokenize(
            model.name, train_examples, eval_examples, bool(options.override("train_on_prompt", False)), trust_remote_code,
            data_key, options.cache_dir)
    except ModelError:
        if tokenizer_required:
            raise
    if hf_tokenizer is None:
        stats = estimated_stats(train_examples, len(eval_examples), dataset.format)
    else:
        stats = DataStats(lengths=tuple(len(e.input_ids) for e in train_full),
                          first_loss_positions=tuple(first_loss_position(e) for e in train_full),
                          eval_rows=len(eval_full), format=dataset.format)

    plan = optimizer.plan(model, stats, options.overrides, preset_source=options.preset_source, world_size=world_size)
    if choice_reason:
        plan = replace(plan, reasons=(choice_reason,) + plan.reasons)
    plan = replace(plan, data=str(Path(options.data).resolve()), data_format=dataset.format,
                   data_sha256=data_sha, row_max_len=plan.max_seq_len, eval_data_sha256=eval_sha,
                   skip_bad_rows=options.skip_bad_rows,
                   eval_data=str(Path(options.eval_data).resolve()) if options.eval_data else None, eval_split=fraction)
    train = truncate(train_full, plan.max_seq_len)
    evaluation = truncate(eval_full, plan.max_seq_len)
    if hf_tokenizer is not None:
        if plan.eval_rows != len(evaluation.examples):
            plan = plan.with_changes(eval_rows=len(evaluation.examples))
        if not train.examples:
            raise ConfigError(f"No training row keeps a response token within {plan.max_seq_len} tokens.",
                              "Raise --max-seq-len.")
    return PreparedRun(plan=plan, tokenizer=hf_tokenizer, train=train.examples, evaluation=evaluation.examples,
                       dataset=dataset, eval_source=eval_source, truncated=train.truncated + evaluation.truncated,
                       dropped=train.dropped + evaluation.dropped, used_fallback_template=used_fallback,
                       seconds=time.perf_counter() - started)


def _less_sharding_warning(plan: Plan, world_size: int) -> str | None:
    """A warning (for `Plan.warnings`) when an FSDP run resumes over fewer
    processes than it was planned for and the larger shards are unlikely to fit.
    From the plan's own estimate: weights, gradients and optimizer state grow by
    old/new world size."""
    memory = plan.memory
    if plan.distributed != "fsdp" or world_size >= plan.world_size or not memory:
        return None
    state = memory["weights_bytes"] + memory["gradients_bytes"] + memory["optimizer_bytes"]
    grown = memory["total_bytes"] + state * (plan.world_size / world_size - 1)
    if world_size == 1:
        grown -= memory.get("gathered_bytes", 0)  # nothing to gather from others
    if grown <= memory["budget_bytes"] * (1 - SAFETY_MARGIN):
        return None
    return (f"sharded over {plan.world_size} processes this run needs about "
            f"{memory['total_bytes'] / GIB:.1f} GiB per process; with {world_size} about {grown / GIB:.1f} GiB, more "
            f"than the {memory['budget_bytes'] / GIB:.1f} GiB planned for. Out of memory is likely; resume with "
            f"--num-processes {plan.world_size} to keep the sharding")


def prepare_resume(plan: Plan, world_size: int = 1) -> PreparedRun:
    """The same rows, in the same split, tokenized the same way as when the run
    began: everything comes from the run's plan.json. With another number of
    processes, accumulation is recomputed so the effective batch (and so every
    step's rows) stays the same."""
    if world_size != plan.world_size:
        accum = max(1, -(-plan.effective_batch_size // (plan.micro_batch_size * world_size)))
        # Sharding needs several processes; a checkpoint holds whole tensors either way.
        distributed = "none" if world_size == 1 else plan.distributed if plan.distributed != "none" else "ddp"
        warning = _less_sharding_warning(plan, world_size)
        plan = plan.with_changes(f"resumed with {world_size} process(es) instead of {plan.world_size}: "
                                 f"accumulation {plan.grad_accum} -> {accum}", world_size=world_size, grad_accum=accum,
                                 distributed=distributed)
        if warning:
            plan = plan.with_warning(warning)
    for path, expected in ((plan.data, plan.data_sha256), (plan.eval_data, plan.eval_data_sha256)):
        if path and expected:
            if not Path(path).exists():
                raise DataError(f"The run's data file {path} is gone.", "Put it back where it was to resume this run.")
            if fingerprint(path) != expected:
                raise DataError(f"{Path(path).name} has changed since the run started (its checksum differs).",
                                "Restore the original data file, or start a new run with `llmcustoms train`.")
    options = TrainOptions(data=plan.data, model=plan.model, eval_data=plan.eval_data, skip_bad_rows=plan.skip_bad_rows,
                           overrides={"seed": (plan.seed, "plan"), "eval_split": (plan.eval_split, "plan")})
    dataset = read_dataset(plan.data, skip_bad_rows=plan.skip_bad_rows)
    train_examples, eval_examples, eval_source, _ = _split(options, dataset, preset=None)
    hf_tokenizer, used_fallback, train_full, eval_full = _tokenize(
        plan.model, train_examples, eval_examples, plan.train_on_prompt, plan.trust_remote_code)
    # The rows as the run began; FineTuner cuts them further if recovery shortened them.
    train = truncate(train_full, plan.row_max_len or plan.max_seq_len)
    evaluation = truncate(eval_full, plan.row_max_len or plan.max_seq_len)
    if len(train.examples) != plan.train_rows:
        raise DataError(f"{Path(plan.data).name} has changed since the run started: it now gives "
                        f"{len(train.examples)} training rows, the run was planned for {plan.train_rows}.",
                        "Restore the original data file, or start a new run with `llmcustoms train`.")
    return PreparedRun(plan=plan, tokenizer=hf_tokenizer, train=train.examples, evaluation=evaluation.examples,
                       dataset=dataset, eval_source=eval_source, truncated=train.truncated + evaluation.truncated,
                       dropped=train.dropped + evaluation.dropped, used_fallback_template=used_fallback)
