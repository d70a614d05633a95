"""The run directory: made writable and locked by one run at a time, before any model loads, and resolved to one
absolute path that every actor of the run uses.

Two runs in one directory would overwrite each other's checkpoints and write two MLflow runs into one store, so
a run holds an exclusive `flock` on `RUN_DIR/.lock` for as long as its process lives. The kernel drops the lock
when the process exits, however it exits, so a killed run never leaves a stale lock behind.

On a Ray cluster every worker has a working directory of its own (on another node, its own copy of the job's),
so a relative run dir resolved inside an actor names another directory than the one the driver locked: the
learner's checkpoints would land where no resume looks. `for_actors` resolves it once, in the driver.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from opd.errors import OpdError
from opd.outputs import blocked
from opd.spec import ExperimentSpec
from opd.spec.resolve import absolute_inputs
from opd.tracking import sqlite_path

LOCK_FILE = ".lock"


class RunDirLock:
    """An exclusive lock on a run directory; `release()` (or leaving the `with` block) gives it up."""

    def __init__(self, run_dir: Path, field: str = "tracking.run_dir") -> None:
        """`field` is what the user sets to name the directory (`opd reproduce` locks its `out_dir`)."""
        self.run_dir = Path(run_dir)
        path = self.run_dir / LOCK_FILE
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OpdError(unwritable(self.run_dir, exc.strerror or str(exc), field)) from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise OpdError(f"{field}: {self.run_dir} is in use by another run ({holder}); wait for it to "
                           f"end, or set another {field}") from None
        try:  # who holds it, for the refusal above; also proves the directory takes writes
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        except OSError as exc:
            self.release()
            raise OpdError(unwritable(self.run_dir, exc.strerror or str(exc), field)) from None

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = -1

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def unwritable(run_dir: Path, why: str, field: str = "tracking.run_dir") -> str:
    return f"{field}: {run_dir} is not writable ({why}); expected a writable directory"


def writable_problem(run_dir: Path) -> str | None:
    """Why `run_dir` could not be created or written (found without creating it), or None; for `opd validate`."""
    why = blocked(run_dir)
    return unwritable(run_dir, why) if why else None


def lock_holder(run_dir: str | Path) -> str | None:
    """What the lock file of `run_dir` says (`pid N on host`), or None without one: read on another node (where
    `run_dir` arrives as a str), it shows whether that node sees the driver's directory."""
    try:
        return (Path(run_dir) / LOCK_FILE).read_text(errors="replace").strip() or None
    except OSError:
        return None


def for_actors(spec: ExperimentSpec, *, nodes: int = 1, learner_elsewhere: bool = False,
               tracked: bool = True, working_dir: bool = False) -> ExperimentSpec:
    """The spec the driver hands every actor: `tracking.run_dir` as the absolute path it names here, and the MLflow
    URI fixed here too (a sqlite default is a path as well). With `nodes` > 1 alive Ray nodes a relative run dir is
    refused; with the learner on another node than this driver (`learner_elsewhere`), so is a tracked run's sqlite
    store: the driver and the learner would write one sqlite file from two hosts, which its locking does not
    survive on network storage. An MLflow server is then the one process that writes the store. On several
    nodes every relative input path is resolved here too (`absolute_inputs`), unless the job ships a working
    directory (`ray job submit --working-dir`), which every node's actors run in, relative paths and all."""
    if nodes > 1 and not Path(spec.tracking.run_dir).is_absolute():
        raise OpdError(f"tracking.run_dir: {spec.tracking.run_dir!r} is relative, but the Ray cluster has {nodes} "
                       f"nodes, each with its own working directory; expected an absolute path on storage every "
                       f"node mounts (e.g. /mnt/runs/{{name}})")
    uri = spec.tracking_uri
    if tracked and learner_elsewhere and (db := sqlite_path(uri)):
        raise OpdError(f"tracking.uri: the sqlite store {db} would be written from two hosts (this driver and the "
                       f"learner's node); expected an MLflow server URI (tracking.uri=http://HOST:5000 or "
                       f"OPD_TRACKING_URI, see cluster/mlflow.yaml)")
    if nodes > 1 and not working_dir:
        spec = absolute_inputs(spec)
    run_dir = str(Path(os.path.abspath(spec.run_dir))).replace("{", "{{").replace("}", "}}")
    return spec.model_copy(update={"tracking": spec.tracking.model_copy(update={"run_dir": run_dir, "uri": uri})})


def unseen_input(field: str, path: str, node: str) -> str:
    """The one line for an input this driver sees that node `node` does not, where its actors would read it."""
    return (f"{field}: {path} is not there on node {node[:12]} (a relative path is resolved where `opd` runs; "
            "expected a path on storage every node mounts, or `ray job submit --working-dir .` to ship it)")
