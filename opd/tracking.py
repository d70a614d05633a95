"""MLflow tracking: one run per experiment, params = the flattened spec, resumed runs continue the same run.

Only the driver/learner writes; the default store is sqlite inside the run directory.
"""

from __future__ import annotations

from pathlib import Path

from opd.spec import ExperimentSpec, flatten


class Tracker:
    def __init__(self, spec: ExperimentSpec, run_id: str | None = None) -> None:
        import mlflow

        self._mlflow = mlflow
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        mlflow.set_tracking_uri(spec.tracking_uri)
        mlflow.set_experiment(spec.tracking.experiment)
        self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else spec.name)
        if run_id is None:
            params = flatten(spec)
            mlflow.log_params(params)
            mlflow.log_text(spec.to_yaml(), "spec.yaml")

    @property
    def run_id(self) -> str:
        return self.run.info.run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    def artifact(self, path: str | Path, folder: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self._mlflow.log_artifacts(str(path), artifact_path=folder)
        else:
            self._mlflow.log_artifact(str(path), artifact_path=folder)

    def close(self) -> None:
        self._mlflow.end_run()
