"""What llmcustoms asks at the terminal: `setup`'s questions and screens, and
the `chat` conversation.

`console.py` shows results; this module reads answers. These two are the
UI, the only modules that import Rich: the wizard (`wizard.py`) decides which
questions to ask and what to write, and `generation.py` how to answer.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from rich.prompt import Prompt
from rich.table import Table

from llmcustoms.console import console, escape
from llmcustoms.hardware import GIB

Messages = list[dict[str, str]]


def ask(question: str, default: str | None = None, choices: list[str] | None = None) -> str:
    """A prompt whose answer is the default on Enter, or when input has run out."""
    try:
        answer = Prompt.ask(question, default=default, choices=choices, console=console, show_choices=bool(choices))
    except EOFError:
        answer = default
    answer = (answer or "").strip()
    if not sys.stdin.isatty():
        console.print(answer)  # piped input is not echoed; keep the transcript readable
    return answer


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
    if not hardware.has_gpu:
        console.print("[yellow]Without a GPU, training works but is slow: expect hours for real models.[/]")


def show_data_problem(message: str, hint: str | None) -> None:
    console.print(f"[red]{escape(message)}[/]" + (f"\n{escape(hint)}" if hint else ""))


def show_data_checked(description: str, rows: int, median_tokens: int, p95_tokens: int) -> None:
    console.print(f"  [green]ok[/]: {escape(description)}, {rows:,} rows, "
                  f"about {median_tokens} tokens per row (95% under {p95_tokens})")


def show_goals(goals: list[tuple[str, str]]) -> None:
    """(preset name, what it is for), one per line."""
    table = Table(show_header=False, box=None)
    for name, purpose in goals:
        table.add_row(f"[bold]{name}", purpose)
    console.print(table)


def show_model_choices(choices: list[Any], seq_len: int) -> None:
    """`fitting.FittingModel`s, numbered from 1 so a number answers the next question."""
    console.print(f"Models that fit this machine ({seq_len}-token sequences):")
    for index, choice in enumerate(choices, start=1):
        need = f"{choice.params / 1e9:.1f}B params, {choice.method}, about {choice.total_bytes / GIB:.1f} GiB"
        console.print(f"  {index:2}. {escape(choice.hub_id)} [dim]({escape(need)})[/]")
    if not choices:
        console.print("  [red]none of the preset models fits; llmcustoms will say why when you run `plan`[/]")


def write_piece(text: str) -> None:
    """Streamed model output, as it comes: plain stdout, so no markup is read into it."""
    sys.stdout.write(text)
    sys.stdout.flush()


def chat_loop(reply: Callable[[Messages, Callable[[str], None]], str], start: Messages, run: str, model: str) -> None:
    """Talk until /exit, /quit, Ctrl-D or Ctrl-C; /reset goes back to `start`
    (the system message, if any). `reply(messages, on_text)` answers the
    conversation so far, streaming its text to `on_text`, and returns it."""
    console.print(f"Chatting with [bold]{escape(run)}[/] ({escape(model)} + adapter). "
                  "/exit or Ctrl-D to quit, /reset to start over.")
    messages = list(start)
    while True:
        try:
            text = console.input("[bold green]you>[/] ")
        except (EOFError, KeyboardInterrupt):
            console.print()
            break
        if text.strip() in ("/exit", "/quit"):
            break
        if text.strip() == "/reset":
            messages = list(start)
            continue
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        console.print("[bold blue]model>[/] ", end="")
        answer = reply(messages, write_piece)
        write_piece("\n")
        messages.append({"role": "assistant", "content": answer})
