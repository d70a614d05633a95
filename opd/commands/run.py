"""`opd run` (what `make run` calls): Draft-OPD from the warm drafter, with τ before and after.

1. Train with the spec's engine (Ray by default) through the launcher, `opd.commands.launch.train`. Its
   periodic evaluations measure held-out τ of the warm drafter (step 0) and of the trained one (the last step).
2. Measure the speedup of both, side by side in one evaluator (`opd.commands.launch.held_out_eval`: this process,
   or an evaluator actor on the Ray cluster), reusing the τ the training run measured rather than measuring it
   again; print both as one table, plot held-out τ over training steps, and log the table and the plot to the
   run's MLflow run.
3. With `eval.suite`, evaluate both on that benchmark suite (the same evaluator place) and print, write and log
   its table in the paper's layout, beside the ceiling (opd/eval/suite.py).

`opd train` is step 1 alone. Both first lock the run directory and check every input (`open_run`), so a second
run in the same directory, an unwritable directory or a bad prompt line is one line before any compute.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from opd.commands import launch
from opd.commands.export import export_command
from opd.commands.preflight import check_inputs
from opd.commands.shell import shell_line
from opd.eval.row import EvalRow
from opd.eval.suite_report import markdown, metrics, write_report
from opd.outputs import write_text_atomic
from opd.progress import table_console
from opd.run_dir import RunDirLock
from opd.spec import ExperimentSpec, LossSpec, SamplingSpec, ServingSpec
from opd.tracking import end_run, ensure_store, run_status
from opd.train.checkpoint import checkpoint_step, remove_partial_checkpoints
from opd.train.evaluator import Checkpoint
from opd.train.ledger import fault_line
from opd.train.messages import TrainResult


@contextlib.contextmanager
def open_run(spec: ExperimentSpec) -> Iterator[None]:
    """Hold the run directory for the duration of a training command, after checking, before any model or actor
    starts, what would otherwise fail minutes in: the directory is writable and no other run holds it, every input
    is usable (opd/commands/preflight.py), and the MLflow store exists (created atomically)."""
    with RunDirLock(spec.run_dir):
        remove_partial_checkpoints(spec.run_dir)
        check_inputs(spec)
        ensure_store(spec.tracking_uri)
        yield


def run_train(spec: ExperimentSpec) -> int:
    """`opd train`: Draft-OPD training only, resuming from the run directory's last checkpoint."""
    with open_run(spec):
        result = launch.train(launch.held_out_samples(spec))
    print(f"trained to step {result.steps}; checkpoint: {result.checkpoint}")
    print(f"MLflow run {result.run_id}: {mlflow_ui(spec)}")
    if result.checkpoint is not None:
        print(f"to serve it in vLLM: {export_line(spec, result.checkpoint)}")
    _print_faults(result)
    return 0


def _print_faults(result: TrainResult) -> None:
    """The ledger's line when an actor died or a batch was lost (the run recovered, or it would not be here)."""
    if result.ledger is not None and (line := fault_line(result.ledger)):
        print(line)


def mlflow_ui(spec: ExperimentSpec) -> str:
    """The command that opens this run's MLflow store, printed on one line (never wrapped: it is copied)."""
    return shell_line("mlflow", "ui", "--backend-store-uri", spec.tracking_uri)


def export_line(spec: ExperimentSpec, checkpoint: str) -> str:
    """The `opd export` command that writes the trained checkpoint as vLLM serves it, under RUN_DIR/export/."""
    return export_command(checkpoint, spec.models.drafter.kind, spec.run_dir / "export" / Path(checkpoint).name,
                          spec.models.target_path)


def describe_recipe(spec: ExperimentSpec) -> str:
    """The recipe a run trained with, in words, so a table says what produced it."""
    loss, kinds = spec.loss, {"mixed": "forward KL on accepted, reverse KL on rejected slots",
                              "all_forward": "forward KL", "all_reverse": "reverse KL"}
    objectives = {"neg_log_alpha": "-log α", "one_minus_alpha": "1 - α", "lk": f"the LK hybrid (η {loss.lk_eta:g})",
                  "expected_length": "the expected block length"}
    if loss == LossSpec():
        words = "the paper's loss (forward KL on accepted, γ-decayed reverse KL on rejected slots)"
    elif loss.on_acceptance:
        words = f"acceptance of drafts sampled from q: {objectives[loss.objective]}"
        if loss.prefix_gradient == "score":
            words += " with the prefix's score-function term"
    else:
        words = kinds[loss.kl_mode]
        if loss.first_rejected_only:
            words += " on the accepted prefix and the first rejected slot"
        if loss.acceptance_weight:
            words += f", expected-acceptance term x{loss.acceptance_weight:g}"
    if spec.replay.teacher == "served":
        words += ", teacher as the server verifies"
    elif spec.replay.teacher_temperature != 1.0:
        words += f", teacher at T={spec.replay.teacher_temperature:g}"
    temperatures = sorted({s.temperature for s in spec.rollout.settings})
    rollouts = "greedy rollouts" if temperatures == [0.0] else \
        "rollouts at " + " and ".join(f"T={t:g}" for t in temperatures)
    if spec.serving is not None:
        s = spec.serving
        rollouts += f"; served {decoded_with(s)}"
    return f"{words}; {rollouts}"


def decoded_with(setting: ServingSpec | SamplingSpec) -> str:
    """A setting in words: the target's sampling and how drafts are made."""
    target = "greedy" if setting.temperature == 0 else \
        f"T={setting.temperature:g}" + (f", top-p {setting.top_p:g}" if setting.top_p < 1 else "") + \
        (f", top-k {setting.top_k}" if setting.top_k else "")
    return f"{target}, {'drafts sampled from q' if setting.draft == 'sample' else 'point-mass drafts'}"


def comparison_table(spec: ExperimentSpec, before: list[EvalRow], after: list[EvalRow]) -> Table:
    n = before[0].prompts
    rows = "; ".join(f"{s.name} = {decoded_with(s)}" for s in spec.eval.sampling
                     if any(r.sampling == s.name for r in before))
    table = Table(title=f"Held-out τ (± 95% interval over {n} prompts) and speedup: warm drafter → Draft-OPD",
                  caption=f"rows: {rows}\n{spec.name}: {describe_recipe(spec)}")
    for column in ("sampling", "τ before", "τ after", "Δτ", "ceiling", "speedup before", "speedup after"):
        table.add_column(column, justify="right")
    for b, a in zip(before, after):
        ceiling = "-" if b.ceiling is None else f"{b.ceiling:.3f}"  # the argmax oracle on the same samples
        table.add_row(b.sampling, f"{b.tau:.3f} ± {b.tau_ci:.3f}", f"{a.tau:.3f} ± {a.tau_ci:.3f}",
                      f"{(a.tau / b.tau - 1):+.1%}", ceiling, _speedup(b), _speedup(a))
    return table


def _speedup(row: EvalRow) -> str:
    return "-" if row.speedup is None else f"{row.speedup:.2f}x"


def plot_tau(history: dict[int, dict[str, float]], path: Path) -> None:
    """Held-out τ over training steps, one line per sampling setting (a step without a setting's τ: a gap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(history)
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({k for h in history.values() for k in h}):
        taus = [history[s].get(key, math.nan) for s in steps]
        ax.plot(steps, taus, marker="o", label=key.removeprefix("eval_tau_"))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out τ (acceptance length)")
    ax.set_title("Draft-OPD on the tiny target")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_main(spec: ExperimentSpec) -> int:
    console = table_console()
    started = time.perf_counter()
    with open_run(spec):
        console.print(f"[bold]Draft-OPD[/] on {spec.models.target_path}, engine {spec.engine}, {spec.steps} steps; "
                      f"run directory {spec.run_dir}", soft_wrap=True)  # a path to copy: never wrapped
        spec = launch.held_out_samples(spec)  # held-out τ offline from here on (eval.offline)
        result = launch.train(spec)
        try:
            summary = _after_training(spec, console, result, started)
        except BaseException as exc:
            with contextlib.suppress(Exception):  # the learner closed the run FINISHED; never mask `exc`
                end_run(spec, result.run_id, run_status(exc))
            raise
    suite = f"  suite table: {spec.run_dir / 'suite' / 'table.md'}\n" if spec.eval.suite is not None else ""
    print(f"Done in {summary['minutes']:.1f} min.\n"
          f"  checkpoint ({spec.models.drafter.kind} drafter, its public format): {result.checkpoint}\n"
          f"  τ plot: {spec.run_dir / 'tau_over_steps.png'}\n"
          f"{suite}"
          f"  MLflow run {result.run_id}: {mlflow_ui(spec)}")
    if result.checkpoint is not None:
        print(f"  to serve it in vLLM: {export_line(spec, result.checkpoint)}")
    _print_faults(result)
    return 0


def before_and_after(spec: ExperimentSpec, result: TrainResult) -> list[Checkpoint]:
    """The warm and the trained drafter, each with the held-out rows this process's training run measured of
    those very weights: step 0 when it started fresh, and the step of its final checkpoint. A resumed run did not
    measure step 0 here, so the evaluator measures it."""
    final = result.evals.get(checkpoint_step(result.checkpoint)) if result.checkpoint else None
    return [Checkpoint(spec.models.drafter_path, result.evals.get(0)), Checkpoint(result.checkpoint, final)]


def _after_training(spec: ExperimentSpec, console: Console, result: TrainResult, started: float) -> dict:
    """Measure both drafters' speedup, print the table (and the suite's), write the plot and summary, and log them
    to MLflow."""
    run_dir = spec.run_dir
    before, after = launch.held_out_eval(spec, before_and_after(spec, result))
    evals = {**result.evals, 0: before}  # step 0 is the warm drafter, measured before training
    history = {step: {f"eval_tau_{r.sampling}": r.tau for r in rows} for step, rows in sorted(evals.items())}
    plot = run_dir / "tau_over_steps.png"
    plot_tau(history, plot)
    table = comparison_table(spec, before, after)
    console.print(table)
    suite = spec.eval.suite
    suite_metrics, suite_files = suite_table(spec, suite, result) if suite is not None else ({}, [])
    summary = {"before": [asdict(r) for r in before], "after": [asdict(r) for r in after], "history": history,
               "checkpoint": result.checkpoint, "minutes": (time.perf_counter() - started) / 60,
               "ledger": result.ledger}
    write_text_atomic(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    _log_to_mlflow(spec, result.run_id, before, after, [plot, run_dir / "summary.json", *suite_files], suite_metrics)
    return summary


def suite_table(spec: ExperimentSpec, suite: str, result: TrainResult) -> tuple[dict[str, float], list[Path]]:
    """The benchmark table a paper reports (`suite`: `eval.suite`): the warm and the trained drafter per benchmark
    beside the ceiling, printed and written under RUN_DIR/suite/ (samples included, so a rerun resumes them).
    Returns its MLflow metrics and files."""
    out = spec.run_dir / "suite"
    assert result.checkpoint is not None  # training's last step writes one (`checkpoint_due`); a resume had one
    drafters = {"warm": spec.models.drafter_path or "random", "draft-opd": result.checkpoint}
    table = launch.suite_eval(spec, suite, drafters, out)
    print(markdown(table))
    return metrics(table), write_report(table, out)


def _log_to_mlflow(spec: ExperimentSpec, run_id: str | None, before, after, artifacts: list[Path],
                   extra: dict[str, float]) -> None:
    """Add the before/after table, the plot and the suite's metrics (`extra`) to the training run (the learner
    opened it)."""
    if run_id is None:
        return
    from opd.tracking import Tracker

    tracker = Tracker(spec, run_id, resume=False)
    held_out = {f"heldout_{name}_{r.sampling}_{when}": value
                for when, rows in (("before", before), ("after", after)) for r in rows
                for name, value in (("tau", r.tau), ("tau_ci", r.tau_ci), ("speedup", r.speedup)) if value is not None}
    tracker.log({**held_out, **extra}, spec.total_steps)
    for path in artifacts:
        tracker.artifact(path)
