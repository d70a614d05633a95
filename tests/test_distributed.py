"""Data-parallel learner ranks: sharding, two gloo ranks against one learner, and the Ray run with two ranks."""

from __future__ import annotations

import re
import time
from datetime import timedelta
from pathlib import Path

import pytest
import ray
import torch
import torch.multiprocessing as mp

from actors.driver import RayRun
from opd.errors import OpdError
from opd.models.build import build_models
from opd.spec import ExperimentSpec, load_spec
from opd.train.distributed import free_address, init_group, reduce_gradients, shard
from opd.train.learner import Learner, step_norm
from opd.train.local import LocalTrainer
from tests.helpers import forked


def test_shards_are_contiguous_balanced_and_cover_everything():
    items = list(range(7))
    shards = [shard(items, r, 3) for r in range(3)]
    assert shards == [[0, 1, 2], [3, 4], [5, 6]]
    assert shard([0], 1, 2) == []  # a rank may get nothing; it still joins the reductions


def _scored_steps(spec: ExperimentSpec) -> list[list]:
    """Two steps of micro-batches from real rollouts: 3 (shards of 2 and 1 over two ranks), then 4."""
    trainer = LocalTrainer(spec, track=False)
    micro = [mb for i in range(4) for mb in trainer.scorer(trainer.rollout.run(i)).micro_batches]
    return [micro[:3], micro[3:7]]


def _stalled_reduce(rank: int, address: str, out: str) -> None:
    """Rank 0 reduces gradients that rank 1 never sends (a stopped learner rank) and saves the error's line; rank 1
    stays in the group until then (an exit would close the connection instead)."""
    group = init_group(address, rank, 2, "cpu", timeout=timedelta(seconds=1))
    if rank == 0:
        param = torch.nn.Parameter(torch.zeros(3))
        param.grad = torch.ones(3)
        try:
            reduce_gradients([param], group)
            line = "no error"
        except RuntimeError as exc:
            line = str(exc)
        Path(out).write_text(line)
        return
    deadline = time.monotonic() + 30
    while not Path(out).exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def test_a_gradient_reduce_a_rank_never_joins_times_out_naming_it(tmp_path):
    """A stopped learner rank (issue 63): the others' all-reduce fails after the group's timeout, and the line
    names the collective beside gloo's transport operation."""
    out = tmp_path / "line.txt"
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    address = free_address()
    forked.join([forked.start(_stalled_reduce, rank, address, str(out), log=log) for rank, log in enumerate(logs)], logs)
    assert re.search(r"[Tt]imed out.* \(in the learner's gradient all-reduce\)$", out.read_text()), out.read_text()


def _rank_main(rank: int, spec_json: str, address: str, steps: list[list], out: str) -> None:
    """One learner rank in its own process: train on this rank's shard of every step, save the weights."""
    torch.set_num_threads(1)
    spec = ExperimentSpec.model_validate_json(spec_json)
    learner = Learner(spec, build_models(spec).drafter, init_group(address, rank, 2, "cpu"))
    losses = [learner.train_step(shard(micro, rank, 2), step_norm(micro, spec.loss)).loss for micro in steps]
    torch.save({"losses": losses, "state": learner.drafter.state_dict()}, f"{out}/rank{rank}.pt")


@pytest.mark.slow  # two spawned rank processes: ~50 s on a shared 2-core CPU
def test_two_gloo_ranks_take_the_single_learner_steps(micro_spec_file, tmp_path):
    spec = load_spec(micro_spec_file, ["optim.micro_batch_size=1", "optim.grad_clip=0.01"])  # norms are ~0.02: clipping acts
    steps = _scored_steps(spec)
    single = Learner(spec, build_models(spec).drafter)
    losses = [single.train_step(micro).loss for micro in steps]
    mp.spawn(_rank_main, args=(spec.model_dump_json(), free_address(), steps, str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for k, v in single.drafter.state_dict().items():
        assert torch.equal(ranks[0]["state"][k], ranks[1]["state"][k]), k  # the ranks never drift apart
        assert (ranks[0]["state"][k] - v).abs().max() <= 1e-6, k
    assert ranks[0]["losses"] == ranks[1]["losses"] == pytest.approx(losses, rel=1e-6)


def test_deepspeed_missing_is_one_line_naming_the_extra(micro_spec_file, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "deepspeed", None)  # an import of it now fails
    spec = load_spec(micro_spec_file, ["optim.backend=deepspeed"])
    with pytest.raises(OpdError, match=r"not installed \(pip install -e \.\[gpu\]\)"):
        Learner(spec, build_models(spec).drafter)


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow  # a Ray run with two learner processes: ~100 s on a shared 2-core CPU
def test_ray_run_with_two_learner_ranks_equals_local(ray_cluster, micro_spec_file, tmp_path):
    """learner.replicas 2: each rank trains on one of the step's two micro-batches; the losses are the local
    single-process run's."""
    local = LocalTrainer(load_spec(micro_spec_file, ["steps=3", "eval.every=0",
                                                     f"tracking.run_dir={tmp_path / 'local'}"]), track=False)
    expected = local.run().losses
    spec = load_spec(micro_spec_file, ["engine=ray", "steps=3", "eval.every=0", "resources.max_policy_lag=0",
                                       "resources.learner.replicas=2", "resources.learner.num_cpus=0.25",
                                       f"tracking.run_dir={tmp_path / 'ray'}"])
    run = RayRun(spec, track=False)
    try:
        assert run.start() == 0
        reports = run.train(3)
        assert [r["metrics"]["loss"] for r in reports] == pytest.approx(expected, rel=1e-5, abs=1e-7)
        assert reports[-1]["checkpoint"]
    finally:
        run.shutdown()
