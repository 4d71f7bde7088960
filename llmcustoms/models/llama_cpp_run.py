"""Run a written GGUF in llama.cpp itself (llama-cpp-python), when installed.

For each sample prompt, llama.cpp's tokens must be the model's, and where the
model's own greedy reply stopped, llama.cpp's must stop at an end token too
(the "never stops in Ollama" fault). llama.cpp runs in a child process: a
native crash in it (as its quantized kernels crash on some CPUs for a model
as narrow as a test's) is a failed check with the signal named, never the
end of the export, whose files are already written.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from llmcustoms.models.gguf_check import REPLY_TOKENS

# The child's time for the sample prompts, at most.
CHILD_TIMEOUT_S = 600
# The child: reads {"path", "prompts": [[text, ids], ...]} and prints {"same_ids", "stops"}.
_CHILD = r"""
import json, sys
from llama_cpp import Llama
from llmcustoms.models.gguf_reading import metadata
job = json.load(sys.stdin)
found = metadata(job["path"])
n_ctx = min(1024, int(found.get(f"{found.get('general.architecture')}.context_length") or 1024))
llm = Llama(model_path=job["path"], n_ctx=n_ctx, verbose=False, seed=0)
same_ids = stops = 0
for text, ids in job["prompts"]:
    same_ids += llm.tokenize(text.encode("utf-8"), add_bos=False, special=True) == ids
    llm.reset()
    room = min(job["reply_tokens"], n_ctx - len(ids) - 1)  # never past the context
    if room > 0:
        stops += llm.create_completion(ids, max_tokens=room, temperature=0.0)["choices"][0]["finish_reason"] == "stop"
llm.close()
print(json.dumps({"same_ids": same_ids, "stops": stops}))
"""


def installed() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def llama_cpp_check(path: Path, tokenizer: Any, prompts: list[list[dict[str, str]]], stopped: list[bool]) -> str | None:
    """A line saying what llama.cpp made of the file at `path`; None when
    llama-cpp-python is not installed. Problems come back as a line starting
    with "failed:"."""
    if not installed():
        return None
    jobs = []
    for messages in prompts:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        jobs.append([text, tokenizer(text, add_special_tokens=False)["input_ids"]])
    job = json.dumps({"path": str(path), "prompts": jobs, "reply_tokens": REPLY_TOKENS * 4})
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD], input=job, capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # a big model on a slow CPU: says nothing against the file
        return f"llama.cpp: not run to the end (over {CHILD_TIMEOUT_S // 60} minutes)"
    if done.returncode != 0:
        how = (f"crashed ({signal.Signals(-done.returncode).name})" if done.returncode < 0
               else f"stopped with exit code {done.returncode}")
        return f"failed: llama.cpp {how} running the file"
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return "failed: llama.cpp ran the file but gave no answer"
    line = (f"llama.cpp: token ids equal for {found['same_ids']}/{len(prompts)} prompts, replies stopped at an end "
            f"token {found['stops']}/{len(prompts)} (the model's own: {sum(stopped)}/{len(prompts)})")
    never_stops = any(stopped) and found["stops"] == 0
    return line if found["same_ids"] == len(prompts) and not never_stops else f"failed: {line}"
