"""MLflow tracking: one run per experiment, params = the flattened spec, resumed runs continue the same run.

Only the driver/learner writes; the default store is sqlite inside the run directory. Everything goes through
an explicit run id (MlflowClient), never MLflow's "active run": that is per thread, and a Ray actor may serve
its calls from several threads, which would silently open a second run.

The record must be truthful: a sqlite store is built under a temporary name and renamed into place (MLflow
creates its 65 tables one migration at a time, so an interrupted creation used to leave a file that every rerun
then failed on); artifacts go beside the store, not into `./mlruns` of whatever the working directory is; a run
ends FINISHED, FAILED or KILLED; and steps replayed after a resume are not logged a second time.

Building those tables takes seconds, every new run directory. So the first store built at a schema revision is kept,
empty, in the user's cache (`template_path`), and later stores start as a copy of it: the same MLflow, the same
migrations, only not run again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from opd.spec import ExperimentSpec, flatten

_BATCH = 100  # MLflow's limit of params or metrics per log_batch call
# What MLflow and alembic print while they create tables: noise in a run's output.
_CHATTY = ("alembic", "mlflow.store.db.utils", "mlflow.store.tracking.sqlalchemy_store")


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///` URI; None for any other store (a server decides for itself)."""
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def artifact_root(uri: str) -> str | None:
    """Where a file-backed store keeps artifacts: an `artifacts/` folder beside the database, so they live in the
    run directory (under `ray job submit` the working directory is a temporary package copy)."""
    path = sqlite_path(uri)
    return (path.parent.resolve() / "artifacts").as_uri() if path else None


@contextmanager
def _quiet() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _CHATTY]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def ensure_store(uri: str) -> None:
    """Create a sqlite store atomically: built as a temporary file, then renamed into place. A store whose schema
    is not MLflow's head and that holds no run (what an interrupted creation left before this existed) is
    rebuilt the same way; a store with runs is never touched."""
    path = sqlite_path(uri)
    if path is None or (path.exists() and (_revision(path) == _head_revision() or _has_runs(path))):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.creating")  # one name: a creation killed before is replaced, not piled up
    tmp.unlink(missing_ok=True)
    template = template_path(_head_revision())
    if _revision(template) == _head_revision() and not _has_runs(template):
        shutil.copyfile(template, tmp)
        _adopt(tmp, uri)
    else:
        _build(tmp, uri)
        _keep_as_template(tmp, template)
    os.replace(tmp, path)


def template_path(revision: str) -> Path:
    """Where the empty store of schema `revision` is kept: $OPD_CACHE_DIR, else the user's cache directory."""
    root = os.environ.get("OPD_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "opd"
    return Path(root) / f"mlflow-{revision}.db"


def _build(tmp: Path, uri: str) -> None:
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    with _quiet():
        store = SqlAlchemyStore(f"sqlite:///{tmp}", artifact_root(uri))
    store.engine.dispose()


def _adopt(tmp: Path, uri: str) -> None:
    """Point the copied store's Default experiment (MLflow creates it with the store) at this store's artifacts
    and give it this store's creation time, as building it here would have."""
    now = int(time.time() * 1000)
    with sqlite3.connect(tmp) as db:
        db.execute("UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? "
                   "WHERE experiment_id = 0", (f"{artifact_root(uri)}/0", now, now))
    db.close()


def _keep_as_template(store: Path, template: Path) -> None:
    """Copy a freshly built store to the cache, atomically; a cache that cannot be written is only slower."""
    partial = template.with_name(f".{template.name}.{os.getpid()}")
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(store, partial)
        os.replace(partial, template)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)


def _head_revision() -> str:
    from mlflow.store.db.utils import _get_latest_schema_revision

    return _get_latest_schema_revision()


def _query(path: Path, sql: str) -> list[tuple]:
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            return db.execute(sql).fetchall()
    except sqlite3.Error:
        return []


def _revision(path: Path) -> str | None:
    rows = _query(path, "SELECT version_num FROM alembic_version")
    return rows[0][0] if rows else None


def _has_runs(path: Path) -> bool:
    return bool(_query(path, "SELECT 1 FROM runs LIMIT 1"))


def run_status(exc: BaseException | None) -> str:
    """The MLflow status of a run that ended with `exc` (None: it ended normally)."""
    if exc is None:
        return "FINISHED"
    return "KILLED" if isinstance(exc, KeyboardInterrupt | SystemExit) else "FAILED"


class Tracker:
    """One MLflow run. With `run_id` it continues that run: `resume` (a restarted learner) marks it RUNNING again;
    without, it only adds to it (the main job's before/after table)."""

    def __init__(self, spec: ExperimentSpec, run_id: str | None = None, *, resume: bool = True) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        spec.run_dir.mkdir(parents=True, exist_ok=True)
        ensure_store(spec.tracking_uri)
        self.client = MlflowClient(tracking_uri=spec.tracking_uri)
        self.last_step: dict[str, int] = {}  # metric -> last step logged, so replayed steps are skipped
        if run_id is None:
            experiment = self.client.get_experiment_by_name(spec.tracking.experiment)
            experiment_id = (experiment.experiment_id if experiment else self.client.create_experiment(
                spec.tracking.experiment, artifact_location=artifact_root(spec.tracking_uri)))
            run_id = self.client.create_run(experiment_id, run_name=spec.name).info.run_id
            params = [Param(k, v) for k, v in flatten(spec).items()]
            for i in range(0, len(params), _BATCH):
                self.client.log_batch(run_id, params=params[i : i + _BATCH])
            self.client.log_text(run_id, spec.to_yaml(), "spec.yaml")
        else:
            # each metric's latest point, step included, in one call (a metric's full history could be long)
            self.last_step = {m.key: m.step for m in self.client.get_run(run_id).data._metric_objs}
            if resume:
                self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log `metrics` at `step`, except those already logged at this step or later (a resumed run replays the
        steps after its last checkpoint)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(k, float(v), now, step) for k, v in metrics.items() if step > self.last_step.get(k, -1)]
        self.last_step.update({m.key: step for m in rows})
        for i in range(0, len(rows), _BATCH):
            self.client.log_batch(self.run_id, metrics=rows[i : i + _BATCH])

    def artifact(self, path: str | Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self, status: str = "FINISHED") -> None:
        """End the run as FINISHED, FAILED or KILLED (see `run_status`)."""
        self.client.set_terminated(self.run_id, status)


def end_run(spec: ExperimentSpec, run_id: str | None, status: str) -> None:
    """Mark `run_id` ended from outside the learner (the driver, when the learner died and cannot close it)."""
    if run_id is not None:
        from mlflow import MlflowClient

        MlflowClient(tracking_uri=spec.tracking_uri).set_terminated(run_id, status)
