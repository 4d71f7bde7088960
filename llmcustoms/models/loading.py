"""Load the tokenizer and model a plan names, attach LoRA, and save what was trained.

`--model` is a local directory or a Hugging Face Hub id. A hub id is looked up
in the local cache first, so a cached model loads with no network at all; only
a model the user asked for and that is not cached is fetched.

Loading runs no code but ours unless the user asks, on the command that loads:
the model's own code only with --trust-remote-code, and weights only from
safetensors files (a pickle file, pytorch_model.bin, can run code when
unpickled) unless --allow-pickle-weights (`Allowed`). An adapter loads from
adapter_model.safetensors only.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from llmcustoms.errors import ModelError
from llmcustoms.models import folder, hub_access
from llmcustoms.models.gguf_folder import gguf_folder, is_gguf
from llmcustoms.planning.plan import ModelChoice, Plan
from llmcustoms.planning.presets import Family, ModelSpec, family_for_model_type, find_model_spec, load_families
from llmcustoms.runs.file_modes import make_readable

# "org/name", as the Hub writes a model id.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# Used for model types no preset family covers: peft finds every linear layer.
ALL_LINEAR = ("all-linear",)
# Weight files read with pickle (torch.load), which can run code when read.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class Allowed:
    """What the user allowed a model load to do, on the command that loads a
    run's model (`resume`, `generate`, `chat`, `export`). A run directory can
    come from anyone, so its plan.json never allows anything by itself."""

    remote_code: bool = False  # --trust-remote-code
    pickle_weights: bool = False  # --allow-pickle-weights

    def check(self, plan: Any) -> None:
        """Refuse, before anything loads, a run whose model runs its own code
        when this command was not told it may."""
        if plan.trust_remote_code and not self.remote_code:
            raise ModelError(f"This run's model ({plan.model}) runs code from its repository (trust_remote_code).",
                             "Pass --trust-remote-code to allow it for this command, if you trust that repository.")

    def applied_to(self, plan: Plan) -> Plan:
        """`plan` as this command may load it (`resume`), refused now if it may
        not: remote code, and pickle weights, only as this command allows."""
        self.check(plan)
        check_weight_files(plan.model, self.pickle_weights)
        return replace(plan, allow_pickle_weights=self.pickle_weights)

    def flags(self) -> list[str]:
        """The flags that allow the same again (for the processes a relaunch starts)."""
        return ((["--trust-remote-code"] if self.remote_code else [])
                + (["--allow-pickle-weights"] if self.pickle_weights else []))


def looks_like_path(name: str) -> bool:
    # Hub ids are "org/name": one slash, no leading dot, slash or tilde.
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).expanduser().exists()


def model_location(name: str) -> str:
    """The string to hand to `from_pretrained`: an absolute path for local models."""
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if is_gguf(name) and looks_like_path(name):  # read once into a cached folder: then a folder like any other
        return str(gguf_folder(path))
    if looks_like_path(name):
        raise ModelError(f"Model directory not found: {name}",
                         "Pass --model with a directory that holds config.json, or a Hugging Face Hub id.")
    return name


def remote_code_refused(name: str) -> ModelError:
    return ModelError(f"The model '{name}' runs code from its repository (trust_remote_code), which llmcustoms "
                      "does not allow unless asked.",
                      "Pass --trust-remote-code (or set LLMCUSTOMS_TRUST_REMOTE_CODE=true) if you trust that repository.")


def pickle_refused(name: str, found: str | None = None) -> ModelError:
    """A model whose weights are in pickle files only (`found`: the file), refused."""
    what = (f"The weights of '{name}' are in a pickle file ({found}), which can run code when it is loaded"
            if found else f"The model '{name}' has no safetensors weights, only pickle files, which can run code "
            "when they are loaded")
    return ModelError(f"{what}; llmcustoms loads safetensors weights only.",
                      "If you trust where they came from, convert them once (in Python: AutoModelForCausalLM."
                      "from_pretrained(MODEL).save_pretrained(DIR) writes model.safetensors; then pass --model DIR), "
                      "or pass --allow-pickle-weights to load them as they are.")


def _explain(name: str, exc: Exception) -> ModelError:
    """One message for the many ways a load can fail; never includes a token."""
    text = str(exc)
    kind = type(exc).__name__
    if "Gated" in kind or "gated" in text or "401" in text:
        spec = find_model_spec(name, load_families())
        licence = load_families()[spec.family].hub_licence if spec else ""
        return ModelError(f"The model '{name}' is gated on the Hugging Face Hub and needs an access token.",
                          licence or "Accept its licence on the Hub, then set HF_TOKEN in the environment or in .env.")
    if "trust_remote_code" in text:  # transformers refuses a model's own code unless trusted
        return remote_code_refused(name)
    if "no file named model.safetensors found" in text or "cannot be loaded with `safetensors`" in text:
        return pickle_refused(name)  # what transformers says when use_safetensors=True finds none
    if Path(name).expanduser().is_dir():  # a folder here: what is wrong with it, not with the Hub
        return folder.explain(name, Path(name).expanduser(), exc)
    if "RepositoryNotFound" in kind or "is not a local folder and is not a valid model identifier" in text:
        return ModelError(f"There is no model '{name}' on the Hugging Face Hub or on this disk.",
                          "Check the spelling, or pass --model PATH to a local model directory.")
    if hub_access.offline_detected():
        return ModelError(f"The model '{name}' is not in the local Hugging Face cache and the Hub cannot be reached.",
                          "Connect to the internet once to download it, or pass --model PATH to a local model directory.")
    if hub_access.offline_by_setting():
        return ModelError(f"The model '{name}' is not in the local Hugging Face cache, and offline mode is on "
                          "(HF_HUB_OFFLINE=1), so the Hub cannot be reached.",
                          "Unset HF_HUB_OFFLINE to download it, or pass --model PATH to a local model directory.")
    if "couldn't connect" in text or "offline" in text.lower() or "Connection" in kind or "LocalEntryNotFound" in kind:
        return ModelError(f"The model '{name}' is not in the local Hugging Face cache and the Hub cannot be reached.",
                          "Connect to the internet once to download it, or pass --model PATH to a local model directory.")
    if "model_type" in text or "config.json" in text:
        return ModelError(f"'{name}' is not a Hugging Face model directory (no usable config.json).",
                          "Point --model at a directory written by `save_pretrained`, or use a Hub id.")
    return ModelError(f"Could not load the model '{name}' ({kind}).",
                      "Check that the directory is complete, or pass another --model.")


def from_pretrained(loader: Any, name: str, **kwargs: Any) -> Any:
    """Try the local cache first (instant and offline), then the Hub, if it answers
    at once (`hub_access`: no minute of retries when it cannot be reached)."""
    location = model_location(name)
    # Else, for a Hub model without safetensors weights, transformers asks the
    # Hub's conversion bot to open a pull request on that model, with the user's token.
    os.environ.setdefault("DISABLE_SAFETENSORS_CONVERSION", "1")
    try:
        return loader.from_pretrained(location, local_files_only=True, **kwargs)
    except (OSError, ValueError) as exc:
        if Path(location).is_dir() or not hub_access.hub_reachable():
            raise _explain(name, exc) from None
    try:
        return loader.from_pretrained(location, **kwargs)
    except (OSError, ValueError) as exc:
        raise _explain(name, exc) from None


def check_weight_files(name: str, allow_pickle: bool) -> None:
    """Refuse (exit 2, before anything loads) a local model whose weights are in
    pickle files only, or whose config.json names a weights file that is not
    safetensors, unless pickle weights are allowed. A Hub model is refused when
    it loads (`from_pretrained` with use_safetensors=True)."""
    path = Path(name).expanduser()
    if not path.is_dir():
        return
    folder.check_weights(name, path)  # whole, and fitting config.json: else a traceback mid-load
    if allow_pickle:
        return
    try:
        named = json.loads((path / "config.json").read_text()).get("transformers_weights")
    except (OSError, ValueError, AttributeError):  # no config, not JSON, not an object: loading says so
        named = None
    if isinstance(named, str) and not named.endswith((".safetensors", ".safetensors.index.json")):
        raise pickle_refused(name, named)
    if any(path.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise pickle_refused(name, pickles[0])


def safetensors_only(allow_pickle: bool) -> bool | None:
    """`use_safetensors` for transformers: True, or None (safetensors first, else
    pickle) when allowed; False would prefer pickle files over safetensors ones."""
    return None if allow_pickle else True


def adapter_weights(directory: Path | str) -> Path:
    """The directory of an adapter to load, refused unless its weights are
    adapter_model.safetensors (peft would read adapter_model.bin with pickle)."""
    if not (Path(directory) / ADAPTER_WEIGHTS).is_file():
        found = [p.name for p in Path(directory).glob("adapter_model.*")]
        if not found:  # no pickle to convert: cut short, or being written (a `train --overwrite` under way)
            raise ModelError(f"The adapter in {directory} has no {ADAPTER_WEIGHTS}: its weights are missing.",
                             "If another llmcustoms command is writing it right now (`train --overwrite`), wait "
                             "for it to finish; otherwise put the file back from a copy, or train the run again.")
        raise ModelError(f"The adapter in {directory} has no {ADAPTER_WEIGHTS} (only {found[0]}, a pickle file "
                         "that can run code when loaded).",
                         "llmcustoms loads adapters from safetensors only; the adapters it writes are. Convert it "
                         "once if you trust it: PeftModel.from_pretrained(base, DIR).save_pretrained(DIR).")
    return Path(directory)


def load_config(name: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig

    return from_pretrained(AutoConfig, name, trust_remote_code=trust_remote_code)


def spec_from_config(name: str, config: Any, family: str) -> ModelSpec:
    """Architecture facts of a model from its config.json (memory maths needs them)."""
    from llmcustoms.planning.memory import parameter_counts

    heads = config.num_attention_heads
    spec = ModelSpec(
        hub_id=name, family=family, model_type=config.model_type, params=0, hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers, num_attention_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        intermediate_size=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
        vocab_size=config.vocab_size, tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_context=getattr(config, "max_position_embeddings", None) or 2048,
        head_dim=getattr(config, "head_dim", None) or 0,
    )
    return replace(spec, params=sum(parameter_counts(spec)))


def choice_from_spec(spec: ModelSpec, families: dict[str, Family], source: str) -> ModelChoice:
    family = families.get(spec.family)
    targets = family.targets_for(spec.model_type) if family else ALL_LINEAR
    return ModelChoice(name=spec.hub_id, family=spec.family, model_type=spec.model_type, target_modules=targets,
                       max_context=spec.max_context, source=source, arch=spec)


def describe_model(name: str, families: dict[str, Family], source: str, trust_remote_code: bool = False) -> ModelChoice:
    """Family, LoRA targets, context and architecture of a model, from its config.
    A preset model that is not downloaded yet is described from the presets,
    so planning works offline. A local folder is checked whole first."""
    if Path(name).expanduser().is_dir():
        folder.check_folder(name, Path(name).expanduser())
    try:
        config = load_config(name, trust_remote_code)
    except ModelError:
        known = find_model_spec(name, families)
        if known is None:
            raise
        return choice_from_spec(known, families, source)
    model_type = getattr(config, "model_type", "")
    spec = spec_from_config(name, config, "other")
    family = family_for_model_type(model_type, families, spec)
    return choice_from_spec(replace(spec, family=family.name if family else "other"), families, source)


def load_tokenizer(name: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    tokenizer = from_pretrained(AutoTokenizer, name, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        # Padding positions are masked out of attention and loss, so any token
        # will do; EOS is the one every causal LM tokenizer has.
        tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token
    return tokenizer


def stop_token_ids(name: str) -> set[int]:
    """Token ids generation stops on, from the model's generation_config.json if it has one."""
    path = Path(model_location(name)) / "generation_config.json"
    if not path.is_file():
        return set()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError):
        return set()
    if isinstance(eos, int):
        return {eos}
    return {int(i) for i in eos} if isinstance(eos, list) else set()


def weights_dtype(plan: Plan) -> Any:
    """dtype of the frozen base weights. Trained weights stay fp32 (AdamW on
    16-bit master weights loses small updates); frozen ones can be 16-bit."""
    import torch

    if plan.method == "full" or plan.mixed_precision == "no":
        return torch.float32
    return torch.bfloat16 if plan.mixed_precision == "bf16" else torch.float16


def load_model(plan: Plan, device_index: int | None = None) -> Any:
    """The model of the plan, ready to train: quantized for QLoRA, LoRA attached
    unless the method is full, gradient checkpointing on if planned."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": weights_dtype(plan), "trust_remote_code": plan.trust_remote_code,
                              "use_safetensors": safetensors_only(plan.allow_pickle_weights)}
    check_weight_files(plan.model, plan.allow_pickle_weights)
    if plan.method == "qlora":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=weights_dtype(plan),
        )
        if device_index is not None:
            kwargs["device_map"] = {"": device_index}
    model = from_pretrained(AutoModelForCausalLM, plan.model, **kwargs)
    model.config.use_cache = False  # the KV cache is for generation; it only costs memory here
    if plan.packing:
        from llmcustoms.models.packing import use_varlen_attention

        use_varlen_attention(model)
    if plan.method == "qlora":
        _keep_4bit_layout_trainable(model)
    # QLoRA is prepared as LoRA is, not by PEFT's prepare_model_for_kbit_training: that casts
    # every weight that is not 4-bit (embeddings, head, norms) to fp32, which keeps the residual
    # stream and the MLP's saved tensors in fp32 too. On an H200 such a step peaked at 1.56x the
    # same step's with them in 16 bits (docs/benchmarks.md). They are frozen either way, and
    # attaching the adapter freezes the rest.
    checkpointing_kwargs = {"use_reentrant": False}
    if plan.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs)
        model.enable_input_require_grads()
    if plan.method == "full":
        model = model if model.dtype == torch.float32 else model.float()
    else:
        model = continue_adapter(model, plan.from_run) if plan.from_run else attach_lora(model, plan)
    if plan.compile:
        compile_layers(model)
    return model


def compile_layers(model: Any) -> None:
    """torch.compile each decoder layer in place, as torchtune does: the layers are
    where the time goes, one compiled layer serves all of them, and the state
    dict, the LM head's patch (`sft.select_logits`) and checkpoints stay as
    they are. Lengths vary from batch to batch, so shapes are dynamic."""
    import torch
    from peft import PeftModel

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    layers = base.get_decoder().layers
    # Each layer's own attributes (its index) are guarded on: one compiled graph per layer, not per step.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(layers) + 8)
    for layer in layers:
        layer.compile(dynamic=True)


def continue_adapter(model: Any, adapter: str) -> Any:
    """A finished run's adapter on `model`, trainable: `--from-run` goes on training it."""
    from peft import PeftModel

    if not (Path(adapter) / "adapter_config.json").is_file():
        raise ModelError(f"The adapter this run starts from ({adapter}) is gone.",
                         "Put that run's adapter back where it was, or start a new run.")
    return PeftModel.from_pretrained(model, adapter_weights(adapter), is_trainable=True)


def attach_lora(model: Any, plan: Plan) -> Any:
    """The plan's LoRA layers on `model`, freshly initialised: for training, and
    for `generate --checkpoint`, which then puts a checkpoint's weights in them."""
    from peft import LoraConfig, get_peft_model

    assert plan.lora is not None
    targets = plan.lora.target_modules
    config = LoraConfig(
        r=plan.lora.r, lora_alpha=plan.lora.alpha, lora_dropout=plan.lora.dropout, bias="none",
        task_type="CAUSAL_LM", target_modules="all-linear" if targets == ALL_LINEAR else list(targets),
    )
    try:
        return get_peft_model(model, config)
    except ValueError as exc:
        raise ModelError(f"Cannot attach LoRA to this model: {exc}",
                         "The model's layer names differ from its family's; check `lora_target_modules` in presets/.") from None


def _keep_4bit_layout_trainable(model: Any) -> None:
    """On CPUs with AVX512-BF16, bitsandbytes repacks 4-bit weights into an
    inference-only layout the first time a layer runs in eval mode, and keeps
    that layout when training resumes, where it then fails (bitsandbytes 0.50).
    Evaluation between training steps must not trigger it."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def save_trained(model: Any, tokenizer: Any, directory: Path, state_dict: dict[str, Any] | None = None) -> None:
    """Write the adapter (or the full model) and the tokenizer, with its chat template.
    `state_dict`: whole weights to write instead of the model's own (FSDP holds shards)."""
    directory.mkdir(parents=True, exist_ok=True)
    extra = {} if state_dict is None else {"state_dict": state_dict}
    model.save_pretrained(str(directory), safe_serialization=True, **extra)
    tokenizer.save_pretrained(str(directory))
    make_readable(directory)
    _name_the_base_model(directory / "README.md")


def _name_the_base_model(card: Path) -> None:
    """peft's model card names the base model by the path it was loaded from,
    a path on this machine; a card names it as `card_base_model` does."""
    if not card.is_file():
        return
    text = card.read_text()
    named = re.sub(r"(?m)^base_model: (.+)$", lambda m: f"base_model: {card_base_model(m[1].strip())}", text, count=1)
    if named != text:
        card.write_text(named)


def card_base_model(model: str) -> str:
    """The base model as a card names it, never a path on this machine: a Hub
    id as given; for a local directory the Hub id it was saved from (its
    config.json's `_name_or_path`), else the directory's name."""
    path = Path(model).expanduser()
    if path.is_dir():
        try:
            origin = json.loads((path / "config.json").read_text()).get("_name_or_path")
        except (OSError, ValueError, AttributeError):  # no config, not JSON, not an object
            origin = None
        if isinstance(origin, str) and HUB_ID.fullmatch(origin) and ".." not in origin:
            return origin
    elif HUB_ID.fullmatch(model):
        return model
    return path.resolve().name


def quiet_libraries() -> None:
    """Keep the libraries' own progress bars and advice out of the user's terminal."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import logging
    import warnings

    # bitsandbytes announces on import that an optional Hub-hosted CPU kernel is
    # missing; it falls back to its own kernel, so the notice only confuses.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    # A retry line per attempt at an unreachable Hub: hub_access says it once instead.
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(torch|transformers|peft|bitsandbytes)\..*")
