"""Check a written GGUF against the model it came from, before anyone runs it.

Read back through transformers' GGUF reader, the file must give:
  - the metadata of the model: architecture, context length, layers, heads,
    vocabulary size, the chat template unchanged, and the special token ids
    (BOS, EOS, the end-of-turn token a reply stops at);
  - the same token ids for every sample prompt, rendered with the chat template;
  - the same next-token predictions: at f16 and bf16 the greedy replies to the
    sample prompts are identical; at q8_0 and q4_0 the logits stay within the
    tolerance below (quantization moves them; how far is reported).
When llama-cpp-python is installed, the file is also run in llama.cpp itself
(`models/llama_cpp_run.py`): its tokens for the prompts must equal the
model's, and a reply must end at the end-of-turn token.

Tolerances, on the sample prompts' next-token distributions at every
position: the mean KL divergence from the model's distribution to the GGUF's
(in nats; what llama.cpp's own `--kl-divergence` measures):
  f16, bf16  every greedy reply identical, and mean KL at most 0.005; a
             reply may part from the model's only at a tie: where the
             model's own logits for the two tokens differ by no more than
             twice the largest logit difference the file shows (a random
             test model's logits are that flat; a broken file's are not)
  q8_0       mean KL at most 0.02
  q4_0       mean KL at most 1.0: what 4 bits cost depends on the model's
             size (0.57 for SmolLM2-135M, whose every weight matters; a
             few hundredths for 7B models), so this only catches a broken
             file; above 0.15 the export says what q4_0 costs and suggests q8_0
The share of positions whose most likely token is the same, and the largest
logit difference, are reported beside it, not judged: at a position where the
model hesitates between two tokens (most positions of a prompt it did not
write), the slightest rounding may swap them, and that says little.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

KL_ALLOWED = {"f16": 0.005, "bf16": 0.005, "q8_0": 0.02, "q4_0": 1.0}
# Above this, q4_0 works but costs the model visibly: the export says so and suggests q8_0.
Q4_COSTLY = 0.15
REPLY_TOKENS = 32
# Told how far the check is: (stage "tensors" or "prompts", done, total).
Progress = Callable[[str, int, int], None]


def _unseen(stage: str, done: int, total: int) -> None:
    return None


@dataclass
class GgufCheck:
    quant: str
    prompts: int = 0
    ids_equal: int = 0
    replies_equal: int = 0
    replies_tied: int = 0  # replies that part from the model's only where its top tokens tie (`_parts_at_a_tie`)
    top1_agreement: float = 0.0
    mean_kl: float = 0.0
    max_logit_difference: float = 0.0
    problems: list[str] = field(default_factory=list)
    stopped: list[bool] = field(default_factory=list)  # whether the model's greedy reply to each prompt stopped

    def summary(self) -> str:
        parts = [f"token ids equal for {self.ids_equal}/{self.prompts} prompts",
                 f"greedy replies equal {self.replies_equal}/{self.prompts}"
                 + (f" ({self.replies_tied} more part only at a tie)" if self.replies_tied else ""),
                 f"mean KL divergence {self.mean_kl:.4f} (allowed {KL_ALLOWED[self.quant]})",
                 f"next token agrees at {self.top1_agreement:.1%} of positions",
                 f"largest logit difference {self.max_logit_difference:.3f}"]
        return "; ".join(parts)


def expected_metadata(model: Any, tokenizer: Any, architecture: str, end_of_turn: int | None) -> dict[str, Any]:
    config = model.config
    expected = {
        "general.architecture": architecture,
        f"{architecture}.context_length": config.max_position_embeddings,
        f"{architecture}.block_count": config.num_hidden_layers,
        f"{architecture}.embedding_length": config.hidden_size,
        f"{architecture}.attention.head_count": config.num_attention_heads,
        f"{architecture}.attention.head_count_kv": getattr(config, "num_key_value_heads", None)
        or config.num_attention_heads,
        "tokenizer.ggml.tokens": config.vocab_size,
        "tokenizer.ggml.eos_token_id": tokenizer.eos_token_id,
        "tokenizer.chat_template": tokenizer.chat_template,
    }
    if tokenizer.bos_token_id is not None:
        expected["tokenizer.ggml.bos_token_id"] = tokenizer.bos_token_id
    if end_of_turn is not None and end_of_turn != tokenizer.eos_token_id:
        expected["tokenizer.ggml.eot_token_id"] = end_of_turn
    return expected


def check_gguf(path: Path, model: Any, tokenizer: Any, quant: str, expected: dict[str, Any],
               prompts: list[list[dict[str, str]]], stop_ids: list[int], progress: Progress = _unseen) -> GgufCheck:
    """Compare the GGUF at `path` with `model` (merged, unquantized) on `prompts`.
    `progress` hears how far it is: ("tensors", done, total) as the file is read
    back (27 s to 1 min 40 s for a 135M model on a busy CPU), then ("prompts", done, total)."""
    import torch

    from llmcustoms.models import gguf_reading

    check = GgufCheck(quant=quant, prompts=len(prompts))
    found = gguf_reading.metadata(path)
    for key, value in expected.items():
        if found.get(key) != value:
            shown = (lambda v: f"{len(v)} characters" if isinstance(v, str) and len(v) > 60 else repr(v))
            check.problems.append(f"{key} is {shown(found.get(key))}, expected {shown(value)}")
    gguf_tokenizer = gguf_reading.load_tokenizer(path)
    gguf_model = gguf_reading.load_model(path, torch.float32, lambda done, total: progress("tensors", done, total)).eval()
    reference = model.float().eval() if model.dtype != torch.float32 else model.eval()
    agree = positions = 0
    divergence = 0.0
    progress("prompts", 0, len(prompts))
    for number, messages in enumerate(prompts, start=1):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        check.ids_equal += gguf_tokenizer(text, add_special_tokens=False)["input_ids"] == ids
        batch = torch.tensor([ids])
        with torch.no_grad():
            want, got = reference(batch).logits[0], gguf_model(batch).logits[0]
        agree += int((want.argmax(-1) == got.argmax(-1)).sum())
        divergence += float(torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                                       reduction="sum"))
        positions += len(ids)
        check.max_logit_difference = max(check.max_logit_difference, float((want - got).abs().max()))
        reply, gguf_reply = _greedy(reference, batch, stop_ids), _greedy(gguf_model, batch, stop_ids)
        check.stopped.append(bool(reply) and reply[-1] in stop_ids)
        check.replies_equal += reply == gguf_reply
        check.replies_tied += reply != gguf_reply and _parts_at_a_tie(reference, batch, reply, gguf_reply,
                                                                     2 * check.max_logit_difference)
        progress("prompts", number, len(prompts))
    check.top1_agreement = agree / max(positions, 1)
    check.mean_kl = divergence / max(positions, 1)
    if check.ids_equal < check.prompts:
        check.problems.append(f"the GGUF's tokenizer gives other token ids for {check.prompts - check.ids_equal} "
                              f"of {check.prompts} prompts")
    if check.mean_kl > KL_ALLOWED[quant]:
        check.problems.append(f"the GGUF's next-token distributions differ from the model's by a mean KL divergence "
                              f"of {check.mean_kl:.4f} (at {quant} at most {KL_ALLOWED[quant]} is expected)")
    differing = check.prompts - check.replies_equal - check.replies_tied
    if quant in ("f16", "bf16") and differing:
        check.problems.append(f"{differing} of {check.prompts} greedy replies differ at "
                              f"{quant}, where they should be identical")
    return check


def cost_note(check: GgufCheck) -> str | None:
    """A line for a q4_0 file that works but costs this model visibly."""
    if check.quant != "q4_0" or check.mean_kl <= Q4_COSTLY:
        return None
    return (f"note: 4 bits cost this model visibly (mean KL {check.mean_kl:.2f}, {check.replies_equal}/"
            f"{check.prompts} greedy replies unchanged); --quant q8_0 keeps it close at twice the size")


def _greedy(model: Any, batch: Any, stop_ids: list[int]) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(batch, max_new_tokens=REPLY_TOKENS, do_sample=False, eos_token_id=stop_ids,
                             pad_token_id=stop_ids[0] if stop_ids else None)
    return out[0, batch.shape[1]:].tolist()


def _parts_at_a_tie(model: Any, batch: Any, reply: list[int], other: list[int], tolerance: float) -> bool:
    """Whether `other` leaves `reply` (the model's greedy reply to `batch`) at a token the
    model itself scores within `tolerance` of the one it chose: rounding may swap such a tie."""
    import torch

    part = next((i for i, (a, b) in enumerate(zip(reply, other)) if a != b), None)
    if part is None:  # one reply stops where the other goes on: not a swapped token
        return False
    with torch.no_grad():
        logits = model(torch.cat([batch, torch.tensor([reply[:part]], dtype=batch.dtype)], dim=1)).logits[0, -1]
    return float(logits[reply[part]] - logits[other[part]]) <= tolerance
