"""`engine: local`: the synchronous single-process Draft-OPD loop, rollout → replay → loss → step.

It is the reference the Ray path is tested against (with `max_policy_lag: 0` they take the same steps) and the
easiest place to debug. Checkpoints carry everything needed to resume to the same state as an uninterrupted run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.progress import TextColumn

from opd.data import train_prompts
from opd.eval import EvalRow
from opd.models.drafter import DFlashDrafter
from opd.progress import progress_bar
from opd.replay import score_micro_batches
from opd.spec import ExperimentSpec
from opd.train.flops import target_matmul_params
from opd.train.rollout import AnchorBatch, RolloutWorker
from opd.train.session import LearnerSession, ScoredItem


@dataclass
class TrainResult:
    steps: int
    losses: list[float] = field(default_factory=list)  # per step taken in this process
    evals: dict[int, list[EvalRow]] = field(default_factory=dict)  # step -> rows
    checkpoint: str | None = None
    run_id: str | None = None


def copy_drafter(drafter: DFlashDrafter) -> DFlashDrafter:
    """A separate drafter with the same weights and the same shared target modules (the rollout's copy)."""
    clone = DFlashDrafter(drafter.config, drafter.embed_tokens, drafter.lm_head).to(drafter.fc.weight.device)
    clone.load_state_dict(drafter.state_dict())
    return clone


class Scorer:
    """Teacher replay of whole rollout batches; the ReplayScorerActor owns one of these."""

    def __init__(self, spec: ExperimentSpec, target) -> None:
        self.spec, self.target = spec, target
        self.params = target_matmul_params(target.model)

    def __call__(self, batch: AnchorBatch) -> ScoredItem:
        micro = score_micro_batches(self.target, batch, self.spec)
        tokens = sum(int(m.context_valid.shape[0] * m.features.shape[1]) for m in micro)
        return ScoredItem(batch, micro, scorer_flops=2.0 * self.params * tokens)


def progress_columns() -> tuple[TextColumn, TextColumn]:
    return TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("τ {task.fields[tau]:.3f}")


class LocalTrainer:
    """Session + rollout worker + scorer in one process; `run()` trains to the step budget, resuming if it can."""

    def __init__(self, spec: ExperimentSpec, *, track: bool = True) -> None:
        self.spec = spec
        self.session = LearnerSession(spec, track=track)
        m = self.session.models
        prompts = train_prompts(spec.data, m.tokenizer)
        self.rollout = RolloutWorker(spec, m.target, copy_drafter(self.session.drafter), m.eos_id, prompts)
        self.scorer = Scorer(spec, m.target)
        self.per_step = spec.optim.batch_size // spec.rollout.batch_size

    @property
    def learner(self):
        return self.session.learner

    def train_step(self):
        step = self.session.step
        items = [self.scorer(self.rollout.run(step * self.per_step + j)) for j in range(self.per_step)]
        report = self.session.train_step(items)
        snapshot = self.session.published
        if snapshot.version != self.rollout.draft_version:
            self.rollout.load_drafter(snapshot.verified().state, snapshot.version)
        return report

    def start(self) -> bool:
        """Resume the session if it can and hand rollout the published weights; True when resumed."""
        s = self.session
        resumed = s.start()
        self.rollout.load_drafter(s.published.verified().state, s.published.version)
        return resumed

    def run(self, *, stop_after: int | None = None) -> TrainResult:
        """Train to `spec.steps` (or stop after `stop_after` steps in this call, as a crash would)."""
        s = self.session
        resumed = self.start()
        result = TrainResult(steps=s.step, run_id=s.run_id)
        if not resumed:
            result.evals[0] = s.evaluate_and_log()
        with progress_bar(*progress_columns()) as bar:
            task = bar.add_task("draft-opd", total=self.spec.steps, completed=s.step, loss=float("nan"),
                                tau=float("nan"))
            while s.step < self.spec.steps and (stop_after is None or stop_after > 0):
                report = self.train_step()
                result.losses.append(report.metrics["loss"])
                result.evals.update({report.step: report.evals} if report.evals else {})
                result.checkpoint = report.checkpoint or result.checkpoint
                bar.update(task, completed=s.step, loss=report.metrics["loss"], tau=report.metrics["rollout_tau"])
                stop_after = None if stop_after is None else stop_after - 1
        result.steps = s.step
        s.close()
        return result


def run_train(spec: ExperimentSpec) -> int:
    if spec.engine == "ray":
        from actors.driver import run_ray

        result = run_ray(spec)
    else:
        result = LocalTrainer(spec).run()
    print(f"trained to step {result.steps}; checkpoint: {result.checkpoint}; MLflow run {result.run_id} "
          f"in {spec.tracking_uri}")
    return 0
