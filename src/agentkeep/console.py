"""Terminal output of the ``agentkeep`` command: aligned tables and progress bars.

With the ``agentkeep[cli]`` extra installed (``rich``), tables and progress
bars are drawn by rich; without it, a plain fallback prints the same tables as
space-aligned columns and the progress as one updating line. Either way:

* :func:`print_table` writes to the given stream; the plain form is also what
  rich is asked for when the stream is not a terminal (stable output for
  scripts that do not use ``--json``).
* :class:`Progress` draws only when its stream is a terminal and it is
  enabled; piped (or ``--json``) it prints nothing.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, TextIO

__all__ = ["Progress", "format_ms", "have_rich", "print_table", "render_plain_table"]


def _rich() -> ModuleType | None:
    """The ``rich`` package, or None when it is not installed (or hidden by a test)."""
    try:
        return importlib.import_module("rich")
    except ImportError:
        return None


def have_rich() -> bool:
    """True when the ``agentkeep[cli]`` extra (rich) is importable."""
    return _rich() is not None


def format_ms(ms: int | None) -> str:
    """Epoch milliseconds as an ISO-8601 UTC time (``-`` for None or 0)."""
    if not ms:
        return "-"
    import datetime as _dt

    moment = _dt.datetime.fromtimestamp(ms / 1000, tz=_dt.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def render_plain_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """The table as lines of space-aligned columns (no trailing spaces)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, text in enumerate(row):
            widths[i] = max(widths[i], len(text))
    lines = []
    for row in [list(headers), *cells]:
        lines.append("  ".join(t.ljust(w) for t, w in zip(row, widths, strict=True)).rstrip())
    return lines


def print_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    title: str | None = None,
    stream: TextIO | None = None,
) -> None:
    """Print an aligned table (rich's on a terminal when installed, else plain).

    A titled table without rows prints its title alone.
    """
    out = stream if stream is not None else sys.stdout
    if title and not rows:
        print(title, file=out)
        return
    rich = _rich()
    if rich is not None and _is_tty(out):
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, title_justify="left")
        for header in headers:
            table.add_column(header)
        for row in rows:
            table.add_row(*(_cell(v) for v in row))
        Console(file=out).print(table)
        return
    if title:
        print(title, file=out)
    for line in render_plain_table(headers, rows):
        print(line, file=out)


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class Progress:
    """A progress bar on a terminal; silent when piped or disabled.

    Use as ``progress.update(phase, done, total)`` (``total`` None when not
    known yet), inside ``with Progress(enabled=...) as progress``.
    """

    def __init__(self, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self.active = enabled and _is_tty(self._stream)
        self._rich: Any = None
        self._tasks: dict[str, Any] = {}
        self._last = ""

    def __enter__(self) -> Progress:
        if self.active and _rich() is not None:
            from rich.console import Console
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(console=Console(file=self._stream), transient=True)
            self._rich.start()
        return self

    def update(self, phase: str, done: int, total: int | None) -> None:
        """Show ``done`` of ``total`` for ``phase``."""
        if not self.active:
            return
        if self._rich is not None:
            task = self._tasks.get(phase)
            if task is None:
                task = self._tasks[phase] = self._rich.add_task(phase, total=total)
            self._rich.update(task, completed=done, total=total)
            return
        if total:
            width = 30
            filled = int(width * min(done, total) / total)
            line = f"{phase} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}"
        else:
            line = f"{phase} {done}"
        self._stream.write("\r" + line.ljust(len(self._last)))
        self._stream.flush()
        self._last = line

    def __exit__(self, *exc: object) -> None:
        if self._rich is not None:
            self._rich.stop()
        elif self.active and self._last:
            self._stream.write("\r" + " " * len(self._last) + "\r")
            self._stream.flush()
