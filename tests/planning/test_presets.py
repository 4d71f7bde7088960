"""Every preset and model family file loads and validates; bad files say what is wrong."""

from __future__ import annotations

import pytest
import yaml

from llmcustoms.errors import ConfigError
from llmcustoms.planning.presets import (MODEL_SIZE_CLASSES, builtin_preset_names, dataset_size_bucket, family_for_model_type,
                                find_model_spec, load_families, load_preset, model_size_class, presets_dir)

PRESETS = builtin_preset_names()
FAMILY_FILES = sorted((presets_dir() / "families").glob("*.yaml"))


def test_the_three_presets_and_nine_families_ship():
    assert PRESETS == ["bestaccuracy", "highspeed", "quality"]
    assert set(load_families()) == {"tinyllama", "smollm2", "phi", "mistral", "qwen", "qwen3", "llama3", "gemma3",
                                     "smollm3"}
    gated = {name for name, family in load_families().items() if family.hub_licence}
    assert gated == {"llama3", "gemma3"}


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_and_names_known_families_and_models(name):
    preset = load_preset(name)
    families = load_families()
    assert preset.name == name
    hub_ids = {m.hub_id for f in families.values() for m in f.models}
    assert preset.models and set(preset.models) <= hub_ids
    # The CPU tier: known models, and small enough that a CPU run is minutes.
    assert preset.cpu_models and set(preset.cpu_models) <= hub_ids
    assert all(model_size_class(find_model_spec(m, families).params) == "tiny" for m in preset.cpu_models)
    assert set(preset.by_model_size) == set(MODEL_SIZE_CLASSES)
    for rows in (10, 5_000, 50_000):
        values, bucket = preset.for_dataset_size(rows)
        assert bucket == dataset_size_bucket(rows)
        assert values["effective_batch_size"] >= 1 and 0 < values["lr"] < 1
        for params in (135e6, 1.5e9, 3e9, 7e9):
            resolved = preset.resolve(rows, int(params))
            assert resolved.values["effective_batch_size"] >= 1 and 0 < resolved.values["lr"] < 1
    # Every preset evaluates and stops early (the loop keeps the best evaluation's weights).
    assert preset.early_stopping_patience >= 2 and preset.eval_split > 0


def test_model_size_classes_come_from_the_parameter_count():
    families = load_families()
    def size(hub_id):
        return model_size_class(find_model_spec(hub_id, families).params)
    assert size("HuggingFaceTB/SmolLM2-135M-Instruct") == size("HuggingFaceTB/SmolLM2-360M-Instruct") == "tiny"
    assert size("Qwen/Qwen2.5-0.5B-Instruct") == size("TinyLlama/TinyLlama-1.1B-Chat-v1.0") == "small"
    assert size("Qwen/Qwen2.5-1.5B-Instruct") == "small"
    assert size("Qwen/Qwen2.5-3B-Instruct") == size("microsoft/Phi-3.5-mini-instruct") == "medium"
    assert size("Qwen/Qwen2.5-7B-Instruct") == size("mistralai/Mistral-7B-Instruct-v0.3") == "large"
    assert [model_size_class(n) for n in (399_999_999, 400_000_000, 1_999_999_999, 2e9, 4_999_999_999, 5e9)] == \
        ["tiny", "small", "small", "medium", "medium", "large"]


def test_the_model_size_class_is_applied_after_the_dataset_size_bucket(tmp_path):
    data = yaml.safe_load((presets_dir() / "quality.yaml").read_text())
    data.update(name="mine", lr=1e-4, epochs=3, lora_r=16)
    data["by_dataset_size"] = {"small": {"lr": 5e-5, "epochs": 5}}
    data["by_model_size"] = {"tiny": {"lr": 8e-4, "lora_r": 8}, "large": {"epochs": 1}}
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    preset = load_preset(str(path))
    tiny_small_data = preset.resolve(100, 135_000_000)
    # The tiny class's lr wins over the small bucket's; the bucket's epochs stay.
    assert tiny_small_data.values["lr"] == 8e-4 and tiny_small_data.values["lora_r"] == 8
    assert tiny_small_data.values["epochs"] == 5
    assert tiny_small_data.sources["lr"] == tiny_small_data.sources["lora_r"] == "preset mine (tiny model)"
    assert tiny_small_data.sources["epochs"] == tiny_small_data.sources["lora_alpha"] == "preset mine (small dataset)"
    assert tiny_small_data.model_size_reasons(set(), 135_000_000) == \
        ["lr 0.0008, lora_r 8: preset mine for a tiny model (135M parameters)"]
    assert tiny_small_data.model_size_reasons({"lr", "lora_r"}, 135_000_000) == []  # flags replaced them
    large = preset.resolve(100, 7_000_000_000)
    assert large.values["lr"] == 5e-5 and large.values["epochs"] == 1 and large.size_class == "large"
    assert large.model_size_reasons(set(), 7_248_023_552) == ["epochs 1: preset mine for a large model (7.2B parameters)"]
    medium_data = preset.resolve(5_000, 1_500_000_000)  # no bucket or class sets anything: the base values
    assert medium_data.values["lr"] == 1e-4 and medium_data.by_model_size == ()


@pytest.mark.parametrize("path", FAMILY_FILES, ids=lambda p: p.stem)
def test_every_family_has_consistent_architecture_facts(path):
    family = load_families()[yaml.safe_load(path.read_text())["name"]]
    assert family.models
    for model in family.models:
        assert model.num_attention_heads % model.num_kv_heads == 0
        assert model.head_dim or model.hidden_size % model.num_attention_heads == 0
        assert family.targets_for(model.model_type)
        # Parameter count is close to what the architecture implies (embeddings + blocks).
        head_dim = model.head_width
        attention = model.hidden_size * head_dim * (2 * model.num_attention_heads + 2 * model.num_kv_heads)
        mlp = (2 if model.model_type == "phi" else 3) * model.hidden_size * model.intermediate_size
        embeddings = model.vocab_size * model.hidden_size * (1 if model.tie_word_embeddings else 2)
        estimate = model.num_layers * (attention + mlp) + embeddings
        assert 0.9 < model.params / estimate < 1.1, model.hub_id


def test_preset_by_path_and_size_adjustment(tmp_path):
    data = yaml.safe_load((presets_dir() / "quality.yaml").read_text())
    data["name"] = "mine"
    data["by_dataset_size"] = {"small": {"epochs": 9}}
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    preset = load_preset(str(path))
    assert preset.name == "mine"
    assert preset.for_dataset_size(10)[0]["epochs"] == 9
    assert preset.for_dataset_size(5000)[0]["epochs"] == data["epochs"]


def test_a_bad_preset_file_lists_every_problem(tmp_path):
    data = yaml.safe_load((presets_dir() / "quality.yaml").read_text())
    data.update(lr=5.0, method="magic", lora_r="big", colour="blue")
    del data["epochs"]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_preset(str(path))
    message = info.value.message
    for fragment in ("missing field 'epochs'", "'lora_r' has the wrong type", "unknown field 'colour'",
                     "'lr' has an out-of-range value 5.0", "'method' has an out-of-range value 'magic'"):
        assert fragment in message


def test_bad_model_size_overrides_and_cpu_models_are_listed_together(tmp_path):
    data = yaml.safe_load((presets_dir() / "quality.yaml").read_text())
    data["by_model_size"] = {"huge": {"lr": 1e-4}, "tiny": {"lr": "fast", "lora_r": 0, "colour": "blue",
                                                            "eval_split": 0.2},
                             "small": [1, 2]}
    data["cpu_models"] = ["HuggingFaceTB/SmolLM2-135M-Instruct", "nobody/NoSuchModel-1M"]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_preset(str(path))
    message = info.value.message
    for fragment in ("by_model_size.huge: must be one of tiny, small, medium, large",
                     "by_model_size.tiny: field 'lr' has the wrong type (str)",
                     "by_model_size.tiny: 'lora_r' has an out-of-range value 0",
                     "by_model_size.tiny: 'colour' cannot be adjusted per model size",
                     # the split is made before the model is chosen
                     "by_model_size.tiny: 'eval_split' cannot be adjusted per model size",
                     "by_model_size.small: must be a mapping",
                     "cpu_models lists 'nobody/NoSuchModel-1M', which is not in any family file"):
        assert fragment in message
    assert message.count("\n  ") == 7  # one message, every problem on its own line
    data["cpu_models"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    data["by_model_size"] = ["tiny"]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_preset(str(path))
    assert "field 'cpu_models' has the wrong type (str)" in info.value.message
    assert "'by_model_size' must be a mapping of tiny/small/medium/large" in info.value.message


def test_a_preset_without_a_cpu_tier_or_model_sizes_still_loads(tmp_path):
    # A preset written by `tune`, or by hand before these sections existed.
    data = yaml.safe_load((presets_dir() / "quality.yaml").read_text())
    del data["cpu_models"], data["by_model_size"]
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))
    preset = load_preset(str(path))
    assert preset.model_candidates(has_gpu=False) == preset.models == preset.model_candidates(has_gpu=True)
    assert preset.resolve(100, 135_000_000).values == preset.for_dataset_size(100)[0]


def test_llama_checkpoints_go_to_the_right_family():
    # SmolLM2 and TinyLlama both claim `llama`: the architecture decides, and a
    # Llama checkpoint of neither shape goes to tinyllama, which covers others.
    families = load_families()
    smol, tiny = (find_model_spec(h, families) for h in ("HuggingFaceTB/SmolLM2-135M-Instruct",
                                                         "TinyLlama/TinyLlama-1.1B-Chat-v1.0"))
    assert family_for_model_type("llama", families, smol).name == "smollm2"
    assert family_for_model_type("llama", families, tiny).name == "tinyllama"
    other = tiny.__class__(**{**tiny.__dict__, "hidden_size": 64, "num_layers": 2})
    assert family_for_model_type("llama", families, other).name == "tinyllama"
    assert family_for_model_type("llama", families).name == "tinyllama"
    # Either way the LoRA targets are Llama's.
    assert families["smollm2"].targets_for("llama") == families["tinyllama"].targets_for("llama")


def test_unknown_preset_name_lists_the_builtin_ones():
    with pytest.raises(ConfigError) as info:
        load_preset("turbo")
    assert "highspeed" in info.value.hint and "bestaccuracy" in info.value.hint


def test_invalid_yaml_names_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nlr: [1, 2\nepochs: 3\n")
    with pytest.raises(ConfigError) as info:
        load_preset(str(path))
    assert "line" in info.value.message


def test_a_models_item_that_is_not_text_is_named_not_looked_up(tmp_path):
    """A YAML slip (`- 42`, `- {name: x}`) is said for what it is, with its place in the list."""
    data = yaml.safe_load((presets_dir() / "quality.yaml").read_text())
    data["models"] = [data["models"][0], 42, {"name": "x"}]
    data["cpu_models"] = [None]
    path = tmp_path / "slip.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_preset(str(path))
    message = info.value.message
    for fragment in ("models item 2 is a number, not a model id", "models item 3 is a mapping, not a model id",
                     "cpu_models item 1 is empty, not a model id"):
        assert fragment in message
