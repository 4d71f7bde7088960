"""Rows that pass validation but are probably not what the user means to
train on, found by a few general detectors over each row's text.

  placeholder  a template field never filled in: {{name}} (Jinja, mustache),
               {name} (Python's str.format) or <NAME>, in prose
  media        a row for a vision or audio model: a media field (images,
               video, ...), a content part of such a type, or an <image>,
               <video> or <audio> marker in its text
  echo_reply   a reply identical to the prompt before it (whitespace aside)
  blank_reply  a reply of nothing but whitespace or invisible characters, or
               of one character or one word repeated
  template_markup  a plain text row that already holds a chat template's
               special tokens (<|im_start|>, [INST], <start_of_turn>, ...):
               a conversation written out, which a messages row says better

Code and markup hold braces and angle brackets that are no placeholders
(`{x: 1}`, f"{name}", JSX, a Jinja template the row teaches, `<YOUR_API_KEY>`
in a snippet), so a text is searched for placeholders only when it reads as
prose: no other brace, and none of the signs of code in `_CODE`. A `{name}`
or `<NAME>` in a prompt that the reply repeats or names is what the row works
on (text to clean up, a template to rewrite), not a field left empty; so is
one in a reply that the prompt already holds. `{{name}}` is never excused.

What reading does with them (`data/dataset.py`): media rows are refused once
the file is read, since every model llmcustoms trains reads text only; under
--strict a placeholder makes the row a bad row, so the first stops the run;
everything else is counted and reported with the first locations and what to
do. Only counts, locations and the kind of marker are kept, never the text.
No torch.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from llmcustoms.data.data_files import RawRow
from llmcustoms.data.row_formats import Example, Message
from llmcustoms.errors import DataError

PLACEHOLDER, MEDIA, ECHO, BLANK, MARKUP = "placeholder", "media", "echo_reply", "blank_reply", "template_markup"
# kind: (what was found, what to do). Shown after a count of rows and their first locations.
FINDINGS = {
    PLACEHOLDER: ("template placeholders never filled in",
                  "fill them in or remove those rows; they are learned as written (--strict refuses them)"),
    ECHO: ("replies identical to their prompt", "fix or remove those rows; they teach the model to repeat the prompt"),
    BLANK: ("replies of only whitespace or invisible characters, or one character or word repeated",
            "fix or remove those rows; they teach the model to say nothing useful"),
    MARKUP: ("text rows that hold a chat template's special tokens",
             "write each conversation as a messages row ({\"messages\": [{\"role\": \"user\", \"content\": ...}, "
             "{\"role\": \"assistant\", \"content\": ...}]}): the model's own template then writes its tokens, "
             "and only the replies are learned; as text, every token is learned, prompts and markup too"),
    MEDIA: ("rows for a vision or audio model (images, video or audio)",
            "vision and audio models are not supported: keep text rows only"),
}
# The turn markers of the common chat templates (ChatML, Llama 2 and 3, Gemma, Phi, Zephyr).
TEMPLATE_MARKERS = ("<|im_start|>", "<|im_end|>", "[INST]", "[/INST]", "<start_of_turn>", "<end_of_turn>",
                    "<|start_header_id|>", "<|eot_id|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>")
# How many locations of each finding are named.
LOCATIONS_SHOWN = 3

# Fields and content parts that carry images, video or audio, as LLaMA-Factory,
# LLaVA and OpenAI's API write them. A field counts only when it holds something.
MEDIA_FIELDS = ("image", "images", "video", "videos", "audio", "audios")
MEDIA_PARTS = ("image", "image_url", "input_image", "video", "video_url", "audio", "audio_url", "input_audio")
TURN_FIELDS = ("messages", "conversations", "prompt", "chosen", "rejected")
# <image>, <image 2>, <video_1>: where a vision model's data puts the picture.
# HTML's <video> and <audio> come with their closing tag, so a text that holds one is markup.
_MEDIA_MARKER = re.compile(r"<(image|video|audio)(?:[ _]?\d{1,3})?>")
_CLOSING_MEDIA_TAG = re.compile(r"</(image|video|audio)>")

JINJA, FORMAT, ANGLE = "{{...}}", "{...}", "<...>"
_JINJA = re.compile(r"\{\{\s*([A-Za-z_][\w.]*)\s*\}\}")
# A lone identifier in braces, not a JS ${x} or Ruby #{x}, a LaTeX \frac{a}{b} or x^{n}, nor part of {{ }}.
_FORMAT = re.compile(r"(?<![\w{}$#%\\^_])\{([A-Za-z_]\w*)\}(?!\})")
# <NAME>, <YOUR_NAME>: two capitals or more, not a generic's <T> nor List<T>.
_ANGLE = re.compile(r"(?<![\w<])<([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*)>")
# Tokens that prose about tokenizers names; not fields of a template.
_SPECIAL_TOKENS = {"BOS", "EOS", "PAD", "UNK", "SEP", "CLS", "MASK"}
# Signs that a text is code, markup or math, where braces and <NAME> mean something else.
_CODE = re.compile(
    r"^(?:[ \t]{2,}|\t)\S"            # an indented line
    r"|[;{]\s*$"                       # a line ending as a statement or a block does
    r"|[=!<>]=|=>|->|::|&&|\|\|"      # operators
    r"|\w\s*=\s*[\w\"'\[({]"           # an assignment
    r"|\w\(|`|</|/>|\{%|\$\{|#\{"      # a call, a code span, markup, template tags, interpolation
    r"|\b[fF][\"']"                   # an f-string
    r"|/\*|\*/|^\s*//"                 # a comment
    r"|\\[A-Za-z]+\{"                  # LaTeX
    r"|\{\s*[\"']|[\"']\s*:",          # JSON
    re.MULTILINE)
_INVISIBLE = {"Cc", "Cf", "Zs", "Zl", "Zp"}


@dataclass
class Finding:
    """Rows of one kind: how many, where the first are, and what marked them."""

    rows: int = 0
    where: list[str] = field(default_factory=list)
    what: dict[str, int] = field(default_factory=dict)

    def add(self, raw: RawRow, what: Iterable[str] = ()) -> None:
        self.rows += 1
        if len(self.where) < LOCATIONS_SHOWN:
            self.where.append(raw.location())
        for label in what:
            self.what[label] = self.what.get(label, 0) + 1

    def places(self) -> str:
        return ", ".join(self.where) + (", ..." if self.rows > len(self.where) else "")


@dataclass
class SuspiciousRows:
    """What the detectors found in one pass over a file."""

    found: dict[str, Finding] = field(default_factory=dict)

    def _add(self, kind: str, raw: RawRow, what: Iterable[str] = ()) -> None:
        self.found.setdefault(kind, Finding()).add(raw, what)

    def holds_media(self, raw: RawRow, example: Example | None) -> bool:
        """Whether the row is for a vision or audio model; counted if so."""
        what = media_in(raw.value, example)
        if what:
            self._add(MEDIA, raw, what)
        return bool(what)

    def check(self, raw: RawRow, example: Example) -> str | None:
        """Count what a usable row holds. Returns the problem that makes it a
        bad row under --strict (a placeholder), or None."""
        prompts, replies = _texts(example)
        styles, in_reply = placeholders_in(prompts, replies)
        if styles:
            self._add(PLACEHOLDER, raw, styles)
        if any(_same(prompt, reply) for prompt, reply in _exchanges(example)):
            self._add(ECHO, raw)
        if any(blank(reply) for reply in replies):
            self._add(BLANK, raw)
        markers = [m for m in TEMPLATE_MARKERS if m in example.completion] if not (example.is_chat or example.prompt) else []
        if markers:
            self._add(MARKUP, raw, markers)
        if not styles:
            return None
        return f"a template placeholder ({', '.join(styles)}) in {'a reply' if in_reply else 'the prompt'}, never filled in"

    def refuse_media(self, path: Path) -> None:
        """Stop, naming the rows, if any is for a vision or audio model."""
        media = self.found.get(MEDIA)
        if media is None:
            return
        rows = "1 row holds" if media.rows == 1 else f"{media.rows:,} rows hold"
        raise DataError(f"{path.name}: {rows} images, video or audio ({', '.join(media.what)}: {media.places()}); "
                        "llmcustoms trains text-only models.",
                        "Vision and audio models are not supported. Train on text: remove those rows, or their "
                        "media fields and markers.")

    def to_json(self) -> list[dict[str, Any]]:
        return [{"kind": kind, "rows": finding.rows, "first_lines": list(finding.where), "what": list(finding.what),
                 "finding": FINDINGS[kind][0], "advice": FINDINGS[kind][1]}
                for kind, finding in sorted(self.found.items(), key=lambda item: -item[1].rows)]


def media_in(value: Any, example: Example | None) -> list[str]:
    """What makes a row one for a vision or audio model: "field 'images'",
    "content part 'image_url'", "marker <image>". Only the row's top level and
    its turns are looked at, never deeper."""
    if not isinstance(value, dict):
        return []
    what = [f"field '{name}'" for name in MEDIA_FIELDS if name in value and _holds(value[name])]
    turns = [turn for name in TURN_FIELDS if isinstance(value.get(name), list) for turn in value[name]]
    for turn in turns:
        parts = turn.get("content", turn.get("value")) if isinstance(turn, dict) else None
        for part in parts if isinstance(parts, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS and f"content part '{kind}'" not in what:
                what.append(f"content part '{kind}'")
    if example is not None:
        prompts, replies = _texts(example)
        for text in prompts + replies:
            tags = _MEDIA_MARKER.findall(text) if "<" in text else ()
            if tags and not _CLOSING_MEDIA_TAG.search(text):
                what += [f"marker <{tag}>" for tag in dict.fromkeys(tags) if f"marker <{tag}>" not in what]
    return what


def _holds(value: Any) -> bool:
    """Whether a media field holds something: a path, a URL, a list of them."""
    return isinstance(value, (str, list, dict)) and bool(value)


def placeholders_in(prompts: list[str], replies: list[str]) -> tuple[list[str], bool]:
    """The styles of placeholder left unfilled in a row ("{{...}}", "{...}",
    "<...>"), and whether one is in a reply."""
    asked = [mark for text in prompts for mark in _marks(text)]
    answered = [mark for text in replies for mark in _marks(text)]
    if not asked and not answered:
        return [], False
    reply_text = "\n".join(replies)
    asked_names = {name for _, name in asked}
    in_reply = [style for style, name in answered if style == JINJA or name not in asked_names]
    in_prompt = [style for style, name in asked if style == JINJA or not _names(reply_text, name)]
    return list(dict.fromkeys(in_reply + in_prompt)), bool(in_reply)


def _marks(text: str) -> list[tuple[str, str]]:
    """(style, name) of each placeholder in a text that reads as prose."""
    if "{" not in text and "<" not in text:
        return []
    braces, angles = "{" in text, "<" in text
    marks = [(JINJA, m) for m in (_JINJA.findall(text) if "{{" in text else ())]
    marks += [(FORMAT, m) for m in (_FORMAT.findall(text) if braces else ())]
    marks += [(ANGLE, m) for m in (_ANGLE.findall(text) if angles else ()) if m not in _SPECIAL_TOKENS and len(m) > 1]
    if not marks:
        return []
    rest = _ANGLE.sub("", _FORMAT.sub("", _JINJA.sub("", text)))
    if "{" in rest or "}" in rest or _CODE.search(text):
        return []
    return marks


def _names(text: str, name: str) -> bool:
    """Whether `text` uses `name` as a word, in any case."""
    return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text, re.IGNORECASE) is not None


def blank(reply: str) -> bool:
    """Nothing but whitespace or invisible characters, or one character (five
    or more times) or one word (three or more times) repeated."""
    text = reply.strip()
    if not text or (unicodedata.category(text[0]) in _INVISIBLE
                    and all(unicodedata.category(c) in _INVISIBLE for c in text)):
        return True
    if len(text) >= 5 and text[0] == text[-1] and text.count(text[0]) == len(text):
        return True
    first = text.split(None, 2)  # most replies differ by their second word: not split further
    if len(first) < 3 or first[0] != first[1]:
        return False
    words = text.split()
    return all(word == words[0] for word in words)


def _same(prompt: str, reply: str) -> bool:
    """Equal but for whitespace. Texts of very different lengths are not
    split to find out."""
    if prompt == reply:
        return True
    longer = max(len(prompt), len(reply))
    return abs(len(prompt) - len(reply)) <= longer // 4 + 8 and prompt.split() == reply.split()


def _texts(example: Example) -> tuple[list[str], list[str]]:
    """The row's prompt texts (system and user turns and the assistant turns
    not learned, or the prompt) and its reply texts (learned assistant turns
    with no tool call, or the completion)."""
    if not example.is_chat:
        return ([example.prompt] if example.prompt else []), [example.completion]
    prompts = [m.content for m in example.messages
               if m.role in ("system", "user") or (m.role == "assistant" and not m.learned)]
    replies = [m.content for m in example.messages if _learned_reply(m)]
    return prompts, replies


def _learned_reply(message: Message) -> bool:
    """A learned assistant turn that says something itself (a turn that only
    calls tools, or only reasons, is judged elsewhere)."""
    return (message.role == "assistant" and message.learned and not message.tool_calls
            and bool(message.content or not message.reasoning))


def _exchanges(example: Example) -> list[tuple[str, str]]:
    """(prompt, reply) for each reply that answers a user turn, or a raw prompt."""
    if not example.is_chat:
        return [(example.prompt, example.completion)] if example.prompt else []
    turns = example.messages
    return [(before.content, turn.content) for before, turn in zip(turns, turns[1:])
            if before.role == "user" and _learned_reply(turn)]
