"""`opd run` (what `make run` calls): Draft-OPD from the warm drafter, with τ before and after.

1. Evaluate the warm drafter on the held-out prompts (greedy and sampled, with the autoregressive baseline).
2. Train with the spec's engine (Ray by default) — rollout, replay scorer and learner actors.
3. Evaluate the trained drafter the same way, print both as one table, plot held-out τ over training steps,
   and log the table and the plot to the run's MLflow run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from opd.data import eval_prompts
from opd.eval import EvalRow, evaluate
from opd.models.build import build_models
from opd.spec import ExperimentSpec


def held_out_eval(spec: ExperimentSpec, drafter_path: str | None) -> list[EvalRow]:
    models = build_models(spec, drafter_path)
    prompts = eval_prompts(spec.data, models.tokenizer, spec.eval.num_prompts)
    e = spec.eval
    return evaluate(models, prompts, e.sampling, max_new_tokens=e.max_new_tokens, batch_size=e.batch_size,
                    seed=spec.seed, baseline=True, static_cache=spec.rollout.static_cache)


def comparison_table(before: list[EvalRow], after: list[EvalRow]) -> Table:
    table = Table(title="Held-out τ and speedup: warm drafter → Draft-OPD")
    for column in ("sampling", "τ before", "τ after", "Δτ", "speedup before", "speedup after"):
        table.add_column(column, justify="right")
    for b, a in zip(before, after):
        table.add_row(b.sampling, f"{b.tau:.3f}", f"{a.tau:.3f}", f"{(a.tau / b.tau - 1):+.1%}",
                      f"{b.speedup:.2f}x", f"{a.speedup:.2f}x")
    return table


def plot_tau(history: dict[int, dict[str, float]], path: Path) -> None:
    """Held-out τ over training steps, one line per sampling setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(history)
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({k for h in history.values() for k in h}):
        ax.plot(steps, [history[s].get(key) for s in steps], marker="o", label=key.removeprefix("eval_tau_"))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out τ (acceptance length)")
    ax.set_title("Draft-OPD on the tiny target")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_main(spec: ExperimentSpec) -> int:
    console = Console()
    started = time.perf_counter()
    run_dir = spec.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]Draft-OPD[/] on {spec.models.target_path}, engine {spec.engine}, {spec.steps} steps; "
                  f"run directory {run_dir}")
    before = held_out_eval(spec, spec.models.drafter_path)
    if spec.engine == "ray":
        from actors.driver import run_ray

        result = run_ray(spec)
    else:
        from opd.train.local import LocalTrainer

        result = LocalTrainer(spec).run()
    after = held_out_eval(spec, result.checkpoint)
    evals = {**result.evals, 0: before}  # step 0 is the warm drafter, measured by the driver
    history = {step: {f"eval_tau_{r.sampling}": r.tau for r in rows} for step, rows in sorted(evals.items())}
    plot = run_dir / "tau_over_steps.png"
    plot_tau(history, plot)
    table = comparison_table(before, after)
    console.print(table)
    summary = {"before": [vars(r) for r in before], "after": [vars(r) for r in after], "history": history,
               "checkpoint": result.checkpoint, "minutes": (time.perf_counter() - started) / 60}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _log_to_mlflow(spec, result.run_id, before, after, [plot, run_dir / "summary.json"])
    console.print(f"Done in {summary['minutes']:.1f} min.\n"
                  f"  checkpoint (DFlash format): {result.checkpoint}\n"
                  f"  τ plot: {plot}\n"
                  f"  MLflow run {result.run_id}: mlflow ui --backend-store-uri {spec.tracking_uri}\n"
                  f"  Ray dashboard (while a run is live): http://127.0.0.1:8265")
    return 0


def _log_to_mlflow(spec: ExperimentSpec, run_id: str | None, before, after, artifacts: list[Path]) -> None:
    """Add the before/after table and the plot to the training run (the learner opened it)."""
    if run_id is None:
        return
    from opd.tracking import Tracker

    tracker = Tracker(spec, run_id)
    metrics = {f"heldout_{name}_{r.sampling}_{when}": value
               for when, rows in (("before", before), ("after", after)) for r in rows
               for name, value in (("tau", r.tau), ("speedup", r.speedup))}
    tracker.log(metrics, spec.steps)
    for path in artifacts:
        tracker.artifact(path)
