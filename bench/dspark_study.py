"""A drafter-family study in one command: arms of `opd reproduce` at matched training FLOPs on the shipped tiny
target, summarised per arm and seed. Issue 50's DSpark study (against DFlash 2, each with Draft-OPD at T=1.0 with
drafts sampled from q) is the default spec; issue 62's are configs/reproduce/xpress.yaml and mtp.yaml.

Runs `opd reproduce SPEC` (resumable: finished arms are kept in its out_dir), copies its report, plots and per-arm
JSON to the results directory (default bench/results/reproduce-dspark/), and writes there summary.json and
summary.md: per arm, held-out and reworded τ before (its own warm drafter; an SFT arm shares its Draft-OPD arm's)
and after its training in every eval setting, with the 95% interval over prompts, the held-out expected acceptance
per drafted slot, the steps and training FLOPs it spent, and what a block costs to draft (the counters of
opd/models/flops.py: the layers over the block's tokens, the head and the Markov bias at K-1 slots, DFlash 2's
convolution taps and selector). summary.md has one row per arm and seed, then per arm the mean over seeds, so the
docs' tables are read off it, not computed by hand.

    python bench/dspark_study.py [--spec configs/reproduce/dspark.yaml] [--set KEY=VALUE ...] [--results DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path
from typing import cast

from torch import nn

from opd.models.build import build_models
from opd.models.flops import DrafterParams
from opd.reproduce import ArmResult, load_reproduce_spec, run_reproduce
from opd.spec import load_spec

RESULTS = Path(__file__).parent / "results" / "reproduce-dspark"  # --results: a variant's own (a longer budget)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="configs/reproduce/dspark.yaml")
    parser.add_argument("--set", action="append", default=[], help="a top-level override of the reproduce spec")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the summary and reports go")
    args = parser.parse_args()
    results = args.results
    run_reproduce(args.spec, args.set)
    spec = load_reproduce_spec(args.spec, args.set)
    out = Path(spec.out_dir)
    (results / "arms").mkdir(parents=True, exist_ok=True)
    for report in [out / "results.md", *out.glob("*.png")]:
        shutil.copy(report, results / report.name)
    rows = []
    for arm in spec.arms:
        for seed in spec.seeds:
            source = out / "arms" / f"{arm.name}-seed{seed}.json"
            shutil.copy(source, results / "arms" / source.name)
            result = ArmResult(**json.loads(source.read_text()))
            rows.append(_row(result, _drafter_cost(spec.experiment, [*spec.set, *arm.set])))
    summary = {"spec": args.spec, "overrides": args.set, "arms": rows}
    (results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    report = _table(rows) + "\n" + _over_seeds(rows) + "\n" + _slots(rows)
    (results / "summary.md").write_text(report)
    print(report)


def _drafter_cost(experiment: str, overrides: list[str]) -> dict[str, float | int | str]:
    """The arm's warm drafter: its family, size and the FLOPs of one drafted block."""
    drafter = build_models(load_spec(experiment, overrides)).drafter
    params = DrafterParams.of(cast(nn.Module, drafter))  # every family is a module
    return {"family": type(drafter).__name__, "parameters": sum(p.numel() for p in drafter.parameters()),
            "block_flops": params.forward(context=0, blocks=1, slots=drafter.block_size - 1),
            "context_flops_per_token": params.forward(context=1, blocks=0, slots=0)}


def _row(result: ArmResult, cost: dict[str, float | int | str]) -> dict:
    """τ before and after per (family, setting) with its interval over prompts, the held-out expected acceptance
    per slot in each setting, and what the arm spent. An SFT arm has no "before": its warm drafter is the one the
    Draft-OPD arm of the same drafter evaluated."""
    def cells(rows: dict[str, list[dict]], key: str) -> dict[str, float]:
        return {f"{family} {r['sampling']}": r[key] for family, family_rows in rows.items() for r in family_rows}

    def slots(rows: dict[str, list[dict]]) -> dict[str, list[float]]:
        return {r["sampling"]: r["expected"][r["sampling"]]["slot"] for r in rows.get("heldout", [])
                if r.get("expected")}

    return {"arm": result.arm, "seed": result.seed, **cost, "steps": result.steps,
            "train_flops": result.flops["total"], "before": cells(result.initial_rows, "tau"),
            "after": cells(result.final_rows, "tau"), "before_ci": cells(result.initial_rows, "tau_ci"),
            "after_ci": cells(result.final_rows, "tau_ci"), "slots_before": slots(result.initial_rows),
            "slots_after": slots(result.final_rows), "minutes": result.minutes}


def _table(rows: list[dict]) -> str:
    cells = list(rows[0]["after"])
    lines = ["| arm | drafter | parameters | FLOPs per block | steps | training FLOPs | "
             + " | ".join(f"τ {c} before → after" for c in cells) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(cells)]
    for r in rows:
        moves = [f"{r['before'][c]:.3f} → {r['after'][c]:.3f}" if r["before"] else f"{r['after'][c]:.3f}"
                 for c in cells]
        lines.append(f"| {r['arm']} | {r['family']} | {r['parameters']:,} | {r['block_flops'] / 1e9:.4f} GFLOP | "
                     f"{r['steps']} | {r['train_flops']:.3g} | " + " | ".join(moves) + " |")
    return "\n".join(lines) + "\n"


def _by_arm(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["arm"], []).append(r)
    return out


def _cell(runs: list[dict], when: str, cell: str) -> str:
    """mean ± std over seeds [± the mean 95% interval over prompts] (per seed in parentheses): the spread over
    seeds and over prompts are different questions, so both are shown."""
    taus = [r[when][cell] for r in runs]
    std = statistics.stdev(taus) if len(taus) > 1 else 0.0
    ci = statistics.fmean(r[f"{when}_ci"][cell] for r in runs)
    return (f"{statistics.fmean(taus):.3f} ± {std:.3f} [±{ci:.3f}] ("
            + ", ".join(f"{t:.3f}" for t in taus) + ")")


def _over_seeds(rows: list[dict]) -> str:
    """Per arm, its warm drafter then after its training: τ over seeds in every (family, setting)."""
    cells = list(rows[0]["after"])
    lines = ["| arm | when | steps | training FLOPs | " + " | ".join(cells) + " |", "|---|---|---|---|" + "---|" * len(cells)]
    for arm, runs in _by_arm(rows).items():
        steps = f"{min(r['steps'] for r in runs)}–{max(r['steps'] for r in runs)}"
        flops = f"{min(r['train_flops'] for r in runs):.3g}–{max(r['train_flops'] for r in runs):.3g}"
        for when, spent in (("before", "0 | 0"), ("after", f"{steps} | {flops}"))[0 if runs[0]["before"] else 1:]:
            lines.append(f"| {arm} | {'warm' if when == 'before' else 'trained'} | {spent} | "
                         + " | ".join(_cell(runs, when, c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _slots(rows: list[dict]) -> str:
    """Held-out expected acceptance per drafted slot, mean over seeds, per arm, setting, before and after."""
    lines = []
    for arm, runs in _by_arm(rows).items():
        for when in ("slots_before", "slots_after"):
            for setting in runs[0][when]:
                mean = [statistics.fmean(s) for s in zip(*(r[when][setting] for r in runs))]
                lines.append(f"| {arm} | {'warm' if when == 'slots_before' else 'trained'} | {setting} | "
                             + " | ".join(f"{a:.3f}" for a in mean) + " |")
    width = len(rows[0]["slots_after"][next(iter(rows[0]["slots_after"]))]) if rows[0]["slots_after"] else 0
    head = ["| arm | when | setting | " + " | ".join(str(k + 1) for k in range(width)) + " |",
            "|---|---|---|" + "---|" * width]
    return "\n".join(head + lines) + "\n"


if __name__ == "__main__":
    main()
