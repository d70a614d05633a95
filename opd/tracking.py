"""MLflow tracking: one run per experiment, params = the flattened spec, resumed runs continue the same run.

Only the driver/learner writes; the default store is sqlite inside the run directory. Everything goes through
an explicit run id (MlflowClient), never MLflow's "active run": that is per thread, and a Ray actor may serve
its calls from several threads, which would silently open a second run.
"""

from __future__ import annotations

import time
from pathlib import Path

from opd.spec import ExperimentSpec, flatten

_BATCH = 100  # MLflow's limit of params or metrics per log_batch call


class Tracker:
    def __init__(self, spec: ExperimentSpec, run_id: str | None = None) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        spec.run_dir.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=spec.tracking_uri)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(spec.tracking.experiment)
            experiment_id = (experiment.experiment_id if experiment
                             else self.client.create_experiment(spec.tracking.experiment))
            run_id = self.client.create_run(experiment_id, run_name=spec.name).info.run_id
            params = [Param(k, v) for k, v in flatten(spec).items()]
            for i in range(0, len(params), _BATCH):
                self.client.log_batch(run_id, params=params[i : i + _BATCH])
            self.client.log_text(run_id, spec.to_yaml(), "spec.yaml")
        self.run_id = run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(rows), _BATCH):
            self.client.log_batch(self.run_id, metrics=rows[i : i + _BATCH])

    def artifact(self, path: str | Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
