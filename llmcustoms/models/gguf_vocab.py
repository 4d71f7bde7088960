"""A tokenizer as GGUF metadata: the vocabulary, its merges, the special token
ids and the chat template, under llama.cpp's key names.

GGUF has no tokenizer.json: llama.cpp (and so Ollama and LM Studio) rebuilds
the tokenizer from `tokenizer.ggml.*`. Two kinds cover the families the
presets offer:

  gpt2   byte-level BPE (SmolLM2, Qwen2, Llama 3, the tests' tiny models): the
         tokens spelled in the byte alphabet, the merges, and a named
         pre-tokenizer (`tokenizer.ggml.pre`) saying how text is split first;
  llama  SentencePiece-style BPE with byte fallback (TinyLlama, Mistral,
         Phi-3): `▁` for spaces, `<0x0A>` byte tokens, and scores, which
         llama.cpp merges by (a higher score merges first).

The pre-tokenizer is read off the tokenizer's own structure, not guessed from
the model's name: a tokenizer that splits digits one by one gets "smollm",
one that splits as Qwen2 "qwen2", plain GPT-2 splitting "gpt-2". One llama.cpp
does not know is refused rather than written wrong (`GgufRefused`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from llmcustoms.errors import ConfigError

# llama.cpp's token types (gguf.TokenType), by value so this module needs no gguf import to be read.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The regexes of the byte-level pre-tokenizers llama.cpp knows, by the name it
# knows them by (llama-vocab.cpp). The tokenizer's own Split regex is matched
# against these; ByteLevel's built-in regex is GPT-2's.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
KNOWN_SPLITS = {QWEN2_SPLIT: "qwen2", LLAMA3_SPLIT: "llama-bpe"}


class GgufRefused(ConfigError):
    """This model or tokenizer cannot be written as a GGUF llama.cpp reads right."""


@dataclass
class GgufVocab:
    model: str  # "gpt2" or "llama"
    pre: str | None  # the pre-tokenizer, for "gpt2"
    tokens: list[str]
    scores: list[float]
    types: list[int]
    merges: list[str]
    special_ids: dict[str, int] = field(default_factory=dict)  # "bos", "eos", "unk", "pad", "eot"
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None

    def add_to(self, writer: Any) -> None:
        """Write it all into a `gguf.GGUFWriter`."""
        writer.add_tokenizer_model(self.model)
        if self.pre:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_scores(self.scores)
        writer.add_token_types(self.types)
        if self.merges:
            writer.add_token_merges(self.merges)
        for kind, token_id in self.special_ids.items():
            getattr(writer, f"add_{kind}_token_id")(token_id)
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(self.add_eos)
        if self.chat_template:
            writer.add_chat_template(self.chat_template)


def tokens_past_rows(tokenizer: Any, rows: int, end_of_turn: int | None) -> list[int]:
    """The ids of the tokenizer's tokens the model has no embedding row for
    (`rows`: its vocab_size). A GGUF holds one token per row (llama.cpp's
    converter refuses a tokenizer larger than the model), and the model can
    neither read nor write these, so they are left out of it: transformers'
    GGUF reader adds <|endoftext|> past the rows of a byte-level file that has
    none (a GGUF-in, GGUF-out round trip), and a token added to a tokenizer
    without resizing the model is past them too. Refused when the file must
    name one of them: BOS, EOS, the token a reply ends with."""
    past = sorted(index for index in tokenizer.get_vocab().values() if index >= rows)
    named = {"BOS": getattr(tokenizer, "bos_token_id", None), "EOS": getattr(tokenizer, "eos_token_id", None),
             "end-of-turn": end_of_turn}
    needed = [f"its {kind} token (id {index})" for kind, index in named.items() if index is not None and index >= rows]
    if needed:
        raise GgufRefused(f"The tokenizer has {len(tokenizer)} tokens but the model only {rows} embedding rows, and "
                          f"{needed[0]} is one without a row: no GGUF of it could read or end a reply.",
                          "Give the model a row for every token of its tokenizer (in Python: model."
                          "resize_token_embeddings(len(tokenizer)), then save_pretrained both to a folder to pass as "
                          "--model) and train again, or train with the tokenizer the model came with.")
    return past


def gguf_vocab(tokenizer: Any, vocab_size: int, end_of_turn: int | None) -> GgufVocab:
    """The GGUF form of a transformers fast tokenizer, one token per row of the
    model's `vocab_size`: unused rows get `[PAD<id>]`, as llama.cpp's converter
    writes them, and tokens past the rows are left out (`tokens_past_rows`).
    `end_of_turn`: the token a reply ends with, when it is not eos."""
    if not getattr(tokenizer, "is_fast", False):
        raise GgufRefused("GGUF export needs the model's fast tokenizer (tokenizer.json), and this run has none.",
                          "Export with --merge instead; llama.cpp's own convert_hf_to_gguf.py can convert that folder.")
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise GgufRefused(f"This tokenizer is a {model.get('type')} tokenizer; GGUF export writes BPE tokenizers only.",
                          "Export with --merge instead and convert that folder with llama.cpp's convert_hf_to_gguf.py.")
    byte_level = _uses_byte_level(spec)
    if not byte_level and not model.get("byte_fallback"):
        raise GgufRefused("This tokenizer is neither byte-level BPE nor SentencePiece BPE with byte fallback, "
                          "the two kinds llama.cpp reads.",
                          "Export with --merge instead and convert that folder with llama.cpp's convert_hf_to_gguf.py.")
    by_id = {index: token for token, index in tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True).items()}
    added = {token["id"]: token for token in spec.get("added_tokens", [])}
    tokens_past_rows(tokenizer, vocab_size, end_of_turn)  # refused when one left out is needed
    tokens, scores, types = [], [], []
    for index in range(vocab_size):
        token = by_id.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]"), scores.append(-1000.0), types.append(UNUSED)
            continue
        tokens.append(token)
        scores.append(-1000.0 if index in added else -float(index))  # SentencePiece BPE: earlier merges first
        types.append(_token_type(token, added.get(index), byte_level, model.get("unk_token")))
    merges = [" ".join(pair) if isinstance(pair, list) else pair for pair in model.get("merges", [])]
    return GgufVocab(model="gpt2" if byte_level else "llama", pre=_pre_tokenizer(spec) if byte_level else None,
                     tokens=tokens, scores=scores, types=types, merges=merges,
                     special_ids=_special_ids(tokenizer, end_of_turn, vocab_size), add_bos=_adds(tokenizer, "bos"),
                     add_eos=_adds(tokenizer, "eos"), chat_template=_template_text(tokenizer))


def _uses_byte_level(spec: dict[str, Any]) -> bool:
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    return any(step.get("type") == "ByteLevel" for step in steps if step)


def _pre_tokenizer(spec: dict[str, Any]) -> str:
    """llama.cpp's name for how this byte-level tokenizer splits text before BPE."""
    pre = spec.get("pre_tokenizer") or {}
    steps = [step for step in pre.get("pretokenizers", [pre]) if step]
    kinds = [step.get("type") for step in steps]
    normalizer = (spec.get("normalizer") or {}).get("type")
    if normalizer not in (None, "NFC"):  # Qwen2's NFC: llama.cpp's converter writes it as plain qwen2 too
        raise _unknown_split(f"it normalises text first ({normalizer})")
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"  # each digit alone, then GPT-2's regex
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        if regex in KNOWN_SPLITS:
            return KNOWN_SPLITS[regex]
    raise _unknown_split(f"its pre-tokenizer ({' + '.join(str(kind) for kind in kinds)}) is not one this export knows")


def _unknown_split(why: str) -> GgufRefused:
    return GgufRefused(f"Cannot write this tokenizer to GGUF: {why}, so llama.cpp would split text differently "
                       "from the model you trained.",
                       "Export with --merge instead and convert that folder with llama.cpp's convert_hf_to_gguf.py, "
                       "which knows more tokenizers.")


def _token_type(token: str, added: dict[str, Any] | None, byte_level: bool, unk: str | None) -> int:
    if added is not None:
        return CONTROL if added.get("special") else USER_DEFINED
    if token == unk:
        return UNKNOWN
    if not byte_level and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return BYTE
    return NORMAL


def _special_ids(tokenizer: Any, end_of_turn: int | None, rows: int) -> dict[str, int]:
    ids = {kind: getattr(tokenizer, f"{kind}_token_id", None) for kind in ("bos", "eos", "unk", "pad")}
    # An unknown or padding token left out with the tokens past the rows goes unnamed: llama.cpp needs neither.
    ids = {kind: token_id for kind, token_id in ids.items() if token_id is None or token_id < rows}
    if end_of_turn is not None and end_of_turn != ids.get("eos"):
        # llama.cpp and Ollama stop at the end-of-turn token as well as eos: a chat
        # template that ends a reply with its own token (<|im_end|>, <|end|>) needs it named.
        ids["eot"] = end_of_turn
    return {kind: int(token_id) for kind, token_id in ids.items() if token_id is not None}


def _adds(tokenizer: Any, kind: str) -> bool:
    """Whether encoding plain text puts BOS first (or EOS last): read off the tokenizer itself."""
    token_id = getattr(tokenizer, f"{kind}_token_id", None)
    if token_id is None:
        return False
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and (ids[0] if kind == "bos" else ids[-1]) == token_id


def _template_text(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one is what a chat uses
        template = template.get("default")
    return template if isinstance(template, str) else None
