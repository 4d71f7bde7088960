"""llama.cpp runs an exported file in a child process: a native crash in it
is a failed check naming the signal, never the end of the export."""

from __future__ import annotations


from llmcustoms.models import llama_cpp_run


class Template:
    """A tokenizer as the check uses one: a chat template and token ids."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "".join(m["content"] for m in messages)

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [ord(c) for c in text]}


PROMPTS = [[{"role": "user", "content": "Hi"}]]


def test_a_crash_in_llama_cpp_is_a_failed_check_naming_the_signal(monkeypatch, tmp_path):
    monkeypatch.setattr(llama_cpp_run, "installed", lambda: True)
    monkeypatch.setattr(llama_cpp_run, "_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    said = llama_cpp_run.llama_cpp_check(tmp_path / "model.gguf", Template(), PROMPTS, [True])
    assert said == "failed: llama.cpp crashed (SIGSEGV) running the file"


def test_what_llama_cpp_found_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(llama_cpp_run, "installed", lambda: True)
    monkeypatch.setattr(llama_cpp_run, "_CHILD", "import sys, json; json.load(sys.stdin); "
                                                 "print(json.dumps({'same_ids': 1, 'stops': 1}))")
    said = llama_cpp_run.llama_cpp_check(tmp_path / "model.gguf", Template(), PROMPTS, [True])
    assert said == ("llama.cpp: token ids equal for 1/1 prompts, replies stopped at an end token 1/1 "
                    "(the model's own: 1/1)")
    monkeypatch.setattr(llama_cpp_run, "_CHILD", "import sys, json; json.load(sys.stdin); "
                                                 "print(json.dumps({'same_ids': 1, 'stops': 0}))")
    assert llama_cpp_run.llama_cpp_check(tmp_path / "m.gguf", Template(), PROMPTS, [True]).startswith("failed: ")
    monkeypatch.setattr(llama_cpp_run, "installed", lambda: False)
    assert llama_cpp_run.llama_cpp_check(tmp_path / "m.gguf", Template(), PROMPTS, [True]) is None
