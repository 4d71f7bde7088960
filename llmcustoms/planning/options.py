"""Every option a user can set, declared once.

One row per option: its type, range, help text, command-line flag,
`LLMCUSTOMS_*` variable, preset key and the plan value it sets. Everything
else is derived from this table: the Typer options (`flags.py`), the settings
read from the environment and `.env` (`planning/settings.py`), `.env.example`, the
values a preset file may hold and their range checks (`planning/presets.py`), and the
values planning accepts as overrides (`planning/planner.py`). A test holds each of
those to the table, so a new option cannot reach only some of them.

Adding an option: a row here; its default in the preset files (if a preset
sets it) or in planning; the place where it takes effect. CONTRIBUTING.md
has the recipe.

No torch, no Typer here: planning imports this module.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from llmcustoms.planning.objective_kinds import OBJECTIVES

PREFIX = "LLMCUSTOMS_"
# The commands whose options come from this table.
TRAIN, PLAN, TUNE, RESUME, RUNS, LR_FIND = "train", "plan", "tune", "resume", "runs", "lr-find"
PLANNING = frozenset({TRAIN, PLAN, TUNE, LR_FIND})


class Given(NamedTuple):
    """A value the user gave, and where from ("flag", "environment variable
    LLMCUSTOMS_X", ".env line 3", a preset's name): what the plan records as its source."""
    value: Any
    source: str


# Option (or plan field) name -> what the user gave for it.
Overrides = dict[str, Given]


@dataclass(frozen=True)
class Option:
    """One option. `flag=None`: not a command-line flag; `env=None`: no
    environment variable; `plan=None`: not a value a user overrides in the
    plan (it picks the model, the data or where output goes, or only a preset
    sets it)."""

    name: str  # the command parameter's name
    kind: type  # int, float, bool or str
    help: str
    flag: str | None = None
    short: str | None = None
    env: str | None = None  # without the LLMCUSTOMS_ prefix
    preset: str | None = None  # key in a preset file
    plan: str | None = None  # the override name planning reads
    minimum: float | None = None
    maximum: float | None = None
    max_open: bool = False  # the maximum itself is not allowed
    min_open: bool = False  # the minimum itself is not allowed
    # The values it takes: a tuple, or a live collection that may grow after import
    # (`objective_kinds.OBJECTIVES`: an objective a loss adds), read whenever a value is checked.
    choices: Collection[str] = field(default=(), hash=False)
    commands: frozenset[str] = PLANNING
    argument: bool = False  # a positional argument rather than a --flag

    @property
    def variable(self) -> str | None:
        return PREFIX + self.env if self.env else None

    def describe_range(self) -> str:
        """What a valid value is, in words: the tail of every range message."""
        if self.choices:
            return f"one of {', '.join(self.choices)}"
        if self.kind is bool:
            return "true or false"
        if self.kind is str:
            return "text"
        noun = "a whole number" if self.kind is int else "a number"
        parts = []
        # A whole number's bound in full (a seed's 4294967295, not 4.29497e+09).
        shown = (lambda bound: f"{int(bound)}" if self.kind is int and float(bound).is_integer() else f"{bound:g}")
        if self.minimum is not None:
            parts.append(f"above {shown(self.minimum)}" if self.min_open else f"of at least {shown(self.minimum)}")
        if self.maximum is not None:
            parts.append(f"below {shown(self.maximum)}" if self.max_open else f"of at most {shown(self.maximum)}")
        return noun + (" " + " and ".join(parts) if parts else "")

    def problem(self, value: Any) -> str | None:
        """Why `value` is not valid for this option, or None if it is."""
        return None if self._valid(value) else f"expected {self.describe_range()}"

    def _valid(self, value: Any) -> bool:
        if self.choices:
            return value in self.choices
        # bool is a subclass of int in Python; `lora_r: true` is still a mistake.
        if isinstance(value, bool) != (self.kind is bool):
            return False
        if self.kind in (bool, str):
            return isinstance(value, self.kind)
        numbers = (int,) if self.kind is int else (int, float)
        if not isinstance(value, numbers) or not math.isfinite(value):
            return False
        low, high = self.minimum, self.maximum
        too_low = low is not None and (value < low or (self.min_open and value == low))
        too_high = high is not None and (value > high or (self.max_open and value == high))
        return not (too_low or too_high)

    def parse(self, text: str) -> Any:
        """A value from text (an environment variable); ValueError says what is expected."""
        text = text.strip()
        value: Any
        try:
            if self.kind is bool:
                value = _parse_bool(text)
            elif self.kind is int:
                value = int(text)
            elif self.kind is float:
                value = float(text)
            else:
                value = text
        except ValueError:
            raise ValueError(f"expected {self.describe_range()}") from None
        problem = self.problem(value)
        if problem:
            raise ValueError(problem)
        return value


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


_BOTH = frozenset({TRAIN, PLAN})
_OUTPUT = frozenset({TRAIN, TUNE, RESUME, RUNS, LR_FIND})
# The LoRA shape sets the scale of the updates, so the range test takes it too.
_LORA = frozenset({TRAIN, PLAN, LR_FIND})

OPTIONS: tuple[Option, ...] = (
    # What to train on and with: not plan values, but settings like the rest.
    Option("data", str, "Training data: .jsonl, .json, .csv, .parquet, .txt or a saved datasets directory "
           "(`llmcustoms setup` sets the variable).", env="DATA", argument=True),
    Option("model", str, "Hugging Face Hub id or local model directory. Default: the preset's best model that fits.",
           flag="--model", short="-m", env="MODEL"),
    Option("preset", str, "highspeed, quality (default), bestaccuracy, or a preset YAML file.",
           flag="--preset", short="-p", env="PRESET"),
    Option("method", str, "lora, qlora (4-bit base) or full fine-tuning. Default: what fits.",
           flag="--method", env="METHOD", preset="method", plan="method", choices=("lora", "qlora", "full")),
    Option("output_dir", str, "Where run directories go. Default: runs.", flag="--output-dir", short="-o",
           env="OUTPUT_DIR", commands=_OUTPUT),
    Option("eval_data", str, "A separate evaluation file (replaces --eval-split).", flag="--eval-data",
           env="EVAL_DATA"),
    Option("skip_bad_rows", bool, "Skip every row that fails validation, however many (by default up to 5% are "
           "skipped and more stop the run).", flag="--skip-bad-rows", env="SKIP_BAD_ROWS"),
    Option("strict", bool, "Stop at the first row that fails validation.", flag="--strict", env="STRICT"),
    # The length of training.
    # At most a thousand passes: far more than fine-tuning wants, and a bound that keeps
    # the step count (epochs x steps per epoch) a number; 1e308 overflowed it.
    Option("epochs", float, "Passes over the training data.", flag="--epochs", env="EPOCHS", preset="epochs",
           plan="epochs", minimum=0, min_open=True, maximum=1000, commands=_BOTH),
    Option("max_steps", int, "Stop after this many optimizer steps (overrides --epochs).", flag="--max-steps",
           env="MAX_STEPS", plan="max_steps", minimum=1, commands=_BOTH),
    # Batch shape and sequence length.
    Option("batch_size", int, "Micro-batch size: rows per forward pass. Default: the largest that fits.",
           flag="--batch-size", env="BATCH_SIZE", plan="micro_batch_size", minimum=1),
    Option("grad_accum", int, "Micro-batches per optimizer step.", flag="--grad-accum", env="GRAD_ACCUM",
           plan="grad_accum", minimum=1),
    Option("effective_batch_size", int, "Rows per optimizer step, over micro-batches and processes (the planner "
           "picks the micro-batch and accumulation to reach it).", preset="effective_batch_size", minimum=1),
    Option("max_seq_len", int, "Longest sequence in tokens; longer rows are truncated.", flag="--max-seq-len",
           env="MAX_SEQ_LEN", preset="max_seq_len", plan="max_seq_len", minimum=16),
    # The optimizer and its schedule.
    Option("lr", float, "Peak learning rate.", flag="--lr", env="LR", preset="lr", plan="lr", minimum=0,
           maximum=1, min_open=True, max_open=True, commands=_BOTH),
    Option("lr_scheduler", str, "Learning-rate decay after warmup.", flag="--lr-scheduler", env="LR_SCHEDULER",
           preset="lr_scheduler", plan="lr_scheduler", choices=("cosine", "linear", "constant"),
           commands=frozenset({TRAIN, PLAN, TUNE})),
    Option("warmup_ratio", float, "Share of steps spent warming up.", flag="--warmup-ratio", env="WARMUP_RATIO",
           preset="warmup_ratio", plan="warmup_ratio", minimum=0, maximum=1, max_open=True, commands=_BOTH),
    Option("weight_decay", float, "AdamW weight decay (on matrices only).", flag="--weight-decay",
           env="WEIGHT_DECAY", preset="weight_decay", plan="weight_decay", minimum=0, maximum=1, max_open=True),
    Option("max_grad_norm", float, "Clip the gradient norm to this (0: no clipping).", flag="--max-grad-norm",
           env="MAX_GRAD_NORM", preset="max_grad_norm", plan="max_grad_norm", minimum=0),
    # LoRA.
    Option("lora_r", int, "LoRA rank.", flag="--lora-r", env="LORA_R", preset="lora_r", plan="lora_r", minimum=1,
           commands=_LORA),
    Option("lora_alpha", int, "LoRA alpha (scale = alpha / r).", flag="--lora-alpha", env="LORA_ALPHA",
           preset="lora_alpha", plan="lora_alpha", minimum=1, commands=_LORA),
    Option("lora_dropout", float, "Dropout on the LoRA path.", flag="--lora-dropout", env="LORA_DROPOUT",
           preset="lora_dropout", plan="lora_dropout", minimum=0, maximum=1, max_open=True, commands=_LORA),
    # Evaluation and checkpoints.
    Option("eval_split", float, "Share of rows held out for evaluation.", flag="--eval-split", env="EVAL_SPLIT",
           preset="eval_split", plan="eval_split", minimum=0, maximum=1, max_open=True),
    Option("eval_every", int, "Evaluate every N optimizer steps. Default: from the preset's evaluations per epoch.",
           flag="--eval-every", env="EVAL_EVERY", plan="eval_every", minimum=1, commands=_BOTH),
    Option("evals_per_epoch", int, "Evaluations per epoch (0: only at the end), when --eval-every is not given.",
           preset="evals_per_epoch", minimum=0),
    Option("early_stopping_patience", int, "Stop after N evaluations without a better eval loss (0: never).",
           flag="--early-stopping-patience", env="EARLY_STOPPING_PATIENCE", preset="early_stopping_patience",
           plan="early_stopping_patience", minimum=0, commands=_BOTH),
    Option("forgetting_limit", float, "How much the loss on general text may rise over the base model's for "
           "weights to be kept (0.1: 10%). Default: 0, no limit (measured and reported only).", flag="--forgetting-limit",
           env="FORGETTING_LIMIT", plan="forgetting_limit", minimum=0, commands=PLANNING),
    Option("replay", float, "Mix the base model's own replies to general prompts the package ships into "
           "training, this share of each step's rows (0.25: a quarter more), so the model keeps answering as it "
           "did (0: off). Default: 0.25 for supervised rows in one process.", flag="--replay", env="REPLAY", plan="replay", minimum=0, maximum=1,
           commands=PLANNING),
    Option("save_every", int, "Checkpoint every N optimizer steps.", flag="--save-every", env="SAVE_EVERY",
           plan="save_every", minimum=1, commands=_BOTH),
    Option("keep", int, "Checkpoints to keep (plus the best by eval loss). Default: 3.", flag="--keep",
           env="KEEP_CHECKPOINTS", plan="keep_checkpoints", minimum=1, commands=_BOTH),
    # numpy's and torch's generators take seeds in [0, 2^32): a value outside would fail halfway into the run.
    Option("seed", int, "Random seed: same seed, same run.", flag="--seed", env="SEED", plan="seed", minimum=0,
           maximum=2 ** 32 - 1),
    # Memory and precision.
    Option("gradient_checkpointing", bool, "Recompute activations to save memory (slower). Default: only when needed.",
           flag="--gradient-checkpointing", env="GRADIENT_CHECKPOINTING", plan="gradient_checkpointing"),
    Option("mixed_precision", str, "Autocast precision; no means fp32 throughout. Default: bf16 or fp16 on a GPU, "
           "bf16 on a CPU with AVX512-BF16 or AMX, else fp32.",
           flag="--mixed-precision", env="MIXED_PRECISION", plan="mixed_precision", choices=("no", "bf16", "fp16")),
    Option("optimizer", str, "adamw (32-bit moments), adamw_8bit (bitsandbytes, a quarter of the state), or their "
           "paged versions, whose state moves to CPU RAM when the GPU runs short. Default: adamw_8bit where it lets "
           "a larger micro-batch fit on a GPU, else adamw.", flag="--optimizer", env="OPTIMIZER", plan="optimizer",
           choices=("adamw", "adamw_8bit", "paged_adamw", "paged_adamw_8bit")),
    Option("packing", bool, "Run each micro-batch's rows as one padding-free sequence (per-row positions, no "
           "attention across rows; same loss). Default: on with an Ampere or newer GPU and varlen attention, else off.",
           flag="--packing", env="PACKING", plan="packing"),
    Option("compile", bool, "torch.compile the model: slower first steps, faster later ones. Default: off.",
           flag="--compile", env="COMPILE", plan="compile"),
    # What the run learns: replies (sft), or to prefer the chosen reply of a pair (dpo); `objective_kinds.py`.
    Option("objective", str, "sft (learn the replies) or dpo (learn to prefer the chosen reply of preference "
           "pairs). Default: dpo for preference data, else sft.", flag="--objective", env="OBJECTIVE",
           plan="objective", choices=OBJECTIVES, commands=frozenset({TRAIN, PLAN, TUNE})),
    Option("beta", float, "DPO's beta: how far the model may move from the reference (higher: less).",
           flag="--beta", env="BETA", plan="beta", minimum=0, min_open=True, commands=frozenset({TRAIN, PLAN, TUNE})),
    Option("from_run", str, "Start from a finished run's weights (its adapter goes on training; with DPO its "
           "model is the reference): the SFT-then-DPO recipe.", flag="--from-run", env="FROM_RUN", commands=_BOTH),
    # What the loss covers, and trust.
    Option("train_on_prompt", bool, "Also compute the loss on prompts, not only on responses.",
           flag="--train-on-prompt", env="TRAIN_ON_PROMPT", plan="train_on_prompt"),
    Option("raw_prompts", bool, "Join prompt/completion rows as they are, without the model's chat template.",
           flag="--raw-prompts", env="RAW_PROMPTS", plan="raw_prompts"),
    Option("trust_remote_code", bool, "Allow the model repository to run its own code.", flag="--trust-remote-code",
           env="TRUST_REMOTE_CODE", plan="trust_remote_code"),
    Option("allow_pickle_weights", bool, "Also load model weights from pickle files (pytorch_model.bin), which can "
           "run code when loaded. Default: safetensors weights only.", flag="--allow-pickle-weights",
           env="ALLOW_PICKLE_WEIGHTS", plan="allow_pickle_weights"),
    # Several processes.
    Option("distributed", str, "With several processes: ddp (each holds the model; default) or fsdp (full "
           "fine-tuning sharded over the processes).", flag="--distributed", env="DISTRIBUTED", plan="distributed",
           choices=("ddp", "fsdp"), commands=_BOTH),
    # Where prepared data is kept between runs.
    Option("cache_dir", str, "Where prepared (tokenized) data is cached between runs. Default: ~/.cache/llmcustoms.",
           flag="--cache-dir", env="CACHE_DIR"),
    # Where metrics also go.
    Option("report_to", str, "Also send metrics to tensorboard or wandb (optional extras). Default: none.",
           flag="--report-to", env="REPORT_TO", choices=("none", "tensorboard", "wandb"),
           commands=frozenset({TRAIN, RESUME})),
)

BY_NAME = {option.name: option for option in OPTIONS}
BY_VARIABLE = {option.variable: option for option in OPTIONS if option.variable}


def for_command(command: str) -> tuple[Option, ...]:
    """The options a command takes from the table, in table order."""
    return tuple(o for o in OPTIONS if command in o.commands and (o.flag or o.argument))


def plan_overridable() -> tuple[str, ...]:
    """The plan values a flag, variable or preset may set (planning's override names)."""
    return tuple(o.plan for o in OPTIONS if o.plan)


def preset_keys() -> tuple[str, ...]:
    """The keys a preset file may set that become plan values."""
    return tuple(o.preset for o in OPTIONS if o.preset)


def by_preset_key(key: str) -> Option:
    return next(o for o in OPTIONS if o.preset == key)
