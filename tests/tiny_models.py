"""Tiny random models of each supported family, built locally (no download).

Each model directory is written with `save_pretrained`, with a small byte-level
BPE tokenizer trained on the fixture texts, so tests exercise the real
`from_pretrained` path. Three tokenizer styles cover the cases that matter:

  zephyr   <|user|> ... </s> template, BOS <s> added to plain text (Llama, Mistral, Phi-3)
  chatml   <|im_start|> ... <|im_end|> template, EOS <|im_end|>, no BOS (Qwen2)
  none     no chat template at all, <|endoftext|> for everything (Phi-2)
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


def _corpus() -> list[str]:
    texts = [p.read_text() for p in sorted(FIXTURES.iterdir()) if p.suffix in (".jsonl", ".json", ".csv")]
    texts += ["### System:\n### User:\n### Assistant:\n", "Question: Answer: user assistant system"]
    return texts * 4


def build_tokenizer(style: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(_corpus(), trainer)
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
