"""`MemoryEstimator`: peak training memory from architecture facts alone.

The estimate is a sum of parts, each from first principles:

  weights      parameters x bytes per parameter (fp32 / bf16 / fp16); for
               QLoRA the block linears are NF4 with double quantisation,
               4.127 bits per weight (QLoRA paper: 4 bits + 8-bit absmax per
               64 + fp32 second-level absmax per 256 blocks), while embeddings,
               LM head and norms stay in the compute dtype
  trainable    LoRA adapters in fp32 (full fine-tuning: already in weights)
  gradients    one fp32 gradient per trained parameter
  optimizer    AdamW: two fp32 moments (8 bytes / parameter); 8-bit AdamW: 2;
               paged variants the same bytes (they can spill to CPU RAM)
  activations  what autograd keeps per layer for backward, per token, as a
               function of hidden, intermediate and key/value widths
               (Korthikanti et al. 2022, restated for Llama-style blocks with
               memory-efficient attention); with gradient checkpointing, each
               layer's input plus one layer's worth during recomputation
  norms        RMSNorm works in fp32: q/k norms (Qwen3, Gemma 3) and Gemma's
               two extra norms a block keep fp32 copies for backward
  logits       batch x sequence x vocabulary in fp32, a few times over (the
               logits, log-softmax kept for backward, and their gradient);
               large for Qwen's 152k vocabulary
  dropout      LoRA dropout above 0: each adapted linear keeps its own
               dropped copy of its input and the mask (one byte an element)
               for backward: 0.8 MiB a token for SmolLM2-135M, measured
  heap         on a CPU, what glibc's heap holds beyond the live tensors: the
               blocks a step frees are not all reused for the next ones, and
               the resident size (what runs out) counts them; a share of the
               parts that grow with the batch, fitted on real runs
  overhead     runtime bookkeeping, plus the CUDA context on a GPU

With FSDP (`shards` > 1) each process keeps 1/shards of the weights, gradients
and optimizer state, plus what it gathers to compute, in the compute dtype:
the root unit (embeddings, head, norms) for the whole step and two blocks at a
time (the one running and the one prefetched), plus unsharded fp32 gradients
before they are reduce-scattered: one block's, and the root unit's, which is
whole until the end of backward. Not yet measured on GPUs.

The peak is not the plain sum: backward writes the gradients while it frees
the activations, so the peak holds weights, adapters and optimizer state plus
the larger of (gradients) and (activations + logits). That matters for full
fine-tuning, where gradients are as large as the weights.

The per-token activation and logit coefficients are calibrated against
measured peaks (`benchmarks/memory_accuracy.py`); the table in docs/train-and-plan.md ("How accurate is the memory
estimate?") shows predicted against measured. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from llmcustoms.planning.presets import ModelSpec

GIB = 1024 ** 3
NF4_BITS_PER_WEIGHT = 4.127
# Budget kept free for fragmentation and stray allocations when choosing a batch.
SAFETY_MARGIN = 0.10
CUDA_CONTEXT_BYTES = 600 * 1024 ** 2

# Saved-for-backward elements per token per layer. First principles gave
# (14, 4, 2) for LoRA and (16, 5, 2) for full fine-tuning; least squares over
# the measured peaks of benchmarks/memory_accuracy.py scaled them by 0.78.
# LoRA keeps fewer tensors than full fine-tuning: frozen linears save no
# inputs for weight gradients.
ACTIVATION_COEFFICIENTS = {
    "lora": {"hidden": 10.9, "intermediate": 3.1, "kv": 1.6},
    "full": {"hidden": 12.5, "intermediate": 3.9, "kv": 1.6},
}
# RMSNorm computes in fp32 and keeps what backward needs of that: bytes per
# normalised element per token, fitted on Qwen3-1.7B's simulated step
# (benchmarks/cuda_simulation.py: 7.4; its q/k norms are the only norms it has
# beyond Llama's). Qwen3 and Gemma 3 normalise each head's queries and keys;
# Gemma 3 also normalises each block's attention and MLP outputs and the MLP's
# input (four norms a block against Llama's two).
NORM_BYTES_PER_ELEMENT = 7.4
QK_NORM_TYPES = {"qwen3", "gemma3_text", "gemma3", "olmo2", "qwen3_moe"}
SANDWICH_NORM_TYPES = {"gemma3_text", "gemma3", "gemma2"}
# Copies of the fp32 logits alive at the peak (logits, log-softmax kept for
# backward, their gradient, partly overlapping): fitted 2.85.
LOGIT_COPIES = 2.85
# The loss holds at most this many logits (positions x vocabulary) at once:
# it runs the head and cross-entropy chunk by chunk (`sft.head_cross_entropy`;
# 2^26 fp32 logits are 256 MiB: 441 positions of Qwen2.5's 151,936 words).
# Under FSDP, and for DPO's log-probabilities, the head computes all its logits.
CHUNK_LOGITS = 2 ** 26
# Optimizer state per trained parameter: AdamW keeps two fp32 moments; the
# bitsandbytes 8-bit variants keep two 8-bit ones (plus small block scales).
# Paged variants hold the same bytes but can spill them to CPU RAM under
# pressure, so the budget must still allow for them.
OPTIMIZER_STATE_BYTES = {"adamw": 8, "paged_adamw": 8, "adamw_8bit": 2, "paged_adamw_8bit": 2}
# Autograd bookkeeping, batch tensors, kernel workspaces: fitted ~106 MiB.
RUNTIME_OVERHEAD_BYTES = 100 * 1024 ** 2
# bf16 on a CPU: oneDNN's kernels, built for each shape of a run (lengths and the head's rows rounded up
# to multiples, so a few: `training/batching.pad_multiple`, `losses/sft.HEAD_ROWS_MULTIPLE`), with their
# scratch space. Fitted: a tiny Llama on the example data peaked 175 MiB over its fp32-fitted plan, and
# SmolLM2-135M 0.5 GiB over, both while a head of unpadded rows still grew (160 MiB then). Since, flat,
# and refitted to the middle: with 160 MiB the tiny Llama peaked 0.89x its plan over 408 steps,
# SmolLM2-135M 1.08x over 80, `benchmarks/memory_accuracy.py --mixed-precision bf16` 0.80-1.09x.
CPU_BF16_KERNELS_BYTES = 128 * 1024 ** 2
# The CPU heap's share on top of the batch's tensors (activations, logits,
# dropout copies): peak resident size per token over the live tensors' on
# SmolLM2-135M-Instruct with the shared datasets (benchmarks/NOTES.md: 1.29 and
# 1.43 on the two; 1.58 for full-vocabulary logits). GPUs' caching allocator
# is what max_memory_allocated measures past, so it has none.
CPU_HEAP_SHARE = 0.36


@dataclass(frozen=True)
class Linear:
    name: str
    in_features: int
    out_features: int

    @property
    def params(self) -> int:
        return self.in_features * self.out_features


def block_linears(arch: ModelSpec) -> list[Linear]:
    """The linear layers of one transformer block, by model type."""
    h, i = arch.hidden_size, arch.intermediate_size
    d = arch.head_width
    q, kv = arch.num_attention_heads * d, arch.num_kv_heads * d
    if arch.model_type == "phi":
        return [Linear("q_proj", h, q), Linear("k_proj", h, kv), Linear("v_proj", h, kv),
                Linear("dense", q, h), Linear("fc1", h, i), Linear("fc2", i, h)]
    if arch.model_type == "phi3":
        return [Linear("qkv_proj", h, q + 2 * kv), Linear("o_proj", q, h),
                Linear("gate_up_proj", h, 2 * i), Linear("down_proj", i, h)]
    return [Linear("q_proj", h, q), Linear("k_proj", h, kv), Linear("v_proj", h, kv), Linear("o_proj", q, h),
            Linear("gate_proj", h, i), Linear("up_proj", h, i), Linear("down_proj", i, h)]


def parameter_counts(arch: ModelSpec) -> tuple[int, int]:
    """(parameters in block linears, all other parameters: embeddings, head, norms)."""
    linear = arch.num_layers * sum(l.params for l in block_linears(arch))
    embeddings = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    norms = (2 * arch.num_layers + 1) * arch.hidden_size
    return linear, embeddings + norms


def largest_matrix(arch: ModelSpec) -> int:
    """Entries of the model's largest weight: the embedding (or head), or a block linear."""
    return max([arch.vocab_size * arch.hidden_size] + [l.params for l in block_linears(arch)])


def lora_parameters(arch: ModelSpec, rank: int, targets: tuple[str, ...]) -> int:
    linears = block_linears(arch)
    chosen = linears if targets == ("all-linear",) else [l for l in linears if l.name in targets]
    return arch.num_layers * sum(rank * (l.in_features + l.out_features) for l in chosen)


@dataclass(frozen=True)
class MemoryEstimate:
    weights_bytes: int
    trainable_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    logits_bytes: int
    overhead_bytes: int
    budget_bytes: int

    gathered_bytes: int = 0  # FSDP: parameters gathered from the other shards to compute
    heap_bytes: int = 0  # on a CPU: the heap's share beyond the batch's live tensors

    @property
    def batch_bytes(self) -> int:
        """What grows with the micro-batch's tokens: activations (LoRA dropout's
        copies among them), logits, and on a CPU the heap around them."""
        return self.activations_bytes + self.logits_bytes + self.heap_bytes

    @property
    def total_bytes(self) -> int:
        """Estimated peak. Gradients are written while activations are freed, so
        the two overlap in time rather than add up."""
        in_backward = max(self.gradients_bytes, self.batch_bytes)
        return (self.weights_bytes + self.trainable_bytes + self.optimizer_bytes + in_backward + self.overhead_bytes
                + self.gathered_bytes)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes * (1 - SAFETY_MARGIN)

    def summary(self) -> str:
        """"1.2 of 7.0 GiB": the peak against the budget, for a reason or a warning."""
        return f"{self.total_bytes / GIB:.1f} of {self.budget_bytes / GIB:.1f} GiB"

    def to_json(self) -> dict[str, int]:
        data = asdict(self)
        data["total_bytes"] = self.total_bytes
        return data


class MemoryEstimator:
    """Estimates peak training memory of one configuration, and finds the largest
    micro-batch that fits a budget."""

    def __init__(self, arch: ModelSpec, on_gpu: bool, budget_bytes: int):
        self.arch = arch
        self.on_gpu = on_gpu
        self.budget_bytes = budget_bytes

    def weight_bytes_per_param(self, method: str, mixed_precision: str) -> int:
        # Full fine-tuning keeps fp32 master weights; a frozen base can be 16-bit.
        if method == "full" or mixed_precision == "no":
            return 4
        return 2

    def weights(self, method: str, mixed_precision: str) -> int:
        linear, other = parameter_counts(self.arch)
        per_param = self.weight_bytes_per_param(method, mixed_precision)
        if method == "qlora":
            return int(linear * NF4_BITS_PER_WEIGHT / 8) + other * per_param
        return (linear + other) * per_param

    def _update_buffer(self, method: str, optimizer: str) -> int:
        """On a CPU, bitsandbytes' 8-bit update dequantizes one weight's two moments
        to fp32 while it updates that weight (its GPU kernel does it in registers):
        the largest weight's, for full fine-tuning (LoRA's weights are small)."""
        if self.on_gpu or method != "full" or not optimizer.endswith("8bit"):
            return 0
        return largest_matrix(self.arch) * 8

    def _extra_norm_width(self) -> int:
        """Elements per token per layer normalised beyond a Llama block's two
        hidden-size norms: q/k norms (Qwen3, Gemma 3), Gemma's two more."""
        arch = self.arch
        width = 0
        if arch.model_type in QK_NORM_TYPES:
            width += (arch.num_attention_heads + arch.num_kv_heads) * arch.head_width
        if arch.model_type in SANDWICH_NORM_TYPES:
            width += 2 * arch.hidden_size
        return width

    def activation_bytes_per_token(self, method: str, mixed_precision: str, gradient_checkpointing: bool,
                                   lora_dropout: float = 0.0, lora_targets: tuple[str, ...] = ("all-linear",)) -> float:
        arch = self.arch
        element = 4 if mixed_precision == "no" else 2
        kv = arch.num_kv_heads * arch.head_width
        c = ACTIVATION_COEFFICIENTS["full" if method == "full" else "lora"]
        per_layer = (c["hidden"] * arch.hidden_size + c["intermediate"] * arch.intermediate_size + c["kv"] * kv) * element
        per_layer += NORM_BYTES_PER_ELEMENT * self._extra_norm_width()
        if method != "full" and lora_dropout > 0:
            # PEFT applies each adapter's own dropout to its input and keeps the result and the mask.
            linears = block_linears(arch)
            chosen = linears if lora_targets == ("all-linear",) else [l for l in linears if l.name in lora_targets]
            per_layer += sum(l.in_features for l in chosen) * (element + 1)
        if gradient_checkpointing:
            # Each layer keeps only its input; backward recomputes one layer at a time.
            return arch.num_layers * arch.hidden_size * element + per_layer
        return arch.num_layers * per_layer

    def estimate(self, method: str, micro_batch: int, seq_len: int, mixed_precision: str,
                 gradient_checkpointing: bool, lora_rank: int = 16, lora_targets: tuple[str, ...] = ("all-linear",),
                 optimizer: str = "adamw", trained_fraction: float = 1.0, shards: int = 1,
                 sequences_per_row: int = 1, lora_dropout: float = 0.0) -> MemoryEstimate:
        """`trained_fraction`: share of positions whose next token is trained; the
        LM head computes logits only there (prompts and padding get none).
        `shards`: processes an FSDP run shards the model over (1: no sharding).
        `sequences_per_row`: 2 for preference pairs (chosen and rejected in one
        forward). DPO's reference forward runs first, without gradients: its
        activations are freed before the policy's forward, so it adds no peak."""
        linear, other = parameter_counts(self.arch)
        trained = linear + other if method == "full" else lora_parameters(self.arch, lora_rank, lora_targets)
        tokens = micro_batch * sequences_per_row * seq_len
        activations = int(tokens * self.activation_bytes_per_token(method, mixed_precision, gradient_checkpointing,
                                                                    lora_dropout, lora_targets))
        positions = tokens * trained_fraction
        if shards == 1 and sequences_per_row == 1:  # DPO's log-probabilities take every logit at once
            positions = min(positions, max(1, CHUNK_LOGITS // self.arch.vocab_size))
        logits = int(positions * self.arch.vocab_size * 4 * LOGIT_COPIES)
        heap = 0 if self.on_gpu else int((activations + logits) * CPU_HEAP_SHARE)
        overhead = RUNTIME_OVERHEAD_BYTES + (CUDA_CONTEXT_BYTES if self.on_gpu else
                                             CPU_BF16_KERNELS_BYTES if mixed_precision == "bf16" else 0)
        gathered = 0
        if shards > 1:
            # Gathered in the compute dtype (FSDP's mixed-precision policy); the
            # block's gradient is reduced in fp32.
            per_param = 4 if mixed_precision == "no" else 2
            block = linear // self.arch.num_layers
            # The root unit's gradient (embeddings, head) is whole until the end of backward.
            gathered = (other + 2 * block) * per_param + ((block + other) * 4 if method == "full" else 0)
        return MemoryEstimate(
            weights_bytes=self.weights(method, mixed_precision) // shards,
            trainable_bytes=0 if method == "full" else trained * 4 // shards,
            gradients_bytes=trained * 4 // shards,
            optimizer_bytes=trained * OPTIMIZER_STATE_BYTES[optimizer] // shards + self._update_buffer(method, optimizer),
            activations_bytes=activations,
            logits_bytes=logits,
            overhead_bytes=overhead,
            budget_bytes=self.budget_bytes,
            gathered_bytes=gathered,
            heap_bytes=heap,
        )

    def largest_micro_batch(self, method: str, seq_len: int, mixed_precision: str, gradient_checkpointing: bool,
                            limit: int, **options: Any) -> int:
        """The largest micro-batch <= limit that fits; 0 if not even one row fits."""
        best = 0
        for batch in (1, 2, 4, 8, 16, 32, 64, 128):
            if batch > limit:
                break
            if self.estimate(method, batch, seq_len, mixed_precision, gradient_checkpointing, **options).fits:
                best = batch
            else:
                break
        return best
