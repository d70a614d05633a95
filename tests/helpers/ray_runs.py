"""Ray runs of the micro spec (tests/conftest.py's `micro_spec_file`) against the single-process reference: a local
Ray for a whole module, a Ray spec with no policy lag and small queues, the local run's losses, the ledger's
account, and a wait for a condition."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from actors.driver import RayRun
from opd.spec import ExperimentSpec, load_spec
from opd.train.local import LocalTrainer


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray for the module (2 CPUs, 4 pretend GPUs for the placement checks), private to this process's
    RAY_TMPDIR (tests/conftest.py), so a module on the other xdist worker runs its own beside it."""
    if ray.is_initialized():  # a Ray an earlier module's `opd run` left up in this process (make test-all)
        ray.shutdown()
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def ray_four_cpus():
    """A local Ray of 4 CPUs for one test: room for sharded replicas' gloo ranks beside the learner."""
    if ray.is_initialized():  # a Ray an earlier module left up in this process
        ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def ray_spec(micro_spec_file, tmp_path, *sets: str, **overrides) -> ExperimentSpec:
    base = ["engine=ray", "resources.max_policy_lag=0", "resources.queue_size=1", "eval.every=0",
            f"tracking.run_dir={tmp_path / 'ray' / '{name}'}", "tracking.checkpoint_every=1"]
    return load_spec(micro_spec_file, base + list(sets) + [f"{k}={v}" for k, v in overrides.items()])


BOUND = 1e-5  # how far a healed run's drafter may be from the uninterrupted one's (tests/test_ray_heal.py says why)
STEPS = 4


def local_drafter(micro_spec_file, tmp_path, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The uninterrupted single-process run's drafter, which a healed Ray run at max_policy_lag 0 must equal."""
    spec = load_spec(micro_spec_file, [f"steps={steps}", "eval.every=0", f"tracking.run_dir={tmp_path / 'local'}"])
    trainer = LocalTrainer(spec, track=False)
    trainer.run()
    return trainer.session.drafter.state_dict()


def local_losses(micro_spec_file, tmp_path, steps: int, sets: list[str] | None = None) -> list[float]:
    spec = load_spec(micro_spec_file, [*(sets or []), f"steps={steps}", "eval.every=0",
                                       f"tracking.run_dir={tmp_path / 'local'}"])
    return LocalTrainer(spec, track=False).run().losses


def account(run: RayRun) -> dict[str, int]:
    return ray.get(run.ledger.account.remote())


def wait_for(fn, timeout: float = 180.0):
    """`fn()`'s first truthy value, polled; a module's first actor or task starts a worker process that imports torch,
    which on a loaded 2-core machine took over a minute (a 60 s limit failed there)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("timed out")
