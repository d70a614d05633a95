"""A replica that spans ranks (`resources.<role>.gpus_per_replica` > 1): rank 0 is the role's usual actor and owns
the queue I/O; each other rank is a `ShardFollower` that holds the same object over its shard of the target and
runs every call rank 0 runs, with the same arguments, in the same order (SPMD). The target's forward is a sequence
of collectives, and what rank 0 computes (acceptance, the next block) is computed bit for bit alike on every rank
(the collectives hand every rank the same logits), so the ranks meet at every collective. The group is
torch.distributed's (opd/models/sharding.py); the ranks join it in their constructors, at an address on rank 0's
node that the driver picks before any of them exists.

A rank that dies ends the replica's group: its peers' next collective fails (or times out, after
`resources.restarts.collective_timeout_s`, for a rank that stopped), and the driver restarts every rank of the
replica together in a fresh group (actors/supervisor.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from opd.data.prompts import load_tokenizer, train_prompts
from opd.decoding.speculative import SpeculativeDecoder
from opd.eval.row import EvalRow
from opd.eval.suite import SuiteResult
from opd.models.build import Models, build_drafter, build_models, resolve_device
from opd.models.sharding import build_sharded_target, in_collective, join_group, own_rank
from opd.models.target import Target
from opd.spec import ExperimentSpec
from opd.train.distributed import collective_timeout, free_address
from opd.train.evaluator import Checkpoint, EvalResult, Evaluator
from opd.train.messages import AnchorBatch, ScoredItem, WeightSnapshot
from opd.train.rollout import RolloutWorker
from opd.train.scorer import Scorer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")
R = TypeVar("R")


def rollout_worker(spec: ExperimentSpec, world: int = 1) -> RolloutReplica:
    """A rollout replica's worker (target + drafter copy, or only a sampler or sample file) over `world` ranks."""
    tokenizer = load_tokenizer(spec.models.tokenizer)
    if spec.rollout.holds_target:
        if world == 1:
            target, drafter = (models := build_models(spec)).target, models.drafter
        else:
            target = build_sharded_target(spec, world)
            drafter = build_drafter(spec, target, tokenizer)
    else:  # stored samples or vLLM's own engine: only the prompts
        target, drafter = None, None
    prompts = train_prompts(spec.data, tokenizer)
    worker = RolloutWorker(spec, target, drafter, tokenizer.eos_token_id, prompts, draft_version=-1)
    return RolloutReplica(spec, worker, target, tokenizer)


class RolloutReplica:
    """A rollout replica's `RolloutWorker` (forwarding what the rollout actor uses of it), and the `Evaluator` that
    shares its target when `resources.evaluate_on` is rollout: held-out decoding between rollout batches, with a
    drafter copy of its own, so evaluating never disturbs the weights the replica drafts with. The evaluator is built
    at the first evaluation, on every rank alike (the calls reach all of them), so a replica never asked costs
    nothing."""

    def __init__(self, spec: ExperimentSpec, worker: RolloutWorker, target: Target | None,
                 tokenizer: PreTrainedTokenizerBase) -> None:
        """`target`: the worker's (None: a replica without a target of ours cannot evaluate)."""
        self.spec, self.worker, self.target, self.tokenizer = spec, worker, target, tokenizer
        self.evaluator: Evaluator | None = None

    @property
    def draft_version(self) -> int:
        return self.worker.draft_version

    @property
    def decoder(self) -> SpeculativeDecoder | None:
        return self.worker.decoder

    def run(self, index: int) -> AnchorBatch:
        return self.worker.run(index)

    def load_drafter(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.worker.load_drafter(state_dict, version)

    def evaluate(self, snapshot: WeightSnapshot) -> EvalResult:
        """`Evaluator.__call__` on this replica's target."""
        if self.evaluator is None:
            assert self.target is not None  # the spec refuses evaluate_on rollout without one (holds_target)
            drafter = build_drafter(self.spec, self.target, self.tokenizer)
            self.evaluator = Evaluator(self.spec, Models(self.target, drafter, self.tokenizer), rank=own_rank())
        return self.evaluator(snapshot)


def scorer(spec: ExperimentSpec, world: int = 1) -> Scorer:
    """A scorer replica's `Scorer` over `world` ranks, with its drafter when the rollout source is rebuilt."""
    target = build_sharded_target(spec, world)
    drafter = build_drafter(spec, target, load_tokenizer(spec.models.tokenizer)) if spec.rollout.rebuilt else None
    return Scorer(spec, target, drafter)


def evaluator(spec: ExperimentSpec, world: int = 1) -> Evaluator:
    """The evaluator's `Evaluator` over `world` ranks (its target and a drafter copy)."""
    if world == 1:
        return Evaluator(spec)
    tokenizer = load_tokenizer(spec.models.tokenizer)
    target = build_sharded_target(spec, world)
    return Evaluator(spec, Models(target, build_drafter(spec, target, tokenizer), tokenizer), rank=own_rank())


BUILDERS: dict[str, Callable[[ExperimentSpec, int], Any]] = {"rollout": rollout_worker, "scorer": scorer,
                                                             "evaluator": evaluator}


@ray.remote(num_cpus=0)
def _node_address() -> str:
    return free_address(ray.util.get_node_ip_address())


def bundle_address(pg, bundle: int = 0) -> str:
    """A free host:port on the node of `bundle` of `pg` (the learner's rank 0, or a sharded replica's) for rank 0 to
    listen on, known before any rank is built, so all of them join the group in their constructors."""
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
    return ray.get(_node_address.options(scheduling_strategy=strategy).remote())


def join(spec: ExperimentSpec, shard: tuple[str, int] | None, rank: int = 0) -> int:
    """Join the replica's group when `shard` (address, ranks) is given; the ranks this replica spans."""
    if shard is None:
        return 1
    address, world = shard
    join_group(address, rank, world, resolve_device(spec.models.device), collective_timeout(spec))
    return world


@ray.remote
class ShardFollower:
    """Rank > 0 of a sharded replica of `role`: builds what rank 0 builds and runs the calls rank 0 forwards."""

    def __init__(self, spec: dict, role: str, address: str, rank: int, world: int) -> None:
        parsed = ExperimentSpec.model_validate(spec)
        self.obj = BUILDERS[role](parsed, join(parsed, (address, world), rank))

    def ready(self) -> None:
        """Answers once the constructor has finished, and then while it computes: the driver's liveness call."""

    def call(self, method: str, *args: Any) -> None:
        """Run `method` as rank 0 does; its result stays here (rank 0 ships its own)."""
        getattr(self.obj, method)(*args)


class Spmd(Generic[T]):
    """Rank 0's object, whose method calls also run on the followers: the arguments go once to the object store,
    the followers start, rank 0 runs, then waits for them (so a follower's error surfaces at the call). One call at
    a time: an actor's threads (a rollout's loop and the evaluation it serves) share the target, and two calls
    interleaving their collectives would pair the wrong ones across ranks. Each role's subclass names the calls its
    actor makes, so none reaches rank 0 alone by mistake; reads of state stay on rank 0 (every rank holds the same)."""

    def __init__(self, obj: T, followers: list) -> None:
        self.obj, self.followers, self.lock = obj, followers, threading.Lock()

    def _everywhere(self, method: Callable[..., R], *args: Any) -> R:
        """`method`, a bound method of `obj`, on rank 0; the followers run theirs by its name."""
        with self.lock:
            if not self.followers:
                return method(*args)
            refs = [ray.put(arg) for arg in args]
            pending = [follower.call.remote(method.__name__, *refs) for follower in self.followers]
            try:
                out = method(*args)
            except RuntimeError as exc:  # a peer died or stopped mid-collective: say where rank 0 was
                raise in_collective(exc) from exc
            ray.get(pending)
            return out


class SpmdRollout(Spmd[RolloutReplica]):
    """A rollout replica's ranks, as `RolloutActor` uses them."""

    @property
    def draft_version(self) -> int:
        return self.obj.draft_version

    @property
    def decoder(self) -> SpeculativeDecoder | None:
        return self.obj.decoder

    def run(self, index: int) -> AnchorBatch:
        return self._everywhere(self.obj.run, index)

    def load_drafter(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self._everywhere(self.obj.load_drafter, state_dict, version)

    def evaluate(self, snapshot: WeightSnapshot) -> EvalResult:
        return self._everywhere(self.obj.evaluate, snapshot)


class SpmdScorer(Spmd[Scorer]):
    """A scorer replica's ranks, as `ReplayScorerActor` uses them."""

    @property
    def draft_version(self) -> int:
        return self.obj.draft_version

    def __call__(self, batch: AnchorBatch) -> ScoredItem:
        return self._everywhere(self.obj.__call__, batch)

    def load_drafter(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self._everywhere(self.obj.load_drafter, state_dict, version)


class SpmdEvaluator(Spmd[Evaluator]):
    """The evaluator's ranks, as `EvaluatorActor` uses them."""

    def __call__(self, snapshot: WeightSnapshot) -> EvalResult:
        return self._everywhere(self.obj.__call__, snapshot)

    def checkpoints(self, drafters: list[Checkpoint]) -> list[list[EvalRow]]:
        return self._everywhere(self.obj.checkpoints, drafters)

    def draw_samples(self, path: str) -> None:
        self._everywhere(self.obj.draw_samples, path)

    def suite(self, drafters: dict[str, str], out: str) -> SuiteResult:
        return self._everywhere(self.obj.suite, drafters, out)
