"""The Ollama Modelfile written beside model.gguf: `FROM`, a `TEMPLATE` that
renders a conversation exactly as the run's chat template did, a
`PARAMETER stop` for each token a reply ends with, and the system prompt.

A Modelfile without the template's TEMPLATE and stop lines is the most common
reason an exported model "answers gibberish" or "never stops" in Ollama.
Ollama's templates are Go templates, not Jinja, so the run's template is not
copied but read: a probe conversation with marker contents is rendered, each
role's text before and after its content is cut out, and a Go template built
from those pieces. It is only written when its rendering (`render_pieces`,
the same pieces in Python) equals the Jinja template's on every probe
conversation; a template it cannot match (per-turn BOS, content rewritten) is
left to Ollama, which reads the chat template stored in the GGUF, and the
export says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from llmcustoms.errors import ConfigError

# A chat template as a function: (messages, add_generation_prompt) -> text.
Render = Callable[[list[dict[str, str]], bool], str]
MARKERS = {"system": "\x01SYSTEM\x01", "user": "\x01USER1\x01", "assistant": "\x01ASSISTANT\x01",
           "user2": "\x01USER2\x01"}


@dataclass(frozen=True)
class Pieces:
    """The text around each role's content, and what starts and ends a prompt."""

    before: dict[str, str]  # role -> text before its content
    after: dict[str, str]  # role -> text after it
    generation: str  # what asks for the assistant's reply
    default_system: str | None  # the system prompt the template adds when none is given


def _message(role: str, marker: str) -> dict[str, str]:
    return {"role": role, "content": MARKERS[marker]}


def template_pieces(render: Render, bos: str | None) -> Pieces | None:
    """The pieces of the template, or None where its shape is not one Go can
    mirror. `bos`: the BOS text to drop from the start (llama.cpp adds BOS
    itself, so writing it in the TEMPLATE would give the model two)."""
    user, assistant, system = _message("user", "user"), _message("assistant", "assistant"), _message("system", "system")
    try:
        alone = _drop_bos(render([user], False), bos)
        asking = _drop_bos(render([user], True), bos)
        answered = _drop_bos(render([user, assistant], False), bos)
        talk = _drop_bos(render([user, assistant, _message("user", "user2")], False), bos)
        with_system = _drop_bos(render([system, user], False), bos)
    except Exception:  # a template that refuses a role order (e.g. no system role) is left to Ollama
        return None
    if not (asking.startswith(alone) and talk.startswith(answered)):
        return None
    head, _, user_after = alone.partition(MARKERS["user"])
    between, _, assistant_after = answered.partition(MARKERS["user"])[2].partition(MARKERS["assistant"])
    user_before = talk[len(answered):].partition(MARKERS["user2"])[0]
    if not (between.startswith(user_after) and head.endswith(user_before)):
        return None
    preamble = head[: len(head) - len(user_before)]
    system_before, _, system_rest = with_system.partition(MARKERS["system"])
    system_after = system_rest.partition(MARKERS["user"])[0]
    if not system_after.endswith(user_before):
        return None
    system_after = system_after[: len(system_after) - len(user_before)]
    default = _default_system(preamble, system_before, system_after)
    if preamble and default is None:
        return None  # text before every conversation that is not a system prompt: not mirrored
    return Pieces(before={"system": system_before, "user": user_before,
                          "assistant": between[len(user_after):]},
                  after={"system": system_after, "user": user_after, "assistant": assistant_after},
                  generation=asking[len(alone):], default_system=default)


def _drop_bos(text: str, bos: str | None) -> str:
    return text[len(bos):] if bos and text.startswith(bos) else text


def _default_system(preamble: str, before: str, after: str) -> str | None:
    """The system prompt a template writes when the conversation has none
    (Qwen2.5's "You are Qwen..."), read out of the preamble."""
    if not preamble:
        return None
    if preamble.startswith(before) and preamble.endswith(after) and len(preamble) >= len(before) + len(after):
        return preamble[len(before): len(preamble) - len(after)]
    return None


def render_pieces(pieces: Pieces, messages: list[dict[str, str]], generation: bool) -> str:
    """What the Go template below renders for `messages`, in Python, to check it
    against the Jinja template. Ollama passes the system prompt as the first message."""
    if pieces.default_system is not None and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": pieces.default_system}, *messages]
    text = "".join(pieces.before[m["role"]] + m["content"] + pieces.after[m["role"]] for m in messages)
    return text + (pieces.generation if generation else "")


def go_template(pieces: Pieces) -> str:
    """The pieces as an Ollama TEMPLATE. No `{{-` anywhere: it would trim the
    newlines the pieces end with."""
    branches = "".join(
        f'{{{{ {"if" if index == 0 else "else if"} eq .Role "{role}" }}}}'
        f"{_go_text(pieces.before[role])}{{{{ .Content }}}}{_go_text(pieces.after[role])}"
        for index, role in enumerate(("system", "user", "assistant")))
    return f"{{{{ range .Messages }}}}{branches}{{{{ end }}}}{{{{ end }}}}{_go_text(pieces.generation)}"


def _go_text(text: str) -> str:
    # Literal "{{" would open an action; Go templates print it from a string constant.
    return text.replace("{{", '{{ "{{" }}')


PROBES = (
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke.\nA short one."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}],
)


def mismatches(pieces: Pieces, render: Render, bos: str | None) -> int:
    """On how many probe conversations the Go template's text differs from the Jinja template's."""
    return sum(render_pieces(pieces, list(probe), True) != _drop_bos(render(list(probe), True), bos)
               for probe in PROBES)


def modelfile(gguf_name: str, pieces: Pieces | None, stops: list[str], system: str | None) -> str:
    """The Modelfile's text. `stops`: the tokens a reply ends with; `system`:
    the system prompt the training data used, if it had one throughout."""
    lines = [f"FROM ./{gguf_name}", ""]
    if pieces is not None:
        lines += [f'TEMPLATE """{go_template(pieces)}"""', ""]
    system = system if system is not None else (pieces.default_system if pieces else None)
    if system:
        lines += [f'SYSTEM """{_raw(system)}"""', ""]
    lines += [f'PARAMETER stop "{_quoted(stop)}"' for stop in stops]
    return "\n".join(lines) + "\n"


def _raw(text: str) -> str:
    """Text inside a Modelfile's triple quotes, as it is: Ollama's parser reads
    everything up to the next three quotes with no escapes, so a backslash
    written there would reach the model. Text that would end them early is refused."""
    if '"""' in text or text.endswith('"'):
        raise ConfigError('The system prompt holds three double quotes in a row (or ends with one), which an Ollama '
                          'Modelfile cannot hold inside SYSTEM """...""".',
                          "Change those quotes in the training rows' system turn, or export with --format hf and write "
                          "the Modelfile's SYSTEM line yourself.")
    return text


def _quoted(text: str) -> str:
    """Text inside a Modelfile's quotes: its own quotes escaped."""
    return text.replace("\\", "\\\\").replace('"', '\\"')
