"""What `tune` and `lr-find` show: the search space, the live table of trials,
the study's outcome, the range test's progress and its curve.

A UI module beside `ui/console.py` (whose `console` it prints to): Rich may be
imported here. It computes nothing; `commands/tune.py` and `commands/lr_find.py` hand it what
to show.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from llmcustoms.ui.console import console, escape
from llmcustoms.ui.layout import WideOrNarrow
from llmcustoms.ui.train_progress import Countdown, clock, counted


def show_search(space: Any, base: Any, settings: Any, tokens_per_trial: int) -> None:
    if settings.note:  # the study of the name asked for was started on other data or another budget
        console.print(f"[yellow]note:[/] {escape(settings.note)}")
    table = Table(title=f"Search space (study {escape(settings.study_name)})", show_header=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    for name, values in space.describe():
        table.add_row(name, escape(values))
    table.add_row("fixed", escape(f"{base.model}, {base.method}, micro-batch {base.micro_batch_size} x "
                                  f"{base.grad_accum}, {base.max_seq_len} tokens"))
    table.add_row("budget per trial", f"{settings.steps} optimizer steps (about {tokens_per_trial:,} tokens), "
                                      f"eval loss on {base.eval_rows} held-out rows")
    table.add_row("scored by", _objectives(settings) if base.objective_kind.token_loss else
                  "held-out loss (forgetting is measured only when training on replies: not for preference pairs)")
    table.add_row("pruning", _pruning(settings))
    table.add_row("trials", f"{settings.trials} now, sampler {settings.sampler}"
                            + (f", timeout {settings.timeout:g} s" if settings.timeout else ""))
    table.add_row("then", _check(settings, base))
    table.add_row("stored in", escape(settings.where))  # without the URL's password
    console.print(table)


def _objectives(settings: Any) -> str:
    """The two objectives and the rule of the pick (`tune_pareto.pick`)."""
    limit = settings.forgetting_limit
    rule = ", forgetting not limited (--forgetting-limit 0)" if limit == 0 else (
        " among the trials forgetting no more than "
        + ("the preset's own trial" if limit is None else f"--forgetting-limit ({_rise(limit)})"))
    return f"held-out loss and forgetting (general-text loss against the base model's); the pick: the lowest " \
           f"held-out loss{rule}"


def _pruning(settings: Any) -> str:
    if not settings.rungs:
        return "none: a trial this short has no step to be judged at"
    at = " and ".join(map(str, settings.rungs))
    return (f"successive halving: at steps {at} of {settings.steps}, only the best third of the trials that "
            "got there go on, by held-out loss (the preset's trial always does)")


def _check(settings: Any, base: Any) -> str:
    """What follows the trials: the full-length check and its cost, or not."""
    if not settings.confirm:
        return "the pick is written as the preset, unchecked (--no-confirm)"
    if settings.steps >= base.total_steps:
        return ("the pick against the preset's own: trials are whole runs here, so nothing is trained "
                "again; the better is written as the preset")
    runs = 2 * base.total_steps
    return (f"the pick and the preset each trained for a whole run ({base.total_steps} steps; "
            f"{runs:,} steps in all, as much as {runs / settings.steps:.1f} trials; less if known from "
            "before) and compared on the held-out rows; the better is written as the preset (--no-confirm "
            "skips it)")


TRIAL_COLUMNS = ("#", "state", "eval loss", "forgetting", "lr", "r", "alpha/r", "dropout", "warmup", "steps", "time")
# The same columns at 80: shorter headers, so that every value is whole (Rich
# would cut the widest columns short, numbers included, to fit the line).
NARROW_TRIAL_COLUMNS = ("#", "state", "loss", "forgot", "lr", "r", "alpha/r", "drop", "warm", "steps", "time")
FRONT_COLUMNS = ("#", "eval loss", "forgetting", "lr", "r", "alpha/r", "dropout", "warmup", "")
TRIAL_COLOURS = {"complete": "green", "pruned": "yellow", "fail": "red", "running": "cyan", "interrupted": "yellow"}


def trials_table(rows: list[dict[str, Any]]) -> WideOrNarrow:
    """The newest trials, so a long study still fits the screen: a table with a
    note column where each trial fits a line; else (80 columns) one without
    rules or notes, whose values all read whole, and the notes under it."""
    wide = Table(title="Trials")
    for column in (*TRIAL_COLUMNS, "note"):
        wide.add_column(column, no_wrap=column != "note")
    # No padding: the box's blank rule alone parts the columns, or the forgetting column would not fit 80.
    narrow = Table(title="Trials", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True,
                   padding=(0, 0))
    for column in NARROW_TRIAL_COLUMNS:
        narrow.add_column(column, no_wrap=True)
    notes = []
    for r in rows[-30:]:
        note = "; ".join(filter(None, ["the preset's own values" if r.get("preset") else "", r["reason"]]))
        wide.add_row(*_trial_cells(r), escape(note))
        narrow.add_row(*_trial_cells(r))
        if note:  # wrapped at its spaces, under the table
            notes.append(Text.assemble((f"trial {r['trial']}: ", "bold"), note))
    return WideOrNarrow(wide, Group(narrow, *notes))


def _trial_cells(r: dict[str, Any]) -> list[str]:
    """A trial's values, as markup, in the order of TRIAL_COLUMNS."""
    loss = "" if r["eval_loss"] is None else f"{r['eval_loss']:.4f}"
    if r["best"]:
        loss = f"[bold green]{loss}[/]"
    steps = _blank(r["steps"]) + (f"/{r['budget']}" if r.get("budget") and r["steps"] is not None else "")
    # A complete trial that could not measure forgetting says so (`tune_pareto.py`); the others have none yet.
    forgot = _rise(r.get("forgetting")) if r.get("forgetting") is not None else (
        "[dim]unknown[/]" if r["state"] == "complete" else "")
    return [str(r["trial"]), f"[{TRIAL_COLOURS.get(r['state'], 'white')}]{r['state']}[/]", loss, forgot,
            *_param_cells(r), steps, "" if r["seconds"] is None else f"{r['seconds']:.0f}s"]


def _param_cells(params: dict[str, Any]) -> list[str]:
    """A trial's lr, rank, alpha/rank, dropout and warmup, as cells."""
    return ["" if params.get("lr") is None else f"{params['lr']:.2e}", _blank(params.get("lora_r")),
            _blank(params.get("alpha_ratio")), _blank(params.get("lora_dropout")), _blank(params.get("warmup_ratio"))]


def _rise(value: float) -> str:
    """Forgetting as a signed share, as `tune_pareto.rise` shows it: +3.12%, -0.40%."""
    return f"{value:+.2%}"


def _blank(value: Any) -> str:
    return "" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


class TrialsDisplay:
    """A live table of the study's trials, redrawn as trials report, and under it
    a line saying what is going on: a trial's row comes at its first rung, minutes
    after it starts on a CPU, and the line says what fills them (its steps, with an ETA)."""

    def __enter__(self) -> "TrialsDisplay":
        from rich.live import Live

        self.table = Table(title="Trials")
        self.doing: Callable[[float], str] | None = _since("preparing the study", time.monotonic())
        self.live = Live(get_renderable=self.render, console=console, refresh_per_second=4, transient=False)
        self.live.__enter__()
        # Drawn now: Live with a renderable function first draws at its first tick, a quarter
        # second on (later on a busy machine), after a quick study's preparation is over.
        self.live.refresh()
        return self

    def render(self) -> Any:
        """The table, and the line of what is going on (none once the study is over)."""
        if self.doing is None:
            return self.table
        return Group(self.table, Text(self.doing(time.monotonic()), style="cyan"))  # too long: wrapped, the ETA kept

    def update(self, rows: list[dict[str, Any]]) -> None:
        self.table = trials_table(rows)
        self.live.refresh()

    def reporter(self, what: str) -> "TrialReporter":
        """The Reporter of one training run of the study (`what`: "trial 3"), shown on the line under the table."""
        reporter = TrialReporter(what, self.warn, self.live.refresh)
        self.doing = reporter.line
        self.live.refresh()
        return reporter

    def warn(self, text: str) -> None:
        """A trial's warning (Ctrl-C acknowledged, a recovery), above the table."""
        self.live.console.print(f"[yellow]warning:[/] {escape(text)}")

    def say(self, text: str) -> None:
        """How the full-length check goes, above the table."""
        self.live.console.print(escape(text))

    def __exit__(self, *exc: Any) -> None:
        self.doing = None
        self.live.__exit__(*exc)
        console.print()


class TrialReporter:
    """A trial's (or a full-length run's) training as one line: what it is doing
    and for how long, or its steps with an ETA from the first one on. Warnings go
    above the table; the rest of what a run says, the table shows once it reports."""

    def __init__(self, what: str, warn: Callable[[str], None], changed: Callable[[], None]):
        self.what, self.warn, self.changed = what, warn, changed
        self.doing: Callable[[float], str] = _since("starting", time.monotonic())
        self.steps: Countdown | None = None
        self.countdown: Countdown | None = None  # a counted wait within the run, if any

    def line(self, now: float) -> str:
        return f"{self.what}: {self.doing(now)}"

    def message(self, text: str, warning: bool = False) -> None:
        if warning:
            self.warn(text)

    def activity(self, text: str | None) -> None:
        self.countdown = None
        if text is not None:
            self.doing = _since(text, time.monotonic())
        elif self.steps is not None:  # back to training
            self.doing = self.steps.text
        self.changed()

    def count(self, what: str, done: int, total: int) -> None:
        self.countdown = counted(self.countdown, what, done, total, time.monotonic())
        self.doing = self.countdown.text

    def training_started(self, total_steps: int, start_step: int = 0, memory: dict[str, Any] | None = None) -> None:
        self.steps = Countdown("step", total_steps, time.monotonic())
        self.steps.update(start_step, time.monotonic())
        self.doing = self.steps.text
        self.changed()

    def step(self, row: dict[str, Any]) -> None:
        if self.steps is not None:
            # The first step's own time: the wait before it held setting the trial up.
            self.steps.update(row["step"], time.monotonic(), row.get("seconds"))
            self.doing = self.steps.text
            self.changed()

    def evaluated(self, row: dict[str, Any]) -> None:
        pass  # the table shows the eval loss, from `run_study`'s update

    def training_finished(self) -> None:
        self.steps = None  # the steps are over: "finishing" until the table has the row or the next run begins
        self.activity("finishing")


def _since(text: str, started: float) -> Callable[[float], str]:
    """`text` and the time since `started`, for a line that says what a wait is and never stands still."""
    return lambda now: f"{text} {clock(now - started)}"


def show_study_outcome(outcome: Any, data_path: str, model: str | None) -> None:
    counts = outcome.counts()
    elsewhere = f", {counts['running']} running in another process" if counts["running"] else ""
    console.print(f"Study: {len(outcome.rows)} trials in all ({counts['complete']} complete, {counts['pruned']} pruned, "
                  f"{counts['fail']} failed, {counts['interrupted']} interrupted{elsewhere}); "
                  f"{outcome.trials_this_run} ran now.")
    if outcome.stale:
        console.print(f"{outcome.stale} trial(s) left running by a process that ended (killed?) are counted as failed.")
    if outcome.steps_budgeted:
        saved = 1 - outcome.steps_run / outcome.steps_budgeted
        console.print(f"Pruning: {outcome.steps_run:,} of {outcome.steps_budgeted:,} budgeted steps ran "
                      f"({saved:.0%} saved).")
    if outcome.lr_centre is not None:
        console.print(f"Learning rates were searched around lr-find's suggestion, {outcome.lr_centre:.1e}.")
    if outcome.interrupted:
        console.print("[yellow]Interrupted.[/] The study is saved; run the same command again to continue it.")
    if outcome.pick is None:
        console.print("No trial completed yet, so there is no best preset.")
        return
    _show_front(outcome)
    console.print(f"[bold]Pick:[/] {escape(outcome.pick.said)}")
    best = outcome.best_row()
    if best is not None:
        _show_verdict(outcome, best)
    if outcome.best_preset_path is None:
        console.print("Stopped before the full-length check was done, so no preset was written: the same command "
                      "continues the study and checks its best.")
        return
    folder = outcome.best_preset_path.parent
    console.print(f"Wrote {escape(str(outcome.best_preset_path))}, {escape(str(folder / 'trials.csv'))} and "
                  f"{escape(str(folder / 'pareto.json'))}.")
    command = f"llmcustoms train {data_path} --preset {outcome.best_preset_path}" + (f" --model {model}" if model else "")
    console.print("Train with it:")
    console.print("  " + escape(command), soft_wrap=True)  # never broken: it is meant to be copied


def _show_front(outcome: Any) -> None:
    """The Pareto front (`tune_pareto.pareto_front`): no trial is better on both held-out loss and forgetting."""
    front, picked = outcome.front(), outcome.pick.point
    if front:
        table = Table(title="Pareto front: held-out loss against forgetting", box=box.SIMPLE_HEAD, show_edge=False,
                      pad_edge=False)
        for column in FRONT_COLUMNS:
            table.add_column(column, no_wrap=column != "")
        for p in front:
            mark = ", ".join(filter(None, ["picked" if picked is not None and p.trial == picked.trial else "",
                                           "the preset's own values" if p.preset else ""]))
            table.add_row(str(p.trial), f"{p.eval_loss:.4f}", _rise(p.forgetting), *_param_cells(p.params), mark)
        console.print(table)
    unknown = outcome.not_measured()
    if unknown:
        console.print(f"Forgetting was not measured in trial(s) {', '.join(map(str, unknown))}: they are left out "
                      "of the front" + (", and of the pick." if outcome.pick.bound is not None else "."))


def _show_verdict(outcome: Any, best: dict[str, Any]) -> None:
    """Which won, the search's best or the preset, and by how much."""
    check, preset = outcome.confirmation, outcome.preset_row()
    if check is None:
        if preset is not None and not best["preset"]:
            change = best["eval_loss"] / preset["eval_loss"] - 1
            console.print(f"Against the preset's own trial ({preset['trial']}): eval loss {preset['eval_loss']:.4f} -> "
                          f"{best['eval_loss']:.4f} ({change:+.1%}) in {best['budget'] or '?'}-step trials.")
        if not outcome.confirm:
            console.print("Not checked at a whole run's length (--no-confirm).")
        return
    for note in check.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")
    if check.same:
        console.print("[bold]The preset stays:[/] no trial beat the preset's own values.")
    elif check.search_won and check.change is not None:
        console.print(f"[bold green]The search's best lowered validation loss {check.preset:.4f} -> {check.best:.4f} "
                      f"({check.change:+.1%}) vs the preset[/], at full length ({check.steps} steps).")
    elif check.search_won:
        console.print("[bold green]The search's best wins:[/] the preset failed at full length.")
    else:
        versus = "" if check.change is None else f" ({check.best:.4f} vs {check.preset:.4f}, {check.change:+.1%})"
        console.print(f"[bold]The preset stays:[/] the search's best did not beat it at full length{versus}.")
    if check.from_trials:
        console.print("The trials were whole runs, so their own evaluations decided: nothing was trained again.")
    elif check.runs:
        console.print(f"The check trained {check.runs} whole run(s), {check.steps_run:,} steps in "
                      f"{check.seconds:.0f} s.")


class RangeTestDisplay:
    """The range test's progress: a live line with the step count, its ETA from
    the first step on (Rich's own ETA column stays blank while a step takes
    longer than its 30 s window), the last lr and its loss; and a line that
    stays for every step, or every k-th so that at most KEPT_LINES stay (the
    default 100 steps would push the plan off the screen), and the last."""

    KEPT_LINES = 20

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.stride = -(-steps // self.KEPT_LINES)
        self.last = ""  # the last step's lr and loss

    def __enter__(self) -> "RangeTestDisplay":
        from rich.live import Live

        self.countdown = Countdown("step", self.steps, time.monotonic())
        self.live = Live(get_renderable=self.render, console=console, refresh_per_second=4, transient=True)
        self.live.__enter__()
        return self

    def render(self) -> Table:
        from rich.progress_bar import ProgressBar

        line = Table.grid(padding=(0, 1))
        line.add_row("lr-find", ProgressBar(total=max(1, self.steps), completed=self.countdown.done, width=20),
                     self.countdown.text(time.monotonic()) + self.last)
        return line

    def update(self, row: dict[str, Any]) -> None:
        """A step ended: `row` is the curve's, with the step's own `seconds`."""
        self.countdown.update(row["step"], time.monotonic(), row.get("seconds"))
        self.last = f"  lr {row['lr']:.1e}  loss {_loss(row['loss'])}"
        if (row["step"] - 1) % self.stride and row["step"] != self.steps:
            self.live.refresh()
            return
        self.live.console.print(f"step {row['step']}/{self.steps}  lr {row['lr']:.1e}  loss {_loss(row['loss'])}  "
                                f"smoothed {_loss(row['smoothed'])}")
        self.live.refresh()  # the line under it as it is now, not as the last redraw left it

    def __exit__(self, *exc: Any) -> None:
        self.live.__exit__(*exc)


def lr_find_table(rows: list[dict[str, Any]]) -> Table:
    from rich import box

    table = Table(title="Learning-rate range test", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("step", "lr", "loss", "smoothed", ""):
        table.add_column(column, no_wrap=True, justify="right" if column in ("step", "loss", "smoothed") else "left")
    for r in rows:
        table.add_row(str(r["step"]), f"{r['lr']:.1e}", _loss(r["loss"]), _loss(r["smoothed"]),
                      f"[bold green]{r['note']}[/]" if r["note"] == "suggested" else r["note"])
    return table


def _loss(value: float | None) -> str:
    return "not finite" if value is None else f"{value:.4f}"


def show_lr_find(result: Any, rows: list[dict[str, Any]], path: Any, commands: list[str],
                 notes: list[str], shown: str = "") -> None:
    """`lr_find.RangeTestResult`, a few rows of its curve (`shown` says which), where
    it was saved and what to run next."""
    console.print(lr_find_table(rows))
    if shown:
        console.print(f"[dim]Steps in the table: {escape(shown)}.[/]")
    ran = f"{len(result.curve)} of {result.steps} steps, lr {result.start_lr:.0e} to {result.end_lr:.0e}"
    console.print(f"Ran {ran}; " + escape(result.stopped or "reached the last lr") + ".")
    for note in notes:
        console.print(f"[yellow]note:[/] {escape(note)}")
    console.print(f"Wrote {escape(str(path))} (the whole curve).")
    suggestion = result.suggestion
    if suggestion.lr is None:
        return  # the error that follows says why and what to do
    console.print(f"Suggested learning rate: [bold green]{suggestion.lr:.1e}[/] ({escape(suggestion.rule)}).")
    console.print(f"The other common rule, the lr of the minimum ({suggestion.min_loss_lr:.1e}) / 10, "
                  f"gives {suggestion.min_loss_lr_over_10:.1e}.")
    if commands:
        console.print("Next, train with it, or tune around it:")
        for command in commands:
            console.print("  " + escape(command), soft_wrap=True)  # never broken: it is meant to be copied


def show_lr_centre(path: Any, lr: float, ran: bool) -> None:
    """`tune --lr-find`: where the centre of the lr range came from."""
    where = "from the range test just run" if ran else "from the saved range test"
    console.print(f"Learning rate: centring the search on {lr:.1e}, {where} ({escape(str(path))}).")


def show_lr_find_starting(path: Any) -> None:
    console.print(f"No lr-find result for this model and data ({escape(str(path))}): running the range test first.")
