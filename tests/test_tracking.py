"""MLflow tracking writes to one run by id, whichever thread logs (Ray actors serve calls from several)."""

from __future__ import annotations

import threading

import mlflow

from opd.spec import load_spec
from opd.tracking import Tracker


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
