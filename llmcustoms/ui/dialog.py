"""What llmcustoms asks at the terminal: `setup`'s questions and screens, and
the `chat` conversation.

`ui/console.py` shows results; this module reads answers. Both are in `ui/`,
the only folder whose modules import Rich: the wizard (`commands/setup.py`) decides which
questions to ask and what to write, and `models/generation.py` how to answer.
"""

from __future__ import annotations

import os
import select
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from rich.cells import cell_len  # the columns text takes: a wide (CJK) character takes two
from rich.prompt import Prompt
from rich.table import Table
from rich.text import Text

from llmcustoms.planning.access_tokens import hide_tokens
from llmcustoms.planning.hardware import GIB
from llmcustoms.ui.console import console, escape

Messages = list[dict[str, str]]


# Set once an answer found no input left; every later answer is its default.
_input_ended = False
# Bytes a terminal in another encoding (Latin-1) sends: a strict UTF-8 standard input refuses them.
NOT_UTF8 = "what you typed is not UTF-8 text"
SET_UTF8 = "set your terminal to UTF-8 (LANG=C.UTF-8, for example) and type it again"


def ask(question: str, default: str | None = None, choices: list[str] | None = None) -> str:
    """A prompt whose answer is the default on Enter, or when input has run out."""
    global _input_ended
    try:
        if sys.stdin is None:  # started with stdin closed: as if piped input had run out
            console.print(f"{escape(question)}:", end=" ")
            raise EOFError
        # Text: a question quoting a path with [brackets] is shown as written, not as markup.
        answer = Prompt.ask(Text(question), default=default, choices=choices, console=console, show_choices=bool(choices))
    except EOFError:
        _input_ended = True
        answer = default
    except UnicodeDecodeError:
        console.print(f"[yellow]{NOT_UTF8[:1].upper()}{NOT_UTF8[1:]}: {SET_UTF8}.[/]")
        return ask(question, default, choices)
    answer = (answer or "").strip()
    if sys.stdin is None or not sys.stdin.isatty():
        console.print(Text(hide_tokens(answer)))  # piped input is not echoed; keep the transcript readable
    return answer


def can_ask_again() -> bool:
    """Whether a refused answer can be asked for again: not once input has run
    out (piped answers used up, stdin closed) nor under CI, where no one would
    answer and asking again would only repeat the default."""
    ci = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")
    return not _input_ended and not ci


def say(text: str) -> None:
    console.print(escape(text))


def ask_again(why: str) -> None:
    """Why the last answer was refused, before the question comes again."""
    console.print(f"[yellow]{escape(why)}[/]")


def show_setup_start(hardware: Any) -> None:
    console.rule("llmcustoms setup")
    where = (f"{hardware.gpus[0].name}, {hardware.gpus[0].total_bytes / GIB:.0f} GiB" if hardware.has_gpu
             else f"no GPU; {hardware.cpu_cores} CPU cores, {hardware.ram_bytes / GIB:.0f} GiB RAM")
    console.print(f"This machine: {escape(where)}")
    if hardware.torch_note:  # GPUs found that the installed torch cannot use
        console.print(f"[yellow]{escape(hardware.torch_note)}[/]")
    if not hardware.has_gpu:
        console.print("[yellow]Without a GPU, training runs on the CPU: minutes for the smallest models, hours for "
                      "larger ones; each model below comes with its time here.[/]")


def show_example_offer(answer: str, what: str) -> None:
    """Before the data question, when no data was named: the example is its default."""
    console.print(f"No data file yet? Press Enter (the answer [bold]{escape(answer)}[/]) to start with the "
                  f"example: {escape(what)}. It is copied where you choose, to train on or to copy the shape of.")


def show_data_problem(message: str, hint: str | None) -> None:
    console.print(f"[red]{escape(message)}[/]" + (f"\n{escape(hint)}" if hint else ""))


def show_data_checked(description: str, rows: int, median_tokens: int, p95_tokens: int) -> None:
    console.print(f"  [green]ok[/]: {escape(description)}, {rows:,} rows, "
                  f"about {median_tokens} tokens per row (95% under {p95_tokens})")


def show_bad_rows(count: int, reasons: list[str], skip_all: bool, share: float) -> None:
    """Bad rows that `train` will skip, by reason with their first places (`BadRows.lines`)."""
    rows = "1 bad row" if count == 1 else f"{count:,} bad rows"
    why = "you chose to skip them" if skip_all else f"as `train` does with up to {share:.0%} of the rows"
    console.print(f"  [yellow]{rows} will be skipped[/] ({escape(why)}):")
    for reason in reasons:
        console.print(f"    {escape(reason)}")


def show_too_many_bad_rows(name: str, count: int, total: int, share: float, reasons: list[str],
                           description: str) -> None:
    console.print(f"[yellow]{escape(name)}: {count:,} of {total:,} rows ({count / total:.0%}) fail validation[/], "
                  f"more than the {share:.0%} `train` skips without asking:")
    for reason in reasons:
        console.print(f"    {escape(reason)}")
    console.print(f"If the format was misread (detected: {escape(description)}), fix the file instead.")


def show_goals(goals: list[tuple[str, str]]) -> None:
    """(preset name, what it is for), one per line."""
    table = Table(show_header=False, box=None)
    for name, purpose in goals:
        table.add_row(f"[bold]{name}", purpose)
    console.print(table)


MODEL_WHERE_STYLE = {"local": "green", "cached": "green", "download": "yellow", "offline: no": "red"}


def show_model_choices(offers: list[Any], seq_len: int, suggested: str | None, reason: str, offline: str | None) -> None:
    """`setup.ModelOffer`s, numbered from 1 so a number answers the next question:
    size, method, memory, the estimated training time here and where each loads from."""
    console.print(f"Models that fit this machine ({seq_len}-token sequences), with the estimated training time "
                  "for this data:")
    # Memory is the column to leave out at 80 columns: the time and availability are what decide here.
    wide = console.width >= 100
    table = Table(box=None, padding=(0, 1, 0, 0), pad_edge=False)
    columns = [("#", "right"), ("model", "left"), ("size", "right"), ("method", "left")]
    columns += [("memory", "right")] if wide else []
    columns += [("est. time", "right"), ("available", "left"), ("", "left")]
    # A model directory by its folder's name: its whole path is under the table, where a copy takes it.
    names = [Path(offer.hub_id).name if offer.origin and offer.where == "local" else offer.hub_id for offer in offers]
    # The number and the name are what a user types: narrow terminals squeeze the other columns.
    widths = {"model": max((len(name) for name in names), default=0), "#": len(f"{len(offers)}.")}
    for header, justify in columns:
        table.add_column(header, justify=justify, header_style="dim", no_wrap=True, min_width=widths.get(header))
    for index, (offer, name) in enumerate(zip(offers, names), start=1):
        style = MODEL_WHERE_STYLE.get(offer.where, "")
        memory = [f"{offer.total_bytes / GIB:.1f} GiB"] if wide and offer.total_bytes else [""] * wide
        table.add_row(f"{index}.", escape(name), f"{offer.params / 1e9:.1f}B" if offer.params else "?", offer.method,
                      *memory,
                      escape(offer.estimate.removeprefix("about ")),
                      f"[{style}]{escape(offer.where)}[/]" if style else escape(offer.where),
                      "[bold]<-[/]" if offer.hub_id == suggested else "")
    if offers:
        console.print(table)
        show_models_on_disk([(i, o) for i, o in enumerate(offers, start=1) if o.origin])
    else:
        console.print("  [red]none of the catalog's models fits; llmcustoms will say why when you run `plan`[/]")
    if offline:
        console.print(f"[yellow]Offline[/]: {escape(offline)}: those marked cached, or a local model directory.")
    console.print(f"Suggested (<-): {escape(reason)}." if suggested else f"[yellow]No suggestion[/]: {escape(reason)}.")


def show_models_on_disk(numbered: list[tuple[int, Any]]) -> None:
    """Where each model on this disk was found; a directory's whole path on a line of its own."""
    for index, offer in numbered:
        console.print(Text(f"{index}. {offer.origin}" + (":" if offer.where == "local" else f": {offer.hub_id}")))
        if offer.where == "local":
            console.print(Text(offer.hub_id), soft_wrap=True)


def show_model_accepted(name: str, where: str, detail: str) -> None:
    """The model answer, checked: where it loads from and what training it here means."""
    how = {"local": "a local model directory", "cached": "in the local Hugging Face cache",
           "download": "downloaded from the Hugging Face Hub when training starts"}.get(where, where)
    shown = Path(name).name if where == "local" else name  # the whole path on a line of its own, below
    console.print(f"  [green]ok[/]: {escape(shown)}: {escape(how)}" + (f"; {escape(detail)}" if detail else ""))
    if where == "local":
        console.print(Text(name), soft_wrap=True)


def write_piece(text: str) -> None:
    """Streamed model output, as it comes: plain stdout, so no markup is read into it."""
    sys.stdout.write(text)
    sys.stdout.flush()


class WordWrap:
    """Streamed text written wrapped at word boundaries to `width` columns, as
    the terminal would not (it cuts words at its edge). A word is held until a
    space or a line break ends it, then goes on the current line if it fits,
    else begins the next one, where the spaces before it are dropped. A word
    wider than a whole line is cut at the edge. `column`: where the cursor is
    when the text begins (after the "model> " prompt)."""

    def __init__(self, width: int, column: int = 0, write: Callable[[str], None] = write_piece):
        self.width, self.column, self.write = max(1, width), column, write
        self.word = self.spaces = ""

    def __call__(self, piece: str) -> None:
        for char in piece:
            if char == "\n":
                self.finish()
                self.write("\n")
                self.column, self.spaces = 0, ""
            elif char.isspace():
                self.finish()
                self.spaces += " " if char == "\t" else char  # a tab's width is the terminal's to choose
            else:
                self.word += char

    def finish(self) -> None:
        """Write the word held (at the end of a reply, or when it is stopped)."""
        if not self.word:
            return
        if self.column and self.column + cell_len(self.spaces + self.word) > self.width:
            self.write("\n")
            self.column, self.spaces = 0, ""
        text, self.word, self.spaces = self.spaces + self.word, "", ""
        while self.column + cell_len(text) > self.width:  # wider than a line: cut where the line ends
            cut = next(i for i in range(len(text), 0, -1) if self.column + cell_len(text[:i]) <= self.width or i == 1)
            self.write(text[:cut] + "\n")
            text, self.column = text[cut:], 0
        self.write(text)
        self.column += cell_len(text)


def chat_loop(reply: Callable[[Messages, Callable[[str], None]], str], start: Messages, run: str, weights: str) -> None:
    """Talk until /exit, /quit, Ctrl-D, or Ctrl-C at the prompt; /reset goes back
    to `start` (the system message, if any). `reply(messages, on_text)` answers
    the conversation so far, streaming its text to `on_text`, and returns it.

    Ctrl-C during a reply stops that reply only. What was shown of it stays in
    the conversation, so the model's memory matches the screen; if nothing was
    shown yet, the unanswered message is dropped too (most chat templates
    refuse two user turns in a row). `weights`: what is loaded (`Weights.describe`)."""
    console.print(f"Chatting with [bold]{escape(run)}[/] ({escape(weights)}). "
                  "/exit or Ctrl-D to quit, /reset to start over, Ctrl-C stops a reply.")
    messages = list(start)
    while True:
        text = _typed()
        if text is None:
            break
        if text.strip() in ("/exit", "/quit"):
            break
        if text.strip() == "/reset":
            messages = list(start)
            console.print("[dim](conversation cleared" + ("; the system message stays" if start else "") + ")[/]")
            continue
        if not text.strip():
            continue
        asked = [*messages, {"role": "user", "content": text}]
        answer = _answer(reply, asked)
        if answer is not None:
            messages = [*asked, {"role": "assistant", "content": answer}]


def _typed() -> str | None:
    """The next message typed; None when the chat ends (Ctrl-D, Ctrl-C), "" when it was
    not UTF-8 text (a Latin-1 terminal), which no tokenizer takes: said, and asked again."""
    try:
        text = console.input("[bold green]you>[/] ")
        text.encode("utf-8")  # lone surrogates: bytes of another encoding, read with surrogateescape
        return text
    except (EOFError, KeyboardInterrupt):
        console.print()
        return None
    except (UnicodeDecodeError, UnicodeEncodeError):  # the first from a strict UTF-8 standard input
        console.print(f"[yellow]({NOT_UTF8}, so it was not sent: {SET_UTF8})[/]")
        return ""


@contextmanager
def typing_held(fd: int | None = None) -> Iterator[list[bool]]:
    """While a reply streams, keys typed at the terminal `fd` (standard input)
    are not echoed: they used to land in the middle of the reply on the screen.
    What was typed is dropped after it rather than sent, unseen, as the next
    message; the list yielded holds True then, so the caller can say so.
    Ctrl-C still works (only echo is off). Not a terminal: nothing changes."""
    dropped: list[bool] = []
    try:
        import termios
    except ImportError:  # Windows
        yield dropped
        return
    try:
        fd = sys.stdin.fileno() if fd is None else fd
        saved = termios.tcgetattr(fd)
    except (termios.error, OSError, ValueError, AttributeError):  # not a terminal, or a replaced stdin
        yield dropped
        return
    quiet = list(saved)
    quiet[3] &= ~termios.ECHO
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield dropped
    finally:
        if select.select([fd], [], [], 0)[0]:
            dropped.append(True)
        termios.tcflush(fd, termios.TCIFLUSH)
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def _answer(reply: Callable[[Messages, Callable[[str], None]], str], messages: Messages) -> str | None:
    """The reply, streamed as it comes (keys typed meanwhile held back:
    `typing_held`). After Ctrl-C, what was shown of it, or None when nothing was."""
    with typing_held() as dropped:
        answer = _streamed(reply, messages)
    if dropped:
        console.print("[dim](what you typed during the reply was not sent; type it again)[/]")
    return answer


def _streamed(reply: Callable[[Messages, Callable[[str], None]], str], messages: Messages) -> str | None:
    shown: list[str] = []
    wrap = WordWrap(console.width, column=len("model> "))

    def show(piece: str) -> None:
        wrap(piece)
        shown.append(piece)

    console.print("[bold blue]model>[/] ", end="")
    try:
        answer = reply(messages, show)
    except KeyboardInterrupt:
        wrap.finish()  # the screen shows all the conversation keeps
        write_piece("\n")
        partial = "".join(shown).strip()
        console.print("[dim](stopped; " + ("the reply so far stays in the conversation)[/]" if partial
                                          else "your message is left out of the conversation)[/]"))
        return partial or None
    wrap.finish()
    write_piece("\n")
    return answer
