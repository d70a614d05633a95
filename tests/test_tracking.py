"""MLflow tracking writes to one run by id, whichever thread logs (Ray actors serve calls from several)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from opd.spec import load_spec
from opd.tracking import Tracker, _head_revision, ensure_store, template_path


def test_logging_from_another_thread_stays_in_the_same_run(micro_spec_file):
    spec = load_spec(micro_spec_file)
    tracker = Tracker(spec)
    worker = threading.Thread(target=tracker.log, args=({"loss": 1.5}, 1))
    worker.start()
    worker.join()
    tracker.log({"loss": 1.0}, 2)
    resumed = Tracker(spec, tracker.run_id)  # a restarted learner continues the same run
    resumed.log({"loss": 0.5}, 3)
    resumed.close()
    mlflow.set_tracking_uri(spec.tracking_uri)
    runs = mlflow.search_runs(experiment_names=[spec.tracking.experiment])
    assert len(runs) == 1 and runs.iloc[0]["params.optim.lr"] == "0.001"
    history = mlflow.MlflowClient().get_metric_history(tracker.run_id, "loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(1, 1.5), (2, 1.0), (3, 0.5)]


# A child that creates the store and stops mid-creation until killed: after the migration that adds the MCP
# tables has created `mcp_servers`, before it is recorded as applied (where the Ctrl-C landed).
CREATE_AND_STALL = """
import sys, time
from sqlalchemy import event
from sqlalchemy.engine import Engine


@event.listens_for(Engine, "before_cursor_execute")
def stall(conn, cursor, statement, *args):
    if statement.lstrip().startswith("CREATE TABLE mcp_server_versions"):
        print("creating", flush=True)
        time.sleep(600)


from opd.spec import load_spec
from opd.tracking import Tracker

spec = load_spec(sys.argv[1])
if sys.argv[2] == "tracker":
    Tracker(spec)
else:  # as MLflow itself creates a store, and this project did before it built stores atomically
    from mlflow import MlflowClient

    MlflowClient(spec.tracking_uri).search_experiments()
"""


@pytest.mark.slow  # a child process that imports MLflow and is killed mid-creation: 8-16 s each on a shared CPU
@pytest.mark.parametrize("creator", ["tracker", "mlflow"])
def test_a_store_killed_mid_creation_does_not_break_the_rerun(micro_spec_file, creator, tmp_path):
    """Issue 16, item 4: MLflow builds its tables one migration at a time; killed in between, it left a half-built
    mlflow.db that every rerun died on (`table mcp_servers already exists`). Now a store is built under another
    name and renamed into place, and a half-built one left by MLflow itself (it holds no run) is rebuilt."""
    spec = load_spec(micro_spec_file)
    empty_cache = {**os.environ, "OPD_CACHE_DIR": str(tmp_path / "cache")}  # so the child builds, not copies
    child = subprocess.Popen([sys.executable, "-c", CREATE_AND_STALL, str(micro_spec_file), creator],
                             stdout=subprocess.PIPE, text=True, env=empty_cache)
    try:
        assert child.stdout.readline() == "creating\n"
    finally:
        child.kill()
        child.wait()
    tracker = Tracker(spec)
    tracker.log({"loss": 1.0}, 1)
    tracker.close()
    assert MlflowClient(spec.tracking_uri).get_run(tracker.run_id).info.status == "FINISHED"
    assert sorted(p.name for p in spec.run_dir.iterdir()) == ["artifacts", "mlflow.db"]  # no temporary left over


def test_artifacts_go_under_the_run_directory_not_the_working_directory(micro_spec_file, tmp_path, monkeypatch):
    """Under `ray job submit` the working directory is Ray's temporary copy of the package."""
    spec = load_spec(micro_spec_file)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    tracker = Tracker(spec)
    (tmp_path / "table.txt").write_text("τ 4.2\n")
    tracker.artifact(tmp_path / "table.txt")
    tracker.close()
    stored = sorted(p.relative_to(spec.run_dir).as_posix() for p in spec.run_dir.rglob("*.txt"))
    assert stored == [f"artifacts/{tracker.run_id}/artifacts/table.txt"]
    assert list(Path.cwd().iterdir()) == []  # no ./mlruns


def test_steps_replayed_after_a_resume_are_not_logged_twice(micro_spec_file):
    spec = load_spec(micro_spec_file)
    crashed = Tracker(spec)
    for step in (1, 2, 3):  # the checkpoint was at step 1; steps 2 and 3 were logged, then the learner died
        crashed.log({"loss": 1.0 / step}, step)
    resumed = Tracker(spec, crashed.run_id)
    for step in (2, 3, 4):
        resumed.log({"loss": 1.0 / step, "tau": 4.0}, step)
    history = MlflowClient(spec.tracking_uri).get_metric_history(crashed.run_id, "loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]
    assert [m.step for m in MlflowClient(spec.tracking_uri).get_metric_history(crashed.run_id, "tau")] == [2, 3, 4]


@pytest.mark.parametrize("error, status, code", [(RuntimeError("boom"), "FAILED", None),
                                                 (KeyboardInterrupt(), "KILLED", 130)])
def test_a_failed_or_interrupted_run_is_not_marked_finished(micro_spec_file, monkeypatch, error, status, code):
    from opd.cli import main
    from opd.train.local import LocalTrainer

    def fail(self):
        raise error

    monkeypatch.setattr(LocalTrainer, "train_step", fail)
    args = ["train", str(micro_spec_file), "--set", "eval.num_prompts=1"]
    if code is None:
        with pytest.raises(type(error)):
            main(args)
    else:
        assert main(args) == code
    spec = load_spec(micro_spec_file)
    runs = MlflowClient(spec.tracking_uri).search_runs([MlflowClient(spec.tracking_uri).get_experiment_by_name(
        spec.tracking.experiment).experiment_id])
    assert [r.info.status for r in runs] == [status]


def _dump(path: Path) -> list[str]:
    with sqlite3.connect(path) as db:
        return list(db.iterdump())


def test_a_new_store_is_a_copy_of_the_cached_empty_one_as_mlflow_builds_it(tmp_path, monkeypatch):
    """The first store built at MLflow's schema revision is kept in the cache; the next is copied from it, without
    running a migration, and equals the one MLflow built but for its Default experiment's artifact location."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    monkeypatch.setenv("OPD_CACHE_DIR", str(tmp_path / "cache"))
    built, copied = tmp_path / "built" / "mlflow.db", tmp_path / "copied" / "mlflow.db"
    ensure_store(f"sqlite:///{built}")
    assert template_path(_head_revision()).exists()

    def no_migrations(*args, **kwargs):
        raise AssertionError("the store was built, not copied")

    with monkeypatch.context() as patched:
        patched.setattr(SqlAlchemyStore, "__init__", no_migrations)
        ensure_store(f"sqlite:///{copied}")
    as_built = [line.replace("/built/", "/copied/") for line in _dump(built) if "'Default'" not in line]
    assert [line for line in _dump(copied) if "'Default'" not in line] == as_built
    default = MlflowClient(f"sqlite:///{copied}").get_experiment("0")
    assert default.artifact_location == f"{(copied.parent / 'artifacts').as_uri()}/0"
    assert sorted(p.name for p in copied.parent.iterdir()) == ["mlflow.db"]  # no temporary left over


def test_a_broken_or_unwritable_cache_only_makes_the_store_slower(tmp_path, monkeypatch):
    """A half-written template is not copied (it is rebuilt and replaced); a cache that cannot be written still
    gives a working store."""
    monkeypatch.setenv("OPD_CACHE_DIR", str(tmp_path / "cache"))
    template = template_path(_head_revision())
    template.parent.mkdir()
    template.write_bytes(b"SQLite format 3\0 cut short")
    ensure_store(f"sqlite:///{tmp_path / 'a' / 'mlflow.db'}")
    assert sqlite3.connect(template).execute("SELECT version_num FROM alembic_version").fetchone() == (
        _head_revision(),)
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("OPD_CACHE_DIR", str(tmp_path / "not-a-dir"))
    uri = f"sqlite:///{tmp_path / 'b' / 'mlflow.db'}"
    ensure_store(uri)
    assert MlflowClient(uri).get_experiment("0").name == "Default"
