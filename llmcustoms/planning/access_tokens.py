"""Access tokens pasted where a name goes (`--model hf_...`, a token at the
model question of `setup`): recognised, so the model is refused before the
token is sent anywhere as a model id, and hidden in every message shown
(`hide_tokens`: "hf_***"), since a message repeats what it was given.

A Hugging Face token is "hf_" and 30-odd letters and digits ("api_" or
"api_org_" before 2022). Another service's secret is a word of 32 or more
letters and digits mixing both cases and digits, with no run of 8 lowercase
letters: a real word has one ("Mistral3ForConditionalGeneration" is kept), a
checksum has no uppercase, a random string of that length rarely has either.
"""

from __future__ import annotations

import re

HUB_TOKEN = re.compile(r"\b(hf|api_org|api)_[A-Za-z0-9]{20,}")
_WORD = re.compile(r"[A-Za-z0-9]{32,}")
_LOWER_RUN = re.compile(r"[a-z]{8}")


def _opaque(word: str) -> bool:
    return (any(c.isupper() for c in word) and any(c.islower() for c in word) and any(c.isdigit() for c in word)
            and not _LOWER_RUN.search(word))


def looks_like_token(text: str) -> bool:
    """Whether `text` holds something shaped like an access token."""
    return bool(HUB_TOKEN.search(text)) or any(_opaque(m[0]) for m in _WORD.finditer(text))


def hide_tokens(text: str) -> str:
    """`text` with each token-shaped word replaced: "hf_***" (its kind stays), or "***"."""
    text = HUB_TOKEN.sub(lambda m: f"{m[1]}_***", text)
    return _WORD.sub(lambda m: "***" if _opaque(m[0]) else m[0], text)
