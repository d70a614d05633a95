"""How a command `opd` prints for the user to run next is spelled: copied as printed into a shell, it runs.

A printed command names this environment's console scripts as the shell will find them (`make run` does not
activate the venv), and quotes every argument the shell would split or expand.
"""

from __future__ import annotations

import contextlib
import shlex
import shutil
import sys
from pathlib import Path


def command(name: str) -> str:
    """How to call this environment's console script `name` from here: bare when the shell finds this very one,
    else its path."""
    path = Path(sys.executable).with_name(name)
    if not path.exists() or shutil.which(name) == str(path):
        return name
    with contextlib.suppress(ValueError):
        return str(path.relative_to(Path.cwd()))
    return str(path)


def shell_line(script: str, *args: str) -> str:
    """One command line: this environment's `script`, then `args` quoted for the shell."""
    return shlex.join([command(script), *args])
