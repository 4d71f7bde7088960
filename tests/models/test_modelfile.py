"""The Ollama Modelfile: a TEMPLATE that renders every probe conversation as
the run's Jinja chat template does, stop lines, the system prompt, and no
TEMPLATE at all where Go cannot mirror the template."""

from __future__ import annotations

import pytest
from jinja2 import Template

from llmcustoms.errors import ConfigError

from llmcustoms.models.modelfile import PROBES, go_template, mismatches, modelfile, render_pieces, template_pieces
from tiny_models import CHATML_TEMPLATE, ZEPHYR_TEMPLATE

SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
           "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Llama 2: BOS and [INST] around each user turn, the system prompt folded into the first one.
LLAMA2 = ("{% for message in messages %}{% if message['role'] == 'system' %}{% set system = message['content'] %}"
          "{% elif message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}"
          "{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}{% endfor %}")
WITH_BOS = "{{ bos_token }}" + ZEPHYR_TEMPLATE


def renderer(template: str, bos: str = "<s>", eos: str = "</s>"):
    compiled = Template(template)
    return lambda messages, generation: compiled.render(messages=messages, add_generation_prompt=generation,
                                                        bos_token=bos, eos_token=eos)


def test_chatml_and_zephyr_templates_are_mirrored_exactly():
    for template, end in ((CHATML_TEMPLATE, "<|im_end|>"), (ZEPHYR_TEMPLATE, "</s>")):
        render = renderer(template)
        pieces = template_pieces(render, None)
        assert pieces is not None and mismatches(pieces, render, None) == 0
        assert pieces.after["assistant"].startswith(end)
        assert pieces.default_system is None
        for probe in PROBES:
            assert render_pieces(pieces, list(probe), True) == render(list(probe), True)


def test_a_default_system_prompt_becomes_the_modelfile_system():
    render = renderer(SMOLLM2)
    pieces = template_pieces(render, None)
    assert pieces is not None and mismatches(pieces, render, None) == 0
    assert pieces.default_system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    text = modelfile("model.gguf", pieces, ["<|im_end|>"], None)
    assert 'SYSTEM """You are a helpful AI assistant named SmolLM' in text
    # The data's own system prompt wins over the template's default.
    assert 'SYSTEM """Answer in French."""' in modelfile("model.gguf", pieces, ["<|im_end|>"], "Answer in French.")


def test_the_go_template_has_the_pieces_and_no_whitespace_trimming():
    pieces = template_pieces(renderer(CHATML_TEMPLATE), None)
    go = go_template(pieces)
    assert "{{-" not in go and "-}}" not in go  # trimming would eat the newlines the pieces end with
    assert go.startswith("{{ range .Messages }}") and go.endswith("<|im_start|>assistant\n")
    assert '{{ if eq .Role "system" }}<|im_start|>system\n{{ .Content }}<|im_end|>\n' in go
    assert '{{ else if eq .Role "assistant" }}<|im_start|>assistant\n{{ .Content }}<|im_end|>\n' in go


def test_bos_written_by_the_template_is_left_to_llama_cpp():
    """llama.cpp adds BOS itself when the file says so: a TEMPLATE that wrote it too would give two."""
    render = renderer(WITH_BOS)
    pieces = template_pieces(render, "<s>")
    assert pieces is not None and mismatches(pieces, render, "<s>") == 0
    assert "<s>" not in go_template(pieces).replace("</s>", "")


def test_a_template_go_cannot_mirror_gets_no_template_line():
    render = renderer(LLAMA2)
    pieces = template_pieces(render, None)
    assert pieces is None or mismatches(pieces, render, None) > 0
    text = modelfile("model.gguf", None, ["</s>"], None)
    assert "TEMPLATE" not in text and text.startswith("FROM ./model.gguf") and 'PARAMETER stop "</s>"' in text


def ollama_triple_quoted(text: str, command: str) -> str:
    """A command's value as Ollama's parser/parser.go reads a triple-quoted one:
    everything up to the next three quotes, no escape processing."""
    start = text.index(f'{command} """') + len(command) + 4
    return text[start:text.index('"""', start)]


def test_stop_lines_and_the_system_prompt_reach_ollama_as_written():
    system = 'You are "Ava", the C:\\support bot.'
    text = modelfile("model.gguf", None, ["<|im_end|>", "</s>"], system)
    assert 'PARAMETER stop "<|im_end|>"' in text and 'PARAMETER stop "</s>"' in text
    assert ollama_triple_quoted(text, "SYSTEM") == system  # no backslash added before a quote or a backslash


def test_a_system_prompt_ollama_cannot_hold_is_refused_by_name():
    for system in ('Three """ quotes.', 'Ends with a "quote"'):
        with pytest.raises(ConfigError, match="three double quotes"):
            modelfile("model.gguf", None, ["</s>"], system)


def test_literal_braces_in_a_template_are_escaped_for_go():
    render = renderer(CHATML_TEMPLATE.replace("{% if add_generation_prompt %}<|im_start|>assistant\n",
                                              "{% if add_generation_prompt %}{{ '{{' }}assistant\n"))
    pieces = template_pieces(render, None)
    assert pieces is not None and pieces.generation == "{{assistant\n"
    assert '{{ "{{" }}assistant' in go_template(pieces)
