"""The one result loop: step reports from either engine, folded into a `TrainResult` under a progress bar.

The local trainer (opd/train/local.py) and the Ray driver (actors/driver.py) differ only in `advance`, the call
that takes the learner to a given step and returns that step's reports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from rich.progress import TextColumn

from opd.progress import progress_bar
from opd.spec import ExperimentSpec
from opd.tracking import Tracker
from opd.train.checkpoint import latest_checkpoint
from opd.train.ledger import account_metrics
from opd.train.messages import StepReport, TrainResult


def progress_columns(replicas: bool = False) -> tuple[TextColumn, ...]:
    """The bar counts optimizer updates (the spec's steps); the rollout batches they trained on are shown beside,
    since papers often count those. Loss and τ are the last step's this invocation trained (`–` before one: a
    resumed run at its last step trains none). `replicas`: a column of the replicas each role runs (a Ray run,
    whose rollout and scorer replicas come and go with the cluster)."""
    columns = (TextColumn("{task.fields[batches]:,} rollout batches"), TextColumn("loss {task.fields[loss]}"),
               TextColumn("τ {task.fields[tau]}"))
    return (*columns, TextColumn("{task.fields[replicas]}")) if replicas else columns


def run_to(spec: ExperimentSpec, result: TrainResult, advance: Callable[[int], Iterable[StepReport]], *,
           until: int | None = None, label: str = "draft-opd",
           replicas: Callable[[], str] | None = None) -> TrainResult:
    """Advance one step at a time from `result.steps` to `until` (default `spec.steps`), recording each step's
    loss and checkpoint, and the held-out evaluations that came back, under the steps they evaluated, in `result`.
    `replicas`: the line of replicas running, shown after each step."""
    until = spec.total_steps if until is None else until
    step = result.steps
    if result.checkpoint is None and (resumed := latest_checkpoint(spec.run_dir)) is not None:
        result.checkpoint = str(resumed.resolve())  # a resumed run's drafter so far, even with no step here
    with progress_bar(*progress_columns(replicas is not None)) as bar:
        task = bar.add_task(label, total=spec.total_steps, completed=step, loss="–", tau="–",
                            batches=step * spec.batches_per_step, replicas=replicas() if replicas else "")
        while step < until:
            for report in advance(step + 1):
                step = report.step
                result.losses.append(report.metrics["loss"])
                result.evals.update(report.evals)
                result.checkpoint = report.checkpoint or result.checkpoint
                bar.update(task, completed=step, loss=f"{report.metrics['loss']:.4f}",
                           tau=f"{report.metrics['rollout_tau']:.3f}", batches=step * spec.batches_per_step,
                           replicas=replicas() if replicas else "")
    result.steps = step
    return result


def record_ledger(spec: ExperimentSpec, result: TrainResult, account: dict[str, int], *, track: bool) -> None:
    """Keep the ledger's account in `result` and, tracked, log it to the run's MLflow run at its last step
    (`ledger_lost`, ...): a batch lost with its producer and produced again changes no step, so without this no
    record says it happened."""
    result.ledger = account
    if track and result.run_id is not None:
        Tracker(spec, result.run_id, resume=False).log(account_metrics(account), result.steps)
