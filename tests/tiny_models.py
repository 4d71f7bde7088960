"""Tiny random models of each supported family, built locally (no download).

Each model directory is written with `save_pretrained`, with a small byte-level
BPE tokenizer trained on the fixture texts, so tests exercise the real
`from_pretrained` path. Three tokenizer styles cover the cases that matter:

  zephyr   <|user|> ... </s> template, BOS <s> added to plain text (Llama, Mistral, Phi-3)
  chatml   <|im_start|> ... <|im_end|> template, EOS <|im_end|>, no BOS (Qwen2)
  none     no chat template at all, <|endoftext|> for everything (Phi-2)

The families of today (`TEMPLATE_FAMILIES`: Qwen3, Qwen3.5, Llama 3.2, Gemma 3,
Phi-3.5) get a tokenizer with the family's own special tokens and the original
chat template TRL ships in `trl/chat_templates/` (never one written from
memory), on a two-layer model of the family's real config class.
"""

from __future__ import annotations

from pathlib import Path

import torch

FIXTURES = Path(__file__).parent / "fixtures"
# The terminal width of a command a test reads the output of: wide enough that no
# message wraps, whatever the length of the checkout's or the temp directory's path
# (tests assert what is said, never where a line breaks; 80-column tests say 80).
WIDE = "1000"

ZEPHYR_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>",
                  "<|im_start|>", "<|im_end|>", "<|endoftext|>"]

FAMILY_STYLE = {"llama": "zephyr", "mistral": "zephyr", "phi3": "zephyr", "qwen2": "chatml", "phi": "none"}

# Families whose tokenizer carries its original chat template (TRL's file of
# that name): the template, its special tokens (BOS, EOS, pad first), the
# added tokens that are not special, and whether BOS starts plain text.
_QWEN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TEMPLATE_FAMILIES = {
    "qwen3": ("qwen3", [None, "<|im_end|>", "<|endoftext|>", "<|im_start|>"], _QWEN_ADDED, False),
    "qwen3_5": ("qwen3_5_think", [None, "<|im_end|>", "<|endoftext|>", "<|im_start|>"], _QWEN_ADDED, False),
    "llama3_2": ("llama3_2", ["<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
                              "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"], [], True),
    "gemma3": ("gemma3", ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"], [], True),
    "phi3_5": ("phi3_5", ["<s>", "<|endoftext|>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
               [], True),
}
# The tokens generation stops on, as each family's generation_config.json lists them.
TEMPLATE_FAMILY_STOPS = {"qwen3": ["<|im_end|>", "<|endoftext|>"], "qwen3_5": ["<|im_end|>", "<|endoftext|>"],
                         "llama3_2": ["<|eom_id|>", "<|eot_id|>"], "gemma3": ["<eos>", "<end_of_turn>"],
                         "phi3_5": ["<|end|>", "<|endoftext|>"]}
# The model class of each (model_type of its config).
TEMPLATE_FAMILY_TYPE = {"qwen3": "qwen3", "qwen3_5": "qwen3", "llama3_2": "llama", "gemma3": "gemma3_text",
                        "phi3_5": "phi3"}


def trl_template(name: str) -> str:
    """The original chat template TRL ships under `name`."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


def build_family_tokenizer(family: str):
    """A small BPE tokenizer with `family`'s special tokens and original chat template."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    template, special, added, bos_first = TEMPLATE_FAMILIES[family]
    bos, eos, pad = special[:3]
    backend = _trained_bpe(["<unk>"] + list(dict.fromkeys(t for t in special if t)))
    if bos_first:
        bos_id = backend.token_to_id(bos)
        backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                               special_tokens=[(bos, bos_id)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=pad, unk_token="<unk>",
                                  additional_special_tokens=[t for t in special[3:] if t != eos])
    tok.add_tokens(added)
    tok.chat_template = trl_template(template)
    return tok


def _corpus() -> list[str]:
    texts = [p.read_text() for p in sorted(FIXTURES.iterdir()) if p.suffix in (".jsonl", ".json", ".csv")]
    texts += ["### System:\n### User:\n### Assistant:\n", "Question: Answer: user assistant system"]
    return texts * 4


def _trained_bpe(special_tokens: list[str]):
    """A byte-level BPE backend of 512 tokens trained on the fixture texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(_corpus(), trainer)
    return backend


def build_tokenizer(style: str):
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = _trained_bpe(SPECIAL_TOKENS)
    if style == "zephyr":
        bos_id = backend.token_to_id("<s>")
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)])
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
        tok.chat_template = ZEPHYR_TEMPLATE
    elif style == "chatml":
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>")
        tok.chat_template = CHATML_TEMPLATE
    else:
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                      unk_token="<|endoftext|>")
    return tok


def build_model(family: str, directory: Path, seed: int = 0) -> Path:
    """Write a two-layer random model of `family` (a model_type) and its tokenizer into `directory`."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Phi3Config, PhiConfig, Qwen2Config

    if family in TEMPLATE_FAMILIES:
        return _build_template_family(family, directory, seed)
    tokenizer = build_tokenizer(FAMILY_STYLE[family])
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
                  bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                  # With the default 0.02 a frozen 64-wide LM head caps logits near +-1.3,
                  # so no adapter could fit anything; 0.1 behaves like a real model.
                  initializer_range=0.1)
    config_class, extra = {
        "llama": (LlamaConfig, {"num_key_value_heads": 2}),
        "mistral": (MistralConfig, {"num_key_value_heads": 2, "sliding_window": None}),
        "qwen2": (Qwen2Config, {"num_key_value_heads": 2, "tie_word_embeddings": True}),
        "phi": (PhiConfig, {}),
        "phi3": (Phi3Config, {"num_key_value_heads": 2}),
    }[family]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_class(**common, **extra))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _build_template_family(family: str, directory: Path, seed: int) -> Path:
    """A two-layer model of the family's config class, scaled down, with the
    family's traits: Qwen3's and Gemma 3's q/k norms (in the class), tied
    embeddings (Llama 3.2, Gemma 3, Qwen3's small sizes), Llama 3's rope
    scaling, Gemma 3's sliding-window layers, Phi-4-mini's partial rotary."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Phi3Config, Qwen3Config

    tokenizer = build_family_tokenizer(family)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                  pad_token_id=tokenizer.pad_token_id, initializer_range=0.1)
    config = {
        "qwen3": lambda: Qwen3Config(**common, head_dim=128, tie_word_embeddings=True),  # Qwen3's at every size
        "llama": lambda: LlamaConfig(**common, tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256}),
        "gemma3_text": lambda: Gemma3TextConfig(**common, head_dim=16, sliding_window=64,
                                                layer_types=["sliding_attention", "full_attention"]),
        "phi3": lambda: Phi3Config(**common, partial_rotary_factor=0.75, tie_word_embeddings=True),
    }[TEMPLATE_FAMILY_TYPE[family]]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(TEMPLATE_FAMILY_STOPS[family])
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
