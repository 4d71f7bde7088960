"""How a row is rendered as text, and which pieces of that text are learned.

Chat rows are rendered with the tokenizer's own chat template. To know exactly
which text belongs to the assistant, the conversation is rendered once per
assistant turn (the prompt up to the turn with `add_generation_prompt=True`,
then the prompt plus the reply) and the text is cut at those boundaries.

Tool calling goes through the same template: the row's tools are passed as
`tools=` and its calls and results as the turns' `tool_calls` and `tool`
messages, so the model's own template writes them (Qwen2.5's <tool_call>
blocks, Mistral's [TOOL_CALLS]). A tool's result is part of the prompt of the
next assistant turn, so only the calls and replies are learned. A template
that cannot show tool calls is refused (`tool_support_error`), never trained
on with the calls silently left out.

prompt/completion rows go through the template too, as one user and one
assistant turn, when it is the model's own (`has_own_template`); with the
fallback template, or when asked (`--raw-prompts`), they are joined raw.

Each piece is the prompt (`PROMPT`, learned only with --train-on-prompt), a
reply (`REPLY`), or a reply the row marks `weight: 0` (`UNLEARNED`: in the
context of later turns, never learned, --train-on-prompt or not). Turns after
the last learned reply are not rendered: they teach nothing. An assistant
turn's reasoning goes to the template as `reasoning_content` when the
template reads that (`supports_reasoning`), and is left out otherwise.

Tokenizers without a chat template get `FALLBACK_CHAT_TEMPLATE` (documented
in docs/data-formats.md); it is saved with the adapter so generation uses the same one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from llmcustoms.data.row_formats import Example, Message, base_format
from llmcustoms.errors import ModelError

# What a piece of rendered text is (see the module's docstring).
PROMPT, REPLY, UNLEARNED = "prompt", "reply", "unlearned"
Segments = list[tuple[str, str]]
# A reply no template changes: what follows it is what the template adds after a reply.
_PROBE_REPLY = "llmcustoms probe reply"

# Used when a tokenizer has no chat template (Phi-2, base Llama checkpoints).
# `{bos}` is filled with the BOS token for tokenizers that normally start with one.
FALLBACK_CHAT_TEMPLATE = (
    "{bos}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '### System:\\n' + message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '### User:\\n' + message['content'] + '\\n\\n' }}"
    "{% else %}{{ '### Assistant:\\n' + message['content'] + eos_token + '\\n\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Assistant:\\n' }}{% endif %}"
)


def starts_with_bos(tokenizer) -> bool:
    """Whether this tokenizer puts BOS in front of plain text by default."""
    if tokenizer.bos_token_id is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


def ensure_chat_template(tokenizer) -> bool:
    """Give the tokenizer the fallback template if it has none. Returns True if it did."""
    if getattr(tokenizer, "chat_template", None):
        return False
    bos = "{{ bos_token }}" if starts_with_bos(tokenizer) else ""
    tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE.replace("{bos}", bos)
    return True


def _fallback_templates() -> set[str]:
    return {FALLBACK_CHAT_TEMPLATE.replace("{bos}", bos) for bos in ("", "{{ bos_token }}")}


def has_own_template(tokenizer) -> bool:
    """Whether the tokenizer's chat template is the model's own, not the fallback."""
    template = getattr(tokenizer, "chat_template", None)
    # Some tokenizers hold several named templates (a dict); ours is one string.
    return bool(template) and not (isinstance(template, str) and template in _fallback_templates())


def prompts_use_template(tokenizer, fmt: str, raw_prompts: bool) -> bool:
    """Whether rows of format `fmt` are shown to this model through its chat
    template: always for chat rows, never for text, and for prompt/completion
    rows when the template is the model's own and --raw-prompts is off."""
    base = base_format(fmt)
    if base == "text":
        return False
    if base == "prompt_completion":
        return has_own_template(tokenizer) and not raw_prompts
    return True


def supports_reasoning(tokenizer) -> bool:
    """Whether the chat template shows an assistant turn's reasoning: it reads
    `reasoning_content` (Qwen3's, DeepSeek's and others' name for it)."""
    return "reasoning_content" in str(getattr(tokenizer, "chat_template", None) or "")


def _render(tokenizer, messages: tuple[Message, ...], tools: list[dict] | None, generation_prompt: bool,
            reasoning: bool = False) -> str:
    # `tools` only when there are some: templates test `tools is not none`.
    extra: dict[str, Any] = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template([m.as_dict(reasoning) for m in messages], tokenize=False,
                                         add_generation_prompt=generation_prompt, **extra)


def chat_segments(tokenizer, messages: tuple[Message, ...], tools: list[dict] | None = None,
                  learned_from: int = 0, reasoning: bool = False) -> Segments:
    """Split a rendered conversation into (text, PROMPT | REPLY | UNLEARNED)
    pieces. An assistant turn's piece holds its reply and its tool calls (and
    its reasoning, if `reasoning`: the template shows it); assistant turns
    before `learned_from` (a preference pair's prompt) are prompt, turns
    marked not `learned` UNLEARNED.

    Each reply is the text the template adds to the conversation up to it
    when that turn is the last: what the model writes after the generation
    prompt. A template that shows earlier turns otherwise (Qwen3 drops their
    think blocks; Phi-3.5 writes EOS after the last turn only) still has
    every reply learned: the reply is cut after its end-of-turn token and
    the sequence goes on with the text the template writes between it and
    the next reply (`_after_turn`), so later turns see earlier replies as
    they were generated, as TRL's training templates show them."""
    learned = [k for k, m in enumerate(messages) if m.role == "assistant" and m.learned and k >= learned_from]
    if not learned:  # nothing to learn (rows read from a file never get here): all prompt
        return [(_render(tokenizer, messages, tools, False, reasoning), PROMPT)]
    messages = messages[:learned[-1] + 1]
    segments: Segments = []
    done, previous = "", -1
    for k, message in enumerate(messages):
        if message.role != "assistant":
            continue
        prefix = _render(tokenizer, messages[:k], tools, True, reasoning)
        full = _render(tokenizer, messages[: k + 1], tools, False, reasoning)
        if not full.startswith(prefix):  # the generation prompt is not how the turn starts (a prefilled think block)
            return _last_turn_segments(tokenizer, messages, tools, reasoning)
        if prefix.startswith(done):
            between = prefix[len(done):]
        elif not any(kind == REPLY for _, kind in segments):  # nothing learned yet: the history as the template shows it
            segments, between = [], prefix
        else:
            stitched = _after_turn(tokenizer, messages[:k], previous, prefix, segments[-1][0], tools, reasoning)
            if stitched is None:
                return _last_turn_segments(tokenizer, messages, tools, reasoning)
            segments[-1] = (stitched[0], segments[-1][1])
            between = stitched[1]
        segments.append((between, PROMPT))
        segments.append((full[len(prefix):], PROMPT if k < learned_from else REPLY if message.learned else UNLEARNED))
        done, previous = full, k
    return _ended_at_turn_end(tokenizer, segments)


def _ended_at_turn_end(tokenizer, segments: Segments) -> Segments:
    """Each reply ends with its end-of-turn token: whitespace the template
    writes after it (ChatML's newline) goes to the next prompt piece, since
    the model stops at the token and never writes it."""
    end = turn_end_text(tokenizer)
    if end is None:
        return segments
    out: Segments = []
    for i, (text, kind) in enumerate(segments):
        after = text[text.rfind(end) + len(end):] if kind != PROMPT and end in text else ""
        if after and not after.strip() and i + 1 < len(segments):
            text = text[:len(text) - len(after)]
            segments[i + 1] = (after + segments[i + 1][0], segments[i + 1][1])
        out.append((text, kind))
    return out


# Put in front of a turn's content to find where the template shows it: a
# private-use character no text or template writes.
_MARK = "\ue000"


def _after_turn(tokenizer, messages: tuple[Message, ...], turn: int, prefix: str, reply: str,
                tools: list[dict] | None, reasoning: bool) -> tuple[str, str] | None:
    """For a template that shows assistant turn `turn` otherwise in the
    history than when generating it: (its `reply` cut after its end-of-turn
    token, the text of `prefix`, the rendering of `messages` with the
    generation prompt, after that turn's end), or None where that cannot be
    told (the template writes no end-of-turn token, or it is not in the reply)."""
    end = turn_end_text(tokenizer)
    if end is None or end not in reply:
        return None
    cut = reply[:reply.rindex(end) + len(end)]
    nxt = turn + 1
    if nxt < len(messages):  # where the next turn's content starts; else where the generation prompt does
        marked = messages[:nxt] + (replace(messages[nxt], content=_MARK + messages[nxt].content),) + messages[nxt + 1:]
        other = _render(tokenizer, marked, tools, True, reasoning)
        start = next((i for i, (a, b) in enumerate(zip(prefix, other)) if a != b), len(prefix))
    else:
        start = len(prefix)
    at = prefix.rfind(end, 0, start)
    # The turn's end in the history must close the same reply: more than the
    # end token in common, unless the reply is nothing else.
    body = cut[:-len(end)]
    if at < 0 or (body and not prefix[:at].endswith(body[-1])):
        return None
    return cut, prefix[at + len(end):]


# turn_end_text's answers: it is asked for every row.
_turn_ends: dict[tuple, str | None] = {}


def turn_end_text(tokenizer) -> str | None:
    """The first special token the chat template writes after an assistant
    reply (ChatML's <|im_end|>, Phi's <|end|>, Gemma's <end_of_turn>), or None."""
    # Keyed by the tokenizer object and what the answer depends on, cheap to
    # take: a tokenizer of thousands of special tokens is asked for every row.
    key = (id(tokenizer), str(getattr(tokenizer, "chat_template", None)), len(tokenizer))
    if key not in _turn_ends:
        specials = tuple(tokenizer.all_special_tokens) + tuple(
            str(a) for a in tokenizer.added_tokens_decoder.values() if a.special)
        _turn_ends[key] = _probe_turn_end(tokenizer, specials)
    return _turn_ends[key]


def _probe_turn_end(tokenizer, specials: tuple[str, ...]) -> str | None:
    from jinja2 import TemplateError

    probe = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": _PROBE_REPLY}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except (TemplateError, TypeError, ValueError, KeyError):  # no template, or one that refuses the probe
        return None
    if not isinstance(text, str) or _PROBE_REPLY not in text:
        return None
    after = text[text.rindex(_PROBE_REPLY) + len(_PROBE_REPLY):]
    return min((t for t in specials if t and t in after), key=after.index, default=None)


def _not_separable() -> ModelError:
    return ModelError(
        "This model's chat template renders a conversation differently from its prompt, "
        "so the reply cannot be separated from the prompt.",
        "Pass --train-on-prompt to train on whole conversations, or use a model with a standard template.",
    )


def _last_turn_segments(tokenizer, messages: tuple[Message, ...], tools: list[dict] | None,
                        reasoning: bool) -> Segments:
    # Where `_after_turn` cannot tell where an earlier turn ends, only the
    # last reply is trained on, which is still exact. `chat_segments` ends the
    # conversation at its last learned reply, so that is the one.
    last = len(messages) - 1
    prefix = _render(tokenizer, messages[:last], tools, True, reasoning)
    full = _render(tokenizer, messages, tools, False, reasoning)
    if not full.startswith(prefix):
        raise _not_separable()
    return [(prefix, PROMPT), (full[len(prefix):], REPLY)]


# What a template's refusal is about, from the words templates use (Gemma's "System role
# not supported", Llama 2's "roles must alternate"), told in ours: a template's own
# text may quote the row (raise_exception('bad role: ' + message['content'])), so it is never shown.
_REFUSALS = (("system", "it does not accept a system turn"),
             ("alternate", "it needs user and assistant turns to alternate"),
             ("tool", "it does not accept tool calls or tool results"),
             ("role", "it does not accept one of the turns' roles"))


def template_refused(what: str, error: Exception, hint: str) -> ModelError:
    """The error for a chat template that raised while rendering `what` ("row 12",
    "the conversation"): what it refused, never its text."""
    said = str(error).lower()
    reason = next((why for word, why in _REFUSALS if word in said), f"it raised an error ({type(error).__name__})")
    return ModelError(f"This model's chat template refused {what}: {reason}.", hint)


def raw_segments(tokenizer, example: Example) -> Segments:
    """prompt/completion and text rows: no template, BOS if the model uses one."""
    bos = tokenizer.bos_token if starts_with_bos(tokenizer) else ""
    return [(bos + example.prompt, PROMPT), (example.completion, REPLY)]



# A conversation that uses every tool feature, with marks that appear in the
# rendered text only if the template shows the call and the result.
_PROBE_CALL_MARK = "llmcustoms_probe_argument_value"
_PROBE_RESULT_MARK = "llmcustoms_probe_result"
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "llmcustoms_probe", "description": "A probe.",
    "parameters": {"type": "object", "properties": {"value": {"type": "string"}}}}}]
_PROBE_TURNS = [
    {"role": "user", "content": "Probe."},
    # The id has nine letters and digits: Mistral's template checks that.
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "probe0001", "function": {
        "name": "llmcustoms_probe", "arguments": {"value": _PROBE_CALL_MARK}}}]},
    {"role": "tool", "tool_call_id": "probe0001", "name": "llmcustoms_probe", "content": _PROBE_RESULT_MARK},
    {"role": "assistant", "content": "Done."},
]


def supports_tools(tokenizer) -> bool:
    """Whether the chat template shows tool calls and tool results. Rendered,
    not read from the Jinja source: a template may name `tools` and still
    drop the calls (or refuse the `tool` role)."""
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(_PROBE_TURNS, tools=_PROBE_TOOLS, tokenize=False)
    except (TemplateError, TypeError, KeyError, ValueError):
        return False
    return _PROBE_CALL_MARK in text and _PROBE_RESULT_MARK in text


def tool_support_error(example: Example) -> ModelError:
    return ModelError(
        f"The data has tool calls (role 'tool' / tool_calls, or a 'tools' list; first at row {example.row}), "
        "but this model's chat template cannot show them, so the model could not learn to call tools.",
        "Use a model whose chat template supports tool calling, such as Qwen2.5 Instruct (e.g. "
        "Qwen/Qwen2.5-1.5B-Instruct) or Mistral-7B-Instruct-v0.3, or leave the tool-calling rows out of the data.",
    )
