"""Model families and training presets, loaded from the YAML files in `presets/`.

Presets are data, not code: a user can read and copy them, and `tune` writes a
file of the same shape. Validation collects every problem in a file and raises
once, so a hand-edited preset is fixed in one go.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from llmcustoms.errors import ConfigError
from llmcustoms.planning import options
from llmcustoms.planning.objective_kinds import DPO, OBJECTIVES, objective_named

# Row-count bounds of the dataset-size buckets a preset adjusts for.
SMALL_DATASET_ROWS = 1_000
MEDIUM_DATASET_ROWS = 10_000
# Parameter-count bounds of the model-size classes a preset adjusts for. Tiny
# stops below Qwen2.5-0.5B (494M), so "tiny" means the SmolLM2 sizes and
# "small" starts at the models named 0.5B.
TINY_MODEL_PARAMS = 400_000_000
SMALL_MODEL_PARAMS = 2_000_000_000
MEDIUM_MODEL_PARAMS = 5_000_000_000
MODEL_SIZE_CLASSES = ("tiny", "small", "medium", "large")
# The evaluation split is made before the model is chosen (the choice plans on
# the training rows), so it cannot depend on the model's size.
NOT_BY_MODEL_SIZE = frozenset({"eval_split"})


def presets_dir() -> Path:
    """Where the preset files are: inside the installed package (wheel), or at
    the repository root (editable install / source checkout)."""
    package = Path(__file__).resolve().parent.parent  # llmcustoms/, above planning/
    for candidate in (package / "presets", package.parent / "presets"):
        if (candidate / "families").is_dir():
            return candidate
    raise ConfigError(
        "The preset files are missing from this installation.",
        "Reinstall llmcustoms (`pip install .` from the source tree).",
    )


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts of one hub model, enough for memory maths without a download."""

    hub_id: str
    family: str
    model_type: str
    params: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_context: int
    # Width of one attention head where it is not hidden_size / heads (Qwen3's
    # 128 at hidden 1024 and 16 heads; Gemma 3's 256); 0: hidden_size / heads.
    head_dim: int = 0

    @property
    def head_width(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class Family:
    name: str
    description: str
    model_types: tuple[str, ...]
    # model_type -> LoRA target module names
    lora_target_modules: dict[str, tuple[str, ...]]
    chat_template_notes: str
    models: tuple[ModelSpec, ...]
    # False for a family that shares its model type with another (SmolLM2 and
    # TinyLlama are both `llama`): it takes a local model only when the
    # architecture is one of its own models'; any other checkpoint of the type
    # goes to the family that covers it.
    covers_other_checkpoints: bool = True
    # Where the Hub gates the family's models behind a licence to accept: what
    # to do, said before a download fails (empty: not gated).
    hub_licence: str = ""

    def targets_for(self, model_type: str) -> tuple[str, ...]:
        return self.lora_target_modules[model_type]


@dataclass(frozen=True)
class TrainingPreset:
    """Training defaults. Every field here can be overridden by a flag."""

    name: str
    description: str
    models: tuple[str, ...]  # hub ids, best first
    method: str
    epochs: float
    lr: float
    lr_scheduler: str
    warmup_ratio: float
    weight_decay: float
    max_grad_norm: float
    lora_r: int
    lora_alpha: int
    lora_dropout: float
    effective_batch_size: int
    max_seq_len: int
    eval_split: float
    evals_per_epoch: int
    early_stopping_patience: int
    by_dataset_size: dict[str, dict[str, Any]]
    by_model_size: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Overrides for an objective other than sft, applied last: DPO's lower lr and fewer epochs.
    by_objective: dict[str, dict[str, Any]] = field(default_factory=dict)
    cpu_models: tuple[str, ...] = ()  # hub ids, best first, for a machine without a GPU
    source: str = ""

    def for_dataset_size(self, rows: int) -> tuple[dict[str, Any], str]:
        """The preset's values adjusted for a dataset of `rows` rows, and the bucket name."""
        bucket = dataset_size_bucket(rows)
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name in TUNABLE_FIELDS}
        values.update(self.by_dataset_size.get(bucket, {}))
        return values, bucket

    def resolve(self, rows: int, params: int, objective: str = "sft") -> PresetValues:
        """The preset's values for `rows` rows of data and a model of `params`
        parameters: the base values, then the dataset-size bucket's, then the
        model-size class's (so a tiny model's lr wins over a bucket's), then
        the objective's (DPO's lr wins over both; a pair objective with no values of its
        own takes DPO's, the pair objective the presets were measured with)."""
        values, bucket = self.for_dataset_size(rows)
        size_class = model_size_class(params)
        by_class = self.by_model_size.get(size_class, {})
        values.update(by_class)
        by_objective = self.by_objective.get(objective) or \
            (self.by_objective.get(DPO.name, {}) if objective_named(objective).pairs else {})
        values.update(by_objective)
        label = f"preset {self.name} ({bucket} dataset)"
        class_label = f"preset {self.name} ({size_class} model)"
        sources = {name: class_label if name in by_class else label for name in values}
        sources.update({name: f"preset {self.name} ({objective})" for name in by_objective})
        return PresetValues(self.name, values, sources, bucket, size_class,
                            tuple(name for name in by_class if name not in by_objective))

    def by_size(self, names: tuple[str, ...]) -> dict[str, dict[str, list[Any]]]:
        """What `presets` shows, as `resolve` gives it: for each dataset size (small, medium,
        large), each of `names` for a tiny, small, medium and large model. The base values
        alone would say lr 2e-4 where a small dataset on a tiny model trains at 5e-4."""
        rows = {"small": SMALL_DATASET_ROWS - 1, "medium": MEDIUM_DATASET_ROWS - 1, "large": MEDIUM_DATASET_ROWS}
        params = (TINY_MODEL_PARAMS - 1, SMALL_MODEL_PARAMS - 1, MEDIUM_MODEL_PARAMS - 1, MEDIUM_MODEL_PARAMS)
        return {bucket: {name: [self.resolve(count, size).values[name] for size in params] for name in names}
                for bucket, count in rows.items()}

    def model_candidates(self, has_gpu: bool) -> tuple[str, ...]:
        """The models to choose from, best first: the CPU tier on a machine
        without a GPU (when the preset has one)."""
        return self.models if has_gpu or not self.cpu_models else self.cpu_models


@dataclass(frozen=True)
class PresetValues:
    """A preset's values for one dataset and model, each with its source label."""

    preset: str
    values: dict[str, Any]
    sources: dict[str, str]  # name -> "preset quality (small dataset)" or "preset quality (tiny model)"
    bucket: str
    size_class: str
    by_model_size: tuple[str, ...]  # the names the model-size class set

    def model_size_reasons(self, given: set[str], params: int) -> list[str]:
        """The plan's reason for the values the model-size class set (those no flag replaced)."""
        names = [name for name in self.by_model_size if name not in given]
        if not names:
            return []
        size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"
        shown = ", ".join(f"{name} {self.values[name]:g}" if isinstance(self.values[name], float)
                          else f"{name} {self.values[name]}" for name in names)
        return [f"{shown}: preset {self.preset} for a {self.size_class} model ({size} parameters)"]


# The preset fields that become plan values (the rest describe the preset
# itself): every option of the table with a preset key.
TUNABLE_FIELDS = options.preset_keys()


def dataset_size_bucket(rows: int) -> str:
    if rows < SMALL_DATASET_ROWS:
        return "small"
    if rows < MEDIUM_DATASET_ROWS:
        return "medium"
    return "large"


def model_size_class(params: int) -> str:
    """tiny, small, medium or large, from a model's parameter count."""
    if params < TINY_MODEL_PARAMS:
        return "tiny"
    if params < SMALL_MODEL_PARAMS:
        return "small"
    if params < MEDIUM_MODEL_PARAMS:
        return "medium"
    return "large"


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"Cannot read preset file {path}: {exc.strerror}.") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: not valid YAML.", "Fix the YAML syntax and try again.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a preset file must be a YAML mapping of field: value.")
    return data


def _check_fields(data: dict[str, Any], required: dict[str, type | tuple[type, ...]], problems: list[str], where: str) -> None:
    for name, kind in required.items():
        kinds = kind if isinstance(kind, tuple) else (kind,)
        value = data.get(name)
        if name not in data:
            problems.append(f"{where}: missing field '{name}'")
        # bool is a subclass of int in Python; `lora_r: true` is still a mistake.
        elif not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            problems.append(f"{where}: field '{name}' has the wrong type ({type(value).__name__})")


_MODEL_FIELDS: dict[str, type | tuple[type, ...]] = {
    "hub_id": str, "params": int, "hidden_size": int, "num_layers": int,
    "num_attention_heads": int, "num_kv_heads": int, "intermediate_size": int,
    "vocab_size": int, "tie_word_embeddings": bool, "max_context": int,
}
# Fields a model may have; their defaults otherwise (`ModelSpec`).
_OPTIONAL_MODEL_FIELDS: dict[str, type] = {"head_dim": int}


def parse_family(data: dict[str, Any], source: str) -> Family:
    problems: list[str] = []
    _check_fields(data, {"name": str, "description": str, "model_types": list,
                         "lora_target_modules": (list, dict), "models": list}, problems, source)
    if problems:
        raise ConfigError("Invalid model family file:\n  " + "\n  ".join(problems))
    model_types = tuple(data["model_types"])
    raw_targets = data["lora_target_modules"]
    if isinstance(raw_targets, list):
        targets = {mt: tuple(raw_targets) for mt in model_types}
    else:
        targets = {mt: tuple(v) for mt, v in raw_targets.items()}
        problems += [f"{source}: no LoRA targets for model type '{mt}'" for mt in model_types if mt not in targets]
    covers = data.get("covers_other_checkpoints", True)
    if not isinstance(covers, bool):
        problems.append(f"{source}: field 'covers_other_checkpoints' has the wrong type ({type(covers).__name__})")
    models = []
    for i, raw in enumerate(data["models"], start=1):
        where = f"{source} model {i}"
        if not isinstance(raw, dict):
            problems.append(f"{where}: must be a mapping")
            continue
        _check_fields(raw, _MODEL_FIELDS, problems, where)
        optional = {k: raw[k] for k in _OPTIONAL_MODEL_FIELDS if k in raw}
        _check_fields(optional, {k: _OPTIONAL_MODEL_FIELDS[k] for k in optional}, problems, where)
        model_type = raw.get("model_type", model_types[0] if model_types else "")
        if model_type not in model_types:
            problems.append(f"{where}: model_type '{model_type}' is not one of {list(model_types)}")
        if raw.get("num_attention_heads") and raw.get("num_kv_heads") and raw["num_attention_heads"] % raw["num_kv_heads"]:
            problems.append(f"{where}: num_attention_heads must be a multiple of num_kv_heads")
        if not problems:
            models.append(ModelSpec(family=data["name"], model_type=model_type,
                                    **{k: raw[k] for k in _MODEL_FIELDS}, **optional))
    if problems:
        raise ConfigError("Invalid model family file:\n  " + "\n  ".join(problems))
    return Family(
        name=data["name"], description=data["description"].strip(), model_types=model_types,
        lora_target_modules=targets, chat_template_notes=str(data.get("chat_template_notes", "")).strip(),
        models=tuple(models), covers_other_checkpoints=covers,
        hub_licence=str(data.get("hub_licence", "")).strip(),
    )


def _field_type(option: options.Option) -> type | tuple[type, ...]:
    return (int, float) if option.kind is float else option.kind  # 3 is a fine number of epochs


_PRESET_FIELDS: dict[str, type | tuple[type, ...]] = {
    "name": str, "description": str, "models": list,
    **{key: _field_type(options.by_preset_key(key)) for key in TUNABLE_FIELDS},
}


def validate_preset_values(values: dict[str, Any], where: str) -> list[str]:
    """Range checks shared by preset files, their per-size overrides and flags:
    each option's own check from the table."""
    problems = []
    for name, value in values.items():
        problem = options.by_preset_key(name).problem(value) if name in TUNABLE_FIELDS else None
        if problem:
            problems.append(f"{where}: '{name}' has an out-of-range value {value!r} ({problem})")
    return problems


def _overrides_by_size(data: dict[str, Any], key: str, names: tuple[str, ...], source: str,
                       problems: list[str]) -> dict[str, dict[str, Any]]:
    """A `by_dataset_size` or `by_model_size` section: a mapping of size name to
    overrides of tunable fields. Problems go to `problems`; returns the valid part."""
    section = data.get(key) or {}
    what = {"by_dataset_size": "dataset size", "by_model_size": "model size", "by_objective": "objective"}[key]
    if not isinstance(section, dict):
        problems.append(f"{source}: '{key}' must be a mapping of {'/'.join(names)}")
        return {}
    kept = {}
    for size, overrides in section.items():
        where = f"{source} {key}.{size}"
        if size not in names:
            problems.append(f"{where}: must be one of {', '.join(names)}")
        elif not isinstance(overrides, dict):
            problems.append(f"{where}: must be a mapping")
        else:
            allowed = {k: v for k, v in overrides.items()
                       if k in TUNABLE_FIELDS and not (key != "by_dataset_size" and k in NOT_BY_MODEL_SIZE)}
            problems += [f"{where}: '{k}' cannot be adjusted per {what}" for k in overrides if k not in allowed]
            wrong_type: list[str] = []
            _check_fields(allowed, {k: _PRESET_FIELDS[k] for k in allowed}, wrong_type, where)
            problems += wrong_type
            problems += validate_preset_values({k: v for k, v in allowed.items()
                                                if not any(f"'{k}'" in p for p in wrong_type)}, where)
            kept[size] = dict(overrides)
    return kept


# What a YAML value that is not text is, in the words of a preset's author.
_YAML_KINDS = {int: "a number", float: "a number", bool: "true or false", dict: "a mapping", list: "a list",
               type(None): "empty"}


def _model_list_problems(data: dict[str, Any], key: str, source: str, known_models: set[str]) -> list[str]:
    """`models` and `cpu_models`: hub ids that a family file describes."""
    models = data.get(key)
    if not isinstance(models, list):
        return []
    problems = [f"{source}: '{key}' must list at least one model"] if not models else []
    # A number or a mapping (`- {name: x}`) is a YAML slip, said as one, not looked up.
    problems += [f"{source}: {key} item {i} is {_YAML_KINDS.get(type(m), 'not text')}, not a model id such as "
                 "Qwen/Qwen3-4B" for i, m in enumerate(models, 1) if not isinstance(m, str)]
    return problems + [f"{source}: {key} lists '{m}', which is not in any family file (presets/families/)"
                       for m in models if isinstance(m, str) and m not in known_models]


def parse_preset(data: dict[str, Any], source: str, known_models: set[str]) -> TrainingPreset:
    problems: list[str] = []
    _check_fields(data, _PRESET_FIELDS, problems, source)
    if "cpu_models" in data and not isinstance(data["cpu_models"], list):
        problems.append(f"{source}: field 'cpu_models' has the wrong type ({type(data['cpu_models']).__name__})")
    unknown = set(data) - set(_PRESET_FIELDS) - {"by_dataset_size", "by_model_size", "by_objective", "cpu_models"}
    problems += [f"{source}: unknown field '{name}'" for name in sorted(unknown)]
    # Range-check every field whose type is right, so one pass reports everything.
    typed = {k: data[k] for k in TUNABLE_FIELDS if k in data and not any(f"'{k}'" in p for p in problems)}
    problems += validate_preset_values(typed, source)
    problems += _model_list_problems(data, "models", source, known_models)
    problems += _model_list_problems(data, "cpu_models", source, known_models)
    by_dataset = _overrides_by_size(data, "by_dataset_size", ("small", "medium", "large"), source, problems)
    by_model = _overrides_by_size(data, "by_model_size", MODEL_SIZE_CLASSES, source, problems)
    by_objective = _overrides_by_size(data, "by_objective", tuple(OBJECTIVES), source, problems)
    if problems:
        raise ConfigError("Invalid preset:\n  " + "\n  ".join(problems),
                          "Compare it with the files in presets/ (`llmcustoms presets` lists them).")
    return TrainingPreset(
        **{k: data[k] for k in _PRESET_FIELDS if k != "models"},
        models=tuple(data["models"]), by_dataset_size=by_dataset, by_model_size=by_model, by_objective=by_objective,
        cpu_models=tuple(data.get("cpu_models") or ()), source=source,
    )


def load_families() -> dict[str, Family]:
    families = {}
    for path in sorted((presets_dir() / "families").glob("*.yaml")):
        family = parse_family(_read_yaml(path), path.name)
        families[family.name] = family
    return families


def builtin_preset_names() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def load_preset(name_or_path: str) -> TrainingPreset:
    """A built-in preset by name, or a preset YAML file by path."""
    families = {spec.hub_id for family in load_families().values() for spec in family.models}
    builtin = presets_dir() / f"{name_or_path}.yaml"
    if "/" not in name_or_path and not name_or_path.endswith((".yaml", ".yml")) and builtin.is_file():
        return parse_preset(_read_yaml(builtin), builtin.name, families)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return parse_preset(_read_yaml(path), str(path), families)
    raise ConfigError(
        f"Unknown preset '{name_or_path}'.",
        f"Use one of {', '.join(builtin_preset_names())}, or the path to a preset YAML file.",
    )


def family_for_model_type(model_type: str, families: dict[str, Family],
                          arch: ModelSpec | None = None) -> Family | None:
    """The family of a model of `model_type`. Where several families claim the
    type, the one with a model of the same architecture as `arch` (from the
    model's config.json), else the one that covers other checkpoints of it."""
    claiming = [family for family in families.values() if model_type in family.model_types]
    if arch is not None:
        for family in claiming:
            if any(_same_architecture(arch, spec) for spec in family.models):
                return family
    covering = [family for family in claiming if family.covers_other_checkpoints]
    return (covering or claiming or [None])[0]


def _same_architecture(a: ModelSpec, b: ModelSpec) -> bool:
    return (a.model_type, a.hidden_size, a.num_layers, a.num_attention_heads, a.num_kv_heads, a.intermediate_size,
            a.vocab_size) == (b.model_type, b.hidden_size, b.num_layers, b.num_attention_heads, b.num_kv_heads,
                              b.intermediate_size, b.vocab_size)


def find_model_spec(hub_id: str, families: dict[str, Family]) -> ModelSpec | None:
    for family in families.values():
        for spec in family.models:
            if spec.hub_id.lower() == hub_id.lower():
                return spec
    return None
