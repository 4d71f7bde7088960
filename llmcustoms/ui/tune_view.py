"""What `tune` and `lr-find` show: the search space, the live table of trials,
the study's outcome, the range test's progress and its curve.

A UI module beside `ui/console.py` (whose `console` it prints to): Rich may be
imported here. It computes nothing; `commands/tune.py` and `commands/lr_find.py` hand it what
to show.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from llmcustoms.ui.console import console, escape


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
    table.add_row("pruning", _pruning(settings))
    table.add_row("trials", f"{settings.trials} now, sampler {settings.sampler}"
                            + (f", timeout {settings.timeout:g} s" if settings.timeout else ""))
    table.add_row("then", _check(settings, base))
    table.add_row("stored in", escape(settings.where))  # without the URL's password
    console.print(table)


def _pruning(settings: Any) -> str:
    if not settings.rungs:
        return "none: a trial this short has no step to be judged at"
    at = " and ".join(map(str, settings.rungs))
    return (f"successive halving: at steps {at} of {settings.steps}, only the best third of the trials that "
            "got there go on (the preset's trial always does)")


def _check(settings: Any, base: Any) -> str:
    """What follows the trials: the full-length check and its cost, or not."""
    if not settings.confirm:
        return "the best trial is written as the preset, unchecked (--no-confirm)"
    if settings.steps >= base.total_steps:
        return ("the best trial against the preset's own: trials are whole runs here, so nothing is trained "
                "again; the better is written as the preset")
    runs = 2 * base.total_steps
    return (f"the best trial and the preset each trained for a whole run ({base.total_steps} steps; "
            f"{runs:,} steps in all, as much as {runs / settings.steps:.1f} trials; less if known from "
            "before) and compared on the held-out rows; the better is written as the preset (--no-confirm "
            "skips it)")


def trials_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Trials")
    for column in ("#", "state", "eval loss", "lr", "r", "alpha/r", "dropout", "warmup", "steps", "time", "note"):
        table.add_column(column, no_wrap=column != "note")
    colours = {"complete": "green", "pruned": "yellow", "fail": "red", "running": "cyan", "interrupted": "yellow"}
    for r in rows[-30:]:  # the newest, so a long study still fits the screen
        loss = "" if r["eval_loss"] is None else f"{r['eval_loss']:.4f}"
        if r["best"]:
            loss = f"[bold green]{loss}[/]"
        steps = _blank(r["steps"]) + (f"/{r['budget']}" if r.get("budget") and r["steps"] is not None else "")
        note = "; ".join(filter(None, ["the preset's own values" if r.get("preset") else "", r["reason"]]))
        table.add_row(str(r["trial"]), f"[{colours.get(r['state'], 'white')}]{r['state']}[/]", loss,
                      "" if r["lr"] is None else f"{r['lr']:.2e}", _blank(r["lora_r"]), _blank(r["alpha_ratio"]),
                      _blank(r["lora_dropout"]), _blank(r["warmup_ratio"]), steps,
                      "" if r["seconds"] is None else f"{r['seconds']:.0f}s", escape(note))
    return table


def _blank(value: Any) -> str:
    return "" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


class TrialsDisplay:
    """A live table of the study's trials, redrawn as trials report."""

    def __enter__(self) -> "TrialsDisplay":
        from rich.live import Live

        self.live = Live(Table(title="Trials"), console=console, refresh_per_second=4, transient=False)
        self.live.__enter__()
        return self

    def update(self, rows: list[dict[str, Any]]) -> None:
        self.live.update(trials_table(rows))

    def warn(self, text: str) -> None:
        """A trial's warning (Ctrl-C acknowledged, a recovery), above the table."""
        self.live.console.print(f"[yellow]warning:[/] {escape(text)}")

    def say(self, text: str) -> None:
        """How the full-length check goes, above the table."""
        self.live.console.print(escape(text))

    def __exit__(self, *exc: Any) -> None:
        self.live.__exit__(*exc)
        console.print()


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
    best = outcome.best_row()
    if best is None:
        console.print("No trial completed yet, so there is no best preset.")
        return
    console.print(f"Best trial: {best['trial']}, eval loss {best['eval_loss']:.4f} (lr {best['lr']:.2e}"
                  + (f", r {best['lora_r']}, alpha/r {best['alpha_ratio']:g}, dropout {best['lora_dropout']:g}"
                     if best["lora_r"] is not None else "") + f", warmup {best['warmup_ratio']:g}).")
    _show_verdict(outcome, best)
    if outcome.best_preset_path is None:
        console.print("Stopped before the full-length check was done, so no preset was written: the same command "
                      "continues the study and checks its best.")
        return
    console.print(f"Wrote {escape(str(outcome.best_preset_path))} and "
                  f"{escape(str(outcome.best_preset_path.parent / 'trials.csv'))}.")
    command = f"llmcustoms train {data_path} --preset {outcome.best_preset_path}" + (f" --model {model}" if model else "")
    console.print("Train with it:")
    console.print("  " + escape(command), soft_wrap=True)  # never broken: it is meant to be copied


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
    """The range test's progress: steps, the lr of the last one and its loss."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __enter__(self) -> "RangeTestDisplay":
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("lr-find"), BarColumn(bar_width=20), MofNCompleteColumn(),
                                 TextColumn("lr {task.fields[lr]}"), TextColumn("loss [cyan]{task.fields[loss]}"),
                                 TextColumn("eta"), TimeRemainingColumn(), console=console, transient=True)
        self.progress.__enter__()
        self.task = self.progress.add_task("lr-find", total=self.steps, lr="-", loss="-")
        return self

    def update(self, row: dict[str, Any]) -> None:
        loss = "not finite" if row["loss"] is None else f"{row['loss']:.4f}"
        self.progress.update(self.task, completed=row["step"], lr=f"{row['lr']:.1e}", loss=loss)

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)


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
                 notes: list[str]) -> None:
    """`lr_find.RangeTestResult`, a few rows of its curve, where it was saved and what to run next."""
    console.print(lr_find_table(rows))
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
