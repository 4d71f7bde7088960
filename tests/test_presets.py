"""Every preset and model family file loads and validates; bad files say what is wrong."""

from __future__ import annotations

import pytest
import yaml

from llmcustoms.errors import ConfigError
from llmcustoms.presets import (builtin_preset_names, dataset_size_bucket, load_families, load_preset,
                                presets_dir)

PRESETS = builtin_preset_names()
FAMILY_FILES = sorted((presets_dir() / "families").glob("*.yaml"))


def test_the_three_presets_and_four_families_ship():
    assert PRESETS == ["bestaccuracy", "highspeed", "quality"]
    assert set(load_families()) == {"tinyllama", "phi", "mistral", "qwen"}


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_and_names_known_families_and_models(name):
    preset = load_preset(name)
    families = load_families()
    assert preset.name == name
    hub_ids = {m.hub_id for f in families.values() for m in f.models}
    assert preset.models and set(preset.models) <= hub_ids
    for rows in (10, 5_000, 50_000):
        values, bucket = preset.for_dataset_size(rows)
        assert bucket == dataset_size_bucket(rows)
        assert values["effective_batch_size"] >= 1 and 0 < values["lr"] < 1


@pytest.mark.parametrize("path", FAMILY_FILES, ids=lambda p: p.stem)
def test_every_family_has_consistent_architecture_facts(path):
    family = load_families()[yaml.safe_load(path.read_text())["name"]]
    assert family.models
    for model in family.models:
        assert model.num_attention_heads % model.num_kv_heads == 0
        assert model.hidden_size % model.num_attention_heads == 0
        assert family.targets_for(model.model_type)
        # Parameter count is close to what the architecture implies (embeddings + blocks).
        head_dim = model.hidden_size // model.num_attention_heads
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
