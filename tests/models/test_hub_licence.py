"""A model the Hub gates behind a licence (Llama 3.2, Gemma 3): said what to
do before the download fails, and when it does."""

from __future__ import annotations

from llmcustoms.preparation import model_choice
from llmcustoms.models import hub_access
from llmcustoms.models.loading import _explain
from llmcustoms.planning.presets import load_families


class GatedRepoError(Exception):
    """What huggingface_hub raises for a gated model without access (by name)."""


def test_a_gated_catalog_model_names_its_licence_and_what_to_do():
    error = _explain("meta-llama/Llama-3.2-1B-Instruct", GatedRepoError("401 Client Error"))
    assert "gated on the Hugging Face Hub" in error.message
    assert "Llama 3.2 Community License" in error.hint and "HF_TOKEN" in error.hint
    other = _explain("someone/gated-model", GatedRepoError("401"))
    assert "Accept its licence on the Hub" in other.hint


def test_plan_says_a_gated_model_is_to_download_before_train_fails(monkeypatch):
    families = load_families()
    monkeypatch.setattr(hub_access, "availability", lambda name: hub_access.DOWNLOADABLE)
    said = model_choice.given_model_reason("google/gemma-3-1b-it", families)
    assert said.startswith("model google/gemma-3-1b-it: to download, and gated:") and "Gemma Terms of Use" in said
    assert model_choice.given_model_reason("Qwen/Qwen3-1.7B", families) is None  # not gated
    monkeypatch.setattr(hub_access, "availability", lambda name: hub_access.CACHED)
    assert model_choice.given_model_reason("google/gemma-3-1b-it", families) is None  # already here
