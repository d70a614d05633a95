"""`engine: local`: the synchronous single-process Draft-OPD loop, rollout → replay → loss → step.

It is the reference the Ray path is tested against (with `max_policy_lag: 0` they take the same steps) and the
easiest place to debug. Checkpoints carry everything needed to resume to the same state as an uninterrupted run.
One step: `RolloutWorker.run` (opd/train/rollout.py) drafts `spec.batches_per_step` AnchorBatches, `Scorer`
(opd/train/scorer.py) replays each through the target, `TrainingSession.train_step` (opd/train/session.py) takes
the optimizer step, and the drafter copy that drafts adopts the newly published `WeightSnapshot`: rollout's, or
with a rebuilt source (`rollout.source: target | samples`) the scorer's, which rebuilds the blocks. One target serves
rollout, scorer, the session's shared embedding and LM head, and the `Evaluator` (opd/train/evaluator.py), which
evaluates inline on a drafter copy of its own, as the Ray engine's evaluator actor does.
"""

from __future__ import annotations

from opd.data.prompts import train_prompts
from opd.models.build import LearnerModels, Models, build_models
from opd.models.protocol import clone_drafter
from opd.spec import ExperimentSpec
from opd.train.evaluator import Evaluator, InlineEvaluations
from opd.train.ledger import undisturbed
from opd.train.messages import StepReport, TrainResult
from opd.train.result import record_ledger, run_to
from opd.train.rollout import RolloutWorker
from opd.train.scorer import Scorer
from opd.train.session import TrainingSession


class LocalTrainer:
    """Session + rollout worker + scorer in one process; `run()` trains to the step budget, resuming if it can."""

    def __init__(self, spec: ExperimentSpec, *, track: bool = True) -> None:
        self.spec, self.track = spec, track
        m = self.models = build_models(spec)  # the target, the warm drafter (trained) and the tokenizer
        evaluator = Evaluator(spec, Models(m.target, clone_drafter(m.drafter), m.tokenizer))
        self.session = TrainingSession(spec, track=track, models=LearnerModels(m.target, m.drafter, m.tokenizer),
                                       evals=InlineEvaluations(evaluator))
        prompts = train_prompts(spec.data, m.tokenizer)
        self.rollout = RolloutWorker(spec, m.target, clone_drafter(m.drafter), m.eos_id, prompts)
        self.scorer = Scorer(spec, m.target, clone_drafter(m.drafter) if spec.rollout.rebuilt else None)
        self.per_step = spec.batches_per_step

    @property
    def learner(self):
        return self.session.learner

    def train_step(self) -> StepReport:
        step = self.session.step
        items = [self.scorer(self.rollout.run(step * self.per_step + j)) for j in range(self.per_step)]
        report = self.session.train_step(items)
        self._adopt_published()
        return report

    def _adopt_published(self) -> None:
        """Hand the newest published weights to whoever drafts: rollout's decoder, or the scorer that rebuilds."""
        snapshot = self.session.published
        drafts = self.scorer if self.spec.rollout.rebuilt else self.rollout
        if snapshot.version != drafts.draft_version:
            drafts.load_drafter(snapshot.verified().state, snapshot.version)

    def start(self, *, evaluate: bool = True) -> bool:
        """Start the session (resume, or evaluate the warm drafter as step 0 unless `evaluate` is False) and hand
        rollout the published weights; True when resumed."""
        resumed = self.session.start(evaluate=evaluate)
        self._adopt_published()
        return resumed

    def run(self, *, stop_after: int | None = None) -> TrainResult:
        """Train to `spec.steps` (or stop after `stop_after` steps in this call, as a crash would)."""
        s = self.session
        resumed = self.start()
        result = TrainResult(steps=s.step, run_id=s.run_id, evals={} if resumed else {0: s.start_evals})
        until = None if stop_after is None else min(self.spec.total_steps, s.step + stop_after)
        first = s.step
        run_to(self.spec, result, lambda _: [self.train_step()], until=until)
        record_ledger(self.spec, result, undisturbed((s.step - first) * self.per_step), track=self.track)
        s.close()
        return result
