"""Turn `Example`s into token ids and labels, with the loss masked on prompts.

Chat rows are rendered with the tokenizer's own chat template. To know exactly
which tokens belong to the assistant, the conversation is rendered once per
assistant turn (the prompt up to the turn with `add_generation_prompt=True`,
then the prompt plus the reply) and the text is cut at those boundaries. Each
piece is tokenized on its own, so labels are -100 on exactly the prompt pieces.

Tokenizers without a chat template get `FALLBACK_CHAT_TEMPLATE` (documented
in the README); it is saved with the adapter so generation uses the same one.

Every sequence ends with a token the model stops on: a reply whose template
ends with an end-of-turn token followed by whitespace (ChatML's
"<|im_end|>\\n") is cut after that token; one with no stop token gets EOS.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmcustoms.data import Example, Message
from llmcustoms.errors import ModelError

IGNORE_INDEX = -100

# Used when a tokenizer has no chat template (Phi-2, base Llama checkpoints).
# `{bos}` is filled with the BOS token for tokenizers that normally start with one.
FALLBACK_CHAT_TEMPLATE = (
    "{bos}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '### System:\\n' + message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '### User:\\n' + message['content'] + '\\n\\n' }}"
    "{% else %}{{ '### Assistant:\\n' + message['content'] + eos_token + '\\n\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Assistant:\\n' }}{% endif %}"
)


def starts_with_bos(tokenizer) -> bool:
    """Whether this tokenizer puts BOS in front of plain text by default."""
    if tokenizer.bos_token_id is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


def ensure_chat_template(tokenizer) -> bool:
    """Give the tokenizer the fallback template if it has none. Returns True if it did."""
    if getattr(tokenizer, "chat_template", None):
        return False
    bos = "{{ bos_token }}" if starts_with_bos(tokenizer) else ""
    tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE.replace("{bos}", bos)
    return True


def _render(tokenizer, messages: tuple[Message, ...], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in messages],
        tokenize=False, add_generation_prompt=generation_prompt,
    )


def chat_segments(tokenizer, messages: tuple[Message, ...]) -> list[tuple[str, bool]]:
    """Split a rendered conversation into (text, is_assistant_reply) pieces."""
    segments: list[tuple[str, bool]] = []
    done = ""
    for k, (role, _) in enumerate(messages):
        if role != "assistant":
            continue
        prefix = _render(tokenizer, messages[:k], generation_prompt=True)
        full = _render(tokenizer, messages[: k + 1], generation_prompt=False)
        if not (prefix.startswith(done) and full.startswith(prefix)):
            return _last_turn_segments(tokenizer, messages)
        segments.append((prefix[len(done):], False))
        segments.append((full[len(prefix):], True))
        done = full
    return segments


def _last_turn_segments(tokenizer, messages: tuple[Message, ...]) -> list[tuple[str, bool]]:
    # Some templates rewrite earlier turns (e.g. drop reasoning) as the
    # conversation grows, so per-turn cuts do not line up; then only the last
    # reply is trained on, which is still exact.
    last = max(i for i, (role, _) in enumerate(messages) if role == "assistant")
    prefix = _render(tokenizer, messages[:last], generation_prompt=True)
    full = _render(tokenizer, messages[: last + 1], generation_prompt=False)
    if not full.startswith(prefix):
        raise ModelError(
            "This model's chat template renders a conversation differently from its prompt, "
            "so the reply cannot be separated from the prompt.",
            "Pass --train-on-prompt to train on whole conversations, or use a model with a standard template.",
        )
    return [(prefix, False), (full[len(prefix):], True)]


def raw_segments(tokenizer, example: Example) -> list[tuple[str, bool]]:
    """prompt/completion and text rows: no template, BOS if the model uses one."""
    bos = tokenizer.bos_token if starts_with_bos(tokenizer) else ""
    return [(bos + example.prompt, False), (example.completion, True)]


@dataclass(frozen=True)
class TokenizedExample:
    row: int
    input_ids: list[int]
    labels: list[int]

    @property
    def trainable_tokens(self) -> int:
        # Label i is predicted from position i-1, so the first label never counts.
        return sum(1 for label in self.labels[1:] if label != IGNORE_INDEX)


@dataclass
class TokenizedData:
    examples: list[TokenizedExample]
    truncated: int = 0
    dropped: int = 0


class Tokenizer:
    """Binds a Hugging Face tokenizer to the masking rules of one run."""

    def __init__(self, hf_tokenizer, train_on_prompt: bool = False, stop_token_ids: set[int] | None = None):
        if hf_tokenizer.eos_token_id is None:
            raise ModelError("The tokenizer has no EOS token, so the model could not learn where to stop.",
                             "Use a tokenizer that defines eos_token.")
        self.hf = hf_tokenizer
        self.train_on_prompt = train_on_prompt
        self.stop_token_ids = set(stop_token_ids or ()) | {hf_tokenizer.eos_token_id}

    def segments(self, example: Example) -> list[tuple[str, bool]]:
        if example.is_chat:
            return chat_segments(self.hf, example.messages)
        return raw_segments(self.hf, example)

    def _end_with_stop_token(self, ids: list[int]) -> list[int]:
        if ids and ids[-1] in self.stop_token_ids:
            return ids
        for i in range(len(ids) - 1, -1, -1):
            if ids[i] in self.stop_token_ids:
                if not self.hf.decode(ids[i + 1:]).strip():
                    return ids[: i + 1]
                break
        return ids + [self.hf.eos_token_id]

    def encode(self, example: Example) -> TokenizedExample:
        """Token ids and labels of one example, not truncated."""
        segments = [(text, trained) for text, trained in self.segments(example) if text]
        pieces = self.hf([text for text, _ in segments], add_special_tokens=False)["input_ids"]
        last_reply = max(i for i, (_, trained) in enumerate(segments) if trained)
        input_ids: list[int] = []
        labels: list[int] = []
        for i, ((_, trained), ids) in enumerate(zip(segments, pieces)):
            ids = list(ids)
            if i == last_reply:
                ids = self._end_with_stop_token(ids)
            input_ids += ids
            labels += ids if (trained or self.train_on_prompt) else [IGNORE_INDEX] * len(ids)
        return TokenizedExample(example.row, input_ids, labels)


def first_loss_position(example: TokenizedExample) -> int:
    """Index of the first label that counts towards the loss (len if none does)."""
    for i in range(1, len(example.labels)):
        if example.labels[i] != IGNORE_INDEX:
            return i
    return len(example.labels)


def truncate(examples: list[TokenizedExample], max_seq_len: int) -> TokenizedData:
    """Cut rows to max_seq_len; rows left with nothing to learn are dropped and counted."""
    out = TokenizedData(examples=[])
    for example in examples:
        if len(example.input_ids) <= max_seq_len:
            out.examples.append(example)
            continue
        out.truncated += 1
        cut = TokenizedExample(example.row, example.input_ids[:max_seq_len], example.labels[:max_seq_len])
        if cut.trainable_tokens == 0:
            out.dropped += 1
        else:
            out.examples.append(cut)
    return out
