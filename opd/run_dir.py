"""The run directory: made writable and locked by one run at a time, before any model loads.

Two runs in one directory would overwrite each other's checkpoints and write two MLflow runs into one store, so
a run holds an exclusive `flock` on `RUN_DIR/.lock` for as long as its process lives. The kernel drops the lock
when the process exits, however it exits, so a killed run never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from opd.errors import OpdError

LOCK_FILE = ".lock"


class RunDirLock:
    """An exclusive lock on a run directory; `release()` (or leaving the `with` block) gives it up."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        path = self.run_dir / LOCK_FILE
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OpdError(unwritable(self.run_dir, exc.strerror or str(exc))) from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise OpdError(f"tracking.run_dir: {self.run_dir} is in use by another run ({holder}); wait for it to "
                           f"end, or set another tracking.run_dir") from None
        try:  # who holds it, for the refusal above; also proves the directory takes writes
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        except OSError as exc:
            self.release()
            raise OpdError(unwritable(self.run_dir, exc.strerror or str(exc))) from None

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = -1

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def unwritable(run_dir: Path, why: str) -> str:
    return f"tracking.run_dir: {run_dir} is not writable ({why}); expected a writable directory"


def writable_problem(run_dir: Path) -> str | None:
    """Why `run_dir` could not be created or written (found without creating it), or None; for `opd validate`."""
    existing = Path(run_dir).absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return unwritable(run_dir, f"{existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        return unwritable(run_dir, f"{existing} does not allow writes")
    return None
