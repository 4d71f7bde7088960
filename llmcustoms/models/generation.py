"""Try a trained model: `generate` (one prompt) and `chat` (a conversation).

The run's base model is loaded the way it was trained (4-bit for QLoRA runs)
with the chosen weights on top (`run_weights`: the adapter, or with
--checkpoint a checkpoint's), and prompts are rendered with the chat template
the run trained with, so the model sees the format it learned. A reply ends
at a token the run's rows end replies with (`generation_stops`: EOS, the
generation_config's stop tokens, the template's end-of-turn token). What the
loading may do (remote code, pickle weights) is what this command's flags
allow (`loading.Allowed`), never what the run's plan.json says.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from llmcustoms.data.chat_templates import prompts_use_template, template_refused
from llmcustoms.data.stop_tokens import stop_ids
from llmcustoms.errors import ConfigError, LlmcustomsError, ModelError
from llmcustoms.models.loading import Allowed, adapter_weights, check_weight_files
from llmcustoms.runs import run_lock
from llmcustoms.runs.run_directory import RunDirectory
from llmcustoms.runs.run_weights import Weights, choose_weights

Say = Callable[[str], None]
# `console.waiting`: shows a wait (what is happening, the time so far) and yields a Say for its stages.
Waiting = Callable[[str], AbstractContextManager[Say]]


@dataclass(frozen=True)
class Trained:
    """A model ready to reply, and what it is (`Weights.describe`)."""

    model: Any
    tokenizer: Any
    plan: Any
    description: str

    def reply(self, messages: list[dict[str, str]], max_new_tokens: int, temperature: float,
              on_text: Say = lambda text: None) -> str:
        return generate(self.model, self.tokenizer, self.plan, messages, max_new_tokens, temperature, on_text)

    def conversation_start(self, system: str | None) -> list[dict[str, str]]:
        """The turns a chat starts with: the system message, if any, refused
        now if the chat template refuses one (Gemma's), not at the first reply."""
        start = [{"role": "system", "content": system}] if system else []
        if start:
            prompt_ids(self.tokenizer, self.plan, [*start, {"role": "user", "content": "Hello."}],
                       "a system message (--system)", "Leave out --system, and say what it would have said in your "
                       "first message instead.")
        return start


def open_trained(run: Path, checkpoint: str | None, waiting: Waiting, warn: Say, seed: int | None = None,
                 allowed: Allowed = Allowed()) -> Trained:
    """The model of the run at `run`, loaded while `waiting` shows it. A run
    without the weights asked for, or whose model runs code `allowed` does not
    allow, is refused before torch is even imported."""
    weights = _loadable_weights(run, checkpoint, warn, allowed)
    from llmcustoms.models.loading import quiet_libraries

    with waiting(f"Loading {weights.describe()}") as say:
        quiet_libraries()  # imports transformers: seconds already
        trained = load_trained(weights, say, allowed)
    if seed is not None:  # after loading: new LoRA layers draw their first values from the generator
        from transformers import set_seed

        set_seed(seed)
    return trained


def _loadable_weights(run: Path, checkpoint: str | None, warn: Say, allowed: Allowed) -> Weights:
    """The weights asked for, checked. While another command holds the run (a
    `train --overwrite` deleting and writing it again, a `resume`), what is
    missing or half written is so for now: that is said, not the advice for a
    damaged run (converting a pickle adapter, training again)."""
    try:
        weights = choose_weights(RunDirectory.existing(run), checkpoint, warn)
        check_loadable(weights, allowed)
        return weights
    except LlmcustomsError as error:
        pid = run_lock.holder(Path(run))
        if pid is None:
            raise
        raise ConfigError(f"{run} is being trained or rewritten right now by another llmcustoms command "
                          f"({f'process {pid}' if pid else 'another process'}), so its weights cannot be loaded "
                          f"yet ({error.message.rstrip('.')}).",
                          "Wait for it to finish (`llmcustoms runs` shows how it stands), then run this again; "
                          "--checkpoint latest tries the newest checkpoint it has saved.") from None


def load_trained(weights: Weights, say: Say = lambda text: None, allowed: Allowed = Allowed()) -> Trained:
    """The model of `weights`, on the GPU if there is one, ready to generate."""
    check_loadable(weights, allowed)
    import torch
    from transformers import AutoModelForCausalLM

    from llmcustoms.models import loading

    plan = weights.plan
    trust = plan.trust_remote_code and allowed.remote_code
    tokenizer = _tokenizer(weights, trust)
    on_gpu = torch.cuda.is_available()
    dtype = (torch.bfloat16 if on_gpu and torch.cuda.is_bf16_supported() else torch.float16) if on_gpu else torch.float32
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust,
                              "use_safetensors": loading.safetensors_only(allowed.pickle_weights)}
    if on_gpu:
        kwargs["device_map"] = "auto"
    if plan.method == "qlora":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
    # A fully fine-tuned run's model/ is a whole model; anything else starts from the base.
    source = str(weights.directory) if plan.method == "full" and weights.directory else plan.model
    say(f"Loading {weights.base_name if source == plan.model else source}")
    model = loading.from_pretrained(AutoModelForCausalLM, source, **kwargs)
    if plan.method != "full" and weights.directory is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_weights(weights.directory))
    elif plan.method != "full":
        model = loading.attach_lora(model, plan)
    if weights.tensors is not None:
        say(f"Putting in the weights of {weights.label}")
        put_in(model, weights.tensors)
    return Trained(model.eval(), tokenizer, plan, weights.describe())


def check_loadable(weights: Weights, allowed: Allowed) -> None:
    """Refuse, from the files alone, what `load_trained` may not load: a model
    running its own code, pickle weights, an adapter not in safetensors."""
    plan = weights.plan
    allowed.check(plan)
    full_model = plan.method == "full" and weights.directory is not None
    check_weight_files(str(weights.directory) if full_model else plan.model, allowed.pickle_weights)
    if plan.method != "full" and weights.directory is not None:
        adapter_weights(weights.directory)


def _tokenizer(weights: Weights, trust_remote_code: bool) -> Any:
    """The tokenizer saved with the weights, or (a checkpoint keeps none) the
    base model's, with the chat template training gave it."""
    from llmcustoms.models import loading

    if weights.directory is not None:
        from transformers import AutoTokenizer

        # trust_remote_code always given: left out, transformers would ask on the terminal.
        return loading.from_pretrained(AutoTokenizer, str(weights.directory), trust_remote_code=trust_remote_code)
    from llmcustoms.data.chat_templates import ensure_chat_template

    tokenizer = loading.load_tokenizer(weights.plan.model, trust_remote_code)
    ensure_chat_template(tokenizer)
    return tokenizer


def put_in(model: Any, path: Path) -> None:
    """Trained tensors (a checkpoint's, or best/'s) into the model the plan
    built, by the names training saved them under: every trainable parameter."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:  # pruned by a run still training, or damaged
        raise ModelError(f"Cannot read {path} ({type(exc).__name__}).",
                         "If the run is still training, its checkpoints change: try again. Otherwise the file is "
                         "damaged: pick another checkpoint (--checkpoint).") from None
    params = {name: param for name, param in model.named_parameters() if param.requires_grad}
    if set(params) != set(tensors):
        missing, extra = len(set(params) - set(tensors)), len(set(tensors) - set(params))
        raise ModelError(f"The weights in {path} do not fit the model the run's plan builds "
                         f"({missing} missing, {extra} unexpected).", "Was plan.json edited after training?")
    # copy_ would broadcast a [1, n] tensor into an [r, n] weight without a word.
    for name, param in params.items():
        if tensors[name].shape != param.shape:
            raise ModelError(f"The weights in {path} do not fit the model the run's plan builds ({name} is "
                             f"{list(tensors[name].shape)}, the model's {list(param.shape)}).",
                             "Was plan.json edited after training? Otherwise pick another checkpoint (--checkpoint).")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[name].to(param.device, param.dtype))


def prompt_ids(tokenizer: Any, plan: Any, messages: list[dict[str, str]], what: str = "the conversation",
               hint: str = "Ask without the turn it refused, or use a run of another model.") -> Any:
    """Token ids of the prompt, in the format the run trained on. A template
    that refuses the turns is an error saying what it refused (`what`)."""
    from jinja2 import TemplateError

    # A plan without a data report predates templated prompts: its rows were raw.
    if not prompts_use_template(tokenizer, plan.data_format, plan.raw_prompts or not plan.data_report):
        text = "".join(m["content"] for m in messages if m["role"] == "user")
        return tokenizer(text, return_tensors="pt")["input_ids"]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as error:
        raise template_refused(what, error, hint) from None
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


def generate(model: Any, tokenizer: Any, plan: Any, messages: list[dict[str, str]], max_new_tokens: int,
             temperature: float, on_text: Callable[[str], None] = lambda text: None) -> str:
    """The model's reply, streamed piece by piece to `on_text` as it is generated."""
    return reply_and_stop(model, tokenizer, plan, messages, max_new_tokens, temperature, on_text)[0]


def reply_and_stop(model: Any, tokenizer: Any, plan: Any, messages: list[dict[str, str]], max_new_tokens: int,
                   temperature: float, on_text: Callable[[str], None] = lambda text: None) -> tuple[str, bool]:
    """The model's reply (streamed to `on_text`), and whether it stopped: ended
    with a token of `generation_stops` before `max_new_tokens` ran out."""
    import torch
    from transformers import TextStreamer

    class Collect(TextStreamer):
        def __init__(self) -> None:
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.pieces: list[str] = []

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            self.pieces.append(text)
            on_text(text)

    ids = prompt_ids(tokenizer, plan, messages).to(model.device)
    stop = sorted(generation_stops(tokenizer, plan))
    streamer = Collect()
    sampling = {"do_sample": True, "temperature": temperature, "top_p": 0.95} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        sequence = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  eos_token_id=stop, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                                  streamer=streamer, **sampling)[0]
    stopped = len(sequence) > ids.shape[1] and int(sequence[-1]) in stop
    return "".join(streamer.pieces).strip(), stopped


def generation_stops(tokenizer: Any, plan: Any) -> set[int]:
    """The tokens generation stops on: the tokenizer's EOS, those of the model's
    generation_config.json, and the end-of-turn token the chat template ends a
    reply with (`stop_tokens.end_of_turn`), which the run's rows learned."""
    from llmcustoms.models import loading

    templated = prompts_use_template(tokenizer, plan.data_format, plan.raw_prompts or not plan.data_report)
    return stop_ids(tokenizer, loading.stop_token_ids(plan.model), templated)
