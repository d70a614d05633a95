"""One progress-bar style for every long command."""

from __future__ import annotations

import os

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def progress_bar(*extra_columns) -> Progress:
    """A rich progress bar: description, bar, n/total, elapsed, remaining, plus any extra columns.

    OPD_PROGRESS=0 hides it: worker processes (`opd reproduce`) leave the terminal to the parent's bar."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), *extra_columns,
                    TimeElapsedColumn(), TimeRemainingColumn(), disable=os.environ.get("OPD_PROGRESS") == "0")
