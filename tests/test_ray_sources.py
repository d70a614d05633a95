"""Rebuilt rollout sources on the Ray actor system against the single-process reference. Apart from tests/test_ray.py
so that `make test`'s two workers (pytest-xdist, a module per worker) run the two longest Ray modules side by side;
each starts its own local Ray (a private RAY_TMPDIR per worker, tests/conftest.py)."""

from __future__ import annotations

import pytest

from actors.driver import RayRun
from opd.commands.gen_samples import run_gen_samples
from opd.spec import load_spec
from opd.train.ledger import reconciles
from opd.train.local import LocalTrainer
from tests.helpers.ray_runs import account, ray_cluster, ray_spec  # noqa: F401 (ray_cluster is a fixture)


# make test-all: five actors that load models make this a minute of CPU. What it adds to make test's tests is the
# scorer actor's adoption of published versions (`_next_scorable`, a few lines); the version gate it uses is tested
# alone (test_ledger.py), every source trains identically on the local engine with either family
# (test_rollout_sources.py, test_eagle3_train.py), and the Ray path equals the local one (test_ray.py).
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("source", ["target", "samples", "target-eagle3"])
def test_rebuilt_sources_on_ray_equal_local(ray_cluster, micro_spec_file, tmp_path, source):
    """Two rollout actors, so batches can reach the scorer out of order, max_policy_lag 0: the scorer sets aside
    what arrives early and rebuilds each batch with exactly the version the local path uses; the steps are equal.
    With an EAGLE-3 drafter too: the actors build, broadcast and rebuild with its family unchanged."""
    sets = ["rollout.source=target"]
    if source == "target-eagle3":
        sets += ["models.drafter_path=", "models.drafter.kind=eagle3", "models.drafter.target_layer_ids=[1,1,2]",
                 "models.drafter.draft_vocab_size=64"]
    if source == "samples":
        path = tmp_path / "samples.jsonl"
        run_gen_samples(load_spec(micro_spec_file, [f"tracking.run_dir={tmp_path / 'gen'}"]), None, 1, str(path))
        sets = ["rollout.source=samples", f"rollout.samples_path={path}"]
    local = LocalTrainer(load_spec(micro_spec_file, ["steps=3", "eval.every=0", f"tracking.run_dir={tmp_path / 'local'}",
                                                     *sets]), track=False).run().losses
    spec = ray_spec(micro_spec_file, tmp_path, "resources.queue_size=4", "resources.rollout.replicas=2",
                    "resources.rollout.num_cpus=0.25", *sets, steps=3)
    run = RayRun(spec, track=False)
    try:
        assert run.start() == 0
        reports = [r for step in (1, 2, 3) for r in run.train(step)]
        assert [r["metrics"]["loss"] for r in reports] == pytest.approx(local, rel=1e-5, abs=1e-7)
        assert [r["metrics"]["policy_lag"] for r in reports] == [0, 0, 0]
        assert reconciles(account(run)) and account(run)["stale"] == 0
    finally:
        run.shutdown()
