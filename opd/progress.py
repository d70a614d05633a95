"""One progress-bar style for every long command."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def progress_bar(*extra_columns) -> Progress:
    """A rich progress bar: description, bar, n/total, elapsed, remaining, plus any extra columns."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), *extra_columns,
                    TimeElapsedColumn(), TimeRemainingColumn())
