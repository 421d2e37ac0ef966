"""The progress bar that tuning shows (the command line's layer loop, ``optimize``'s), in one place.

    >>> with tuning_bar("tuning", 2, disable=True) as (bar, task):
    ...     bar.advance(task)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from .settings import settings


@contextlib.contextmanager
def tuning_bar(description: str, total: int, console: Console | None = None, disable: bool = False,
               transient: bool = False) -> Iterator[tuple[Progress, TaskID]]:
    """A rich progress bar of ``total`` steps on ``console`` (stderr by default) and its task; silent where
    ``disable`` or ``settings.progress`` is off."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console or Console(stderr=True), transient=transient,
                  disable=disable or not settings.progress) as bar:
        yield bar, bar.add_task(description, total=total)
