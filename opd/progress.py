"""One progress-bar style for every long command, and the console every table is printed on."""

from __future__ import annotations

import os

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def progress_bar(*extra_columns) -> Progress:
    """A rich progress bar: description, bar, n/total, elapsed, remaining, plus any extra columns.

    OPD_PROGRESS=0 hides it: worker processes (`opd reproduce`) leave the terminal to the parent's bar."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), *extra_columns,
                    TimeElapsedColumn(), TimeRemainingColumn(), disable=os.environ.get("OPD_PROGRESS") == "0")


PIPED_WIDTH = 200  # a table written to a pipe or file: wide enough that no column of ours is cut or wrapped


def table_console() -> Console:
    """The terminal's width on a terminal; on a pipe or a file (where rich assumes 80 columns and cuts a wide
    table's cells) PIPED_WIDTH, unless COLUMNS says otherwise."""
    piped = not os.isatty(1) and "COLUMNS" not in os.environ
    return Console(width=PIPED_WIDTH) if piped else Console()
