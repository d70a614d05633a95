"""The training session: the learner's side of a run, shared by the local loop and the Ray `LearnerActor`.

It owns the trainable drafter and optimizer (`Learner`) on the target's embedding and LM head only (never the
target), the MLflow run, checkpoints and the weight snapshot last published to rollout — so the two engines differ
only in how batches reach it. Held-out evaluation is not done here: the session hands a snapshot of the weights to
its `Evaluations` (opd/train/evaluator.py) and logs each result at the step it evaluated when it comes back
(inline with `engine: local`; a step or more later with `engine: ray`, whose evaluator is an actor of its own).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from opd.distill.losses import StepNorm
from opd.distill.micro_batches import sequence_rows
from opd.distill.scored_batch import ScoredBatch
from opd.errors import OpdError
from opd.eval.acceptance import AcceptanceStats
from opd.eval.expected import ExpectedAcceptance
from opd.eval.row import EvalRow
from opd.models.build import LearnerModels, build_learner_models
from opd.models.flops import FlopCounter
from opd.models.protocol import Drafter
from opd.models.shared_head import SharedHead
from opd.models.target import Target
from opd.spec import ExperimentSpec
from opd.tracking import Tracker
from opd.train.checkpoint import check_same_training, latest_checkpoint, load_state, save_checkpoint, training_fields
from opd.train.distributed import Group, shard
from opd.train.evaluator import EvalResult, Evaluations
from opd.train.learner import Learner, StepMetrics, step_norm
from opd.train.messages import ScoredItem, StepReport, WeightSnapshot
from opd.train.publisher import Publisher


@dataclass
class Counters:
    """The learner's own account (checkpointed): every batch that reaches it is trained on or counted stale. With
    `engine: ray` the run's ledger (opd/train/ledger.py) also accounts for batches lost before reaching it."""

    trained_batches: int = 0
    stale_batches: int = 0
    trained_sequences: int = 0
    trained_anchors: int = 0
    trained_tokens: int = 0  # committed response tokens of the trained batches
    idle_s: float = 0.0  # learner time spent waiting for data
    busy_s: float = 0.0


class Peers(Protocol):
    """Learner ranks 1..N-1 as rank 0 drives them (actors/learner.py implements it over Ray)."""

    def launch(self, shards: list[list[ScoredBatch]], norm: StepNorm) -> None:
        """Start rank r+1's step on `shards[r]` of the step whose loss denominators are `norm`; returns at once."""

    def join(self) -> None:
        """Wait for the launched steps; raises what a rank raised."""


def checkpoint_due(spec: ExperimentSpec, step: int) -> bool:
    """Whether step `step` ends with a checkpoint; every learner rank asks, as ZeRO's checkpoint is a gather."""
    return step % spec.tracking.checkpoint_every == 0 or step == spec.steps


def restore_learner(learner: Learner, path: Path, head: SharedHead | Target) -> dict:
    """Load checkpoint `path`'s drafter weights and optimizer state into `learner` (every learner rank resumes
    from the same checkpoint); `head` is what the drafter shares of the target. Returns the whole saved state."""
    state = load_state(path)
    family_class: Any = type(learner.drafter)  # every family's class loads with from_pretrained(path, head)
    learner.drafter.load_state_dict(family_class.from_pretrained(path, head).state_dict())
    learner.load_state_dict(state["learner"])
    return state


class TrainingSession:
    """Learner rank 0 (the only one by default): with `peers`, each step's micro-batches are sharded over the
    ranks of `group` and this rank trains on the first shard. `models` defaults to the warm drafter on the target's
    embedding and LM head read from its files; `evals` is where held-out evaluation happens (None: nowhere);
    `publish` is where each published snapshot goes, called from the publisher's thread (opd/train/publisher.py;
    None: nowhere, `published` is read instead)."""

    def __init__(self, spec: ExperimentSpec, *, track: bool = True, group: Group | None = None,
                 peers: Peers | None = None, models: LearnerModels | None = None,
                 evals: Evaluations | None = None, publish: Callable[[WeightSnapshot], None] | None = None) -> None:
        self.spec, self.peers, self.evals = spec, peers, evals
        self.models = models or build_learner_models(spec)
        self.learner = Learner(spec, self.models.drafter, group)
        self.flops = FlopCounter()  # rollout + scorer + learner, everything this run has spent
        self.counters = Counters()
        self.eval_history: dict[int, dict[str, float]] = {}
        self.publisher = Publisher(WeightSnapshot.of(self.learner.drafter.state_dict(), 0), publish)
        self.track = track
        self.tracker: Tracker | None = None
        self.run_id: str | None = None
        self.resumed_from: Path | None = None  # the checkpoint `start` restored, for the other ranks
        self.start_evals: list[EvalRow] = []  # a fresh run's step-0 evaluation (the warm drafter)

    @property
    def step(self) -> int:
        return self.learner.step

    @property
    def drafter(self) -> Drafter:
        return self.learner.drafter

    @property
    def published(self) -> WeightSnapshot:
        """The last published snapshot (waits for a publication still under way)."""
        return self.publisher.latest()

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self, *, evaluate: bool = True) -> bool:
        """Resume from the newest checkpoint if there is one and open the MLflow run; True when resumed. A fresh
        run then hands the warm drafter to the evaluator as step 0 unless `evaluate` is False: both engines start
        here. `start_evals` holds its rows when they are back already (inline evaluation); otherwise they come
        with a later step's report."""
        path = self.resumed_from = latest_checkpoint(self.spec.run_dir)
        if path is not None:
            self._restore(path)
        if self.track:
            self.tracker = Tracker(self.spec, self.run_id)
            self.run_id = self.tracker.run_id
        if path is None and evaluate and self.evals:
            self.evals.submit(self.published)
            self.start_evals = self.collect_evals().get(0, [])
        return path is not None

    def close(self, status: str = "FINISHED") -> None:
        """Finish the pending publication, then end the MLflow run as FINISHED, FAILED or KILLED."""
        try:
            self.publisher.close()
        finally:
            if self.tracker:
                self.tracker.close(status)

    def _restore(self, path: Path) -> None:
        check_same_training(path, load_state(path).get("spec"), self.spec)
        state = restore_learner(self.learner, path, self.models.head)
        published = state["published"]  # re-summed: checkpoints before CRC-32 hold another kind of checksum
        self.publisher.replace(WeightSnapshot.of(published["state"], published["version"]))
        self.flops = FlopCounter(**{k: v for k, v in state["flops"].items() if k != "total"})
        self.counters = Counters(**state["counters"])
        self.eval_history, self.run_id = state["eval_history"], state["mlflow_run_id"]
        torch.set_rng_state(state["torch_rng"])

    def checkpoint(self, learner_state: dict | None = None) -> str:
        """Write a checkpoint; `learner_state` is the learner's, taken right after the step (with ZeRO it is a
        gather that the other ranks join then, not after evaluation)."""
        state = {"learner": learner_state or self.learner.state_dict(), "published": vars(self.published),
                 "flops": self.flops.as_dict(), "counters": vars(self.counters), "eval_history": self.eval_history,
                 "mlflow_run_id": self.run_id, "torch_rng": torch.get_rng_state(),
                 "spec": training_fields(self.spec)}
        return str(save_checkpoint(self.spec.run_dir, self.step, self.drafter, state,
                                   keep_last=self.spec.tracking.keep_last, resumed_from=self.resumed_from))

    # -- training ----------------------------------------------------------------------------------------------

    def is_stale(self, item: ScoredItem) -> bool:
        return self.step - item.batch.draft_version > self.spec.resources.max_policy_lag

    def discard(self, item: ScoredItem) -> None:
        """A batch too old to train on: counted (and its compute still paid), never trained; with `engine: ray` it
        is then re-produced with newer weights."""
        self.counters.stale_batches += 1
        self._add_flops(item)

    def train_step(self, items: list[ScoredItem]) -> StepReport:
        """One optimizer step on whole rollout batches (in index order, so any engine takes the same step)."""
        t0 = time.perf_counter()
        self.publisher.check()  # a failed publication stops the run here, at the step after it
        items = sorted(items, key=lambda it: it.batch.index)
        micro = self.learner.trainable([mb for it in items for mb in it.micro_batches])
        world, norm = self.learner.group.world, step_norm(micro, self.spec.loss)
        if self.spec.optim.micro_batch_tokens is not None:  # ranks share sequences; each packs its own under the budget
            micro = [row for mb in micro for row in sequence_rows(mb)]
        elif self.spec.optim.backend == "deepspeed" and len(micro) % world:
            raise OpdError(f"optim.backend deepspeed: {len(micro)} micro-batches per step do not split evenly over "
                           f"{world} learner ranks (make rollout.batch_size a multiple of optim.micro_batch_size)")
        if self.peers:
            self.peers.launch([shard(micro, r, world) for r in range(1, world)], norm)
        metrics = self.learner.train_step(shard(micro, 0, world), norm)
        learner_state = self.learner.state_dict() if checkpoint_due(self.spec, self.step) else None
        if self.peers:
            self.peers.join()
        for it in items:
            self._add_flops(it)
        self.counters.trained_batches += len(items)
        self.counters.trained_sequences += sum(len(it.batch.records) for it in items)
        self.counters.trained_tokens += sum(it.batch.tokens for it in items)
        self.counters.trained_anchors += sum(r.num_steps for it in items for r in it.batch.records)
        if self.step % self.spec.resources.broadcast_every == 0:
            self.publisher.submit(self.drafter.state_dict(), self.step)  # finished in the background
        self.counters.busy_s += time.perf_counter() - t0
        report = StepReport(self.step, self._metrics(metrics, items, time.perf_counter() - t0))
        self._periodic(report, learner_state)
        return report

    def _add_flops(self, item: ScoredItem) -> None:
        self.flops.target_forward += item.batch.flops.target_forward + item.scorer_flops
        self.flops.drafter_forward += item.batch.flops.drafter_forward

    def _metrics(self, m: StepMetrics, items: list[ScoredItem], step_time: float) -> dict[str, float]:
        stats = AcceptanceStats.from_records([r for it in items for r in it.batch.records],
                                             self.drafter.block_size)
        out = {"loss": m.loss, "loss_acc": m.loss_acc, "loss_rej": m.loss_rej, "grad_norm": m.grad_norm, "lr": m.lr,
               "skipped_nonfinite": float(m.skipped), "rollout_tau": stats.tau_token_weighted,
               "policy_lag": max(self.step - 1 - it.batch.draft_version for it in items),
               "step_time_s": step_time, "stale_batches": self.counters.stale_batches,
               # the paper's x-axis: its "steps" are rollout batches (the authors' global_steps)
               "rollout_batches": self.counters.trained_batches, "sequences": self.counters.trained_sequences}
        out.update({f"accept_ge_{k}": v for k, v in enumerate(stats.survival, start=1)})
        out.update({f"first_reject_{k}": v for k, v in enumerate(stats.first_rejection[:-1], start=1)})
        out["first_reject_full_accept"] = stats.first_rejection[-1]
        out.update(_expected_metrics(items))
        flops = self.flops
        flops.drafter_train = self.learner.flops.drafter_train
        out.update({f"flops_{k}": v for k, v in flops.as_dict().items()})
        return out

    def _periodic(self, report: StepReport, learner_state: dict | None) -> None:
        """Log the step, hand an eval due now to the evaluator, log the evals that came back (the last step waits
        for all of them, so the run ends with its final eval logged and checkpointed), then checkpoint."""
        if self.tracker:
            self.tracker.log(report.metrics, self.step)
        every, last = self.spec.eval.every, self.step == self.spec.steps
        if self.evals and ((every and self.step % every == 0) or last):
            self.evals.submit(self._snapshot())
        report.evals = self.collect_evals(wait=last)
        if checkpoint_due(self.spec, self.step):
            report.checkpoint = self.checkpoint(learner_state)

    # -- evaluation --------------------------------------------------------------------------------------------

    def _snapshot(self) -> WeightSnapshot:
        """This step's weights as published (the last publication when it is this step's)."""
        if self.published.version == self.step:
            return self.published
        return WeightSnapshot.of(self.drafter.state_dict(), self.step)

    def collect_evals(self, *, wait: bool = False) -> dict[int, list[EvalRow]]:
        """Log the evaluations that have come back, each at the step it evaluated; step -> rows. With
        `eval.stop_on_collapse` a collapsed τ stops the run here: with an evaluator actor that is when the result
        arrives, a step or more after the step it evaluated."""
        done = self.evals.finished(wait) if self.evals else []
        for result in done:
            self._log_eval(result)
        return {result.step: result.rows for result in done}

    def _log_eval(self, result: EvalResult) -> None:
        rows, step = result.rows, result.step
        best = max((h[f"eval_tau_{rows[0].sampling}"] for h in self.eval_history.values()), default=None)
        self.eval_history[step] = {f"eval_tau_{r.sampling}": r.tau for r in rows}
        collapsed = self._collapsed(rows[0].tau, best)
        if self.tracker:
            expected = {k: v for r in rows for rule, e in r.expected.items()
                        for k, v in e.metrics(f"eval_expected_{rule}_on_{r.sampling}_").items()}
            self.tracker.log({**self.eval_history[step], **expected, "tau_collapse": float(collapsed)}, step)
        if collapsed and self.spec.eval.stop_on_collapse:
            raise OpdError(f"held-out τ collapsed at step {step}: {rows[0].tau:.3f} < "
                           f"{self.spec.eval.collapse_ratio} x best {best:.3f} (eval.collapse_ratio; the last "
                           f"good checkpoint is in {self.spec.run_dir / 'checkpoints'})")

    def _collapsed(self, tau: float, best: float | None) -> bool:
        ratio = self.spec.eval.collapse_ratio
        return ratio is not None and best is not None and tau < ratio * best


def _expected_metrics(items: list[ScoredItem]) -> dict[str, float]:
    """The step's rollout diagnostic: expected τ and a_k per eval setting, over all its drafted blocks."""
    names = [name for name in items[0].acceptance if all(name in it.acceptance for it in items)]
    rooms = [r.rooms for it in items for r in it.batch.records]
    out: dict[str, float] = {}
    for name in names:
        found = ExpectedAcceptance.of(torch.cat([it.acceptance[name] for it in items]), rooms)
        out.update(found.metrics(f"rollout_expected_{name}_"))
    return out


class LearnerRank:
    """Learner rank r > 0: the same drafter and optimizer (on the target's embedding and LM head, not the
    target), stepping on its shard of each step. Rank 0 alone tracks, evaluates, checkpoints and publishes."""

    def __init__(self, spec: ExperimentSpec, group: Group) -> None:
        self.spec = spec
        models = build_learner_models(spec)
        self.head = models.head
        self.learner = Learner(spec, models.drafter, group)

    def start(self, checkpoint: str | None) -> None:
        """Resume from the checkpoint rank 0 restored (None: a fresh run)."""
        if checkpoint is not None:
            restore_learner(self.learner, Path(checkpoint), self.head)

    def train_step(self, micro_batches: list[ScoredBatch], norm: StepNorm) -> None:
        self.learner.train_step(micro_batches, norm)
        if checkpoint_due(self.spec, self.learner.step):
            self.learner.state_dict()  # this rank's part of rank 0's checkpoint (a gather under ZeRO)
