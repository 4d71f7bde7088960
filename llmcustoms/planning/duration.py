"""How long a run will take: its training and evaluation tokens over a rate.

The rate is the one measured on this machine for the same model and method
when a run has been trained here before (`runs/speeds.py` keeps them), else compute
per token over the machine's nominal rate: a rough figure for the plan (shown,
never acted on), so the constants are measured once and rounded, not tuned
per model. The plan says which it is, and the live display replaces it with
the measured step time from the first step on.

Both rates are an idle machine's, with a thread per core; on a CPU the estimate
is then stretched by the share of it the run will get beside other work and
with the plan's threads (`cpu_share.slowdown`), assuming the machine stays as
busy as it was when planned, and the reason says so.

The estimate is the command's time, not only its steps: the plan names each
part (`Duration`). Besides training and evaluating, a run loads the model,
answers its sample prompts and the forgetting check's general questions with
the base model before the first step (not when an earlier run's answers are
kept: `training/base_replies.py`) and with the trained model after the last,
and saves checkpoints and weights. Generating was 60-80 s of a first run that
the estimate left out. Its time is tokens over a rate, as training's is
(`answering_seconds`):

    each decoded token  max(a decoding step's floor, batch x 2 x weights FLOPs / rate)
    each prompt token   2 x weights FLOPs / rate (the prompt is read in one pass)

where `rate` is the machine's FLOP/s in training (the measured speed times a
training token's FLOPs when there is one, else the nominal rate) and the floor
is what one decoding step costs however small its batch: each layer's calls
(or reading every weight once, for a large model on a CPU), a layer's kernel
launches on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from llmcustoms.planning.cpu_share import busy_text, slowdown
from llmcustoms.planning.hardware import Hardware
from llmcustoms.planning.memory import parameter_counts
from llmcustoms.planning.plan import DataStats
from llmcustoms.planning.presets import ModelSpec

# Share of the GPU's tensor-core peak a fine-tuning step reaches (model FLOPs utilisation).
GPU_MFU = 0.35
# Below that, a small model's step on a GPU is bound by kernel launches and Python, not by
# FLOPs: 10-18 ms per layer per micro-batch (forward and backward) measured on an H200 for
# LoRA on TinyLlama-1.1B's and Qwen2.5-0.5B's shapes, where the FLOPs alone said 25 ms a
# step and it took 250-450 ms (benchmarks/results/gpu-h200-2026-11-27). The launches run
# while the card computes, so the slower of the two is the time.
GPU_SECONDS_PER_LAYER_PASS = 0.012
# Effective FLOP/s per CPU core in fp32 training steps: 42-44 GFLOP/s measured
# on the reference machine (2 AVX-512 cores; LoRA and full fine-tuning of a
# 45M-parameter Llama at 512 tokens). Rounded down for smaller machines.
CPU_FLOPS_PER_CORE = 40e9
# bf16 autocast on a CPU with native bf16 (AVX512-BF16, AMX) against fp32: 1.58x
# measured for a LoRA step of SmolLM2-135M on the reference machine (frozen weights
# in bf16; benchmarks/NOTES.md). Full fine-tuning keeps fp32 weights and gains less.
CPU_BF16_SPEEDUP = {"lora": 1.5, "qlora": 1.5, "full": 1.2}
# Extra time QLoRA spends dequantising 4-bit weights in every forward and backward.
QLORA_SLOWDOWN = 1.3
# What a run generates, each time it answers (the base model, then the trained one):
# `training/samples.py` and `training/general_knowledge.py` hold the same numbers (a test checks).
SAMPLE_PROMPTS, SAMPLE_TOKENS = 3, 48  # one at a time
GENERAL_QUESTIONS, GENERAL_TOKENS, GENERAL_GPU_BATCH = 67, 24, 16  # all at once on a CPU
GENERAL_PROMPT_TOKENS = 40  # a question in its chat template
# Every evaluation also measures forgetting on `training/general_text.json`: 48 rows, 3,321 tokens
# in SmolLM2's chat template (its default system turn included), a forward each.
GENERAL_TEXT_ROWS, GENERAL_TEXT_TOKENS = 48, 3300
# Replay (`training/replay.py`): before the first step the base model answers 48 general prompts,
# 96 tokens at most, in batches as the general questions are; each step then takes its share more
# rows of about 110 tokens (a prompt and a reply in the chat template; SmolLM2: 40-130).
REPLAY_PROMPTS, REPLAY_TOKENS, REPLAY_ROW_TOKENS = 48, 96, 110
# A CPU decoding step costs a floor however small the batch: Python and kernel calls
# per layer (SmolLM2-135M: 88 ms of CPU time a token on one thread of the reference
# machine, `generate` at batch 1, the same in bf16 and fp32: 3 ms for each of its
# 30 layers), or reading every weight once (at about 5 GB/s), whichever is longer.
CPU_DECODE_SECONDS_PER_LAYER = 0.003
CPU_DECODE_BYTES_PER_S = 5e9
# A GPU decoding step is bound by kernel launches and Python: about 5 ms per layer
# (34 s for TinyLlama's base answers on an H200, `training/base_replies.py`).
GPU_DECODE_SECONDS_PER_LAYER = 0.005
# Starting the command (imports, reading and tokenizing the data) and loading the
# model: about 5 s for SmolLM2-135M on the reference machine (3 s of imports, 2 s
# to load), 4.5 s for the tests' two-layer model; a model's weights are read from
# disk at about this rate besides.
STARTUP_S = 5.0
DISK_BYTES_PER_S = 500e6
# A checkpoint beside its bytes (trainable weights and optimizer state, at the disk's
# rate): torch.save's own time, the fsyncs and the rename; a few milliseconds for a
# small adapter, so a fifth of a second allows for a slow disk.
SAVE_S = 0.2
# What a CPU step costs beside its matmuls, which a model's FLOPs leave out: the
# optimizer, clipping, the scheduler and a metrics row. 0.05-0.07 s a step for the
# tests' two-layer model on the reference machine (136 steps of the README's first
# run: 7-9 s where its FLOPs said 0.6 s); nothing next to a real model's seconds.
CPU_STEP_S = 0.05
# Without a GPU the preset's CPU models are planned best first and the first
# expected to finish within this is trained: half an hour is a wait a first
# try can afford, and it still leaves time to change something and run again.
CPU_TIME_LIMIT_S = 30 * 60
# The plan's names for the two rounds of answers (sample replies and general
# questions): the base model's before the first step, the trained model's after the last.
BASE_ANSWERS, TRAINED_ANSWERS = "base model's answers", "trained model's answers"
REPLAY_REPLIES = "replay's replies"


def flops_per_token(arch: ModelSpec, method: str, gradient_checkpointing: bool) -> float:
    """Forward 2N; backward 4N when every weight gets a gradient, about 2N when
    the base is frozen (only activation gradients); checkpointing adds a forward."""
    n = _computed_params(arch)
    backward = 4 * n if method == "full" else 2 * n
    return 2 * n + backward + (2 * n if gradient_checkpointing else 0)


def _computed_params(arch: ModelSpec) -> int:
    """The weights a token multiplies through: the embedding lookup is free, the head is not."""
    linear, _ = parameter_counts(arch)
    return linear + arch.vocab_size * arch.hidden_size


def estimate_seconds(arch: ModelSpec, method: str, gradient_checkpointing: bool, tokens: float, hardware: Hardware,
                     eval_tokens: float = 0.0, threads: int = 0, passes: float = 0.0) -> float:
    """Training `tokens` plus `eval_tokens` (a forward only: 2N of a training token's FLOPs),
    with `threads` CPU threads in all (0: an idle machine's thread per core). `passes`: the
    micro-batches trained (an evaluation batch counts a third), which floor a GPU's time."""
    per_token = flops_per_token(arch, method, gradient_checkpointing)
    work = tokens + eval_tokens * 2 * _computed_params(arch) / per_token  # in training tokens
    measured = hardware.measured_speed(arch.hub_id, method)  # an idle machine's (`runs/speeds.py`)
    if measured is not None:
        return work / measured * slowdown(hardware, threads)
    if hardware.has_gpu:
        rate = hardware.peak_tflops * 1e12 * GPU_MFU
    else:
        rate = CPU_FLOPS_PER_CORE * hardware.cpu_cores * (CPU_BF16_SPEEDUP[method] if hardware.cpu_bf16 else 1.0)
    seconds = work * per_token / rate * (QLORA_SLOWDOWN if method == "qlora" else 1.0)
    if hardware.has_gpu:
        seconds = max(seconds, passes * arch.num_layers * GPU_SECONDS_PER_LAYER_PASS)
    return seconds * slowdown(hardware, threads)


@dataclass(frozen=True)
class Duration:
    """The command's estimated seconds, in parts the plan names (their sum is the total)."""

    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def plan_fields(self, world_size: int = 1) -> dict[str, object]:
        """The plan's `estimated_seconds` and `duration_parts`: with several processes the
        steps and evaluations are shared, the rest is not."""
        shared = {"training", "evaluations"}
        parts = {k: round(v / world_size if k in shared else v, 1) for k, v in self.parts.items()}
        return {"estimated_seconds": sum(parts.values()), "duration_parts": parts}

    def text(self) -> str:
        """"training 1 min 40 s, evaluations 20 s, ...": each part over a second."""
        return ", ".join(f"{name} {short_duration(s)}" for name, s in self.parts.items() if s >= 1)


def replayed_per_step(share: float, step_rows: int) -> int:
    """Replayed rows a step of `step_rows` rows takes (`training/replay.py`): at least one once replay is on."""
    return max(1, round(share * step_rows)) if share > 0 else 0


def expected_seconds(reasons: list[str], hardware: Hardware, stats: DataStats, arch: ModelSpec, method: str,
                     gradient_checkpointing: bool, max_seq_len: int, train_rows: int, rows_trained: int,
                     evaluations: int, threads: int = 0, micro_batch: int = 1, memory: dict[str, int] | None = None,
                     saves: int = 0, replayed: int = 0, steps: int = 0) -> Duration:
    """Notes the rows truncation cuts or drops; returns the command's estimated
    seconds in parts: training and evaluating (`evaluations` passes over the
    evaluation rows) with `threads` CPU threads in all (`cpu_share.choose_threads`;
    0 on a GPU), in micro-batches of `micro_batch` rows; the sample replies and
    general questions (a run with evaluation rows answers them twice); loading the
    model (`memory`: the plan's estimate, its weights) and `saves` checkpoints; `replayed`
    rows replayed over the run, and the base model's replies they are made of; on a CPU,
    each of the `steps` optimizer steps' own work."""
    truncated = stats.rows_truncated(max_seq_len)
    if truncated:
        reasons.append(f"{truncated} of {stats.train_rows} rows are longer than {max_seq_len} tokens and will be truncated"
                       + (f"; {stats.train_rows - train_rows} keep no response and will be dropped"
                          if train_rows < stats.train_rows else ""))
    if replayed:
        reasons.append(f"replay: {replayed:,} rows of the base model's own replies to general prompts mixed into the "
                       "steps, so the model keeps answering such prompts as it did (--replay 0: none)")
    length = stats.mean_length(max_seq_len)
    general = (GENERAL_TEXT_ROWS, GENERAL_TEXT_TOKENS) if stats.eval_rows else (0, 0)  # forgetting, measured with each
    trained_tokens = rows_trained * length + replayed * min(REPLAY_ROW_TOKENS, max_seq_len)
    passes = (rows_trained + replayed + evaluations * (stats.eval_rows + general[0]) / 3) / max(1, micro_batch)
    training = estimate_seconds(arch, method, gradient_checkpointing, trained_tokens, hardware, 0.0, threads,
                                (rows_trained + replayed) / max(1, micro_batch))
    # A measured speed has the steps' own work in it already.
    measured = hardware.measured_speed(arch.hub_id, method) is not None
    stepping = 0.0 if hardware.has_gpu or measured else steps * CPU_STEP_S
    both = estimate_seconds(arch, method, gradient_checkpointing, trained_tokens, hardware,
                            evaluations * (stats.eval_rows * length + general[1]), threads, passes)
    # Sample prompts come from the evaluation rows: without them a run answers nothing.
    answers = answering_seconds(arch, method, gradient_checkpointing, hardware, threads, length) \
        if stats.eval_rows else 0.0
    memory = memory or {}
    written = saves * (memory.get("trainable_bytes", 0) + memory.get("optimizer_bytes", 0))
    disk = STARTUP_S + (memory.get("weights_bytes", 0) + written) / DISK_BYTES_PER_S + saves * SAVE_S
    parts = {"training": training + stepping, "evaluations": both - training, BASE_ANSWERS: answers, TRAINED_ANSWERS: answers}
    if replayed:  # the base model's replies to the replay prompts, before the first step
        parts[REPLAY_REPLIES] = answering_seconds(arch, method, gradient_checkpointing, hardware, threads, 0.0, True)
    duration = Duration({**parts, "loading and saving": disk})
    reasons.append(duration_reason(duration.total, hardware, measured,
                                   busy_text(hardware, threads), duration.text()))
    return duration


def answering_seconds(arch: ModelSpec, method: str, gradient_checkpointing: bool, hardware: Hardware, threads: int,
                      prompt_tokens: float, replay: bool = False) -> float:
    """One round of answers: the sample prompts (`prompt_tokens` each, one at a time) and
    the general questions (in batches), by the formula in the module's docstring; with
    `replay`, the base model's replies to the replay prompts instead (batched the same way)."""
    measured = hardware.measured_speed(arch.hub_id, method)
    if measured is not None:  # the FLOP/s this machine trains at, as measured
        rate = measured * flops_per_token(arch, method, gradient_checkpointing)
    elif hardware.has_gpu:
        rate = hardware.peak_tflops * 1e12 * GPU_MFU
    else:
        rate = CPU_FLOPS_PER_CORE * hardware.cpu_cores * (CPU_BF16_SPEEDUP[method] if hardware.cpu_bf16 else 1.0)
    token_flops = 2 * _computed_params(arch)
    if hardware.has_gpu:
        floor = arch.num_layers * GPU_DECODE_SECONDS_PER_LAYER
        batch = GENERAL_GPU_BATCH
    else:
        floor = max(arch.num_layers * CPU_DECODE_SECONDS_PER_LAYER,
                    arch.params * (2 if hardware.cpu_bf16 else 4) / CPU_DECODE_BYTES_PER_S)
        batch = GENERAL_QUESTIONS

    def generate(prompts: int, prompt_length: float, tokens: int) -> float:
        return prompts * prompt_length * token_flops / rate + tokens * max(floor, prompts * token_flops / rate)

    if replay:
        batch = min(batch, REPLAY_PROMPTS)
        seconds = math.ceil(REPLAY_PROMPTS / batch) * generate(batch, GENERAL_PROMPT_TOKENS, REPLAY_TOKENS)
        return seconds * slowdown(hardware, threads)
    batches = math.ceil(GENERAL_QUESTIONS / batch)
    seconds = (SAMPLE_PROMPTS * generate(1, prompt_tokens, SAMPLE_TOKENS)
               + batches * generate(min(batch, GENERAL_QUESTIONS), GENERAL_PROMPT_TOKENS, GENERAL_TOKENS))
    return seconds * slowdown(hardware, threads)


def seconds_after_last_step(plan: Any) -> float:
    """What the plan expects after its last step: the last evaluation, the trained
    model's answers (half of the two rounds), and saving its checkpoint and weights.
    0 for a plan written before the parts were kept."""
    parts = plan.duration_parts or {}
    evaluations = -(-plan.total_steps // plan.eval_every) + 1 if plan.eval_every and plan.eval_rows else 0
    last_evaluation = parts.get("evaluations", 0.0) / evaluations if evaluations else 0.0
    # A plan.json written before the two rounds were named had them as one part.
    answers = parts.get(TRAINED_ANSWERS, parts.get("sample replies and general questions", 0.0) / 2)
    return last_evaluation + answers + (2 * SAVE_S if parts else 0.0)


def with_base_answers_kept(plan: Any) -> Any:
    """`plan` without the base model's round of answers, when an earlier run in the
    same folder kept them (`base_replies.answered_before`): its time, its parts and
    the reason that names them."""
    parts = dict(plan.duration_parts or {})
    if not parts.pop(BASE_ANSWERS, 0.0):
        return plan
    duration = Duration(parts)
    head = f"estimated duration {human_duration(duration.total)}: {duration.text()}"
    # The reason's head is the time and its parts; what follows " (" says where the speed came from.
    reasons = tuple(head + reason[reason.index(" ("):] + "; the base model's answers are kept from an earlier run"
                    if reason.startswith("estimated duration ") and " (" in reason else reason
                    for reason in plan.reasons)
    return replace(plan, duration_parts=parts, estimated_seconds=round(duration.total, 1), reasons=reasons)


def duration_reason(seconds: float, hardware: Hardware, measured: bool = False, busy: str = "", parts: str = "") -> str:
    """`busy`: what the machine's load does to the estimate (`cpu_share.busy_text`), or "";
    `parts`: what the time is made of (`Duration.text`)."""
    hours = seconds / 3600
    text = f"estimated duration {human_duration(seconds)}" + (f": {parts}" if parts else "")
    text += (" (from the speed measured on this machine with this model and method)" if measured
             else f" (rough: from the nominal speed of {hardware.gpus[0].name}, the GPU planned for, not this "
                  "machine's; a run there measures it from its first step)" if hardware.assumed and hardware.gpus
             else " (rough: from this machine's nominal speed; the live display measures it from the first step)")
    if not hardware.has_gpu and hours >= 1:
        text += (": long, because there is no GPU. A single consumer GPU (e.g. 16-24 GB) would take "
                 "minutes to an hour; on this machine try --preset highspeed, a smaller model or --max-steps")
    return text + (f"; {busy}" if busy else "")


def human_duration(seconds: float) -> str:
    if seconds < 90:
        return f"about {max(1, round(seconds))} s"
    if seconds < 5400:
        return f"about {round(seconds / 60)} min"
    return f"about {seconds / 3600:.1f} h"


def short_duration(seconds: float) -> str:
    """"1 min 40 s", "20 s", "1 h 05 min": a part of an estimate."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min" + (f" {seconds % 60} s" if seconds % 60 else "")
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def cpu_choice(estimates: list[tuple[str, float]], smallest: str) -> tuple[str, str]:
    """Which CPU model to train, and why: the first of `estimates` (name and
    estimated seconds, best model first) within `CPU_TIME_LIMIT_S`, else `smallest`."""
    if not estimates:
        return smallest, "the preset's smallest CPU model"
    names, seconds = [name for name, _ in estimates], dict(estimates)
    limit = f"{CPU_TIME_LIMIT_S // 60} min"
    chosen = next((name for name in names if seconds[name] <= CPU_TIME_LIMIT_S), None)
    if chosen is None:
        others = "; ".join(f"{name.split('/')[-1]} {human_duration(seconds[name])}" for name in names if name != smallest)
        return smallest, (f"the smallest CPU model, estimated {human_duration(seconds[smallest])}; none is expected "
                          f"to finish within {limit}" + (f" ({others})" if others else ""))
    estimate = f"estimated {human_duration(seconds[chosen])}"
    skipped = names[:names.index(chosen)]  # the better models, all over the limit
    if not skipped:
        return chosen, f"the preset's first CPU model, {estimate}, within {limit}"
    slower = "; ".join(f"{name.split('/')[-1]} would take {human_duration(seconds[name])}" for name in skipped)
    return chosen, f"{estimate} ({slower}, over {limit})"
