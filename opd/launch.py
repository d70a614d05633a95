"""The launcher: a validated spec in, a `TrainResult` out, on the spec's engine.

`opd train` and `opd run` (opd/main_job.py) both train through `train` here. It is the only module of opd/ that
imports actors/ (tests/test_layering.py checks it): `engine: local` runs `LocalTrainer` (opd/train/local.py) in
this process, `engine: ray` runs the actor system (actors/driver.py). Both fold their step reports into the
result with the same loop (opd/train/result.py).
"""

from __future__ import annotations

import contextlib

from opd.spec import ExperimentSpec
from opd.tracking import run_status
from opd.train.messages import TrainResult


def train(spec: ExperimentSpec) -> TrainResult:
    """Train with the spec's engine; the MLflow run ends FINISHED, or FAILED / KILLED with the error that stopped
    it (the Ray driver does the same for `engine: ray`)."""
    if spec.engine == "ray":
        from actors.driver import run_ray  # Ray is imported only when the spec asks for it

        return run_ray(spec)
    from opd.train.local import LocalTrainer

    trainer = LocalTrainer(spec)
    try:
        return trainer.run()
    except BaseException as exc:
        with contextlib.suppress(Exception):  # never mask the error that stopped the run
            trainer.session.close(run_status(exc))
        raise
