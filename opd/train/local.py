"""`engine: local`: the synchronous single-process Draft-OPD loop, rollout → replay → loss → step.

It is the reference the Ray path is tested against (with `max_policy_lag: 0` they take the same steps) and the
easiest place to debug. Checkpoints carry everything needed to resume to the same state as an uninterrupted run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from opd.acceptance import AcceptanceStats
from opd.data import load_prompts
from opd.eval import EvalRow, evaluate
from opd.models.build import Models, build_models
from opd.models.drafter import DFlashDrafter
from opd.progress import progress_bar
from opd.replay import ScoredBatch, score_micro_batches
from opd.spec import ExperimentSpec
from opd.tracking import Tracker
from opd.train.checkpoint import latest_checkpoint, load_state, save_checkpoint
from opd.train.flops import target_matmul_params
from opd.train.learner import Learner, StepMetrics
from opd.train.rollout import AnchorBatch, RolloutWorker


@dataclass
class TrainResult:
    steps: int
    losses: list[float] = field(default_factory=list)  # per step taken in this process
    evals: dict[int, list[EvalRow]] = field(default_factory=dict)  # step -> rows
    checkpoint: str | None = None
    run_id: str | None = None


def copy_drafter(drafter: DFlashDrafter) -> DFlashDrafter:
    """A separate drafter with the same weights and the same shared target modules (the rollout's copy)."""
    clone = DFlashDrafter(drafter.config, drafter.embed_tokens, drafter.lm_head)
    clone.load_state_dict(drafter.state_dict())
    return clone


def step_metrics(m: StepMetrics, batches: list[AnchorBatch], learner_version: int, block_size: int) -> dict:
    """What a step logs: losses, rollout acceptance (τ, survival, first rejection) and policy lag."""
    stats = AcceptanceStats.from_records([r for b in batches for r in b.records], block_size)
    out = {"loss": m.loss, "loss_acc": m.loss_acc, "loss_rej": m.loss_rej, "grad_norm": m.grad_norm, "lr": m.lr,
           "skipped_nonfinite": float(m.skipped), "rollout_tau": stats.tau_token_weighted,
           "policy_lag": max(learner_version - b.draft_version for b in batches)}
    out.update({f"accept_ge_{k}": v for k, v in enumerate(stats.survival, start=1)})
    out.update({f"first_reject_{k}": v for k, v in enumerate(stats.first_rejection[:-1], start=1)})
    out["first_reject_full_accept"] = stats.first_rejection[-1]
    return out


class LocalTrainer:
    """Everything for one run in one process; `run()` trains to the step budget, resuming if it can."""

    def __init__(self, spec: ExperimentSpec) -> None:
        self.spec = spec
        self.models = build_models(spec)
        tok, data = self.models.tokenizer, spec.data
        self.train_prompts = load_prompts(data.train_prompts, tok, max_prompt_tokens=data.max_prompt_tokens,
                                          skip_bad_lines=data.skip_bad_lines).prompts
        self.eval_prompts = load_prompts(data.eval_prompts, tok, max_prompt_tokens=data.max_prompt_tokens,
                                         skip_bad_lines=data.skip_bad_lines, limit=spec.eval.num_prompts).prompts
        self.learner = Learner(spec, self.models.drafter)
        self.rollout = RolloutWorker(spec, self.models.target, copy_drafter(self.models.drafter),
                                     self.models.eos_id, self.train_prompts)
        self.per_step = spec.optim.batch_size // spec.rollout.batch_size
        self.target_params = target_matmul_params(self.models.target.model)
        self.eval_history: dict[int, dict[str, float]] = {}
        self.run_id: str | None = None

    # -- one step ----------------------------------------------------------------------------------------------

    def train_step(self) -> tuple[StepMetrics, list[AnchorBatch]]:
        step = self.learner.step
        batches = [self.rollout.run(step * self.per_step + j) for j in range(self.per_step)]
        scored = [s for b in batches for s in self.score_batch(b)]
        metrics = self.learner.train_step(scored)
        if self.learner.step % self.spec.resources.broadcast_every == 0:
            self.rollout.load_drafter(self.learner.drafter.state_dict(), self.learner.step)
        return metrics, batches

    def score_batch(self, batch: AnchorBatch) -> list[ScoredBatch]:
        """Teacher replay of one rollout batch, in micro-batches (the scorer actor does exactly this)."""
        scored = score_micro_batches(self.models.target, batch, self.spec)
        for s in scored:
            self.learner.flops.add_target(self.target_params, int(s.context_valid.shape[0] * s.features.shape[1]))
        return scored

    # -- evaluation, checkpoints -------------------------------------------------------------------------------

    def evaluate(self, *, baseline: bool = False) -> list[EvalRow]:
        e = self.spec.eval
        models = Models(self.models.target, self.learner.drafter, self.models.tokenizer)
        return evaluate(models, self.eval_prompts, e.sampling, max_new_tokens=e.max_new_tokens,
                        batch_size=e.batch_size, seed=self.spec.seed, baseline=baseline,
                        draft_version=self.learner.step)

    def state(self) -> dict:
        return {"learner": self.learner.state_dict(), "rollout_version": self.rollout.draft_version,
                "rollout_drafter": self.rollout.decoder.drafter.state_dict(), "rollout_flops": self.rollout.flops,
                "eval_history": self.eval_history, "mlflow_run_id": self.run_id,
                "torch_rng": torch.get_rng_state()}

    def resume(self) -> int | None:
        path = latest_checkpoint(self.spec.run_dir)
        if path is None:
            return None
        state = load_state(path)
        self.learner.drafter.load_state_dict(DFlashDrafter.from_pretrained(path, self.models.target).state_dict())
        self.learner.load_state_dict(state["learner"])
        self.rollout.load_drafter(state["rollout_drafter"], state["rollout_version"])
        self.rollout.flops = state["rollout_flops"]
        self.eval_history, self.run_id = state["eval_history"], state["mlflow_run_id"]
        torch.set_rng_state(state["torch_rng"])
        return self.learner.step

    def checkpoint(self) -> str:
        return str(save_checkpoint(self.spec.run_dir, self.learner.step, self.learner.drafter, self.state()))

    # -- the loop ----------------------------------------------------------------------------------------------

    def run(self, *, track: bool = True, stop_after: int | None = None) -> TrainResult:
        """Train to `spec.steps` (or stop after `stop_after` steps in this call, as a crash would)."""
        resumed = self.resume()
        tracker = Tracker(self.spec, self.run_id) if track else None
        self.run_id = tracker.run_id if tracker else None
        result = TrainResult(steps=self.learner.step, run_id=self.run_id)
        if resumed is None:
            self._eval_and_log(tracker, result)
        columns = ("loss {task.fields[loss]:.4f}", "τ {task.fields[tau]:.3f}")
        with progress_bar(*(_text(c) for c in columns)) as bar:
            task = bar.add_task("draft-opd", total=self.spec.steps, completed=self.learner.step, loss=float("nan"),
                                tau=float("nan"))
            while self.learner.step < self.spec.steps and (stop_after is None or stop_after > 0):
                t0 = time.perf_counter()
                metrics, batches = self.train_step()
                logged = step_metrics(metrics, batches, self.learner.step - 1, self.learner.drafter.block_size)
                logged["step_time_s"] = time.perf_counter() - t0
                logged.update({f"flops_{k}": v for k, v in self._flops().items()})
                result.losses.append(metrics.loss)
                if tracker:
                    tracker.log(logged, self.learner.step)
                bar.update(task, completed=self.learner.step, loss=metrics.loss, tau=logged["rollout_tau"])
                self._periodic(tracker, result)
                stop_after = None if stop_after is None else stop_after - 1
        result.steps = self.learner.step
        if tracker:
            tracker.close()
        return result

    def _periodic(self, tracker: Tracker | None, result: TrainResult) -> None:
        step, every = self.learner.step, self.spec.eval.every
        if (every and step % every == 0) or step == self.spec.steps:
            self._eval_and_log(tracker, result)
        if step % self.spec.tracking.checkpoint_every == 0 or step == self.spec.steps:
            result.checkpoint = self.checkpoint()

    def _eval_and_log(self, tracker: Tracker | None, result: TrainResult) -> None:
        rows = self.evaluate()
        result.evals[self.learner.step] = rows
        self.eval_history[self.learner.step] = {f"eval_tau_{r.sampling}": r.tau for r in rows}
        if tracker:
            tracker.log(self.eval_history[self.learner.step], self.learner.step)

    def _flops(self) -> dict[str, float]:
        a, b = self.learner.flops.as_dict(), self.rollout.flops.as_dict()
        return {k: a[k] + b[k] for k in a}


def _text(fmt: str):
    from rich.progress import TextColumn

    return TextColumn(fmt)


def run_train(spec: ExperimentSpec) -> int:
    from opd.errors import OpdError

    if spec.engine != "local":
        raise OpdError("engine: 'ray' is not available yet in this version (expected engine: local; "
                       "run with --set engine=local)")
    result = LocalTrainer(spec).run()
    print(f"trained to step {result.steps}; checkpoint: {result.checkpoint}; MLflow run {result.run_id} "
          f"in {spec.tracking_uri}")
    return 0
