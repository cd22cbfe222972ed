"""The bench's live progress display (rich): one line per phase."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)


class Phase:
    """One line of the live display. Where the console is not a terminal (a log file, CI),
    the live display shows nothing until it stops, so each step is also printed as a plain
    line."""

    def __init__(self, progress: Progress, task: TaskID) -> None:
        self._progress = progress
        self._task = task

    def step(self, note: str = "") -> None:
        self._progress.update(self._task, advance=1, note=note)
        self._log()

    def finish(self, note: str = "") -> None:
        total = self._progress.tasks[self._task].total
        self._progress.update(
            self._task, completed=total if total is not None else 1, total=total or 1, note=note
        )
        self._log()

    def _log(self) -> None:
        console = self._progress.console
        if console.is_terminal:
            return
        t = self._progress.tasks[self._task]
        total = "?" if t.total is None else f"{t.total:g}"
        note = t.fields.get("note", "")
        console.print(
            f"{t.description} {t.completed:g}/{total} {t.elapsed or 0:.0f} s {note}".rstrip(),
            highlight=False,
            markup=False,
        )


class LiveProgress:
    """The bench's live progress display (rich), one line per phase."""

    def __init__(self, console: Console) -> None:
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description:<28}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("[dim]{task.fields[note]}"),
            console=console,
        )

    def __enter__(self) -> LiveProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    @contextmanager
    def phase(self, description: str, total: int | None) -> Iterator[Phase]:
        task = self.progress.add_task(description, total=total, note="")
        p = Phase(self.progress, task)
        yield p
        p.finish(self.progress.tasks[task].fields.get("note", ""))
