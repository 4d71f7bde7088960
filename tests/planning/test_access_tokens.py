"""A token pasted as --model (issue 46, 18): recognised and refused before it is sent to
the Hub as a model id, and hidden in every message that could repeat it."""

from __future__ import annotations

import pytest

from llmcustoms.errors import ConfigError
from llmcustoms.planning.access_tokens import hide_tokens, looks_like_token
from llmcustoms.planning.options import Given
from llmcustoms.planning.settings import Settings
from llmcustoms.planning.train_options import train_options

TOKEN = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
OPAQUE = "Xk9fQ2mLp7RtZw4NbV8cHs3JdY6gTa1E"  # 32 letters and digits of another service


@pytest.mark.parametrize("text", [TOKEN, f"org/{TOKEN}", "api_org_AbCdEfGhIjKlMnOpQrStUv", OPAQUE, f"./{OPAQUE}"])
def test_token_shapes_are_recognised_and_hidden(text):
    assert looks_like_token(text)
    hidden = hide_tokens(f"The model '{text}' is not in the cache.")
    assert "***" in hidden and TOKEN not in hidden and OPAQUE not in hidden and hidden.startswith("The model '")


@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-0.5B-Instruct", "meta-llama/Meta-Llama-3-8B-Instruct",
                                  "Mistral3ForConditionalGeneration", "hf_short",
                                  "models--org--name/snapshots/5f0b02c75b57c5855da9ae460ce51323ea669d8a",
                                  "TinyLlama/TinyLlama-1.1B-Chat-v1.0"])
def test_model_names_checksums_and_class_names_are_left_alone(name):
    assert not looks_like_token(name) and hide_tokens(name) == name


def settings(model: str) -> Settings:
    return Settings({"data": Given("data.jsonl", "flag"), "model": Given(model, "flag")})


@pytest.mark.parametrize("model", [TOKEN, f"org/{TOKEN}", OPAQUE])
def test_a_token_given_as_the_model_is_refused_without_showing_it(model):
    with pytest.raises(ConfigError, match="looks like an access token") as refused:
        train_options(settings(model))
    assert TOKEN not in refused.value.message and OPAQUE not in refused.value.message
    assert "HF_TOKEN" in refused.value.hint


def test_a_model_folder_named_like_a_token_is_still_a_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / OPAQUE).mkdir()
    assert train_options(settings(OPAQUE)).model == OPAQUE


def test_an_error_message_repeating_a_token_shows_it_hidden(capsys):
    from llmcustoms.ui.console import print_error, print_warning

    print_error(f"The model 'org/{TOKEN}' is not in the local Hugging Face cache.", f"Check {TOKEN}.")
    print_warning(f"could not reach {TOKEN}")
    shown = capsys.readouterr().err
    assert TOKEN not in shown and "org/hf_***" in " ".join(shown.split())


def test_setup_refuses_a_token_at_the_model_question():
    from llmcustoms.commands.setup import checked_model

    written, why = checked_model(TOKEN, [])
    assert why is not None and "access token" in why and TOKEN not in written + why
