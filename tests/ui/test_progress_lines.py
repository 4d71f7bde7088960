"""No silent minutes: the waits a user saw standing still on a busy CPU (the
sample replies and general questions, `tune` before its first trial row,
`lr-find`) each show a live line with what they do, a count, and an ETA from
the first item on."""

from __future__ import annotations

import io
import re
from types import SimpleNamespace
from typing import Any

from rich.console import Console
from typer.testing import CliRunner

from conftest import DATA_FILES
from llmcustoms.cli import app
from llmcustoms.commands.lr_find import Suggestion, rows_shown, sample_rows
from llmcustoms.planning.train_options import TrainOptions
from llmcustoms.preparation.preparing import prepare_run
from llmcustoms.planning.hardware import Hardware
from llmcustoms.runs.run_directory import RunDirectory
from llmcustoms.training.general_knowledge import GeneralKnowledge, load_questions
from llmcustoms.training.samples import SampleReplies, held_out_prompts
from llmcustoms.ui import tune_view
from llmcustoms.ui.train_progress import Countdown
from llmcustoms.ui.train_view import RichReporter

runner = CliRunner()
ETA = r"eta \d:\d\d:\d\d"


def text_of(renderable: Any) -> str:
    out = Console(file=io.StringIO(), width=80, color_system=None)
    out.print(renderable)
    return " ".join(out.file.getvalue().split())


class Watching:
    """A Reporter in front of the live display that keeps, at each count, what the display shows then."""

    def __init__(self, display: RichReporter):
        self.display = display
        self.counts: list[tuple[str, int, int, str]] = []  # (what, done, total, the display's text)

    def count(self, what: str, done: int, total: int) -> None:
        self.display.count(what, done, total)
        live = self.display.live or self.display.status  # the training display, or the spinner after it
        self.counts.append((what, done, total, text_of(live.renderable)))

    def __getattr__(self, name: str) -> Any:  # the rest of the protocol, as the display has it
        return getattr(self.display, name)

    def of(self, what: str) -> list[tuple[int, int, str]]:
        return [(done, total, shown) for w, done, total, shown in self.counts if w == what]


def frames(captured: io.StringIO) -> str:
    """A terminal's output as plain lines: each redraw of a live display is a frame."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "\n", captured.getvalue()).replace("\r", "\n")


def terminal(monkeypatch) -> io.StringIO:
    """`tune` and `lr-find` draw on a captured terminal (live displays draw nothing elsewhere)."""
    captured = io.StringIO()
    monkeypatch.setattr(tune_view, "console", Console(file=captured, force_terminal=True, width=200,
                                                      color_system=None, highlight=False))
    return captured


def test_a_countdown_has_an_eta_from_the_first_item_on():
    countdown = Countdown("sample replies (base)", 4, now=100.0)
    assert countdown.text(112.0) == "sample replies (base) 0/4 0:00:12"  # the time spent: never standing still
    countdown.update(1, now=130.0)
    assert countdown.text(130.0) == "sample replies (base) 1/4, eta 0:01:30"
    assert countdown.text(140.0) == "sample replies (base) 1/4, eta 0:01:20"  # counts down between items
    countdown = Countdown("step", 10, now=0.0)
    countdown.update(1, now=65.0, seconds=5.0)  # the step's own time: the 60 s before it loaded the model
    assert countdown.eta(65.0) == 45.0


def one_process() -> Any:
    """What `SampleReplies.answer_in_run` asks of a run's processes, for a run of one."""
    accelerator = SimpleNamespace(unwrap_model=lambda model: model, wait_for_everyone=lambda: None)
    return SimpleNamespace(fsdp=False, is_main=True, main_decides=lambda due: due, accelerator=accelerator,
                           signals=SimpleNamespace(received=None))


def test_sample_replies_and_general_questions_count_up_with_an_eta(tmp_path, tiny_models):
    from transformers import AutoModelForCausalLM

    options = TrainOptions(data=str(DATA_FILES["alpaca"]), model=str(tiny_models["llama"]),
                           cache_dir=str(tmp_path / "cache"), overrides={"eval_split": (0.2, "flag")})
    prepared = prepare_run(options, Hardware.cpu_only())
    run_dir = RunDirectory(tmp_path / "run")
    run_dir.create()
    general = GeneralKnowledge(prepared.tokenizer, prepared.plan, run_dir, load_questions()[:6], max_new_tokens=4,
                               batch_size=4)
    samples = SampleReplies(held_out_prompts(prepared), prepared.tokenizer, prepared.plan, run_dir, max_new_tokens=6,
                            general=general)
    prompts = len(samples.prompts)
    assert prompts >= 2
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    display = RichReporter(Console(file=io.StringIO(), width=80))
    reporter = Watching(display)
    display.training_started(2)  # the base model answers in the training display, before the first step
    samples.answer_in_run(one_process(), model, 0, "base", reporter)
    display.training_finished()  # the trained model answers after it, in a spinner
    samples.answer_in_run(one_process(), model, 2, "trained", reporter)
    display.activity(None)

    for label in ("base", "trained"):
        replies = reporter.of(f"sample replies ({label})")
        assert [(done, total) for done, total, _ in replies] == [(n, prompts) for n in range(prompts + 1)]
        assert f"sample replies ({label}) 0/{prompts}" in replies[0][2]
        for done, total, shown in replies[1:]:
            assert re.search(rf"sample replies \({label}\) {done}/{total}, {ETA}", shown), shown
        # Counted in tokens: on a CPU the questions are one batch, answered all at once.
        tokens = reporter.of(f"general questions ({label}), token")
        assert tokens[0][:2] == (0, 8) and tokens[-1][:2] == (8, 8)  # two batches of 4 tokens each
        assert [done for done, _, _ in tokens] == sorted(done for done, _, _ in tokens) and len(tokens) > 3
        for done, _, shown in tokens[1:]:
            assert re.search(rf"general questions \({label}\), token {done}/8, {ETA}", shown), shown


def test_tune_says_what_trial_0_does_before_its_first_row(tmp_path, tiny_models, monkeypatch):
    captured = terminal(monkeypatch)
    args = ["tune", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["llama"]), "--max-steps", "3",
            "--eval-split", "0.2", "--output-dir", str(tmp_path), "--study-name", "s", "--trials", "1"]
    result = runner.invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    shown = frames(captured)
    first_row = min(shown.find(state) for state in ("running", "complete") if state in shown)
    said = [m.start() for m in re.finditer(r"trial 0: ", shown)]
    assert said and said[0] < first_row, shown[:first_row + 200]
    before = shown[:first_row]
    assert "preparing the study" in before and "trial 0: loading the model" in before
    assert "trial 0: step 0/3 0:00:0" in before  # the first step, with the time it has taken so far
    assert re.search(rf"trial 0: step 1/3, {ETA}", before)
    assert re.search(rf"trial 0: step 3/3, {ETA}", shown)
    assert "trial 0:" not in shown[shown.rfind("Trials"):]  # the study over: no line left saying it goes on


def test_lr_find_shows_every_step_and_an_eta_from_the_first(tmp_path, tiny_models, monkeypatch):
    captured = terminal(monkeypatch)
    args = ["lr-find", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["llama"]), "--steps", "10",
            "--output-dir", str(tmp_path)]
    result = runner.invoke(app, args, catch_exceptions=False)
    assert result.exit_code in (0, 2), result.output  # 2: a curve this short may have no suggestion
    shown = frames(captured)
    steps = [int(n) for n in re.findall(r"^step (\d+)/10  lr ", shown, re.MULTILINE)]
    assert steps == list(range(1, 11))  # every step, once, in order
    assert "step 0/10 0:00:0" in shown  # before the first: the time spent
    for done in range(1, 11):
        assert re.search(rf"lr-find .*step {done}/10, {ETA}  lr ", shown), done
    assert "-:--:--" not in shown
    assert "Steps in the table: every step of 10." in " ".join(shown.split())


def test_a_long_curves_table_says_which_steps_it_shows():
    curve = [{"step": i + 1, "lr": 10 ** (-7 + i / 5), "loss": 5.0, "smoothed": 5.0} for i in range(30)]
    rows = sample_rows(curve, Suggestion(None))
    assert [r["step"] for r in rows] == [1, 6, 11, 16, 21, 26, 30]
    assert rows_shown(30) == "every 5 steps from step 1 (of 30), the last, the suggested and the smoothed minimum's"
    assert [r["step"] for r in sample_rows(curve[:10], Suggestion(None))] == list(range(1, 11))
    assert rows_shown(10) == "every step of 10"


def test_a_long_range_test_keeps_at_most_twenty_step_lines_and_counts_every_step(monkeypatch):
    captured = terminal(monkeypatch)
    with tune_view.RangeTestDisplay(100) as display:
        for step in range(1, 101):
            display.update({"step": step, "lr": 1e-5, "loss": 2.0, "smoothed": 2.0, "seconds": 0.01})
    kept = [int(n) for n in re.findall(r"^step (\d+)/100  lr ", frames(captured), re.MULTILINE)]
    assert sorted(set(kept)) == [1, 6, 11, 16, 21, 26, 31, 36, 41, 46, 51, 56, 61, 66, 71, 76, 81, 86, 91, 96, 100]
    assert display.countdown.done == 100  # the live line counted each one


def test_a_counted_wait_says_its_count_and_from_the_first_item_on_the_time_left():
    """`console.waiting`'s stages counted in items (the check prompts of an export,
    a GGUF file's tensors), as the training display counts its waits."""
    from llmcustoms.ui.train_progress import counting

    said: list[str] = []
    now = [100.0]
    told = counting(said.append, "Answering the check prompts", lambda: now[0])
    told(0, 4)
    now[0] += 3
    told(0, 4)  # no item done yet: the time so far, so the line never stands still
    now[0] += 7
    told(1, 4)  # 10 s for the first: 30 s for the other three
    now[0] += 10
    told(2, 4)
    assert said == ["Answering the check prompts 0/4 0:00:00", "Answering the check prompts 0/4 0:00:03",
                    "Answering the check prompts 1/4, eta 0:00:30", "Answering the check prompts 2/4, eta 0:00:20"]


def test_the_preparation_display_counts_a_gguf_files_tensors_in_tensors(monkeypatch):
    from llmcustoms.ui import data_view

    out = io.StringIO()
    monkeypatch.setattr(data_view, "console", Console(file=out, width=100, force_terminal=True, color_system=None))
    monkeypatch.setattr(data_view, "QUIET_SECONDS", 0.0)
    with data_view.PreparationProgress() as progress:
        progress("gguf", 3, 10)
        progress.progress.refresh()
        shown = out.getvalue()
    assert "Reading the GGUF file" in shown and "3/10" in shown and "tensors/s" in shown and "rows/s" not in shown
