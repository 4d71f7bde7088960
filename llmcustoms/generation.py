"""Try a trained model: `generate` (one prompt) and `chat` (a conversation).

The run's base model is loaded the way it was trained (4-bit for QLoRA runs)
with the run's adapter on top, and prompts are rendered with the chat template
saved next to the adapter, so the model sees the format it learned.
"""

from __future__ import annotations

from typing import Any, Callable

from llmcustoms.chattemplates import prompts_use_template
from llmcustoms.errors import ConfigError
from llmcustoms.rundir import RunDirectory


def trained_output(run: RunDirectory) -> Any:
    plan = run.read_plan()
    output = run.output_path(plan.method)
    if not (output / ("adapter_config.json" if plan.method != "full" else "config.json")).is_file():
        raise ConfigError(f"{run.path} has no trained {'model' if plan.method == 'full' else 'adapter'} yet.",
                          "Finish the run first (`llmcustoms resume`), or pick a completed run (`llmcustoms runs`).")
    return plan, output


def load_trained(run: RunDirectory) -> tuple[Any, Any, Any]:
    """(model, tokenizer, plan) ready to generate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmcustoms import modeling

    plan, output = trained_output(run)
    tokenizer = AutoTokenizer.from_pretrained(output)
    on_gpu = torch.cuda.is_available()
    dtype = (torch.bfloat16 if on_gpu and torch.cuda.is_bf16_supported() else torch.float16) if on_gpu else torch.float32
    if plan.method == "full":
        model = AutoModelForCausalLM.from_pretrained(output, dtype=dtype, device_map="auto" if on_gpu else None)
        return model.eval(), tokenizer, plan
    from peft import PeftModel

    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": plan.trust_remote_code}
    if plan.method == "qlora":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
    if on_gpu:
        kwargs["device_map"] = "auto"
    base = modeling.from_pretrained(AutoModelForCausalLM, plan.model, **kwargs)
    model = PeftModel.from_pretrained(base, output)
    return model.eval(), tokenizer, plan


def prompt_ids(tokenizer: Any, plan: Any, messages: list[dict[str, str]]) -> Any:
    """Token ids of the prompt, in the format the run trained on."""
    # A plan without a data report predates templated prompts: its rows were raw.
    if not prompts_use_template(tokenizer, plan.data_format, plan.raw_prompts or not plan.data_report):
        text = "".join(m["content"] for m in messages if m["role"] == "user")
        return tokenizer(text, return_tensors="pt")["input_ids"]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


def generate(model: Any, tokenizer: Any, plan: Any, messages: list[dict[str, str]], max_new_tokens: int,
             temperature: float, on_text: Callable[[str], None] = lambda text: None) -> str:
    """The model's reply, streamed piece by piece to `on_text` as it is generated."""
    import torch
    from transformers import TextStreamer

    from llmcustoms import modeling

    class Collect(TextStreamer):
        def __init__(self) -> None:
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.pieces: list[str] = []

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            self.pieces.append(text)
            on_text(text)

    ids = prompt_ids(tokenizer, plan, messages).to(model.device)
    stop = sorted({tokenizer.eos_token_id} | modeling.stop_token_ids(plan.model))
    streamer = Collect()
    sampling = {"do_sample": True, "temperature": temperature, "top_p": 0.95} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                       eos_token_id=stop, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                       streamer=streamer, **sampling)
    return "".join(streamer.pieces).strip()
