"""Where commands write: output paths checked before any compute, files and directories written atomically.

A result path found unusable after an hour of decoding or training costs that hour, so every command checks
its output paths before it loads a model. Results and drafters are written under a temporary name beside their
place and renamed into it (`os.replace`, atomic on one filesystem), so a crash mid-write never leaves a half
file that a reader, a resume or `opd reproduce` would take for a whole one.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from opd.errors import OpdError


def blocked(path: str | Path) -> str | None:
    """Why directory `path` could not be created or written (found without creating anything), or None."""
    existing = Path(path).absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} does not allow writes"
    return None


def check_output_file(path: str | Path, field: str, holds: str) -> None:
    """Refuse `path` as a file to write `holds` into: a directory, or under one that cannot be made or written."""
    if Path(path).is_dir():
        raise OpdError(f"{field}: {path} is a directory (expected a file path for {holds})")
    if why := blocked(Path(path).absolute().parent):
        raise OpdError(f"{field}: {path} cannot be written ({why}; expected a file path for {holds})")


def check_output_dir(path: str | Path, field: str, holds: str) -> None:
    """Refuse `path` as a directory to write `holds` into: an existing file, or a path that cannot be written."""
    if Path(path).exists() and not Path(path).is_dir():
        raise OpdError(f"{field}: {path} is a file (expected a directory for {holds})")
    if why := blocked(path):
        raise OpdError(f"{field}: {path} cannot be written ({why}; expected a directory for {holds})")


def _temporary(path: Path) -> Path:
    """A name beside `path` of this writer's own: two writers never share one."""
    return path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` whole or not at all (its directory is created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """A temporary directory path beside `path` for the writer to create and fill (as `save_pretrained` does); on
    success it replaces `path` whole (a directory there is set aside until the new one is in place), on failure it
    is removed and `path` is untouched."""
    path = Path(path)
    tmp, old = _temporary(path), path.with_name(f"{_temporary(path).name}-old")
    for leftover in (tmp, old):  # what a killed writer of this name left
        shutil.rmtree(leftover, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield tmp
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    finally:
        if old.exists() and not path.exists():  # the new one never landed: the old one goes back
            os.replace(old, path)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
