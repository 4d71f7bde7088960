"""Any text a user can put in front of llmcustoms (a path, an answer, a prompt, a run name) is
shown as written by every reporter: Rich (markup characters such as "[/]" are text, never tags),
plain (train.log) and JSON (`plan --json` errors). Property-tested with text made of brackets,
backslashes, quotes and bytes that are not UTF-8 (lone surrogates, as Python decodes them from
a path or an argument), written to streams that encode as a terminal does."""

from __future__ import annotations

import io
import json
import sys

import pytest
import typer
from hypothesis import HealthCheck, given, settings, strategies as st
from rich.console import Console

from llmcustoms import endings
from llmcustoms.commands.report import Finding, RunReport
from llmcustoms.errors import LlmcustomsError
from llmcustoms.reporting import SilentReporter
from llmcustoms.runs.run_log import LoggingReporter
from llmcustoms.ui import console as ui
from llmcustoms.ui import dialog
from llmcustoms.ui.train_view import QuietReporter, RichReporter

# What breaks a naive renderer: markup tags and their pieces, escapes, quotes, bytes of another encoding.
PIECES = ["[", "]", "[/]", "[bold]", "[red]x[/red]", "\\", "\\[", '"', "'", "\udce9", "\udcff", "\n", " ", "%s",
          "{}", "\x1b[31m"]
USER_TEXT = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=4)), max_size=12).map("".join)


def terminal() -> io.TextIOWrapper:
    """A stream that encodes as the command's own stdout and stderr do once it has started."""
    stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
    return endings.tolerant(stream)


def shown(stream: io.TextIOWrapper) -> str:
    return stream.buffer.getvalue().decode("utf-8", "surrogateescape")


def every_reporter(path):
    yield QuietReporter(Console(file=terminal(), width=80))
    yield RichReporter(Console(file=terminal(), width=80))
    yield LoggingReporter(SilentReporter(), path)  # train.log, plain text


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=USER_TEXT)
def test_every_reporter_takes_any_text(tmp_path, text):
    log = tmp_path / "train.log"
    log.unlink(missing_ok=True)
    for reporter in every_reporter(log):
        reporter.message(text)
        reporter.message(text, warning=True)
        reporter.activity(text)
        reporter.count(text, 1, 3)
        reporter.training_started(3, 0, {"total_bytes": 1 << 30, "budget_bytes": 1 << 32})
        reporter.step({"step": 1, "loss": 1.5, "lr": 1e-4, "grad_norm": 0.5, "tokens_per_s": 100.0, "epoch": 0.1})
        reporter.evaluated({"step": 1, "eval_loss": 1.4, "eval_ppl": 4.0})
        reporter.activity(None)
        reporter.training_finished()
    written = log.read_text(encoding="utf-8")  # still UTF-8, whatever the text held
    assert all(piece in written for piece in ("[/]", "[bold]") if piece in text)


@settings(max_examples=40, deadline=None)
@given(text=USER_TEXT, hint=USER_TEXT)
def test_every_message_the_console_shows_takes_any_text(text, hint):
    out, err = terminal(), terminal()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ui, "console", Console(file=out, width=80))
        patch.setattr(ui, "err_console", Console(file=err, width=80))
        patch.setattr(dialog, "console", ui.console)
        show_every_message(text, hint)
    # Markup is never applied: a "[/]" or "[bold]" in the text reaches the screen as written.
    for piece in ("[/]", "[bold]"):
        if piece in text:
            assert piece in shown(out) + shown(err)


def show_every_message(text: str, hint: str) -> None:
    ui.print_error(text, hint)
    ui.print_warning(text)
    ui.print_notice(text, hint)
    ui.show_failure({"reason": text, "suggestions": [hint]}, text)
    ui.show_report(RunReport(name=text, status="completed", steps=1, total_steps=1,
                             findings=[Finding(text, "ok", hint)], recommendations=[text],
                             samples=[{"prompt": text, "reference": hint, "base": text, "trained": hint}]))
    with ui.waiting(text) as say:
        say(hint)
    dialog.say(text)
    dialog.ask_again(text)


@settings(max_examples=40, deadline=None)
@given(text=USER_TEXT, hint=USER_TEXT)
def test_a_json_error_carries_any_text_back_exactly(text, hint):
    out, err = terminal(), terminal()
    with pytest.MonkeyPatch.context() as patch, pytest.raises(typer.Exit) as ended:
        patch.setattr(sys, "stdout", out)
        patch.setattr(ui, "err_console", Console(file=err, width=80))
        with endings.ending(json_errors=True):
            raise LlmcustomsError(text, hint)
    assert ended.value.exit_code == 2
    error = json.loads(shown(out).strip().splitlines()[-1])["error"]
    assert (error["message"], error["hint"]) == (text, hint)
