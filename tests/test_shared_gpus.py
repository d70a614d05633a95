"""Layouts for targets whose every copy takes a node (Qwen3.5-397B-A17B in bf16 on two 8xH200 nodes): held-out
evaluation on rollout-0's target (`resources.evaluate_on: rollout`, actors/replica.py `RolloutReplica`) and learner
ranks sharing the scorer ranks' GPUs (`resources.colocate_learner`, opd/spec/placement.py `learner_group_bundles`).

Fast here: the evaluation a rollout replica serves equals the evaluator's and leaves its drafting weights alone;
the placement bundles; the spec's one-line refusals (tests/test_sharded_spec.py holds the others). `slow`: `opd run`
on Ray with both, the rollout and scorer sharded over 2 gloo ranks, takes the unsharded local run's losses (Ray
workers importing torch and transformers take minutes on 2 cores; the fast tests cover the evaluation the rollout
serves and the bundles the driver places)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from actors.replica import rollout_worker
from opd.eval.row import EvalRow
from opd.spec import ResourcesSpec, load_spec
from opd.train.evaluator import Evaluator
from opd.train.messages import WeightSnapshot
from tests.helpers.ray_runs import ray_four_cpus  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[1]
TWO_NODES = ["resources.evaluate_on=rollout", "resources.colocate_learner=true", "resources.evaluator.num_cpus=0",
             "resources.learner.replicas=2", "resources.learner.num_cpus=0.25", "resources.scorer.num_cpus=0.25"]


def untimed(rows: list[EvalRow]) -> list[EvalRow]:
    return [replace(r, spec_tokens_per_s=None, ar_tokens_per_s=None, speedup=None) for r in rows]


def test_a_rollout_replica_evaluates_as_the_evaluator_does_without_touching_its_drafter(micro_spec_file):
    spec = load_spec(micro_spec_file, ["resources.evaluate_on=rollout"])
    replica = rollout_worker(spec)
    drafting = {k: v.clone() for k, v in replica.decoder.drafter.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    trained = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
               for k, v in drafting.items()}
    snapshot = WeightSnapshot.of(trained, version=3)
    served = replica.evaluate(snapshot)
    alone = Evaluator(spec)(snapshot)
    assert served.step == alone.step == 3
    assert untimed(served.rows) == untimed(alone.rows)
    assert all(torch.equal(v, drafting[k]) for k, v in replica.decoder.drafter.state_dict().items())


def test_colocated_learner_ranks_share_the_first_scorer_bundles():
    r = ResourcesSpec.model_validate({
        "cluster": {"num_gpus": 16, "gpus_per_node": 8}, "evaluate_on": "rollout", "colocate_learner": True,
        "rollout": {"num_gpus": 1, "num_cpus": 4, "gpus_per_replica": 8},
        "scorer": {"num_gpus": 0.9, "num_cpus": 4, "gpus_per_replica": 8},
        "learner": {"replicas": 7, "num_gpus": 0.1, "num_cpus": 2}, "evaluator": {"num_cpus": 0}})
    assert r.learner_bundles() == [{"CPU": 6, "GPU": 1.0}] * 7 + [{"CPU": 4, "GPU": 1.0}]
    assert r.first_scorer_bundle == 0
    apart = r.model_copy(update={"colocate_learner": False, "learner": r.learner.model_copy(update={"replicas": 1})})
    assert apart.learner_bundles() == [{"CPU": 2, "GPU": 0.1}] + [{"CPU": 4, "GPU": 0.9}] * 8
    assert apart.first_scorer_bundle == 1


@pytest.mark.parametrize(("overrides", "expected"), [
    (["resources.evaluate_on=rollout", "resources.evaluator.num_cpus=1"],
     "resources.evaluator: 0 GPUs, 1 CPUs, gpus_per_replica 1 with evaluate_on rollout (expected num_gpus 0"),
    (["resources.evaluate_on=rollout", "resources.evaluator.num_cpus=0", "rollout.source=target",
      "rollout.sampler=vllm"],
     "resources.evaluate_on: rollout with rollout.source target and sampler vllm (that rollout replica holds no"),
    (["resources.colocate_learner=true", "resources.learner.replicas=2"],
     "resources.learner.replicas: 2 with colocate_learner but the scorer has 1 ranks (expected at most one"),
    (["resources.colocate_learner=true", "resources.cluster.num_gpus=4", "resources.evaluator.num_gpus=1",
      "resources.learner.num_gpus=0.2", "resources.scorer.num_gpus=0.5"],
     "resources.learner.num_gpus: 0.2 + scorer.num_gpus 0.5 = 0.7 with colocate_learner (expected fractions"),
    (["resources.colocate_learner=true", "resources.cluster.num_gpus=24", "resources.cluster.gpus_per_node=8",
      "resources.evaluator.num_gpus=1", "resources.learner.num_gpus=0.1", "resources.scorer.num_gpus=0.9",
      "resources.scorer.replicas=2", "resources.scorer.gpus_per_replica=8"],
     "resources.scorer: 16 ranks of 1 GPU beside the learner's 0 need 16 GPUs on one node, but"),
])
def test_shared_layouts_that_cannot_run_are_one_line(micro_spec_file, overrides, expected):
    from opd.errors import OpdError

    with pytest.raises(OpdError) as refused:
        load_spec(micro_spec_file, overrides, check_paths=False)
    assert expected in str(refused.value)


def test_the_shipped_two_node_layout_validates_and_evaluates_before_and_after_on_a_rollout_replicas_gpus():
    spec = load_spec(ROOT / "configs" / "qwen3.5-397b-a17b.yaml", [], check_paths=False)
    r = spec.resources
    assert (r.evaluate_on, r.colocate_learner, r.rollout.ranks, r.scorer.ranks) == ("rollout", True, 8, 8)
    assert len(r.learner_bundles()) + r.rollout.ranks == r.cluster.num_gpus == 16
    assert spec.resources.evaluator_role == r.rollout  # one replica of 8 ranks; training's evaluator role reserves nothing


@pytest.mark.slow
def test_a_two_node_style_run_takes_the_unsharded_steps(ray_four_cpus, micro_spec_file, tmp_path):
    """Rollout and scorer at 2 gloo ranks each, the learner's 2 ranks in the scorer ranks' bundles, held-out
    evaluation on rollout-0 at every step: the local run's losses and evaluations."""
    from actors.driver import run_ray
    from opd.train.local import LocalTrainer

    common = ["steps=2", "eval.every=1", "eval.offline=false"]
    local = LocalTrainer(load_spec(micro_spec_file, [*common, f"tracking.run_dir={tmp_path / 'local'}"]),
                         track=False).run()
    spec = load_spec(micro_spec_file, [*common, *TWO_NODES, "engine=ray", "resources.max_policy_lag=0",
                                       "resources.queue_size=1", f"tracking.run_dir={tmp_path / 'ray'}",
                                       "resources.cluster.num_cpus=4", "resources.rollout.gpus_per_replica=2",
                                       "resources.scorer.gpus_per_replica=2"])
    shared = run_ray(spec, track=False)
    assert shared.steps == 2
    assert shared.losses == pytest.approx(local.losses, rel=1e-5, abs=1e-7)
    assert sorted(shared.evals) == sorted(local.evals) == [0, 1, 2]  # the warm drafter at step 0
    assert all(untimed(shared.evals[step]) == untimed(local.evals[step]) for step in local.evals)

