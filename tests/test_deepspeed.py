"""`optim.backend: deepspeed` on CPU (gloo): ZeRO stages against the plain torch learner, one rank and two, in fp32
and with a bf16 drafter (fp32 master weights).

Each case runs in spawned processes, so DeepSpeed's process group and globals never leak into the test process.
Slow: the first run JIT-builds DeepSpeed's CPU communication op (about a minute, cached afterwards).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from opd.models.build import build_models
from opd.spec import ExperimentSpec, load_spec
from opd.train.deepspeed import deepspeed_config
from opd.train.distributed import free_address, init_group, shard
from opd.train.learner import Learner, step_norm
from opd.train.local import LocalTrainer

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _deepspeed_is_installed() -> None:
    """Fail, not skip, without DeepSpeed: a skip would let `make test-all` claim ZeRO 0-2 is tested."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.fail("DeepSpeed is not installed: `make test-all` installs it (DS_BUILD_OPS=0 pip install -e "
                    "'.[deepspeed]')", pytrace=False)


CLIPPED = ["optim.micro_batch_size=1", "optim.grad_clip=0.01"]  # gradient norms here are ~0.02: clipping acts
BF16 = [*CLIPPED, "models.dtype=bfloat16", "optim.lr=3e-3"]  # 3 steps of 3e-3 move a weight of 1.0 past an ulp


def _scored_steps(spec: ExperimentSpec) -> list[list]:
    """Three steps of 2, 4 and 2 micro-batches from real rollouts (even, so two ranks get equal shards)."""
    trainer = LocalTrainer(spec, track=False)
    micro = [mb for i in range(4) for mb in trainer.scorer(trainer.rollout.run(i)).micro_batches]
    return [micro[:2], micro[2:6], micro[6:8]]


def _deepspeed_rank(rank: int, world: int, spec_json: str, address: str, steps: list[list], out: str) -> None:
    """Train on this rank's shards; after the first step save a checkpoint (rank 0 gathers the ZeRO parts) and
    resume a fresh learner from it, as a restarted run would, before taking the remaining steps."""
    torch.set_num_threads(1)
    spec = ExperimentSpec.model_validate_json(spec_json)
    group = init_group(address, rank, world, "cpu")
    learner = Learner(spec, build_models(spec).drafter, group)
    losses = [learner.train_step(shard(steps[0], rank, world), step_norm(steps[0], spec.loss)).loss]
    state = learner.state_dict()  # collective under ZeRO
    if rank == 0:
        torch.save({"learner": state, "drafter": learner.drafter.state_dict()}, f"{out}/ckpt.pt")
    dist.barrier()
    saved = torch.load(f"{out}/ckpt.pt", weights_only=False)
    learner = Learner(spec, build_models(spec).drafter, group)
    learner.drafter.load_state_dict(saved["drafter"])
    learner.load_state_dict(saved["learner"])
    losses += [learner.train_step(shard(micro, rank, world), step_norm(micro, spec.loss)).loss for micro in steps[1:]]
    torch.save({"losses": losses, "state": learner.drafter.state_dict(), "partitioned": learner.partitioned},
               f"{out}/rank{rank}.pt")


def _run_ranks(spec: ExperimentSpec, world: int, steps: list[list], out) -> list[dict]:
    mp.spawn(_deepspeed_rank, args=(world, spec.model_dump_json(), free_address(), steps, str(out)), nprocs=world)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.fixture
def reference(micro_spec_file) -> tuple[list[list], list[float], dict]:
    """The micro-batches and the plain torch learner's losses and final weights on them."""
    spec = load_spec(micro_spec_file, CLIPPED)
    steps = _scored_steps(spec)
    learner = Learner(spec, build_models(spec).drafter)
    losses = [learner.train_step(micro).loss for micro in steps]
    return steps, losses, learner.drafter.state_dict()


@pytest.mark.parametrize(("world", "stage"), [(1, 0), (1, 1), (2, 0), (2, 1), (2, 2)])
def test_zero_stage_matches_the_torch_learner(micro_spec_file, reference, tmp_path, world, stage):
    steps, losses, weights = reference
    spec = load_spec(micro_spec_file, [*CLIPPED, "optim.backend=deepspeed", f"optim.zero_stage={stage}"])
    ranks = _run_ranks(spec, world, steps, tmp_path)
    assert ranks[0]["partitioned"] == (stage > 0)
    for r in ranks:
        assert r["losses"] == pytest.approx(losses, rel=1e-5)
        for k, v in weights.items():
            assert (r["state"][k] - v).abs().max() <= 1e-6, k


@pytest.mark.parametrize(("world", "stage"), [(2, 0), (2, 2)])
def test_a_bf16_drafter_trains_as_the_torch_learner_does(micro_spec_file, tmp_path, world, stage):
    """bf16 weights on fp32 masters: the client AdamW's at stage 0 (DeepSpeed's bf16 mode off), ZeRO's fp32
    partitions at 1-2 (bf16 mode on, on CPU too), restored on resume. Every tensor moves, and the bf16 weights are
    the torch learner's (checked against fp32 in tests/test_bf16.py) to within 5% of their movement: gradients summed
    in another order round differently in bf16, and AdamW's first steps amplify that where they cancel (<= 1e-4)."""
    spec = load_spec(micro_spec_file, BF16)
    steps = _scored_steps(spec)
    learner = Learner(spec, build_models(spec).drafter)
    start = {k: v.clone() for k, v in learner.drafter.state_dict().items()}
    losses = [learner.train_step(micro).loss for micro in steps]
    ds = load_spec(micro_spec_file, [*BF16, "optim.backend=deepspeed", f"optim.zero_stage={stage}"])
    assert deepspeed_config(ds, world)["bf16"]["enabled"] == (stage > 0)
    for r in _run_ranks(ds, world, steps, tmp_path):
        assert r["partitioned"] == (stage > 0) and r["losses"] == pytest.approx(losses, rel=1e-3)
        for k, v in learner.drafter.state_dict().items():
            assert r["state"][k].dtype == torch.bfloat16 and not torch.equal(r["state"][k], start[k]), k
            got, want, moved = r["state"][k].float(), v.float(), (v - start[k]).float()
            assert (got - want).norm() <= 0.05 * moved.norm(), k
