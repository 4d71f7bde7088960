"""Pieces of layout the UI modules share, so that what they show reads whole
at any width (80 columns included): `Parts`, a line broken only between its
parts, and `WideOrNarrow`, a layout chosen by the width it is drawn at.
"""

from __future__ import annotations

from typing import Iterable

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.measure import Measurement
from rich.text import Text


class Parts:
    """Short texts on a line, `sep` apart, the line broken only between two of
    them when the width runs out: Rich breaks at any space, which tears a value
    from its label ("eval" / "1.3012 @30"). A part wider than the whole line is
    left to Rich's wrapping. Strings are plain text; a `Text` keeps its styles."""

    def __init__(self, parts: Iterable[str | Text], sep: str = "  ", style: str = "", indent: int = 0):
        self.parts = [Text(p) if isinstance(p, str) else p for p in parts if p]
        self.sep, self.style, self.indent = sep, style, indent

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        widest = max((part.cell_len for part in self.parts), default=0)
        return Measurement(self.indent + widest, self.indent + self._line(self.parts, "").cell_len)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        line: list[Text] = []
        for part in self.parts:
            if line and self._line([*line, part], self.sep.rstrip()).cell_len > options.max_width:
                yield self._line(line, self.sep.rstrip())  # the separator's mark (a comma) ends the line
                line = []
            line.append(part)
        if line:
            yield self._line(line, "")

    def _line(self, parts: list[Text], end: str) -> Text:
        line = Text(" " * self.indent, style=self.style)
        line.append_text(Text(self.sep).join(parts))
        return line.append(end)


class WideOrNarrow:
    """`wide` where the width it is drawn at holds it at its natural width (a
    table then keeps each row to a line, nothing folded or cut), else `narrow`.
    Chosen as it is drawn, so a live display follows its terminal."""

    def __init__(self, wide: RenderableType, narrow: RenderableType):
        self.wide, self.narrow = wide, narrow

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        # Measured with a column to spare: a measurement never exceeds the width it is given.
        natural = Measurement.get(console, options.update_width(options.max_width + 1), self.wide).maximum
        yield self.wide if natural <= options.max_width else self.narrow
