"""The `sentiment` dataset of `quality.py`: a short-answer classification task, as chat.

    python benchmarks/sentiment_data.py OUT.json     # write the rows (quality.py does this itself)

Source: the VADER sentiment lexicon, `vader_lexicon.txt`, which the pip package
`vaderSentiment` ships inside the package (checked on vaderSentiment 3.3.2's
wheel: `vaderSentiment/vader_lexicon.txt`, 7,520 lines of token, mean rating
from -4 to 4 over ten human raters, its standard deviation, the ten ratings).
License: MIT (the wheel's METADATA says "License: MIT License" and its
dist-info/LICENSE.txt is the MIT license, "Copyright (c) 2016 C.J. Hutto").
Hutto & Gilbert, "VADER: A Parsimonious Rule-based Model for Sentiment
Analysis of Social Media Text", ICWSM 2014.

Why this source: none of the presets was tuned on it (they were tuned on the
identity and code data), the answer is one word and so is scored exactly,
and `pip install vaderSentiment` brings it with no other download; the file
is built here from the installed package each time it is needed, so nothing
downloaded is committed and no network is used.

Rows (ShareGPT, as `sharegpt_identity.json`):
    {"id": "vader-good", "conversations": [
        {"from": "human", "value": "Is the word \\"good\\" positive or negative? Answer with one word."},
        {"from": "gpt", "value": "Positive"}]}
from the lexicon's alphabetic tokens only (its emoticons and tokens with
digits or apostrophes are left out) whose mean rating is at least 1.5 away
from neutral, so each is clearly one or the other: 4,033 words in 3.3.2, 45%
of them positive (many are internet slang, "ftw", "fubar": the raters rated
them too). Shuffled with a fixed seed, so the file is the same on every machine.

Task success: the share of held-out rows whose greedy reply's first word, case
and punctuation aside, is the right label ("**Negative**." counts, "The word
is negative" does not: the question asks for one word).
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

FILE = "sentiment_vader.json"
CLEAR = 1.5  # |mean rating| at least this: the raters agreed it leans one way
SHUFFLE_SEED = 7519  # any fixed number: the rows' order is part of the dataset
QUESTION = 'Is the word "{word}" positive or negative? Answer with one word.'


def lexicon_text() -> str:
    """The lexicon as the installed package ships it."""
    from importlib.resources import files

    try:
        return (files("vaderSentiment") / "vader_lexicon.txt").read_text(encoding="utf-8")
    except ModuleNotFoundError:
        raise SystemExit("the sentiment dataset is built from the vaderSentiment package: pip install vaderSentiment")


def clear_words(text: str, clear: float = CLEAR) -> list[tuple[str, str]]:
    """(word, "Positive" or "Negative") for each alphabetic token of the lexicon
    text whose mean rating is at least `clear` from 0, in the lexicon's order."""
    words = []
    for line in text.splitlines():
        fields = line.split("\t")
        if len(fields) < 2 or not (fields[0].isascii() and fields[0].isalpha()):
            continue
        mean = float(fields[1])
        if abs(mean) >= clear:
            words.append((fields[0], "Positive" if mean > 0 else "Negative"))
    return words


def rows(text: str, seed: int = SHUFFLE_SEED) -> list[dict]:
    """The dataset's rows from the lexicon text, shuffled with `seed`."""
    chosen = [{"id": f"vader-{word}", "conversations": [{"from": "human", "value": QUESTION.format(word=word)},
                                                         {"from": "gpt", "value": label}]}
              for word, label in clear_words(text)]
    random.Random(seed).shuffle(chosen)
    return chosen


def ensure_file(data_dir: Path, work: Path) -> Path:
    """The rows' file: DATA_DIR's copy if someone put one there, else one built
    in the work directory from the installed package (built again each time
    the work directory is new; the same rows every time)."""
    if (data_dir / FILE).exists():
        return data_dir / FILE
    path = work / FILE
    if not path.exists():
        path.write_text(json.dumps(rows(lexicon_text()), indent=1))
    return path


def first_word(reply: str) -> str:
    """The reply's first word, lower-cased, without the punctuation or markup around it."""
    found = re.search(r"[^\W_]+", reply)
    return found.group(0).lower() if found else ""


def is_right(reply: str, label: str) -> bool:
    return first_word(reply) == label.lower()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__.split("\n")[2].strip())
    Path(sys.argv[1]).write_text(json.dumps(rows(lexicon_text()), indent=1))
