"""Random-weight models at the shapes of real ones, for GPU benchmarks without a download.

    python benchmarks/shapes.py tinyllama-1.1b OUT_DIR [--tokenizer DIR]

The tokenizer is a real one (SmolLM2's, from ../shared/tools/make_real_model.py,
by default): speeds and memory depend on the model's shape and the tokens, not
on what the weights know. Its 49,152 ids do not fit TinyLlama's 32,000-token
vocabulary, so the TinyLlama shape uses 49,152 (about 70M more parameters in
the embedding and head, said in every table that uses it). Qwen2.5's 151,936
is kept: its large vocabulary is what the chunked loss is for.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

SHAPES = {
    # TinyLlama/TinyLlama-1.1B-Chat-v1.0's config.json, except the vocabulary (see above).
    "tinyllama-1.1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                       "num_attention_heads": 32, "num_key_value_heads": 4, "rope_theta": 10000.0,
                       "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                       "vocab_size": 49152},
    # Qwen/Qwen2.5-0.5B-Instruct's config.json.
    "qwen2.5-0.5b": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "rope_theta": 1000000.0,
                     "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                     "vocab_size": 151936},
    # mistralai/Mistral-7B-v0.1's config.json: for memory only (the kit's 7B QLoRA step).
    "mistral-7b": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 10000.0,
                   "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                   "sliding_window": None, "vocab_size": 32000},
    # Qwen/Qwen3-1.7B's config.json: the GPU kit's side by side with Unsloth (part 3), LoRA.
    "qwen3-1.7b": {"model_type": "qwen3", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1000000.0,
                   "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                   "vocab_size": 151936},
    # meta-llama/Llama-3.1-8B-Instruct's config.json: the side by side's QLoRA shape.
    "llama3.1-8b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                    "vocab_size": 128256},
    # The GPU kit's dry run on a CPU (benchmarks/gpu/run.sh --dry-run): the same architectures,
    # two layers, the vocabulary of whatever tokenizer is given (vocab_size None).
    "tiny-llama": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
                   "tie_word_embeddings": False, "initializer_range": 0.1, "vocab_size": None},
    "tiny-qwen3": {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
                   "tie_word_embeddings": True, "initializer_range": 0.1, "vocab_size": None},
    "tiny-qwen2": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
                   "tie_word_embeddings": True, "initializer_range": 0.1, "vocab_size": None},
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def build(shape: str, out: Path, tokenizer_dir: Path, **overrides: object) -> Path:
    """Writes a bf16 random model of `shape` and the tokenizer from `tokenizer_dir` into `out`;
    `overrides` changes config fields (initializer_range=0.05: weights drawn wider)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    tokenizer = AutoTokenizer.from_pretrained(out)
    fields = {**SHAPES[shape], **overrides}
    if fields["vocab_size"] is None:
        fields["vocab_size"] = len(tokenizer)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the caller's later runs (other processes) get the memory back
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokenizer", type=Path,
                        default=Path.home() / ".cache" / "llmcustoms-dev" / "smollm2-135m-instruct")
    args = parser.parse_args()
    print(build(args.shape, args.out, args.tokenizer), file=sys.stderr)


if __name__ == "__main__":
    main()
