"""`opd run` on Ray with the rollout and scorer replicas each sharded over 2 gloo ranks (actors/replica.py) takes
the unsharded local run's steps: the same losses at max_policy_lag 0; an evaluator actor sharded over 2 ranks
(actors/evaluator.py) gives the rows the local evaluator gives. Ray workers that each import torch and
transformers take minutes on 2 cores, so these are `slow`; tests/test_sharding.py runs the same sharded
computation (decodes, replay, the rebuild, the evaluator) in `make test`."""

from __future__ import annotations

from dataclasses import replace

import pytest

from actors.driver import evaluate_in_actor, run_ray
from opd.spec import load_spec
from opd.train.evaluator import Checkpoint, Evaluator
from opd.train.local import LocalTrainer
from tests.helpers.ray_runs import ray_four_cpus  # noqa: F401 (a fixture)


@pytest.mark.slow
def test_sharded_rollout_and_scorer_take_the_unsharded_steps(ray_four_cpus, micro_spec_file, tmp_path):
    common = ["steps=2", "eval.every=0", "eval.offline=false"]
    local = LocalTrainer(load_spec(micro_spec_file, [*common, f"tracking.run_dir={tmp_path / 'local'}"]),
                         track=False).run()
    spec = load_spec(micro_spec_file, [*common, "engine=ray", "resources.max_policy_lag=0", "resources.queue_size=1",
                                       f"tracking.run_dir={tmp_path / 'ray'}", "resources.cluster.num_cpus=4",
                                       "resources.rollout.gpus_per_replica=2", "resources.scorer.gpus_per_replica=2"])
    sharded = run_ray(spec, track=False)
    assert sharded.steps == 2
    assert sharded.losses == pytest.approx(local.losses, rel=1e-5, abs=1e-7)


@pytest.mark.slow
def test_a_sharded_evaluator_actor_gives_the_local_rows(ray_four_cpus, micro_spec_file):
    spec = load_spec(micro_spec_file, ["eval.speedup_prompts=2", "resources.cluster.num_cpus=4",
                                       "resources.evaluator.gpus_per_replica=2",
                                       "resources.evaluator.num_cpus=0.5"])
    untimed = [[replace(r, spec_tokens_per_s=None, ar_tokens_per_s=None, speedup=None) for r in rows]
               for rows in evaluate_in_actor(spec, [Checkpoint(None)])]
    local = Evaluator(spec).checkpoints([Checkpoint(None)])
    assert untimed == [[replace(r, spec_tokens_per_s=None, ar_tokens_per_s=None, speedup=None) for r in rows]
                       for rows in local]
